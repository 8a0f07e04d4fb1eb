"""Collaborative training on digits: moshpeer vs hivemind.Optimizer vs a single process.

Same model (the built-in digits MLP), same global batch (256), same micro-batch (32), same sample
budget (epochs x 256), 4 peers as real processes on 127.0.0.1:

- moshpeer: `moshpeer join` peers (gradient averaging, group of 4) behind a `moshpeer dht` bootstrap;
- hivemind: `hivemind.Optimizer` peers (this file run with --hivemind-worker), configured for a small
  local swarm (short matchmaking and timeouts, no offloading or delayed updates; printed below);
- single: one process, `train_locally`, same global batch and samples.

Reports wall time to the target accuracy (first evaluation at or above it; every peer evaluates after
every epoch), final accuracy, and the bytes one moshpeer peer sends per averaging round: with the
default settings (gradients only, parameters every 16 epochs) and, as `bytes_per_round_before`, in a
second moshpeer run that averages the parameters in every round (`--params-every 1`, what moshpeer
did before; skip it with --skip-before). `--straggler` slows one peer with heavy-tailed delays per micro-batch
and adds a moshpeer run with a DropCompute budget, to compare step times with and without it.

    python benchmarks/bench_training.py [--epochs 40] [--target 0.95] [--straggler] [--netlab RATE]

`--netlab RATE` (e.g. 100mbit, or 100,100,100,10 per peer; needs root) runs every peer of both swarms
in a network namespace of its own whose upload is shaped to RATE (`moshpeer.testing.netlab`; bootstrap
and aux peers unshaped), instead of all on 127.0.0.1; `--netlab-rtt MS [--netlab-jitter MS]` puts every
process that far from the others (one value, or one per peer: 50,100,200,...), and `--netlab-sites` puts peers
behind NATs or firewalls (-,-,cone-a,symmetric-b: moshpeer only).

Ends with one JSON line: moshpeer_s, hivemind_s, moshpeer_acc, hivemind_acc, single_acc, speedup_vs_hivemind,
bytes_per_round, bytes_per_round_before, bytes_vs_before, ...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
GLOBAL_BATCH, MICRO_BATCH = 256, 32
HIVEMIND_SETTINGS = dict(
    matchmaking_time=1.0,  # hivemind's default is 15 s (internet); a local swarm assembles in well under 1 s
    averaging_timeout=10.0,  # default 60 s
    allreduce_timeout=10.0,
    next_chunk_timeout=5.0,
    load_state_timeout=30.0,
    average_state_every=1,
    use_local_updates=False,  # large-batch training, like moshpeer's gradient mode
    delay_optimizer_step=False,
    delay_grad_averaging=False,
    offload_optimizer=False,
    reuse_grad_buffers=False,
    verbose=False,
)


def hivemind_settings(matchmaking_time: float) -> dict:
    """HIVEMIND_SETTINGS with this run's matchmaking time, and request_timeout half of it (moshpeer's default rule).
    hivemind warns that request_timeout (default 3 s) must be below matchmaking_time, or matchmaking can deadlock;
    with 1 s matchmaking we saw every round time out at averaging_timeout without it."""
    return {**HIVEMIND_SETTINGS, "matchmaking_time": matchmaking_time,
            "averager_opts": dict(request_timeout=matchmaking_time / 2)}
HIVEMIND_TRACKER = dict(min_refresh_period=0.2, max_refresh_period=1.0, default_refresh_period=0.5)


# ---- processes ----------------------------------------------------------------------------------


# --logs-out: a folder where every child's stderr is kept (else a temporary file each)
LOGS: Dict[str, Optional[Path]] = {"dir": None}


class Child:
    """A child process whose stdout JSON lines are collected in a thread; its stderr is kept in a temporary file,
    or in LOGS["dir"] as COMMAND-XXXXXXXX.log (`stderr_tail`, for the error of a run that did not finish)."""

    def __init__(self, argv: List[str], env: Dict[str, str]):
        if LOGS["dir"] is None:
            self.stderr = tempfile.TemporaryFile()
        else:
            command = next((a for a in argv if a in ("dht", "join", "--hivemind-worker")), "child").lstrip("-")
            self.stderr = tempfile.NamedTemporaryFile(dir=LOGS["dir"], prefix=f"{command}-", suffix=".log",
                                                      delete=False)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.stderr, stdin=subprocess.DEVNULL,
                                     env=env, cwd=str(REPO), start_new_session=True)
        self.events: List[dict] = []
        self.cond = threading.Condition()
        self.ended = False  # stdout reached its end: the process exited (or closed it)
        threading.Thread(target=self._read, daemon=True).start()

    def stderr_tail(self, lines: int = 20) -> str:
        """The last `lines` lines the process wrote to stderr."""
        self.stderr.seek(0)
        return "\n".join(self.stderr.read().decode(errors="replace").splitlines()[-lines:])

    def _read(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").strip()
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                event["received_at"] = time.time()  # one clock for every process of a system
                with self.cond:
                    self.events.append(event)
                    self.cond.notify_all()
        with self.cond:
            self.ended = True
            self.cond.notify_all()

    def wait_event(self, kind: str, timeout: float) -> Optional[dict]:
        """The first `kind` event; None once `timeout` passed or the process ended without printing one."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for event in self.events:
                    if event.get("event") == kind:
                        return event
                if self.ended:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self.cond.wait(min(remaining, 0.5))

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                continue


