"""Training under packet loss and microbursts: the fixed-deadline baseline vs the phase-aware loss budget (DBLP).

4 `moshpeer join` peers (real processes on 127.0.0.1) train the built-in digits classifier in
gradient mode (one group of 4, global batch 256, micro-batch 32, the same data seeds and sample
budget in every run). Every peer injects faults into its own outgoing chunks (`--faults`, the real
transport). Scenarios, each run with both loss settings:

- lossless: no faults;
- loss10: 10% of chunk transmissions lost at random;
- bursts: microbursts: a burst starts with probability `--burst-prob-per-kib` per KiB sent and loses 75%
  of the next `--burst-kib` KiB of transmissions. Bursts are defined in bytes, so the loss process is
  the same whatever the chunk size (FaultConfig counts transmissions: the bench converts).

The chunk is the unit of loss. DBLP works on packets; the default chunk is 1 KiB (256 fp32 values, about
one Ethernet packet's payload), so a round of the 52k-value digits model has ~51 chunks per part and a
receiver expects ~153 chunks per phase in a group of 4: P_low = 2% lets it miss 3 of them.

Links are reliable (`retransmit_s`): a lost chunk is sent again after a 0.2 s retransmission timeout.
The baseline (`--loss-budget fixed`) is a TCP-like in-order link that waits for everything until the
round deadline, so every loss costs a retransmission and holds back the chunks behind it. The
phase-aware budget (`--loss-budget 0.02,0.42`) is DBLP's bounded-loss transport: a receiver may miss
P of the chunks it expects in a phase (P = 2% in critical phases, 42% otherwise; the phase comes from
the relative change of the norm of the gradient summed over a window of 5 epochs, Accordion's signal,
and the group applies the smallest budget any member declared), the rest is reconstructed without
bias, and losses beyond P are resent selectively, without holding back later chunks.

Reports per run: end-to-end training time (slowest peer), p50 / p99 of the round time (data plane of
one averaging round: what the budget governs; matchmaking excluded) over every round of every peer,
final test accuracy (mean of the peers), mean fraction of chunks lost, and rounds per phase.

    python benchmarks/bench_lossy.py [--epochs 30] [--peers 4] [--netlab RATE]

`--netlab RATE` runs the peers on shaped links instead of 127.0.0.1 (see bench_training.py); the faults
are still the injector's (netem is not available), now on top of real bandwidth limits.

Ends with one JSON line: lossless_metric, loss10_metric, burst_p99_baseline_s, burst_p99_budget_s,
burst_total_baseline_s, burst_total_budget_s, and more.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

from bench_training import (Child, Placement, add_netlab_argument, emit, env,  # same directory: the process
                            placement_from_args)  # helpers of the training benchmark

GLOBAL_BATCH, MICRO_BATCH = 256, 32
RETRANSMIT_S = 0.2  # TCP's minimum retransmission timeout
BASELINE, BUDGET = "fixed", "0.02,0.42"


def percentile(values: List[float], q: float) -> Optional[float]:
    """The q-th percentile (nearest rank) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))  # ceil(q/100 * n)
    return ordered[rank - 1]


def burst_settings(args) -> tuple:
    """(burst_prob per transmission, burst_len in transmissions) for the chunk size: bursts in bytes."""
    kib_per_chunk = args.chunk_bytes / 1024
    return min(1.0, args.burst_prob_per_kib * kib_per_chunk), max(1, round(args.burst_kib / kib_per_chunk))


def scenario_faults(name: str, args) -> Optional[str]:
    if name == "lossless":
        return None
    if name == "loss10":
        return f"drop_prob=0.1,retransmit_s={RETRANSMIT_S},seed=7"
    if name == "bursts":
        prob, length = burst_settings(args)
        return f"burst_prob={prob:.6g},burst_len={length},burst_loss=0.75,retransmit_s={RETRANSMIT_S},seed=7"
    raise ValueError(name)


