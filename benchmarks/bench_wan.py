"""Group all-reduce on shaped links (netlab): moshpeer vs hivemind's DecentralizedAverager vs gloo, per scenario.

    sudo python benchmarks/bench_wan.py [--peers 4] [--size 64] [--hetero-size 16] [--rounds 2]
        [--scenarios 100mbit,1gbit,hetero] [--codecs none,int8,int4-int8,arc-topk:0.01]
        [--systems moshpeer,hivemind,gloo] [--declare-bandwidth] [--tcp-congestion cubic]
        [--initial-window 64]

Every scenario builds a `moshpeer.testing.netlab` lab: one network namespace per peer behind a router
namespace, each peer's upload shaped with tbf, with netlab's own delay line for round-trip times and site
routers for NAT (no loss; the fault injector is not used here). Every peer's TCP runs `--tcp-congestion`: CUBIC,
stock Linux's default, unless told otherwise (this machine's kernel may default to BBR, which does worse here with
several flows per uplink: netlab/tcp.py), with the kernel's initial window of 10 segments unless
`--initial-window` says otherwise (docs/operations.md, "Peers far apart"). The workers are bench_allreduce.py's,
started inside the namespaces, so every system moves its bytes over the same links. Scenarios:

- `100mbit`, `1gbit`: every peer uploads at that rate (`--size` MB of fp32 per peer);
- `hetero`: one peer at 10 Mbit/s among 100 Mbit/s peers (`--hetero-size` MB); moshpeer runs twice,
  parts sized by measured upload (`--declare-bandwidth`: by the declared rates) and equal parts;
- `rtt100`: 100 Mbit/s with 100 ms round trips (`--size` MB); `rtt0`, `rtt50`, `rtt200`: matchmaking and
  handshake overhead at that round-trip time (4 MB, moshpeer only);
- `nat`: 2 peers behind each of two NATs + 1 public peer (moshpeer only: gloo and hivemind's averager need
  every peer reachable), `--nat-rounds` rounds through the relay on the public peer's data plane, then 3 rounds
  with every chunk over libp2p streams;
- `join`: a newcomer 100 ms from 3 donors at 50 Mbit/s each downloads a `--join-size` MB state.

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

from bench_allreduce import READY_TIMEOUT_S, _read_json, run_system, summarize  # noqa: E402
from moshpeer.averaging.partition import bandwidth_part_sizes, reduce_allgather_seconds  # noqa: E402
from moshpeer.testing import netlab  # noqa: E402
from moshpeer.testing.netlab import tcp as netlab_tcp  # noqa: E402

SLOW_MBIT, FAST_MBIT = 10.0, 100.0
# Scenarios with latency, NAT or both (the others are a rate, or "hetero"): what each lab adds to uniform links.
# rtt0/50/100/200: every peer at 100 Mbit/s with that round-trip time; rtt100 moves --size MB like 100mbit,
# the others a small vector (their figure is matchmaking: round trips, not bandwidth).
# nat: 2 peers behind each of two NATs (a cone and a symmetric one) and 1 public peer, --nat-rounds rounds (the
# NAT'ed peers hold slots on the public peer's relay: nat_relay_mbps), then the same lab with every chunk over
# libp2p streams (nat_libp2p_*).
RTT_MS = {"rtt0": 0.0, "rtt50": 50.0, "rtt100": 100.0, "rtt200": 200.0}
NAT_SITES = [None, "cone-a", "cone-a", "symmetric-b", "symmetric-b"]
SCENARIOS = ("100mbit", "1gbit", "hetero", *RTT_MS, "nat", "join")
MATCHMAKING_MB = 4.0


def uploads_of(scenario: str, peers: int) -> List[float]:
    if scenario == "hetero":
        return [FAST_MBIT] * (peers - 1) + [SLOW_MBIT]
    if scenario in RTT_MS:
        return [FAST_MBIT] * peers
    if scenario == "nat":
        return [None] * len(NAT_SITES)
    return [netlab.parse_rate(scenario)] * peers


def lab_options(scenario: str) -> dict:
    if scenario in RTT_MS:
        return {"rtt": RTT_MS[scenario]}
    if scenario == "nat":
        return {"sites": NAT_SITES, "subnet": netlab.PUBLIC_CORE_SUBNET}  # see there: relays need public addresses
    return {}


def bounds(size_bytes: float, uploads_mbit: List[float], numel: int) -> Dict[str, float]:
    """Optimal round time over part sizes, and the time of equal parts, on these uploads."""
    bws = [u * 1e6 / 8 for u in uploads_mbit]
    n = len(bws)
    equal = [numel // n + (1 if k < numel % n else 0) for k in range(n)]
    return {"optimum_s": reduce_allgather_seconds(size_bytes, bws, bandwidth_part_sizes(numel, bws)),
            "equal_split_s": reduce_allgather_seconds(size_bytes, bws, equal)}


def tcp_options(args) -> dict:
    """netlab's TCP settings from `--tcp-congestion` ('kernel': this kernel's default) and `--initial-window`."""
    return {"tcp_congestion": None if args.tcp_congestion == "kernel" else args.tcp_congestion,
            "initial_window": args.initial_window}


def run_in_lab(system: str, settings, uploads: List[float], codecs: str, **options) -> Dict[str, dict]:
    """One system in a fresh lab (`options`: netlab.Netlab's rtt, sites, ...): {name: summary + link bytes per
    peer per round}."""
    with netlab.Netlab(uploads, **options) as lab:
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


def nat_scenario(args) -> Dict[str, float]:
    """Peers behind a cone and a symmetric NAT with one public peer (NAT_SITES): the fraction of rounds that
    averaged with every member (the NAT'ed peers reach each other through the relay on the public peer's data
    plane, averaging/tcp_relay/), that path's throughput, and the same lab with every chunk over libp2p."""
    numel = int(args.nat_size * 1e6 / 4)
    peers = len(NAT_SITES)
    settings = SimpleNamespace(peers=peers, numel=numel, rounds=args.nat_rounds, drop=0.0,
                               matchmaking_time=args.matchmaking_time, torch_threads=1, round_timeout=120.0,
                               chunk_bytes=args.chunk_bytes, partition="equal", declare_bandwidth=False,
                               worker_logs=args.worker_logs)
    uploads = uploads_of("nat", peers)
    options = {**lab_options("nat"), **tcp_options(args)}
    auto = run_in_lab("moshpeer", settings, uploads, "none", **options)["none"]
    over_libp2p = SimpleNamespace(**{**vars(settings), "rounds": 3, "transport": "libp2p"})
    forced = run_in_lab("moshpeer", over_libp2p, uploads, "none", **options)["none"]
    relay_mbps = auto["bytes_sent"] * 8 / auto["seconds"] / 1e6
    print(f"  nat: {auto['ok_fraction']:.2f} of {args.nat_rounds} rounds averaged with all {peers} peers "
          f"(up to {auto['relayed_members']} members relayed per peer), {relay_mbps:.0f} Mbit/s per peer; every "
          f"chunk over libp2p: {forced['ok_fraction']:.2f} of 3 rounds with all peers", flush=True)
    return {"nat_round_ok_fraction": auto["ok_fraction"], "nat_relayed_members": auto["relayed_members"],
            "nat_round_s": auto["seconds"], "nat_rel_err": auto["rel_err"], "nat_relay_mbps": relay_mbps,
            "nat_libp2p_ok_fraction": forced["ok_fraction"], "nat_libp2p_rel_err": forced["rel_err"],
            "nat_libp2p_round_s": forced["seconds"]}