class Placement:
    """Where the processes of a run live: all on 127.0.0.1, or process k in namespace k of a netlab lab
    (training peers first, then the bootstrap and aux peers)."""

    def __init__(self, lab=None):
        self.lab = lab

    def maddr(self, k: int) -> str:
        return LOOPBACK if self.lab is None else f"/ip4/{self.lab.nodes[k].address}/tcp/0"

    def argv(self, k: int, argv: List[str]) -> List[str]:
        return argv if self.lab is None else self.lab.command(k, argv)

    def behind_nat(self, k: int) -> bool:
        """Whether process k sits behind a NAT or firewall site: nobody can connect to it (`--behind-nat`)."""
        return self.lab is not None and self.lab.nodes[k].site is not None


def add_netlab_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--netlab", metavar="RATE", default=None,
                        help="run every peer in a network namespace with its upload shaped to RATE (100mbit, 1gbit, "
                        "or one rate per peer: 100,100,100,10); needs root")
    parser.add_argument("--netlab-rtt", metavar="MS", default=None,
                        help="with --netlab: the round trip each process adds, ms: one value (two peers 200 ms apart: "
                        "200) or one per peer (peers i and j are (rtt_i + rtt_j) / 2 apart); the bootstrap and aux "
                        "peers take the first")
    parser.add_argument("--netlab-jitter", metavar="MS", default=None,
                        help="with --netlab-rtt: how much each round trip varies, ms (one value, or one per peer)")
    parser.add_argument("--netlab-sites", metavar="LIST", default=None,
                        help="with --netlab: where each peer sits, comma-separated: - (public), cone-NAME, "
                        "symmetric-NAME or firewall-NAME (peers with one NAME share a site); moshpeer peers behind "
                        "one run --behind-nat, and hivemind is skipped (its peers cannot reach them)")


def per_process(spec: Optional[str], peers: int, extra_nodes: int) -> Union[None, str, List[str]]:
    """A --netlab-rtt / --netlab-jitter value for netlab: one for all, or one per peer then the first for the
    bootstrap and aux processes; SystemExit with one line if the count is wrong."""
    if spec is None or "," not in spec:
        return spec
    entries = spec.split(",")
    if len(entries) != peers:
        raise SystemExit(f"{spec!r}: {len(entries)} entries for {peers} peers")
    return entries + [entries[0]] * extra_nodes


def netlab_sites(args) -> List[Optional[str]]:
    """`--netlab-sites`, one entry per training peer (None: public); SystemExit with one line if it is malformed."""
    from moshpeer.testing import netlab

    if not getattr(args, "netlab_sites", None):
        return [None] * args.peers
    entries = args.netlab_sites.split(",")
    if len(entries) != args.peers:
        raise SystemExit(f"--netlab-sites: {len(entries)} entries for {args.peers} peers")
    try:
        return [netlab.parse_site(entry) for entry in entries]
    except netlab.NetlabError as e:
        raise SystemExit(f"--netlab-sites: {e}") from None


