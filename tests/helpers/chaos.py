"""A swarm of training peers under churn: the harness of tests/swarm/test_churn*.py and benchmarks/bench_churn.py.

    with Swarm() as swarm:
        churn = ChurnSwarm(swarm, "my-run", tmp_path, peers=3)
        churn.start()                                             # bootstrap + 3 peers, all training
        churn.run_chaos(ChaosPlan(duration_s=10, every_s=3, pause_s=1))   # end + restart peers
        churn.wait_rejoined(timeout=60)                           # every restarted peer averages again
        report = churn.measure()                                  # figures of the whole run so far
        churn.stop()                                              # SIGTERM all, check exits and checkpoints

Every peer is a real `moshpeer join` process (task digits) with its own `--checkpoint-dir` and
`--preemption-notice` file; a peer slot keeps its directory across restarts. The chaos loop ends one
random peer every `every_s` seconds, cycling through the three ways a machine goes away (SIGKILL: a
crash; SIGTERM: a polite stop; the preemption notice file: a spot instance's warning), and restarts it
`pause_s` seconds later, alternately from its checkpoint directory and fresh (empty directory).

What it checks along the way, and reports in `ChurnReport`:
- every ended process exits in time (SIGTERM / notice: within the grace period plus a margin, exit
  code 0) and leaves no process behind (its DHT process and p2pd): otherwise it is counted hung;
- before a restart from the checkpoint directory, every checkpoint in it is intact and the newest one
  the previous process announced as durable is there; the restarted peer resumes from the newest
  valid one. Otherwise the checkpoint counts as lost;
- per restart: process start to readiness, readiness to the first round it contributes to (an `ok`
  epoch with a group of two or more), and the bytes of state it downloaded;
- per process: the gaps between consecutive epochs it completed (stalls), also the open gap at the end.
Times are when the lines arrive here (one clock for all processes).
"""

from __future__ import annotations

import itertools
import random
import shutil
import signal
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from swarm import LOOPBACK, READY_TIMEOUT, Proc, Swarm

from moshpeer.testing.netlab import cpu, cpu_budget
from training_swarm import timed_events, wait_event

ENDINGS = ("sigkill", "sigterm", "notice")
RESTARTS = ("checkpoint", "fresh")
# Room on top of the grace period for a stopping peer to be gone on a loaded machine.
EXIT_MARGIN_S = 15.0
# How long the DHT process and p2pd of an ended peer may take to notice and follow it.
FAMILY_GRACE_S = 15.0


@dataclass
class ChaosPlan:
    """When to end peers: one every `every_s` for `duration_s` (or `kills` times), restarted `pause_s`
    after the ending was sent (never before the old process is gone)."""

    duration_s: float
    every_s: float
    pause_s: float
    kills: Optional[int] = None  # stop after this many endings (None: as many as fit)
    seed: int = 0
    endings: Sequence[str] = ENDINGS  # cycled
    restarts: Sequence[str] = RESTARTS  # cycled


@dataclass
class Life:
    """One process of a peer slot, from spawn to exit."""

    proc: Proc
    start: str  # "initial", "checkpoint" or "fresh"
    spawned_at: float
    expected_resume: Optional[str] = None  # newest valid checkpoint file when it was restarted from the dir
    ending: Optional[str] = None  # how it was ended (ENDINGS, or "stop" at the end of the run)
    ended_at: Optional[float] = None  # when the ending was sent
    exited_at: Optional[float] = None
    exit_code: Optional[int] = None
    family_gone: bool = False  # its DHT process and p2pd followed it out
    hung: List[str] = field(default_factory=list)  # what went wrong while it stopped

    @property
    def alive(self) -> bool:
        return self.exited_at is None

    def first(self, kind: str, predicate=lambda event: True) -> Optional[Tuple[float, dict]]:
        """(arrival time, event) of its first `kind` event that satisfies `predicate`."""
        return next(((t, e) for t, e in timed_events(self.proc, kind) if predicate(e)), None)

    def contributed_at(self) -> Optional[float]:
        """When it completed its first round averaged with others."""
        found = self.first("epoch", _contributes)
        return found[0] if found else None