# A newcomer in its own namespace: its DHT node bootstraps the donors; after "go" on stdin it waits for every
# offer, then downloads the state and prints the time.
NEWCOMER = """
import json, sys, time
from moshpeer.dht import start_dht
from moshpeer.peer.state.sync import download_state, list_state_offers
host, run, donors = sys.argv[1], sys.argv[2], int(sys.argv[3])
dht = start_dht(host_maddrs=[f"/ip4/{host}/tcp/0"], run_ids=[run])
print(json.dumps({"event": "ready", "maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)
sys.stdin.readline()
deadline = time.monotonic() + 120
while len(list_state_offers(dht, run)) < donors and time.monotonic() < deadline:
    time.sleep(0.2)
started = time.monotonic()
state = download_state(dht, run, min_epoch=1, timeout=300, show_progress=False)
print(json.dumps({"event": "done", "seconds": time.monotonic() - started, "bytes": state.nbytes,
                  "donors": len(state.donors)}), flush=True)
dht.stop()
"""
JOIN_DONORS, JOIN_DONOR_MBIT, JOIN_RTT_MS = 3, 50.0, 100.0


def join_scenario(args) -> Dict[str, float]:
    """A newcomer 100 ms from 3 donors at 50 Mbit/s each downloads a `--join-size` MB state: the time, against
    the raw transfer bound (the state's bytes over the donors' summed uploads)."""
    import subprocess

    donor_script = os.path.join(REPO, "tests", "helpers", "state_donor.py")
    floats = int(args.join_size * 1e6 / 4)
    uploads = [None] + [JOIN_DONOR_MBIT] * JOIN_DONORS
    run = "bench-join"
    with netlab.Netlab(uploads, rtt=JOIN_RTT_MS, **tcp_options(args)) as lab:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
        newcomer = lab.popen(0, [sys.executable, "-c", NEWCOMER, lab.nodes[0].address, run, str(JOIN_DONORS)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        maddr = _read_json(newcomer, "ready", READY_TIMEOUT_S)["maddrs"][0]
        donors = [lab.popen(k, [sys.executable, donor_script, "--initial-peer", maddr, "--run", run, "--seed", "1",
                                "--floats", str(floats), "--host", lab.nodes[k].address],
                            stdout=subprocess.PIPE, text=True, env=env) for k in range(1, JOIN_DONORS + 1)]
        for donor in donors:
            _read_json(donor, "ready", READY_TIMEOUT_S)  # its offer is advertised
        newcomer.stdin.write("go\n")
        newcomer.stdin.flush()
        done = _read_json(newcomer, "done", 600)
    bound = done["bytes"] / (JOIN_DONORS * JOIN_DONOR_MBIT * 1e6 / 8)
    print(f"  join: {done['bytes'] / 1e6:.0f} MB from {done['donors']} donors at {JOIN_RTT_MS:g} ms RTT in "
          f"{done['seconds']:.2f} s (raw transfer bound {bound:.2f} s)", flush=True)
    return {"join_s_rtt100": done["seconds"], "join_bound_s": bound, "join_bytes": done["bytes"],
            "join_donors_used": done["donors"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--size", type=float, default=64.0, help="MB of fp32 per peer, uniform scenarios")
    parser.add_argument("--hetero-size", type=float, default=16.0, help="MB of fp32 per peer, hetero scenario")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per system and codec (after a warm-up)")
    parser.add_argument("--scenarios", default="100mbit,1gbit,hetero",
                        help=f"comma-separated: {', '.join(SCENARIOS)} or any rate (e.g. 20mbit)")
    parser.add_argument("--nat-rounds", type=int, default=20, help="rounds of the nat scenario")
    parser.add_argument("--join-size", type=float, default=64.0, help="MB of state, join scenario")
    parser.add_argument("--nat-size", type=float, default=16.0, help="MB of fp32 per peer, nat scenario")
    parser.add_argument("--codecs", default="none,int8,int4-int8,arc-topk:0.01")
    parser.add_argument("--systems", default="moshpeer,hivemind,gloo")
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20)
    parser.add_argument("--worker-logs", default=None, help="a folder for each worker's log (default: discarded)")
    parser.add_argument("--matchmaking-time", type=float, default=3.0)
    parser.add_argument("--tcp-congestion", default="cubic",
                        help="the TCP congestion control every peer runs: cubic (default: stock Linux's, what a "
                             "volunteer's machine runs), bbr, ..., or 'kernel' for this kernel's default")
    parser.add_argument("--initial-window", type=int, default=None,
                        help="TCP's initial congestion and receive windows on every peer's routes, in segments "
                             "(ip route's initcwnd / initrwnd; default: the kernel's, 10)")
    parser.add_argument("--declare-bandwidth", action="store_true",
                        help="moshpeer peers declare the lab's upload rates (default: they measure them)")
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    reason = netlab.unavailable(delays=any(s in RTT_MS or s == "join" for s in scenarios), sites="nat" in scenarios)
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    for scenario in scenarios:
        try:
            known = scenario in SCENARIOS or netlab.parse_rate(scenario) is not None
        except netlab.NetlabError:
            known = False
        if not known:
            print(f"unknown scenario {scenario!r} ({', '.join(SCENARIOS)} or any rate)", file=sys.stderr)
            return 2
    try:
        if args.tcp_congestion != "kernel":
            netlab_tcp.check_available(args.tcp_congestion)
    except netlab.NetlabError as e:
        print(f"--tcp-congestion: {e} (or 'kernel')", file=sys.stderr)
        return 2
    if args.initial_window is not None and not 1 <= args.initial_window <= netlab.MAX_INITIAL_WINDOW:
        print(f"--initial-window: 1 to {netlab.MAX_INITIAL_WINDOW} segments, got {args.initial_window}",
              file=sys.stderr)
        return 2
    systems = args.systems.split(",")

    rows = []  # (scenario, name, summary, bound)
    figures: Dict[str, Optional[float]] = {"peers": args.peers, "size_mb": args.size, "hetero_size_mb": args.hetero_size,
                                           "tcp_congestion": args.tcp_congestion,
                                           "initial_window": args.initial_window, "load_at_start": os.getloadavg()[0]}
    for scenario in scenarios:
        if scenario == "nat":
            figures.update(nat_scenario(args))
            continue
        if scenario == "join":
            figures.update(join_scenario(args))
            continue
        uploads = uploads_of(scenario, args.peers)
        size_mb = {"hetero": args.hetero_size, "rtt0": MATCHMAKING_MB, "rtt50": MATCHMAKING_MB,
                   "rtt200": MATCHMAKING_MB}.get(scenario, args.size)
        numel = int(size_mb * 1e6 / 4)
        bound = bounds(numel * 4, uploads, numel)
        slowest_round = max(bound["equal_split_s"] * 5, 60.0)
        settings = SimpleNamespace(peers=args.peers, numel=numel, rounds=args.rounds, drop=0.0,
                                   matchmaking_time=args.matchmaking_time, torch_threads=1,
                                   round_timeout=slowest_round, chunk_bytes=args.chunk_bytes,
                                   partition="bandwidth", declare_bandwidth=args.declare_bandwidth,
                                   worker_logs=args.worker_logs)
        options = {**lab_options(scenario), **tcp_options(args)}
        results: Dict[str, dict] = {}
        if scenario in RTT_MS and scenario != "rtt100":  # matchmaking and handshakes at this round-trip time
            summary = run_in_lab("moshpeer", settings, uploads, "none", **options)["none"]
            figures[f"matchmaking_s_{scenario}"] = summary["matchmaking_s"]
            figures[f"round_overhead_s_{scenario}"] = summary["seconds"] - bound["optimum_s"]
            rows.append((scenario, "moshpeer[none]", {**summary, "link_bytes_per_round": float("nan")},
                         bound["optimum_s"]))
            continue
        if "moshpeer" in systems:
            for codec, summary in run_in_lab("moshpeer", settings, uploads, args.codecs, **options).items():
                results[f"moshpeer[{codec}]"] = summary
            if scenario == "hetero":
                equal = SimpleNamespace(**{**vars(settings), "partition": "equal"})
                results["moshpeer[none] equal parts"] = run_in_lab("moshpeer", equal, uploads, "none")["none"]
        for system in ("hivemind", "gloo"):
            if system in systems:
                results.update(run_in_lab(system, settings, uploads, "none", **options))
        for name, summary in results.items():
            rows.append((scenario, name, summary, bound["optimum_s"]))
            print(f"  {scenario} {name}: round {summary['seconds']:.3f} s, bound {bound['optimum_s']:.3f} s, "
                  f"rel err {summary['rel_err']:.1e}, cpu/peer {summary['cpu_s']:.2f} s", flush=True)

        if scenario == "rtt100" and "moshpeer[none]" in results:
            figures["matchmaking_s_rtt100"] = results["moshpeer[none]"]["matchmaking_s"]
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
    print(f"\n{args.peers} peers on netlab links (tbf upload shaping, {args.tcp_congestion} TCP, no added loss); "
          f"median of "
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