@contextmanager
def placement_from_args(args, extra_nodes: int) -> Iterator[Placement]:
    """A Placement for `args.peers` training peers plus `extra_nodes` more processes (bootstrap, aux)."""
    if not getattr(args, "netlab", None):
        yield Placement()
        return
    from moshpeer.testing import netlab

    reason = netlab.unavailable()
    if reason is not None:
        raise SystemExit(reason)
    uploads = netlab.parse_rates(args.netlab, args.peers) + [None] * extra_nodes
    sites = netlab_sites(args)
    options = {"sites": sites + [None] * extra_nodes, "subnet": netlab.PUBLIC_CORE_SUBNET} if any(sites) else {}
    rtt, jitter = (per_process(spec, args.peers, extra_nodes) for spec in (args.netlab_rtt, args.netlab_jitter))
    with netlab.Netlab(uploads, rtt=rtt, jitter=jitter, **options) as lab:
        print(f"netlab: peers' uploads {uploads[:args.peers]} Mbit/s on a private bridge, round trips "
              f"{args.netlab_rtt or 0} ms (jitter {args.netlab_jitter or 0} ms), sites {sites}", flush=True)
        yield Placement(lab)


def moshpeer_argv(command: str, run_id: str, maddr: str, *flags: str) -> List[str]:
    """`python -m moshpeer COMMAND` of run `run_id`, listening on `maddr`, heartbeat 1 s, then `flags`."""
    return [sys.executable, "-m", "moshpeer", command, "--run-id", run_id, "--host-maddrs", maddr, "--heartbeat", "1",
            *flags]


def bootstrap_maddrs(boot: Child, timeout: float) -> List[str]:
    """The multiaddrs of a `moshpeer dht` child once it printed its ready line; RuntimeError if it did not in time."""
    ready = boot.wait_event("ready", timeout)
    if ready is None:
        raise RuntimeError("bootstrap did not start")
    return ready["maddrs"]


def env() -> Dict[str, str]:
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}


def emit(figures: dict, events: object, events_out: Optional[str]) -> int:
    """Write the raw events to `events_out` (if given), print the figures as one JSON line; exit code 0."""
    if events_out:
        with open(events_out, "w") as f:
            json.dump(events, f)
    print(json.dumps(figures))
    return 0


def time_to_target(peers: List["Child"], target: float) -> Optional[float]:
    """Wall time from the first peer starting to train until any peer first evaluates at/above `target`."""
    starts = [e["received_at"] for p in peers for e in p.events if e.get("event") == "started"]
    reached = [e["received_at"] for p in peers for e in p.events
               if e.get("event") == "epoch" and e.get("metric") is not None and e["metric"] >= target]
    if not starts or not reached:
        return None
    return min(reached) - min(starts)


ALL_EVENTS: Dict[str, List[List[dict]]] = {}


def summarize(peers: List[Child], target: float, time_key: str, name: str = "") -> dict:
    ALL_EVENTS[name] = [p.events for p in peers]
    done = [p.wait_event("done", 0) for p in peers]
    finals = [d["metrics"]["accuracy"] for d in done if d]
    epochs = [[e for e in p.events if e.get("event") == "epoch"] for p in peers]
    # Seconds per collaborative epoch, counted the same way for every system and peer: the time between
    # a peer's first and last epoch events over the epochs it advanced in between (a peer that caught
    # up by downloading state may advance several epochs in one event).
    spans = [(eps[-1][time_key] - eps[0][time_key], eps[-1]["epoch"] - eps[0]["epoch"])
             for eps in epochs if len(eps) >= 2 and eps[-1]["epoch"] > eps[0]["epoch"]]
    seconds, advanced = sum(s for s, _ in spans), sum(n for _, n in spans)
    rounds = [e for eps in epochs for e in eps]
    return {
        "time_to_target_s": time_to_target(peers, target),
        "final_acc": sum(finals) / len(finals) if finals else None,
        "peers_finished": len(finals),
        "train_s": max((d["seconds"] for d in done if d), default=None),
        "mean_step_s": seconds / advanced if advanced else None,
        "rounds_ok_fraction": (sum(bool(e.get("ok")) for e in rounds) / len(rounds)) if rounds else None,
        "mean_group_size": (sum(e.get("group_size", 0) for e in rounds if e.get("ok"))
                            / max(sum(bool(e.get("ok")) for e in rounds), 1)) if rounds else None,
        "dropped_samples": sum(e.get("dropped_samples") or 0 for e in rounds),
        # Bytes one peer sent in one round, over the rounds that averaged with a group.
        "bytes_per_round": (sum(e.get("bytes_sent", 0) for e in rounds if e.get("ok"))
                            / max(sum(bool(e.get("ok")) for e in rounds), 1)) if rounds else None,
    }


# ---- moshpeer -----------------------------------------------------------------------------------