def _contributes(event: dict) -> bool:
    return bool(event.get("ok")) and (event.get("group_size") or 0) >= 2


@dataclass
class Slot:
    """One peer of the swarm: a checkpoint directory and notice file that outlive its processes."""

    index: int
    checkpoint_dir: Path
    notice_file: Path
    lives: List[Life] = field(default_factory=list)

    @property
    def current(self) -> Life:
        return self.lives[-1]


@dataclass
class Join:
    """One restart, measured."""

    slot: int
    start: str
    ending: str  # how its previous process was ended
    startup_s: Optional[float]  # spawn -> readiness line (imports, DHT, p2pd)
    join_s: Optional[float]  # readiness -> first round it contributes to; None if it never did
    downloaded_bytes: int  # 0 if it resumed from its checkpoint without a download
    download_s: Optional[float]  # the download as the peer timed it (offers, transfer, checks)
    raw_s: float  # the same bytes at this machine's loopback TCP rate


@dataclass
class ChurnReport:
    """What a run under churn (or a calm one) achieved; see the module docstring."""

    window_s: float  # the measured window: from the start of training to the end of the schedule
    epochs: int  # swarm epochs gained within the window (by the end, held by a peer still running)
    epochs_per_s: float
    max_stall_s: float
    stall_where: str
    accuracy: Optional[float]  # mean of the latest evaluation of every peer training at the window's end
    round_deadline_s: Optional[float]  # the round deadline in force at the end (from the peers' epoch lines)
    joins: List[Join]  # in the order of the restarts
    endings: int
    hung: List[str]
    lost_checkpoints: List[str]
    bad_exits: List[str]  # SIGTERM / notice endings that did not exit with code 0

    def worst_join(self) -> Tuple[Optional[float], Optional[float]]:
        """(join_over_raw, join_overhead_s) of the worst restart; None where nothing was measured."""
        done = [j for j in self.joins if j.join_s is not None]
        overhead = max((j.join_s - j.raw_s for j in done), default=None)
        ratios = [j.join_s / j.raw_s for j in done if j.raw_s > 0]
        return (max(ratios) if ratios else None), overhead


