"""What the control plane costs a peer's link: swarm progress (signed records in the DHT) at N peers.

Every peer of a run publishes its signed record and reads everyone's (`SwarmProgress`) to learn the swarm's
epoch and how far the target batch is. This benchmark runs only that: N processes, each a DHT node that joins
through the first, links to the run as a trainer (`link_to_swarm`) and reports progress as a training loop
does (a micro-batch every `--step-s`, an epoch of its own count every `--epoch-s`, as DiLoCo's inner phase),
for `--seconds`. Nothing is averaged.
Every peer lives in its own netlab namespace (needs root), so each one's interface counter is what its link
carried: DHT requests and answers, libp2p and TCP headers.

Arms: `fixed` reads and publishes every `--fixed-refresh` seconds (0.3 s by default: the cadence before the
byte budget, which read every 0.3 s and published every 0.2 s) and `budget` uses SwarmProgress's default
cadence (progress_cadence.py). The JSON line gives each arm's mean and max upload per
peer (bytes/s) over the steady window, that mean per record (`per_record_bps`), and `budget_over_fixed` (mean
upload, budget / fixed).

    python benchmarks/bench_dht.py [--peers 4,8] [--seconds 30]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_training import Child, env  # noqa: E402

RUN_ID = "bench-dht"


def child_main(args: argparse.Namespace) -> int:
    """One peer: join, link, report progress like a training loop until `--seconds` passed, then leave."""
    from moshpeer.dht import start_dht
    from moshpeer.peer.optimizer.progress_cadence import ProgressCadence
    from moshpeer.peer.optimizer.swarm_link import link_to_swarm

    initial = [args.join] if args.join else []
    dht = start_dht(initial_peers=initial, run_ids=[RUN_ID], host_maddrs=[f"/ip4/{args.host}/tcp/0"])
    cadence = ProgressCadence.fixed(args.refresh) if args.refresh > 0 else None
    link = link_to_swarm(RUN_ID, "trainer", target_batch_size=args.target, dht=dht, host=args.host, cadence=cadence)
    print(json.dumps({"event": "ready", "maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)
    start = time.monotonic()
    epoch = samples = steps = 0
    epoch_started = start
    while time.monotonic() - start < args.seconds:
        time.sleep(args.step_s)
        samples, steps = samples + args.batch, steps + 1
        if time.monotonic() - epoch_started >= args.epoch_s:
            epoch, samples, epoch_started = epoch + 1, 0, time.monotonic()
        link.progress.report(epoch=epoch, samples_accumulated=samples, samples_per_second=args.batch / args.step_s,
                             step=steps, epoch_eta_s=max(0.0, args.epoch_s - (time.monotonic() - epoch_started)))
    print(json.dumps({"event": "done", "epoch": epoch, "view": link.progress.snapshot().to_json()}), flush=True)
    link.close()
    return 0


def run_arm(lab, peers: int, refresh: float, args: argparse.Namespace) -> Dict[str, float]:
    """Start `peers` children in the lab's first namespaces, measure their uploads over the steady window."""
    children: List[Child] = []

    def spawn(k: int, join: Optional[str]) -> Child:
        argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--host", lab.nodes[k].address,
                "--seconds", str(args.seconds + args.warmup + 30), "--refresh", str(refresh),
                "--step-s", str(args.step_s), "--epoch-s", str(args.epoch_s), "--target", str(args.target)]
        if join:
            argv += ["--join", join]
        child = Child(lab.command(k, argv), env())
        children.append(child)
        return child

    try:
        first = spawn(0, None)
        ready = first.wait_event("ready", 60)
        if ready is None:
            raise RuntimeError(f"the first peer did not start:\n{first.stderr_tail()}")
        for k in range(1, peers):
            spawn(k, ready["maddrs"][0])
        for child in children:
            if child.wait_event("ready", 90) is None:
                raise RuntimeError(f"a peer did not start:\n{child.stderr_tail()}")
        time.sleep(args.warmup)  # benchmark: let every view settle before the window opens
        before = [lab.tx_bytes(k) for k in range(peers)]
        began = time.monotonic()
        time.sleep(args.seconds)
        rates = [(lab.tx_bytes(k) - b) / (time.monotonic() - began) for k, b in enumerate(before)]
    finally:
        for child in children:
            child.stop()
    return {"mean_upload_bps": sum(rates) / len(rates), "max_upload_bps": max(rates),
            "per_record_bps": sum(rates) / len(rates) / peers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="4,8", help="swarm sizes, comma-separated")
    parser.add_argument("--seconds", type=float, default=30.0, help="the measured window per arm")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds after every peer is ready")
    parser.add_argument("--fixed-refresh", type=float, default=0.3, help="the fixed arm's refresh interval")
    parser.add_argument("--step-s", type=float, default=0.1, help="seconds per simulated micro-batch")
    parser.add_argument("--epoch-s", type=float, default=10.0, help="seconds per simulated epoch")
    parser.add_argument("--target", type=int, default=1 << 30, help="target batch size (never reached)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--join", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--refresh", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args)

    from moshpeer.testing import netlab

    reason = netlab.unavailable()
    if reason is not None:
        raise SystemExit(reason)
    sizes = [int(n) for n in args.peers.split(",")]
    figures: Dict[str, object] = {"benchmark": "dht", "seconds": args.seconds, "step_s": args.step_s,
                                  "epoch_s": args.epoch_s, "cpus": os.cpu_count()}
    for n in sizes:
        with netlab.Netlab([None] * n) as lab:
            for arm, refresh in (("fixed", args.fixed_refresh), ("budget", 0.0)):
                result = run_arm(lab, n, refresh, args)
                figures[f"{arm}_{n}"] = {k: round(v) for k, v in result.items()}
                print(f"{n} peers, {arm}: {figures[f'{arm}_{n}']}", file=sys.stderr, flush=True)
        figures[f"budget_over_fixed_{n}"] = round(
            figures[f"budget_{n}"]["mean_upload_bps"] / max(figures[f"fixed_{n}"]["mean_upload_bps"], 1), 3)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