def run_moshpeer(args, *, straggler: Optional[str], budget: Optional[str], tag: str,
                 extra_args: Optional[Callable[[int], List[str]]] = None,
                 companions: Optional[Callable[[str, List[str]], List[Tuple[List[str], str]]]] = None) -> dict:
    """One moshpeer run; `extra_args(i)` adds flags to peer i's `moshpeer join` (e.g. bench_trust's faults);
    `companions(run_id, bootstrap maddrs)` gives more processes, (argv, event), to start on loopback once the
    peers are launched, one after the other, each once the one before printed its `event` (e.g. bench_trust's
    Sybil donors, then a newcomer; a companion whose event is "started" trains, and the run waits for its "done"
    too); their events are kept in ALL_EVENTS["moshpeer-<tag>-companions"]."""
    e = env()
    run_id = f"bench-{tag}-{os.getpid()}"
    where = getattr(args, "placement", None) or Placement()
    boot = Child(where.argv(args.peers, moshpeer_argv("dht", run_id, where.maddr(args.peers))), e)
    children = [boot]
    try:
        maddrs = bootstrap_maddrs(boot, 60)
        peers = []
        for i in range(args.peers):
            argv = moshpeer_argv("join", run_id, where.maddr(i), "--initial-peers", *maddrs, "--group-size",
                                 str(args.group_size or args.peers),
                                 "--min-peers", str(args.peers), "--max-epochs", str(args.epochs), "--eval-every", "1",
                                 "--target-batch-size", str(GLOBAL_BATCH), "--batch-size", str(MICRO_BATCH),
                                 "--matchmaking-time", str(args.matchmaking_time), "--seed", str(i))
            if where.behind_nat(i):
                argv += ["--behind-nat"]
            if LOGS["dir"] is not None:
                argv.insert(argv.index("join"), "-v")  # DEBUG lines too: the logs are for finding what went wrong
            if budget:
                argv += ["--compute-budget", budget]
            if straggler and i == 0:
                argv += ["--straggler", straggler]
            if extra_args is not None:
                argv += extra_args(i)
            peers.append(Child(where.argv(i, argv), e))
        children += peers
        for i in range(args.aux):  # weight-0 helpers: not in `peers`, so not in the figures
            node = args.peers + 1 + i
            children.append(Child(where.argv(node, moshpeer_argv(
                "join", run_id, where.maddr(node), "--initial-peers", *maddrs, "--role", "aux",
                "--group-size", str(args.group_size or args.peers), "--min-peers", str(args.peers),
                "--max-epochs", str(args.epochs), "--matchmaking-time", str(args.matchmaking_time))), e))
        extras = []
        for argv, event in companions(run_id, maddrs) if companions is not None else []:
            extras.append(Child(argv, e))
            children.append(extras[-1])
            if extras[-1].wait_event(event, args.timeout) is None:
                raise RuntimeError(f"{' '.join(argv[1:4])} did not start: {extras[-1].stderr_tail()}")
        for peer in peers:
            peer.wait_event("done", args.timeout)
        for extra in extras:  # a companion that trains (its event was "started") ends with the peers
            if extra.wait_event("started", 0) is not None:
                extra.wait_event("done", 60)
        ALL_EVENTS[f"moshpeer-{tag}-companions"] = [child.events for child in extras]
        return summarize(peers, args.target, "train_time", f"moshpeer-{tag}")
    finally:
        for child in children:
            child.stop()


# ---- hivemind -----------------------------------------------------------------------------------


def run_hivemind(args, *, straggler: Optional[str]) -> dict:
    e = env()
    where = getattr(args, "placement", None) or Placement()
    first = Child(where.argv(0, [sys.executable, __file__, "--hivemind-worker", "--index", "0",
                                 *_worker_args(args, straggler, 0, where)]), e)
    children = [first]
    try:
        ready = first.wait_event("ready", 60)
        if ready is None:
            raise RuntimeError("first hivemind peer did not start")
        for i in range(1, args.peers):
            children.append(Child(where.argv(i, [sys.executable, __file__, "--hivemind-worker", "--index", str(i),
                                                 "--initial-peers", *ready["maddrs"],
                                                 *_worker_args(args, straggler, i, where)]), e))
        for child in children:
            child.wait_event("done", args.timeout)
        return summarize(children, args.target, "train_time", "hivemind")
    finally:
        for child in children:
            child.stop()


def _worker_args(args, straggler: Optional[str], index: int, where: Placement) -> List[str]:
    out = ["--epochs", str(args.epochs), "--peers", str(args.peers), "--matchmaking-time", str(args.matchmaking_time),
           "--host-maddr", where.maddr(index)]
    if straggler and index == 0:
        out += ["--straggler-spec", straggler]
    return out