def loopback_bytes_per_second(nbytes: int = 64 << 20, chunk: int = 1 << 20) -> float:
    """The rate of one TCP stream over 127.0.0.1 on this machine now: the anchor for 'raw transfer time'."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = [0]

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            buffer = bytearray(chunk)
            while received[0] < nbytes:
                n = conn.recv_into(buffer)
                if n == 0:
                    break
                received[0] += n

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    payload = bytes(chunk)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        started = time.perf_counter()
        for _ in range(nbytes // chunk):
            conn.sendall(payload)
        thread.join(timeout=30)
        seconds = time.perf_counter() - started
    server.close()
    return received[0] / max(seconds, 1e-9)


class ChurnSwarm:
    """A swarm of `moshpeer join` training peers (task digits) with checkpoints, ended and restarted.

    :param peer_args: extra `moshpeer join` flags for every peer (matchmaking, group size, ...)
    :param grace_period: each peer's `--grace-period`: SIGTERM / notice to exit
    :param checkpoint_every_s: each peer's periodic checkpoint interval
    :param cpu_share: cores each peer slot may use (a cgroup per slot, moshpeer.testing.netlab.cpu; the restarted
        process gets its slot's), so that a peer that dies frees nothing for the others, as on real machines;
        None = no budget. The caller removes the cgroups (`remove_budgets`)
    """

    def __init__(self, swarm: Swarm, run_id: str, workdir: Path, *, peers: int,
                 peer_args: Sequence[str] = (), grace_period: float = 10.0, checkpoint_every_s: float = 5.0,
                 fixed_round_deadline_s: Optional[float] = None, cpu_share: Optional[float] = None):
        self.swarm, self.run_id, self.workdir = swarm, run_id, Path(workdir)
        self.peer_args = list(peer_args)
        self.grace_period, self.checkpoint_every_s = grace_period, checkpoint_every_s
        self.fixed_round_deadline_s = fixed_round_deadline_s
        self.slots = [Slot(i, self.workdir / f"peer{i}", self.workdir / f"peer{i}.notice") for i in range(peers)]
        self.boot: Optional[Proc] = None
        self.training_started_at: Optional[float] = None
        self.chaos_ended_at: Optional[float] = None
        self.lost: List[str] = []
        self.endings = 0
        self._loopback_bps: Optional[float] = None
        self.budgets = []
        if cpu_share is not None:
            self.budgets = [cpu_budget(i, cpu_share) for i in range(peers)]

    def remove_budgets(self) -> None:
        for group in self.budgets:
            cpu.remove(group)
        self.budgets = []

    # -- processes --

    def start(self, timeout: float = 2 * READY_TIMEOUT) -> None:
        """Bootstrap node and every peer (waiting for all of them), until each one trains."""
        self.boot = self.swarm.bootstrap(self.run_id, "--heartbeat", "1")
        for slot in self.slots:
            slot.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            self._spawn(slot, "initial", min_peers=len(self.slots))
        deadline = time.monotonic() + timeout
        for slot in self.slots:
            wait_event(slot.current.proc, "started", max(1.0, deadline - time.monotonic()))
        self.training_started_at = time.monotonic()

    def _spawn(self, slot: Slot, start: str, *, min_peers: int = 1) -> Life:
        if slot.notice_file.exists():
            slot.notice_file.unlink()  # a notice file present at start would count as a new notice
        args = ["join", "--initial-peers", *self.boot.maddrs, "--run-id", self.run_id, "--host-maddrs", LOOPBACK,
                "--heartbeat", "1", "--eval-every", "1", "--min-peers", str(min_peers), "--seed", str(slot.index),
                "--checkpoint-dir", str(slot.checkpoint_dir), "--checkpoint-every-seconds",
                str(self.checkpoint_every_s), "--grace-period", str(self.grace_period),
                "--preemption-notice", str(slot.notice_file), *self.peer_args]
        preexec = cpu.joiner(self.budgets[slot.index]) if self.budgets else None
        life = Life(self.swarm.spawn(*args, name=f"peer{slot.index}.{len(slot.lives)}", preexec=preexec), start,
                    time.monotonic())
        slot.lives.append(life)
        return life

    def end(self, slot: Slot, ending: str) -> None:
        """End the slot's current process: SIGKILL, SIGTERM, or its preemption notice file."""
        life = slot.current
        life.ending, life.ended_at = ending, time.monotonic()
        if ending == "sigkill":
            life.proc.send_signal(signal.SIGKILL)
        elif ending in ("sigterm", "stop"):
            life.proc.send_signal(signal.SIGTERM)
        elif ending == "notice":
            slot.notice_file.write_text("preempted by the chaos loop\n")
        else:
            raise ValueError(f"unknown ending {ending!r}")

    def restart(self, slot: Slot, start: str) -> Life:
        """Start the slot again, from its checkpoint directory (checked first) or fresh (emptied)."""
        if start == "checkpoint":
            expected = self._check_checkpoints(slot)
        elif start == "fresh":
            shutil.rmtree(slot.checkpoint_dir, ignore_errors=True)
            slot.checkpoint_dir.mkdir(parents=True)
            expected = None
        else:
            raise ValueError(f"unknown restart {start!r}")
        life = self._spawn(slot, start)
        life.expected_resume = expected
        return life

    def _exit_deadline(self, life: Life) -> float:
        return life.ended_at + (1.0 if life.ending == "sigkill" else self.grace_period) + EXIT_MARGIN_S

    def poll(self) -> None:
        """Record exits of ended processes; SIGKILL (and count as hung) those past their deadline, and
        whatever they spawned (DHT process, p2pd) that did not follow them out within FAMILY_GRACE_S."""
        now = time.monotonic()
        for life in (life for slot in self.slots for life in slot.lives):
            if life.ending is None or life.family_gone:
                continue
            if life.alive:
                code = life.proc.returncode
                if code is None and now > self._exit_deadline(life):
                    life.hung.append(f"{life.proc.name}: still running {now - life.ended_at:.1f} s after {life.ending}")
                    life.proc.kill()
                    code = life.proc.returncode
                if code is not None:
                    life.exit_code, life.exited_at = code, now
                continue
            left = life.proc.family()
            if not left:
                life.family_gone = True
            elif now > life.exited_at + FAMILY_GRACE_S:
                names = ", ".join(f"{info.name}({info.pid})" for info in left)
                life.hung.append(f"{life.proc.name}: {names} still running {FAMILY_GRACE_S:g} s after it exited")
                life.family_gone = True  # reported once; the swarm's cleanup kills them

    def wait_exits(self, timeout: float) -> None:
        """Poll until every ended process and its family are gone (bounded by `timeout`)."""
        deadline = time.monotonic() + timeout
        lives = [life for slot in self.slots for life in slot.lives]
        while any(life.ending and not life.family_gone for life in lives) and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.1)

    # -- checkpoints --

    def _check_checkpoints(self, slot: Slot) -> Optional[str]:
        """Check the slot's directory before a restart from it; returns the newest valid file name."""
        from moshpeer.peer.checkpoint import list_checkpoints

        infos = list_checkpoints(slot.checkpoint_dir, verify=True)
        valid = [info for info in infos if info.valid]
        broken = [info for info in infos if not info.valid and not info.name.endswith(".tmp")]
        for info in broken:
            self.lost.append(f"peer{slot.index}: {info.name} unreadable ({info.reason})")
        newest = valid[-1] if valid else None
        life = slot.current
        announced = [e for e in _events(life, "checkpoint")]
        finals = [e["file"] for e in announced if e.get("kind") == "final"]
        periodic = [e["file"] for e in announced if e.get("kind") == "periodic"]
        names = [info.name for info in valid]
        if finals and (newest is None or newest.name != finals[-1]):
            self.lost.append(f"peer{slot.index}: final checkpoint {finals[-1]} is not the newest valid one "
                             f"({newest.name if newest else 'none'})")
        # A SIGKILL may land during the newest periodic write; the one before it was durable.
        elif not finals and len(periodic) >= 2 and not any(_seq(n) >= _seq(periodic[-2]) for n in names):
            self.lost.append(f"peer{slot.index}: periodic checkpoint {periodic[-2]} is gone (valid: {names})")
        return newest.name if newest else None

    def _check_resumes(self) -> None:
        """Every restart from a directory with a valid checkpoint resumed from the newest one."""
        for slot in self.slots:
            for life in slot.lives:
                if life.start != "checkpoint" or life.expected_resume is None:
                    continue
                resumed = _events(life, "resumed")
                if resumed and resumed[0]["file"] != life.expected_resume:
                    self.lost.append(f"{life.proc.name}: resumed from {resumed[0]['file']}, "
                                     f"not the newest valid {life.expected_resume}")
                elif not resumed and life.first("started") is not None:
                    self.lost.append(f"{life.proc.name}: started training without resuming from "
                                     f"{life.expected_resume}")

    # -- chaos --

    def victims(self) -> List[Slot]:
        """Peers that may be ended now: running, not being ended, and averaging with the others."""
        return [slot for slot in self.slots
                if slot.current.ending is None and slot.current.alive and slot.current.proc.returncode is None
                and slot.current.contributed_at() is not None]

    def run_chaos(self, plan: ChaosPlan) -> None:
        """End a random peer every `plan.every_s` and restart it `plan.pause_s` later, for
        `plan.duration_s` (or until `plan.kills` endings); pending restarts are done before returning."""
        rng = random.Random(plan.seed)
        endings, restarts = itertools.cycle(plan.endings), itertools.cycle(plan.restarts)
        started = time.monotonic()
        next_end = started + plan.every_s
        pending: Dict[int, str] = {}  # slot index -> how to restart it
        done = 0
        while True:
            now = time.monotonic()
            over = now - started >= plan.duration_s or (plan.kills is not None and done >= plan.kills)
            if over and not pending:
                break
            if not over and now >= next_end:
                next_end += plan.every_s
                candidates = [s for s in self.victims() if s.index not in pending]
                if candidates:
                    slot = rng.choice(candidates)
                    self.end(slot, next(endings))
                    pending[slot.index] = next(restarts)
                    done += 1
            self.poll()
            for index, start in list(pending.items()):
                life = self.slots[index].current
                if not life.alive and now >= life.ended_at + plan.pause_s:
                    self.restart(self.slots[index], start)
                    del pending[index]
            time.sleep(0.05)
        self.endings += done
        self.chaos_ended_at = time.monotonic()

    def wait_rejoined(self, timeout: float) -> None:
        """Wait until every slot's current process has contributed to a round (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(slot.current.contributed_at() is not None for slot in self.slots):
                return
            time.sleep(0.2)
        late = [s.current.proc.describe(30) for s in self.slots if s.current.contributed_at() is None]
        raise AssertionError(f"{len(late)} peer(s) did not average again within {timeout:g} s:\n" + "\n".join(late))

    def stop(self) -> None:
        """SIGTERM every peer (as "stop"), check exits and final checkpoints; the bootstrap too."""
        for slot in self.slots:
            if slot.current.alive and slot.current.ending is None:
                self.end(slot, "stop")
        self.wait_exits(self.grace_period + EXIT_MARGIN_S + FAMILY_GRACE_S + 1.0)
        for slot in self.slots:
            if any(e.get("kind") == "final" for e in _events(slot.current, "checkpoint")):
                self._check_checkpoints(slot)
        self._check_resumes()
        if self.boot is not None and self.boot.returncode is None:
            self.boot.terminate()

    # -- figures --

    def measure(self, window_end: Optional[float] = None, *, loopback_bps: Optional[float] = None) -> ChurnReport:
        """Figures of the run from the start of training to `window_end` (default: now): progress,
        stalls and accuracy within the window; joins, hangs and lost checkpoints of the whole run so
        far (call it after `stop()` to include the final stop)."""
        start = self.training_started_at
        end = window_end if window_end is not None else time.monotonic()
        lives = [life for slot in self.slots for life in slot.lives]
        epochs_in = [(t, e) for life in lives for t, e in timed_events(life.proc, "epoch") if t <= end]
        at_start = max((e["epoch"] for t, e in epochs_in if t <= start), default=0)
        # Progress the swarm kept: the highest epoch a peer still running at the end holds. Epochs a peer
        # made alone and took with it when it was ended do not count.
        at_end = max((_epoch_at(life, end) for life in lives if _running_at(life, end)), default=at_start)
        stall, where = 0.0, ""
        for life in lives:
            times = [t for t, _ in timed_events(life.proc, "epoch") if start <= t <= end]
            if times and (life.ended_at is None or life.ended_at > end):
                times.append(end)  # an open gap at the end counts: a hung peer prints nothing
            for a, b in zip(times, times[1:]):
                if b - a > stall:
                    stall, where = b - a, life.proc.name
        metrics = []
        for life in lives:
            contributed = life.contributed_at()
            evaluated = [e["metric"] for t, e in timed_events(life.proc, "epoch") if t <= end and e.get("metric") is not None]
            if _running_at(life, end) and evaluated and contributed is not None and contributed <= end:
                metrics.append(evaluated[-1])
        deadlines = [_round_deadline(e) for t, e in sorted(epochs_in, key=lambda te: te[0])]
        deadline = next((d for d in reversed(deadlines) if d is not None), self.fixed_round_deadline_s)
        window = end - start
        if any(life.start != "initial" for life in lives):
            bps = loopback_bps or self.loopback_bps()
        else:
            bps = 1.0
        restarts = sorted(((slot, index) for slot in self.slots for index in range(1, len(slot.lives))),
                          key=lambda restart: restart[0].lives[restart[1]].spawned_at)
        joins = [self._join(slot, index, bps) for slot, index in restarts]  # in the order of the restarts
        bad = [f"{life.proc.name}: exit code {life.exit_code} after {life.ending}" for life in lives
               if life.ending in ("sigterm", "notice", "stop") and life.exit_code not in (None, 0)]
        return ChurnReport(
            window_s=window, epochs=at_end - at_start, epochs_per_s=(at_end - at_start) / window if window > 0 else 0.0,
            max_stall_s=stall, stall_where=where, accuracy=statistics.fmean(metrics) if metrics else None,
            round_deadline_s=deadline, joins=joins, endings=self.endings,
            hung=[h for life in lives for h in life.hung], lost_checkpoints=list(self.lost), bad_exits=bad)

    def loopback_bps(self) -> float:
        if self._loopback_bps is None:
            self._loopback_bps = loopback_bytes_per_second()
        return self._loopback_bps

    def _join(self, slot: Slot, index: int, bps: float) -> Join:
        life, previous = slot.lives[index], slot.lives[index - 1]
        ready = life.first("ready")
        contributed = life.contributed_at()
        loaded = _events(life, "state_loaded")
        nbytes = sum(e.get("bytes") or 0 for e in loaded)
        return Join(
            slot=slot.index, start=life.start, ending=previous.ending or "?",
            startup_s=(ready[0] - life.spawned_at) if ready else None,
            join_s=(contributed - ready[0]) if ready and contributed is not None else None,
            downloaded_bytes=nbytes, download_s=sum(e.get("seconds") or 0.0 for e in loaded) if loaded else None,
            raw_s=nbytes / bps)


def _round_deadline(epoch_event: dict) -> Optional[float]:
    """The whole-round deadline in force for this epoch's round (its `RoundResult`), if it says."""
    result = epoch_event.get("round")
    return result.get("round_deadline_s") if isinstance(result, dict) else None