def run_swarm(args, scenario: str, loss_budget: str) -> dict:
    """One training run of `args.peers` peers; returns its figures."""
    e = env()
    run_id = f"lossy-{scenario}-{abs(hash(loss_budget)) % 10**6}-{os.getpid()}"
    where = getattr(args, "placement", None) or Placement()
    boot = Child(where.argv(args.peers, [sys.executable, "-m", "moshpeer", "dht", "--run-id", run_id,
                                         "--host-maddrs", where.maddr(args.peers), "--heartbeat", "1"]), e)
    children = [boot]
    try:
        ready = boot.wait_event("ready", 120)  # a loaded machine may take a while to import and start p2pd
        if ready is None:
            raise RuntimeError("bootstrap did not start")
        faults = scenario_faults(scenario, args)
        peers = []
        for i in range(args.peers):
            argv = [sys.executable, "-m", "moshpeer", "join", "--initial-peers", *ready["maddrs"], "--run-id", run_id,
                    "--host-maddrs", where.maddr(i), "--heartbeat", "1", "--group-size", str(args.peers),
                    "--min-peers", str(args.peers), "--max-epochs", str(args.epochs), "--eval-every", str(args.epochs),
                    "--target-batch-size", str(GLOBAL_BATCH), "--batch-size", str(MICRO_BATCH),
                    "--matchmaking-time", str(args.matchmaking_time), "--round-timeout", str(args.round_timeout),
                    "--seed", str(i), "--chunk-bytes", str(args.chunk_bytes), "--loss-budget", loss_budget]
            if faults:
                argv += ["--faults", faults]
            if where.behind_nat(i):
                argv += ["--behind-nat"]
            peers.append(Child(where.argv(i, argv), e))
        children += peers
        for peer in peers:
            peer.wait_event("done", args.timeout)
        return summarize(peers)
    finally:
        for child in children:
            child.stop()


def summarize(peers: List[Child]) -> dict:
    done = [p.wait_event("done", 0) for p in peers]
    epochs = [e for p in peers for e in p.events if e.get("event") == "epoch"]
    rounds = [e for e in epochs if e.get("ok")]
    round_s = [e["averaging_s"] for e in rounds]
    finals = [d["metrics"]["accuracy"] for d in done if d]
    ends = [max((e["train_time"] for e in p.events if e.get("event") == "epoch"), default=None) for p in peers]
    phases = [e.get("loss_phase") for e in rounds]
    return {
        "total_s": max((t for t in ends if t is not None), default=None),
        "p50_round_s": percentile(round_s, 50),
        "p99_round_s": percentile(round_s, 99),
        "mean_round_s": statistics.fmean(round_s) if round_s else None,
        "metric": statistics.fmean(finals) if finals else None,
        "peers_finished": len(finals),
        "rounds_ok": len(rounds),
        "rounds": len(epochs),
        "lost_fraction": statistics.fmean(e["lost_fraction"] for e in rounds) if rounds else None,
        "critical_rounds": phases.count("critical"),
        "normal_rounds": phases.count("normal"),
        # The budget's own effect: rounds of the normal phase (critical ones wait like the baseline, by design).
        "p99_normal_round_s": percentile([e["averaging_s"] for e in rounds if e.get("loss_phase") == "normal"], 99),
        "rounds_detail": [(e["epoch"], e.get("loss_phase"), e["averaging_s"], e["lost_fraction"]) for e in rounds],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=30, help="collaborative epochs (sample budget / 256)")
    parser.add_argument("--chunk-bytes", type=int, default=1024,
                        help="averaging chunk, the unit of loss (default: about one packet's payload)")
    parser.add_argument("--burst-prob-per-kib", type=float, default=0.005,
                        help="probability that a burst starts, per KiB sent")
    parser.add_argument("--burst-kib", type=float, default=24.0, help="KiB of transmissions a burst lasts "
                        "(75%% of them lost)")
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--round-timeout", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=400.0, help="per run")
    parser.add_argument("--scenarios", default="lossless,loss10,bursts")
    parser.add_argument("--baseline", default=BASELINE, help="loss budget of the baseline runs (ablation: a tiny "
                        "fixed P such as 0.0001 waits for everything over the selective-resend transport)")
    parser.add_argument("--budget", default=BUDGET, help="loss budget of the budgeted runs")
    parser.add_argument("--events-out", metavar="PATH", help="write every run's figures here (debugging)")
    add_netlab_argument(parser)
    args = parser.parse_args()
    with placement_from_args(args, extra_nodes=1) as args.placement:
        return run_all(args)