def hivemind_worker(args) -> int:
    """One hivemind.Optimizer peer on digits; prints JSON lines like `moshpeer join`."""
    import hivemind
    import torch

    from moshpeer.peer.runtime.straggler import parse_straggler
    from moshpeer.peer.tasks import load_task

    task = load_task("digits")
    dht = hivemind.DHT(initial_peers=args.initial_peers or None, host_maddrs=[args.host_maddr], start=True)
    print(json.dumps({"event": "ready", "maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)
    settings = hivemind_settings(args.matchmaking_time)
    opt = hivemind.Optimizer(dht=dht, run_id="bench-hivemind", target_batch_size=GLOBAL_BATCH,
                             batch_size_per_step=MICRO_BATCH, params=task.model.parameters(),
                             optimizer=lambda params: task.make_optimizer(params),
                             tracker_opts=HIVEMIND_TRACKER, **settings)
    # Start together, as moshpeer's --min-peers does: a barrier of DHT entries, one per worker.
    from hivemind.utils import get_dht_time

    dht.store("bench-barrier", True, expiration_time=get_dht_time() + 600, subkey=args.index)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        found = dht.get("bench-barrier", latest=True)
        if found is not None and isinstance(found.value, dict) and len(found.value) >= args.peers:
            break
        time.sleep(0.2)
    straggler = parse_straggler(args.straggler_spec) if args.straggler_spec else None
    print(json.dumps({"event": "started", "epoch": opt.local_epoch}), flush=True)
    stream = task.open_batches(MICRO_BATCH, seed=args.index)
    started = time.monotonic()
    epoch = opt.local_epoch
    while opt.local_epoch < args.epochs and time.monotonic() - started < args.timeout:
        if straggler is not None:
            straggler()
        loss, count = task.loss(task.model, next(stream))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if opt.local_epoch != epoch:
            epoch = opt.local_epoch
            metric = task.metrics(task.model)["accuracy"]
            print(json.dumps({"event": "epoch", "epoch": epoch, "metric": metric,
                              "train_time": round(time.monotonic() - started, 3)}), flush=True)
    metrics = task.metrics(task.model)
    print(json.dumps({"event": "done", "metrics": metrics, "seconds": time.monotonic() - started,
                      "epochs": opt.local_epoch}), flush=True)
    opt.shutdown()
    dht.shutdown()
    return 0


# ---- single process -----------------------------------------------------------------------------


def run_single(args) -> dict:
    from moshpeer.peer.tasks import load_task, train_locally

    task = load_task("digits")
    run = train_locally(task, num_samples=args.epochs * GLOBAL_BATCH, global_batch_size=GLOBAL_BATCH,
                        micro_batch_size=MICRO_BATCH, eval_every=1, target=args.target)
    to_target = None
    if run.samples_to_target is not None:  # evaluations are excluded from run.seconds: scale by samples
        to_target = run.seconds * run.samples_to_target / max(run.samples, 1)
    return {"time_to_target_s": to_target, "final_acc": run.metrics["accuracy"], "train_s": run.seconds}


# ---- main ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=None,
                        help="moshpeer's --group-size (default: --peers); larger than --peers shows how a swarm "
                        "smaller than its group size averages")
    parser.add_argument("--aux", type=int, default=0, metavar="N",
                        help="also start N `moshpeer join --role aux` peers in the moshpeer runs")
    parser.add_argument("--epochs", type=int, default=40, help="collaborative epochs (sample budget / 256)")
    parser.add_argument("--target", type=float, default=0.95, help="target test accuracy")
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=400.0, help="per system")
    parser.add_argument("--straggler", action="store_true", help="slow one peer with heavy-tailed delays")
    parser.add_argument("--straggler-spec", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--straggler-mean", type=float, default=0.2,
                        help="mean injected delay per micro-batch of the straggler (s), lognormal sigma 1.5")
    parser.add_argument("--budget", default="0.25", help="DropCompute budget (s) for the --straggler comparison")
    parser.add_argument("--skip-hivemind", action="store_true")
    parser.add_argument("--skip-before", action="store_true",
                        help="skip the moshpeer run that averages the parameters every round (bytes_per_round_before)")
    parser.add_argument("--events-out", metavar="PATH", help="write every peer's JSON events here (debugging)")
    parser.add_argument("--logs-out", metavar="DIR",
                        help="keep every process's stderr in this folder, moshpeer peers' with -v (debugging)")
    parser.add_argument("--hivemind-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--host-maddr", default=LOOPBACK, help=argparse.SUPPRESS)
    add_netlab_argument(parser)
    args = parser.parse_args()
    if args.hivemind_worker:
        return hivemind_worker(args)
    if args.logs_out:
        LOGS["dir"] = Path(args.logs_out)
        LOGS["dir"].mkdir(parents=True, exist_ok=True)
    if any(netlab_sites(args)) and not args.skip_hivemind:
        print("--netlab-sites: hivemind skipped (its peers cannot reach peers behind NAT here)", flush=True)
        args.skip_hivemind = True
    with placement_from_args(args, extra_nodes=1 + args.aux) as args.placement:
        return run_all(args)


def run_all(args) -> int:

    straggler = f"lognormal:mean_s={args.straggler_mean},sigma=1.5,seed=7" if args.straggler else None
    print(f"peers={args.peers} aux={args.aux} group_size={args.group_size or args.peers} epochs={args.epochs} global_batch={GLOBAL_BATCH} micro_batch={MICRO_BATCH} "
          f"target_acc={args.target} straggler={straggler}")
    print(f"hivemind.Optimizer settings: {hivemind_settings(args.matchmaking_time)} "
          f"tracker_opts={HIVEMIND_TRACKER}")
    results = {"single": run_single(args)}
    results["moshpeer"] = run_moshpeer(args, straggler=straggler, budget=None, tag="plain")
    if not args.skip_before:
        results["moshpeer_params_every_round"] = run_moshpeer(args, straggler=straggler, budget=None, tag="before",
                                                              extra_args=lambda i: ["--params-every", "1"])
    if args.straggler:
        results["moshpeer_dropcompute"] = run_moshpeer(args, straggler=straggler, budget=args.budget, tag="budget")
    if not args.skip_hivemind:
        results["hivemind"] = run_hivemind(args, straggler=straggler)

    print(f"\n{'system':<28}{'to target (s)':>15}{'final acc':>11}{'mean step (s)':>15}{'train (s)':>11}"
          f"{'bytes/round':>13}")
    for name, r in results.items():
        def fmt(value, spec):
            return format(value, spec) if value is not None else "-".rjust(int(spec.split(".")[0]))
        print(f"{name:<28}{fmt(r.get('time_to_target_s'), '15.2f')}{fmt(r.get('final_acc'), '11.4f')}"
              f"{fmt(r.get('mean_step_s'), '15.3f')}{fmt(r.get('train_s'), '11.2f')}"
              f"{fmt(r.get('bytes_per_round'), '13.0f')}")

    moshpeer, hive = results["moshpeer"], results.get("hivemind", {})
    figures = {
        "moshpeer_s": moshpeer["time_to_target_s"], "hivemind_s": hive.get("time_to_target_s"),
        "moshpeer_acc": moshpeer["final_acc"], "hivemind_acc": hive.get("final_acc"),
        "single_acc": results["single"]["final_acc"],
        "speedup_vs_hivemind": (hive["time_to_target_s"] / moshpeer["time_to_target_s"]
                                if hive.get("time_to_target_s") and moshpeer["time_to_target_s"] else None),
        "moshpeer_step_s": moshpeer["mean_step_s"], "hivemind_step_s": hive.get("mean_step_s"),
        "target_acc": args.target, "epochs": args.epochs, "peers": args.peers,
        "group_size": args.group_size or args.peers, "aux": args.aux, "netlab": args.netlab,
        "netlab_rtt_ms": args.netlab_rtt, "netlab_sites": args.netlab_sites,
        "bytes_per_round": moshpeer["bytes_per_round"],
    }
    if not args.skip_before:
        before = results["moshpeer_params_every_round"]["bytes_per_round"]
        figures["bytes_per_round_before"] = before
        figures["bytes_vs_before"] = moshpeer["bytes_per_round"] / before if before and moshpeer["bytes_per_round"] else None
        figures["before_acc"] = results["moshpeer_params_every_round"]["final_acc"]
    if args.straggler:
        budgeted = results["moshpeer_dropcompute"]
        figures["dropcompute_step_s"] = budgeted["mean_step_s"]
        figures["dropcompute_acc"] = budgeted["final_acc"]
        figures["dropcompute_step_speedup"] = (moshpeer["mean_step_s"] / budgeted["mean_step_s"]
                                               if moshpeer["mean_step_s"] and budgeted["mean_step_s"] else None)
    return emit(figures, ALL_EVENTS, args.events_out)


if __name__ == "__main__":
    sys.exit(main())
