"""Group all-reduce on shaped links (netlab): moshpeer vs hivemind's DecentralizedAverager vs gloo, per scenario.

    sudo python benchmarks/bench_wan.py [--peers 4] [--size 64] [--hetero-size 16] [--rounds 2]
        [--scenarios 100mbit,1gbit,hetero] [--codecs none,int8,int4-int8,arc-topk:0.01]
        [--systems moshpeer,hivemind,gloo] [--declare-bandwidth]

Every scenario builds a `moshpeer.testing.netlab` lab: one network namespace per peer on a private
bridge, each peer's upload shaped with tbf (no added latency or loss: netem is not available; the
fault injector is not used here). The workers are bench_allreduce.py's, started inside the namespaces,
so every system moves its bytes over the same shaped links. Scenarios:

- `100mbit`, `1gbit`: every peer uploads at that rate (`--size` MB of fp32 per peer);
- `hetero`: one peer at 10 Mbit/s among 100 Mbit/s peers (`--hetero-size` MB); moshpeer runs twice,
  parts sized by measured upload (`--declare-bandwidth`: by the declared rates) and equal parts.

Lower bounds (S bytes, n peers, uploads B_i; reduce-scatter + all-gather, downloads unconstrained):
uniform: 2(n-1)/n * S/B. Heterogeneous: member i uploads S - s_i + (n-1) s_i for part sizes s_i, so the
optimum over part sizes is the water-filling of `moshpeer.averaging.partition.bandwidth_part_sizes`:
T* = 2(n-1) S / sum(B) when every B_i >= sum(B) / (2(n-1)); a slower member owns nothing and T* is its
S / B_i (every exact scheme must upload each peer's S bytes once). Link utilization = bound / round time.

Round time: per round the slowest peer's time (moshpeer: the data plane once the group is known;
hivemind: from group assembled to result; gloo: all_reduce after a barrier), median over `--rounds`
timed rounds after a warm-up round. Bytes: moshpeer's own count of what it sent per round (headers
included); for hivemind and gloo the peer's interface counter over the run (all traffic) per round.
Ends with one JSON line; its unprefixed keys are for the 100 Mbit/s scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from types import SimpleNamespace
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_allreduce import run_system, summarize  # noqa: E402
from moshpeer.averaging.partition import bandwidth_part_sizes, reduce_allgather_seconds  # noqa: E402
from moshpeer.testing import netlab  # noqa: E402

SCENARIOS = {"100mbit": None, "1gbit": None, "hetero": None}
SLOW_MBIT, FAST_MBIT = 10.0, 100.0


def uploads_of(scenario: str, peers: int) -> List[float]:
    if scenario == "hetero":
        return [FAST_MBIT] * (peers - 1) + [SLOW_MBIT]
    return [netlab.parse_rate(scenario)] * peers


def bounds(size_bytes: float, uploads_mbit: List[float], numel: int) -> Dict[str, float]:
    """Optimal round time over part sizes, and the time of equal parts, on these uploads."""
    bws = [u * 1e6 / 8 for u in uploads_mbit]
    n = len(bws)
    equal = [numel // n + (1 if k < numel % n else 0) for k in range(n)]
    return {"optimum_s": reduce_allgather_seconds(size_bytes, bws, bandwidth_part_sizes(numel, bws)),
            "equal_split_s": reduce_allgather_seconds(size_bytes, bws, equal)}


def run_in_lab(system: str, settings, uploads: List[float], codecs: str) -> Dict[str, dict]:
    """One system in a fresh lab: {name: summary + link bytes per peer per round}."""
    with netlab.Netlab(uploads) as lab:
        before = [lab.tx_bytes(k) for k in range(len(uploads))]
        per_codec = run_system(system, settings, codecs, lab=lab)
        after = [lab.tx_bytes(k) for k in range(len(uploads))]
    rounds_total = sum(len(r) + 1 for r in per_codec.values())
    link_bytes = statistics.mean(a - b for a, b in zip(after, before)) / rounds_total
    out = {}
    for codec, rounds in per_codec.items():
        summary = summarize(rounds)
        summary["link_bytes_per_round"] = link_bytes  # all codecs of one run together
        summary["group_size_ok"] = all(p.get("group_size", settings.peers) == settings.peers for r in rounds for p in r)
        out[codec if system == "moshpeer" else system] = summary
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--size", type=float, default=64.0, help="MB of fp32 per peer, uniform scenarios")
    parser.add_argument("--hetero-size", type=float, default=16.0, help="MB of fp32 per peer, hetero scenario")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per system and codec (after a warm-up)")
    parser.add_argument("--scenarios", default="100mbit,1gbit,hetero")
    parser.add_argument("--codecs", default="none,int8,int4-int8,arc-topk:0.01")
    parser.add_argument("--systems", default="moshpeer,hivemind,gloo")
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20)
    parser.add_argument("--matchmaking-time", type=float, default=3.0)
    parser.add_argument("--declare-bandwidth", action="store_true",
                        help="moshpeer peers declare the lab's upload rates (default: they measure them)")
    args = parser.parse_args()
    reason = netlab.unavailable()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    scenarios = args.scenarios.split(",")
    for scenario in scenarios:
        if scenario not in SCENARIOS and netlab.parse_rate(scenario) is None:
            print(f"unknown scenario {scenario!r} (100mbit, 1gbit, hetero or any rate)", file=sys.stderr)
            return 2
    systems = args.systems.split(",")

    rows = []  # (scenario, name, summary, bound)
    figures: Dict[str, Optional[float]] = {"peers": args.peers, "size_mb": args.size, "hetero_size_mb": args.hetero_size,
                                           "load_at_start": os.getloadavg()[0]}
    for scenario in scenarios:
        uploads = uploads_of(scenario, args.peers)
        size_mb = args.hetero_size if scenario == "hetero" else args.size
        numel = int(size_mb * 1e6 / 4)
        bound = bounds(numel * 4, uploads, numel)
        slowest_round = max(bound["equal_split_s"] * 5, 60.0)
        settings = SimpleNamespace(peers=args.peers, numel=numel, rounds=args.rounds, drop=0.0,
                                   matchmaking_time=args.matchmaking_time, torch_threads=1,
                                   round_timeout=slowest_round, chunk_bytes=args.chunk_bytes,
                                   partition="bandwidth", declare_bandwidth=args.declare_bandwidth)
        results: Dict[str, dict] = {}
        if "moshpeer" in systems:
            for codec, summary in run_in_lab("moshpeer", settings, uploads, args.codecs).items():
                results[f"moshpeer[{codec}]"] = summary
            if scenario == "hetero":
                equal = SimpleNamespace(**{**vars(settings), "partition": "equal"})
                results["moshpeer[none] equal parts"] = run_in_lab("moshpeer", equal, uploads, "none")["none"]
        for system in ("hivemind", "gloo"):
            if system in systems:
                results.update(run_in_lab(system, settings, uploads, "none"))
        for name, summary in results.items():
            rows.append((scenario, name, summary, bound["optimum_s"]))
            print(f"  {scenario} {name}: round {summary['seconds']:.3f} s, bound {bound['optimum_s']:.3f} s, "
                  f"rel err {summary['rel_err']:.1e}, cpu/peer {summary['cpu_s']:.2f} s", flush=True)

        prefix = {"100mbit": "", "1gbit": "gbit_", "hetero": "hetero_"}.get(scenario, f"{scenario}_")
        none = results.get("moshpeer[none]", {}).get("seconds")
        if none:
            figures[f"{prefix}none_utilization"] = bound["optimum_s"] / none
            figures[f"{prefix}none_rel_err"] = results["moshpeer[none]"]["rel_err"]
            figures[f"{prefix}none_s"] = none
            figures[f"{prefix}none_cpu_s"] = results["moshpeer[none]"]["cpu_s"]
            for codec in args.codecs.split(","):
                if codec != "none" and f"moshpeer[{codec}]" in results:
                    key = codec.split(":")[0].replace("-", "_")
                    figures[f"{prefix}{key}_speedup_vs_none"] = none / results[f"moshpeer[{codec}]"]["seconds"]
                    figures[f"{prefix}{key}_rel_err"] = results[f"moshpeer[{codec}]"]["rel_err"]
        for system in ("gloo", "hivemind"):
            if system in results:
                figures[f"{prefix}{system}_utilization"] = bound["optimum_s"] / results[system]["seconds"]
                figures[f"{prefix}{system}_s"] = results[system]["seconds"]
        figures[f"{prefix}lower_bound_s"] = bound["optimum_s"]
        if scenario == "hetero":
            figures["hetero_equal_split_bound_s"] = bound["equal_split_s"]
            if none:
                figures["hetero_vs_optimum"] = none / bound["optimum_s"]
            equal_s = results.get("moshpeer[none] equal parts", {}).get("seconds")
            if none and equal_s:
                figures["hetero_speedup_vs_equal_split"] = equal_s / none
                figures["hetero_equal_split_s"] = equal_s

    figures["load_at_end"] = os.getloadavg()[0]
    print(f"\n{args.peers} peers on netlab links (tbf upload shaping, no added latency or loss); median of "
          f"{args.rounds} rounds, slowest peer per round; load average {figures['load_at_start']:.1f} at the start, "
          f"{figures['load_at_end']:.1f} at the end")
    print(f"{'scenario':<9}{'system':<30}{'round s':>9}{'bound s':>9}{'util':>7}{'MB sent/peer':>14}"
          f"{'link MB/peer':>14}{'cpu s/peer':>11}{'rel err':>10}{'ok':>4}")
    for scenario, name, r, bound_s in rows:
        sent = r["bytes_sent"] / 1e6 if r["bytes_sent"] == r["bytes_sent"] else float("nan")
        print(f"{scenario:<9}{name:<30}{r['seconds']:>9.3f}{bound_s:>9.3f}{bound_s / r['seconds']:>7.2f}{sent:>14.2f}"
              f"{r['link_bytes_per_round'] / 1e6:>14.2f}{r['cpu_s']:>11.2f}{r['rel_err']:>10.1e}"
              f"{str(r['all_ok'] and r['group_size_ok'])[0]:>4}")
    print("utilization = lower bound / round time (compressed codecs: bound of the uncompressed vector); "
          "link MB/peer: interface counter per round (all traffic, all codecs of one run averaged)")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