def run_all(args) -> int:
    print(f"peers={args.peers} epochs={args.epochs} global_batch={GLOBAL_BATCH} micro_batch={MICRO_BATCH} "
          f"chunk_bytes={args.chunk_bytes} bursts={scenario_faults('bursts', args)!r} "
          f"retransmit_s={RETRANSMIT_S} baseline={args.baseline!r} budget={args.budget!r} "
          f"load={os.getloadavg()[0]:.2f}", flush=True)
    results: Dict[str, dict] = {}
    for scenario in args.scenarios.split(","):
        for label, setting in (("baseline", args.baseline), ("budget", args.budget)):
            started = time.monotonic()
            results[f"{scenario}/{label}"] = run_swarm(args, scenario, setting)
            shown = {k: v for k, v in results[f"{scenario}/{label}"].items() if k != "rounds_detail"}
            print(f"  {scenario}/{label}: {json.dumps(shown)} "
                  f"({time.monotonic() - started:.0f} s wall, load {os.getloadavg()[0]:.2f})", flush=True)

    def fmt(value, spec):
        return format(value, spec) if value is not None else "-"

    print(f"\n{'run':<20}{'total (s)':>10}{'p50 round':>11}{'p99 round':>11}{'accuracy':>10}{'lost':>8}"
          f"{'crit/norm':>11}{'ok/rounds':>11}")
    for name, r in results.items():
        print(f"{name:<20}{fmt(r['total_s'], '10.2f')}{fmt(r['p50_round_s'], '11.3f')}{fmt(r['p99_round_s'], '11.3f')}"
              f"{fmt(r['metric'], '10.4f')}{fmt(r['lost_fraction'], '8.3f')}"
              f"{r['critical_rounds']:>5}/{r['normal_rounds']:<5}{r['rounds_ok']:>5}/{r['rounds']:<5}")

    def get(run: str, key: str):
        return results.get(run, {}).get(key)

    def ratio(a, b):
        return a / b if a is not None and b else None

    burst_total_ratio = ratio(get("bursts/budget", "total_s"), get("bursts/baseline", "total_s"))
    figures = {
        "lossless_metric": get("lossless/budget", "metric"),
        "lossless_baseline_metric": get("lossless/baseline", "metric"),
        "loss10_metric": get("loss10/budget", "metric"),
        "loss10_baseline_metric": get("loss10/baseline", "metric"),
        "burst_metric_baseline": get("bursts/baseline", "metric"),
        "burst_metric_budget": get("bursts/budget", "metric"),
        "burst_p99_baseline_s": get("bursts/baseline", "p99_round_s"),
        "burst_p99_budget_s": get("bursts/budget", "p99_round_s"),
        "burst_p50_baseline_s": get("bursts/baseline", "p50_round_s"),
        "burst_p50_budget_s": get("bursts/budget", "p50_round_s"),
        "burst_total_baseline_s": get("bursts/baseline", "total_s"),
        "burst_total_budget_s": get("bursts/budget", "total_s"),
        "loss10_total_baseline_s": get("loss10/baseline", "total_s"),
        "loss10_total_budget_s": get("loss10/budget", "total_s"),
        "lossless_total_baseline_s": get("lossless/baseline", "total_s"),
        "lossless_total_budget_s": get("lossless/budget", "total_s"),
        "burst_p99_normal_budget_s": get("bursts/budget", "p99_normal_round_s"),
        "burst_p99_speedup": ratio(get("bursts/baseline", "p99_round_s"), get("bursts/budget", "p99_round_s")),
        "burst_total_reduction": 1 - burst_total_ratio if burst_total_ratio is not None else None,
        "peers": args.peers, "epochs": args.epochs, "chunk_bytes": args.chunk_bytes, "load": os.getloadavg()[0],
    }
    return emit(figures, results, args.events_out)


if __name__ == "__main__":
    sys.exit(main())
