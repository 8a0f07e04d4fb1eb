"""Chaos soak: a swarm of `moshpeer join` peers (digits, --checkpoint-dir) under sustained churn,
against the same schedule without churn.

Two runs of the same swarm for the same wall time, each on a fresh bootstrap:
- calm: the peers train undisturbed;
- churn: every --kill-every seconds the chaos loop ends one random peer that is averaging (cycling
  SIGKILL, SIGTERM and its preemption notice file) and restarts it --pause seconds later (never before
  the old process is gone), alternately from its checkpoint directory and fresh.
The harness (tests/helpers/chaos.py, shared with tests/swarm/test_churn*.py) checks every exit and checkpoint.

Figures:
- useful_time_fraction: swarm epochs per second with churn over the same without churn (both measured
  from the start of training to the end of the schedule);
- max_stall_s: the longest gap between two epochs completed by one process, against round_deadline_s
  (the deadline in force at the end, from the peers' epoch lines; the fixed flags' when they print none);
- per restart: startup_s (process start to readiness: imports, DHT, p2pd), join_s (readiness to the
  first round it averaged with others), the bytes it downloaded and raw_s, the time those bytes take
  over one loopback TCP stream measured in this run; join_over_raw and join_overhead_s (join_s - raw_s)
  are the worst restart's;
- acc_churn / acc_calm: mean of the latest evaluation of every peer averaging at the end of the schedule;
- hung_processes: ended processes that outlived their deadline or left their DHT process / p2pd behind,
  plus anything still running after the final stop; lost_checkpoints: unreadable checkpoints, durable
  checkpoints gone, restarts that did not resume from the newest valid one.

    python benchmarks/bench_churn.py [--peers 6] [--duration 600] [--kill-every 15] [--pause 5]

Ends with one JSON line: useful_time_fraction, max_stall_s, round_deadline_s, join_over_raw,
join_overhead_s, acc_churn, acc_calm, hung_processes, lost_checkpoints, ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))  # the swarm and chaos harness shared with the tests

from chaos import ChaosPlan, ChurnReport, ChurnSwarm, describe_joins, loopback_bytes_per_second  # noqa: E402
from swarm import Swarm  # noqa: E402


def run(args: argparse.Namespace, *, churn: bool, loopback_bps: float) -> ChurnReport:
    """One run of the schedule (with or without churn); the report includes leftovers after the stop."""
    name = "churn" if churn else "calm"
    with tempfile.TemporaryDirectory(prefix=f"bench-churn-{name}-") as workdir, Swarm(
            env={"OMP_NUM_THREADS": "1"}) as swarm:
        harness = ChurnSwarm(
            swarm, f"bench-churn-{name}-{os.getpid()}", Path(workdir), peers=args.peers,
            grace_period=args.grace_period, checkpoint_every_s=args.checkpoint_every,
            fixed_round_deadline_s=2 * args.matchmaking_time + args.round_timeout + 5.0,
            peer_args=("--group-size", str(args.group_size), "--matchmaking-time", str(args.matchmaking_time),
                       "--round-timeout", str(args.round_timeout)), cpu_share=args.cpu_share)
        try:
            return _run_schedule(args, harness, swarm, name, churn=churn, loopback_bps=loopback_bps)
        finally:
            harness.remove_budgets()


def _run_schedule(args: argparse.Namespace, harness: ChurnSwarm, swarm: Swarm, name: str, *, churn: bool,
                  loopback_bps: float) -> ChurnReport:
    started = time.monotonic()
    harness.start()
    print(f"[{name}] {args.peers} peers training after {time.monotonic() - started:.1f} s", flush=True)
    window_end = harness.training_started_at + args.duration
    if churn:
        harness.run_chaos(ChaosPlan(duration_s=args.duration, every_s=args.kill_every, pause_s=args.pause,
                                    seed=args.seed))
        try:  # the last restarts' joins: measured if they come back in time, reported as missing if not
            harness.wait_rejoined(timeout=args.rejoin_timeout)
        except AssertionError as e:
            print(f"[{name}] {str(e).splitlines()[0]}", flush=True)
    else:
        while time.monotonic() < window_end:
            time.sleep(min(1.0, max(0.0, window_end - time.monotonic())))
    window_end = min(window_end, time.monotonic())
    harness.stop()
    report = harness.measure(window_end=window_end, loopback_bps=loopback_bps)
    leftovers = swarm.cleanup()
    report.hung.extend(f"{info.name}({info.pid}) still running after the final stop" for info in leftovers)
    if args.events_out:
        with open(f"{args.events_out}.{name}.jsonl", "w") as f:
            for slot in harness.slots:
                for life in slot.lives:
                    for received, line in life.proc.timed_stdout():
                        if line.startswith("{"):
                            f.write(json.dumps({"proc": life.proc.name, "received": received, "line": line}) + "\n")
    return report


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=6)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of training per run (calm and churn)")
    parser.add_argument("--kill-every", type=float, default=15.0, help="seconds between two endings")
    parser.add_argument("--pause", type=float, default=5.0, help="seconds from an ending to the restart")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--round-timeout", type=float, default=10.0)
    parser.add_argument("--grace-period", type=float, default=10.0, help="each peer's --grace-period")
    parser.add_argument("--checkpoint-every", type=float, default=5.0, help="each peer's periodic checkpoint (s)")
    parser.add_argument("--rejoin-timeout", type=float, default=90.0,
                        help="after the schedule: how long the last restarted peers get to average again")
    parser.add_argument("--seed", type=int, default=0, help="which peers the chaos loop picks")
    parser.add_argument("--cpu-share", type=float, default=None, metavar="CORES",
                        help="CPU budget of each peer (cgroup quota, e.g. 0.3): a peer that dies frees nothing for "
                             "the others, as on separate machines (default: none; needs root and cgroup v1 cpu)")
    parser.add_argument("--skip-calm", action="store_true", help="churn run only (no useful_time_fraction, acc_calm)")
    parser.add_argument("--events-out", metavar="PREFIX", help="write every process's JSON lines to PREFIX.{calm,churn}.jsonl")
    args = parser.parse_args()
    for flag in ("peers", "duration", "kill_every", "pause", "group_size"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")

    load_before = load_average()
    loopback_bps = loopback_bytes_per_second()
    print(f"peers={args.peers} duration={args.duration:g}s kill_every={args.kill_every:g}s pause={args.pause:g}s "
          f"group_size={args.group_size} matchmaking={args.matchmaking_time:g}s round_timeout={args.round_timeout:g}s "
          f"loopback={loopback_bps / 1e6:.0f} MB/s load(1,5,15 min)={load_before}", flush=True)
    calm = None if args.skip_calm else run(args, churn=False, loopback_bps=loopback_bps)
    churned = run(args, churn=True, loopback_bps=loopback_bps)
    load_after = load_average()

    print(f"\n{'run':<7}{'epochs':>8}{'epochs/s':>10}{'max stall s':>13}{'accuracy':>10}{'deadline s':>12}"
          f"{'endings':>9}{'hung':>6}{'lost ckpt':>11}")
    for name, r in (("calm", calm), ("churn", churned)):
        if r is None:
            continue
        acc = "-" if r.accuracy is None else f"{r.accuracy:.4f}"
        print(f"{name:<7}{r.epochs:>8}{r.epochs_per_s:>10.3f}{r.max_stall_s:>13.2f}{acc:>10}"
              f"{r.round_deadline_s or 0:>12.2f}{r.endings:>9}{len(r.hung):>6}{len(r.lost_checkpoints):>11}")
    print("\nrestarts:")
    print("\n".join(describe_joins(churned.joins)))
    for problem in [*churned.hung, *churned.lost_checkpoints, *churned.bad_exits,
                    *((calm.hung + calm.lost_checkpoints + calm.bad_exits) if calm else [])]:
        print(f"problem: {problem}")

    join_over_raw, join_overhead = churned.worst_join()
    startups = [j.startup_s for j in churned.joins if j.startup_s is not None]

    def rounded(value: Optional[float], digits: int = 3) -> Optional[float]:
        return None if value is None else round(value, digits)

    figures = {
        "useful_time_fraction": rounded(churned.epochs_per_s / calm.epochs_per_s) if calm and calm.epochs_per_s else None,
        "max_stall_s": rounded(churned.max_stall_s, 2),
        "max_stall_where": churned.stall_where,
        "calm_max_stall_s": rounded(calm.max_stall_s, 2) if calm else None,
        "round_deadline_s": rounded(churned.round_deadline_s, 2),
        "join_over_raw": rounded(join_over_raw, 1),
        "join_overhead_s": rounded(join_overhead, 2),
        "startup_s_max": rounded(max(startups, default=None), 2),
        "restarts": len(churned.joins),
        "restarts_not_rejoined": sum(j.join_s is None for j in churned.joins),
        "acc_churn": rounded(churned.accuracy, 4),
        "acc_calm": rounded(calm.accuracy, 4) if calm else None,
        "hung_processes": len(churned.hung) + (len(calm.hung) if calm else 0),
        "lost_checkpoints": len(churned.lost_checkpoints) + (len(calm.lost_checkpoints) if calm else 0),
        "bad_exits": len(churned.bad_exits) + (len(calm.bad_exits) if calm else 0),
        "endings": churned.endings,
        "epochs_churn": churned.epochs, "epochs_calm": calm.epochs if calm else None,
        "peers": args.peers, "cpu_share": args.cpu_share, "duration_s": args.duration, "kill_every_s": args.kill_every, "pause_s": args.pause,
        "group_size": args.group_size, "loopback_MBps": round(loopback_bps / 1e6, 1),
        "load_before": load_before, "load_after": load_after,
        "joins": [asdict(j) for j in churned.joins],
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
