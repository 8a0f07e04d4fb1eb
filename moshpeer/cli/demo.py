"""`moshpeer demo --peers N`: a local swarm training the default task, watched live.

Starts a bootstrap node (`moshpeer dht`) and N training peers (`moshpeer join`) as real processes
on 127.0.0.1, reads their JSON progress lines, shows a live table (per peer: epoch, loss, metric,
samples/s, group size, lost chunks; swarm: samples toward the target batch) and stops when a peer
reaches the target metric or the time limit passes. It then writes `loss.png` (training loss
against time for every peer) and `summary.json` into `--out`. Ctrl-C stops every child process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from moshpeer.cli.common import add_metrics_argument, check_flags, positive_float
from moshpeer.errors import UserError
from moshpeer.peer.strategies import STRATEGIES

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train the default task with a local swarm of N peers, live, and plot the result",
        description="Start a bootstrap node and N training peers on this machine, show their progress live, "
        "stop at a target metric or time limit, and write loss.png and summary.json to --out.",
    )
    parser.add_argument("--peers", type=int, default=4, metavar="N", help="training peers (default: 4)")
    parser.add_argument("--task", default="digits", metavar="SPEC", help="task (default: digits)")
    parser.add_argument("--run-id", default="demo", metavar="NAME", help="run id (default: demo)")
    parser.add_argument("--target-metric", type=float, default=0.95, metavar="X",
                        help="stop when a peer's metric reaches X (default: 0.95)")
    parser.add_argument("--max-seconds", type=positive_float, default=120.0, metavar="S",
                        help="stop after S seconds of training (default: 120)")
    parser.add_argument("--max-epochs", type=int, metavar="N", help="stop peers after N collaborative epochs")
    parser.add_argument("--averaging", choices=tuple(STRATEGIES), default="gradients")
    parser.add_argument("--compression", default="none", metavar="CODEC")
    parser.add_argument("--group-size", type=int, metavar="N", help="Moshpit group size (default: min(peers, 4))")
    parser.add_argument("--target-batch-size", type=int, metavar="N", help="global batch (default: the task's)")
    parser.add_argument("--compute-budget", default="none", metavar="SECONDS|auto|none")
    parser.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N",
                        help="where every peer trains (auto: CUDA when available; default: auto)")
    parser.add_argument("--out", default="moshpeer-demo", metavar="DIR",
                        help="where to write loss.png and summary.json (default: ./moshpeer-demo)")
    parser.add_argument("--no-live", action="store_true",
                        help="print one short line per peer epoch instead of a live table")
    parser.add_argument("--events", metavar="FILE",
                        help="append every peer's JSON event lines to FILE, each with its peer's name "
                             "(input for 'moshpeer plot')")
    add_metrics_argument(parser, demo=True)
    parser.set_defaults(run=run)


@dataclass
class PeerView:
    """What the demo knows about one peer, from its JSON lines."""

    name: str
    proc: subprocess.Popen
    peer_id: str = ""
    epoch: int = 0
    loss: Optional[float] = None
    metric: Optional[float] = None
    samples_per_second: float = 0.0
    group_size: int = 0
    chunks_lost: int = 0
    swarm_samples: int = 0
    target_batch: int = 0
    state: str = "starting"
    history: List[dict] = field(default_factory=list)  # epoch events
    done: Optional[dict] = None
    stderr_tail: List[str] = field(default_factory=list)


class Demo:
    def __init__(self, args: argparse.Namespace):
        if args.peers < 1 or args.peers > 32:
            raise UserError("--peers must be between 1 and 32")
        from moshpeer.peer.device import resolve_device

        resolve_device(args.device)  # one clear line now rather than N failing peers later
        self.args = args
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.procs: List[subprocess.Popen] = []
        self.peers: List[PeerView] = []
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.stop_reason = ""
        self.events = None
        if args.events:
            try:
                self.events = open(args.events, "a")
            except OSError as e:
                raise UserError(f"cannot write the events file {args.events}: {e.strerror}") from None

    # ---- processes ----------------------------------------------------------------------------

    def spawn(self, *argv: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "moshpeer", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=self.env,
                                start_new_session=True)  # own group: Ctrl-C reaches only the demo
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        args = self.args
        boot = self.spawn("dht", "--run-id", args.run_id, "--host-maddrs", LOOPBACK, "--heartbeat", "1",
                          *self._metrics_flag(0))
        ready = _read_ready(boot, timeout=60)
        group = args.group_size or min(args.peers, 4)
        extra = ["--group-size", str(max(group, 2)), "--min-peers", str(args.peers), "--heartbeat", "1",
                 "--averaging", args.averaging, "--compression", args.compression, "--task", args.task,
                 "--compute-budget", args.compute_budget, "--max-seconds", str(args.max_seconds),
                 "--target-metric", str(args.target_metric), "--matchmaking-time", "1.0", "--device", args.device]
        if args.max_epochs:
            extra += ["--max-epochs", str(args.max_epochs)]
        if args.target_batch_size:
            extra += ["--target-batch-size", str(args.target_batch_size)]
        for i in range(args.peers):
            proc = self.spawn("join", "--initial-peers", *ready["maddrs"], "--run-id", args.run_id,
                              "--host-maddrs", LOOPBACK, *extra, *self._metrics_flag(i + 1))
            view = PeerView(name=f"peer{i + 1}", proc=proc)
            self.peers.append(view)
            threading.Thread(target=self._read_stdout, args=(view,), daemon=True).start()
            threading.Thread(target=self._read_stderr, args=(view,), daemon=True).start()

    def _metrics_flag(self, k: int) -> List[str]:
        """--metrics-port for process k (0: the bootstrap node): N + k, or any free port with N = 0."""
        port = self.args.metrics_port
        if port is None:
            return []
        return ["--metrics-port", str(port + k if port else 0)]

    def _read_stdout(self, view: PeerView) -> None:
        for raw in iter(view.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").strip()
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                self._apply(view, event)
                if self.events is not None:
                    self.events.write(json.dumps({"peer": view.name, **event}) + "\n")
                    self.events.flush()
                if self.args.no_live and event.get("event") in ("epoch", "done"):
                    # Under the lock and in one write: print() writes the text and its newline separately, so two
                    # peers' reader threads once glued two lines into one (a fast-lane run counted 11 of 12).
                    sys.stdout.write(f"{view.name} {short_line(event)}\n")
                    sys.stdout.flush()

    def _read_stderr(self, view: PeerView) -> None:
        for raw in iter(view.proc.stderr.readline, b""):
            with self.lock:
                view.stderr_tail = (view.stderr_tail + [raw.decode(errors="replace").rstrip()])[-20:]

    @staticmethod
    def _apply(view: PeerView, event: dict) -> None:
        kind = event.get("event")
        if kind == "ready":
            view.peer_id, view.state = event["peer_id"], "waiting for peers"
        elif kind == "training":
            view.target_batch, view.state = event["target_batch_size"], "training"
        elif kind == "state_loaded":
            view.state = f"loaded state (epoch {event['epoch']})"
        elif kind == "epoch":
            view.history.append(event)
            view.epoch = event["epoch"]
            view.loss = event["loss"] if event["loss"] is not None else view.loss
            view.metric = event["metric"] if event["metric"] is not None else view.metric
            view.samples_per_second = event["samples_per_second"]
            view.group_size = event["group_size"] if event["ok"] else 1
            view.chunks_lost += event["chunks_lost"]
            view.swarm_samples = event["swarm_samples"]
        elif kind == "done":
            view.done, view.state = event, f"done ({event['reason']})"

    def finished(self) -> bool:
        with self.lock:
            return all(view.done is not None or view.proc.poll() is not None for view in self.peers)

    # ---- output -------------------------------------------------------------------------------

    def table(self):
        """The live table. Peer ids are cut to their last 6 characters and states wrap: nothing is cut off at
        80 columns."""
        from rich.table import Table

        elapsed = time.monotonic() - self.started
        with self.lock:
            swarm_epoch = max((v.epoch for v in self.peers), default=0)
            target = max((v.target_batch for v in self.peers), default=0)
            table = Table(title=f"moshpeer demo: {len(self.peers)} peers, {elapsed:.0f} s, swarm epoch {swarm_epoch}"
                                f" (target batch {target} samples / epoch)")
            for column in ("peer", "state", "epoch", "loss", "acc", "samples/s", "group", "lost"):
                if column == "peer":
                    table.add_column(column, no_wrap=True, min_width=12)
                elif column == "state":
                    table.add_column(column, overflow="fold", ratio=1)
                else:
                    table.add_column(column, justify="right", no_wrap=True)
            for v in self.peers:
                table.add_row(f"{v.name} {v.peer_id[-6:]}", v.state, str(v.epoch),
                              "-" if v.loss is None else f"{v.loss:.4f}",
                              "-" if v.metric is None else f"{v.metric:.3f}", f"{v.samples_per_second:.0f}",
                              str(v.group_size or "-"), str(v.chunks_lost))
        return table

    def write_outputs(self) -> Dict[str, str]:
        os.makedirs(self.args.out, exist_ok=True)
        plot_path = os.path.join(self.args.out, "loss.png")
        summary_path = os.path.join(self.args.out, "summary.json")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(8, 5))
        with self.lock:
            for view in self.peers:
                points = [(e["time"], e["loss"]) for e in view.history if e.get("loss") is not None]
                if points:
                    axis.plot(*zip(*points), marker=".", label=f"{view.name} ({view.peer_id[-6:]})")
            summary = {
                "run_id": self.args.run_id, "task": self.args.task, "peers": len(self.peers),
                "seconds": round(time.monotonic() - self.started, 2), "stop_reason": self.stop_reason,
                "target_metric": self.args.target_metric,
                "per_peer": [
                    {"name": v.name, "peer_id": v.peer_id, "epochs": v.epoch, "final_loss": v.loss,
                     "metric": (v.done or {}).get("metrics", {}).get("accuracy", v.metric),
                     "final_metrics": (v.done or {}).get("metrics"), "reason": (v.done or {}).get("reason"),
                     "chunks_lost": v.chunks_lost, "exit_code": v.proc.poll(),
                     "history": [{k: e.get(k) for k in ("epoch", "time", "loss", "metric", "group_size",
                                                         "samples_per_second")} for e in v.history]}
                    for v in self.peers
                ],
            }
        axis.set_xlabel("seconds since the peer started training")
        axis.set_ylabel("training loss")
        axis.set_title(f"moshpeer demo: {self.args.task}, {len(self.peers)} peers")
        axis.grid(alpha=0.3)
        if self.peers:
            axis.legend()
        figure.tight_layout()
        figure.savefig(plot_path, dpi=100)
        plt.close(figure)
        metrics = [p["metric"] for p in summary["per_peer"] if p["metric"] is not None]
        summary["best_metric"] = max(metrics) if metrics else None
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=2)
        return {"plot": plot_path, "summary": summary_path}

    def wait_peers_exit(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for view in self.peers:
            if view.done is not None:
                try:
                    view.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass

    def stop_all(self, grace: float = 6.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            _signal_group(proc, signal.SIGKILL)  # whatever is left of each group (DHT process, p2pd)
            if proc.poll() is None:
                proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _read_ready(proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    result: Dict[str, dict] = {}

    def read() -> None:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").strip()
            if line.startswith("{") and json.loads(line).get("event") == "ready":
                result["ready"] = json.loads(line)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(max(0.0, deadline - time.monotonic()))
    if "ready" not in result:
        raise UserError(f"the bootstrap node did not start within {timeout:g} s")
    return result["ready"]


def short_line(event: dict) -> str:
    """One readable line for an "epoch" or "done" event (the whole record goes to --events)."""
    if event.get("event") == "done":
        metrics = " ".join(f"{k} {v:.4g}" for k, v in (event.get("metrics") or {}).items()
                           if isinstance(v, (int, float)))
        return f"done ({event.get('reason')}): {event.get('epochs')} epochs {metrics}".rstrip()
    parts = [f"epoch {event.get('epoch')}"]
    if event.get("loss") is not None:
        parts.append(f"loss {event['loss']:.4f}")
    if event.get("metric") is not None:
        parts.append(f"{event.get('metric_name') or 'metric'} {event['metric']:.3f}")
    if event.get("ok"):
        parts.append(f"group {event.get('group_size')}, {event.get('averaging_s', 0.0):.2f} s")
        if event.get("chunks_lost"):
            parts.append(f"{event['chunks_lost']} chunks lost")
    else:
        parts.append(event.get("error") or "alone")  # "alone", "caught up", ...
    parts.append(f"{event.get('samples_per_second', 0):.0f} samples/s")
    return " | ".join(parts)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    check_flags(args)  # a bad codec or task fails here, not in every peer
    demo = Demo(args)
    console = Console(stderr=True)
    # Our own SIGTERM handler: clean up children like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        demo.start()
        deadline = demo.started + args.max_seconds + 90.0  # training time + startup and shutdown margin
        if args.no_live:
            while not demo.finished() and time.monotonic() < deadline:
                time.sleep(0.25)
        else:
            with Live(demo.table(), console=console, refresh_per_second=4) as live:
                while not demo.finished() and time.monotonic() < deadline:
                    time.sleep(0.25)
                    live.update(demo.table())
        demo.stop_reason = "peers finished" if demo.finished() else "demo time limit"
        demo.wait_peers_exit(timeout=10.0)  # finished peers leave the swarm by themselves
    except KeyboardInterrupt:
        demo.stop_reason = "interrupted"
        console.print("interrupted: stopping every peer")
    finally:
        demo.stop_all()
        if demo.events is not None:
            with demo.lock:
                demo.events.close()
                demo.events = None
    paths = demo.write_outputs()
    console.print(demo.table())
    print(json.dumps({"event": "demo_done", "stop_reason": demo.stop_reason, **paths}), flush=True)
    return 0 if demo.stop_reason != "interrupted" else 130