def _running_at(life: Life, moment: float) -> bool:
    """Whether the process was running, not yet told to go, at `moment`."""
    return life.spawned_at <= moment and (life.ended_at is None or life.ended_at > moment)


def _epoch_at(life: Life, moment: float) -> int:
    """The epoch the process held at `moment`: its latest epoch line, or where it started training."""
    held = [e["epoch"] for kind in ("started", "epoch") for t, e in timed_events(life.proc, kind) if t <= moment]
    return max(held, default=0)


def _seq(name: str) -> int:
    """The sequence number of a checkpoint file name (ckpt-<seq>-epoch<E>-step<S>.mpck)."""
    return int(name.split("-")[1])


def _events(life: Life, kind: str) -> List[dict]:
    return [event for _, event in timed_events(life.proc, kind)]


def describe_joins(joins: Iterable[Join]) -> List[str]:
    """One readable row per restart."""
    def fmt(value: Optional[float], spec: str = ".2f") -> str:
        return "-" if value is None else format(value, spec)

    rows = [f"{'peer':>5} {'ended by':>9} {'restart':>10} {'startup s':>10} {'join s':>8} {'bytes':>9} "
            f"{'download s':>11} {'raw s':>8}"]
    for j in joins:
        rows.append(f"{j.slot:>5} {j.ending:>9} {j.start:>10} {fmt(j.startup_s):>10} {fmt(j.join_s):>8} "
                    f"{j.downloaded_bytes:>9} {fmt(j.download_s):>11} {fmt(j.raw_s, '.4f'):>8}")
    return rows
