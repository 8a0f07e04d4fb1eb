"""Group all-reduce benchmark: moshpeer vs hivemind's DecentralizedAverager vs torch.distributed gloo (and, with
`--systems ...,bare`, the floor of moshpeer's architecture: bare_allreduce.py).

    python benchmarks/bench_allreduce.py [--peers 4] [--numel 16777216] [--rounds 7] [--repeats 1]
                                         [--compression none[,fp16,...]] [--drop 0.0] [--torch-threads 1]

Every system runs `--peers` processes on this machine averaging one float32 tensor of `--numel`
values (one group of all peers). Per round we take the slowest peer's time (a round is over when
the last peer is done), then the median over `--rounds` timed rounds after one warm-up round.

What is timed (matchmaking is excluded for both swarm systems and reported separately):
- moshpeer: `RoundReport.total_s`, the data plane from the moment the group is known (connect,
  authenticate, reduce-scatter, all-gather, write-back) until `step()` has the averaged values.
- hivemind: `step(wait=False, require_trigger=True)`; once the control reaches AWAITING_TRIGGER
  (group assembled) the clock starts, `allow_allreduce()`, and it stops when the result is ready.
- gloo: `dist.all_reduce(SUM)` + divide by the peer count, after a barrier.
- bare: the same reduce-scatter + all-gather in Python threads over one TCP connection per pair, with moshpeer's
  frame MACs and nothing else (bare_allreduce.py), after a barrier: what the architecture costs before the protocol.
  It runs every codec of `--compression` (`bare[int8]`: the codec's batched encode and checked decode), so each
  moshpeer codec has its own floor (`bare_over_gloo_per_codec`, `moshpeer_over_bare_per_codec`).
Relative error: ||result - exact mean|| / ||exact mean||, exact mean computed in float64 by each peer, over the
whole vector in the warm-up round and over a fixed sample of coordinates in every timed round (`ErrorCheck`).
Ends with one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# How long a worker may take to import torch + hivemind and start its DHT (minutes on a loaded 2-core machine).
READY_TIMEOUT_S = 300
# A worker behind a NAT waits this long, at most, for a relay slot before it says it is ready (with --transport
# libp2p, p2pd's autorelay reserves one about 3 minutes after start: dht.node.start_dht's behind_nat; else a relay
# on the public peer's data plane takes it within seconds, averaging/tcp_relay/).
RELAY_WAIT_S = 240.0
sys.path.insert(0, REPO)


# ---- shared by the workers -----------------------------------------------------------------------


def peer_values(rank: int, numel: int):
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=gen) + rank


def exact_mean(peers: int, numel: int):
    import torch

    total = torch.zeros(numel, dtype=torch.float64)
    for rank in range(peers):
        total += peer_values(rank, numel).double()
    return total / peers


def rel_err(result, exact) -> float:
    return float((result.double() - exact).norm() / exact.norm())


class ErrorCheck:
    """Relative error of a peer's result to the exact mean, cheap enough to run between timed rounds.

    A full check converts and subtracts 64 MB vectors in float64: ~0.1 s of CPU and 256 MB of fresh pages. A
    peer that finished its round early would run it beside the members still in theirs, on the same cores, and
    the benchmark would time its own checker. So every round checks a fixed sample of SAMPLE coordinates, and
    `full` checks the whole vector (the workers call it in the warm-up round, which is not timed)."""

    SAMPLE = 1 << 16

    def __init__(self, peers: int, numel: int):
        import torch

        self.exact = exact_mean(peers, numel)
        self.sample = torch.randint(numel, (self.SAMPLE,), generator=torch.Generator().manual_seed(7))
        self.exact_sample = self.exact[self.sample]

    def round(self, result) -> float:
        return rel_err(result[self.sample], self.exact_sample)

    def full(self, result) -> float:
        return rel_err(result, self.exact)


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def wait_for_exit() -> None:
    sys.stdin.readline()  # the orchestrator says when everyone is done


def round_barrier() -> None:
    """After a timed round: tell the orchestrator, and wait until every peer has finished its round. What a worker
    does between rounds (checking its result, resetting its tensor: a 64 MB copy) then never runs beside another
    peer's timed round, which it would slow down; gloo and bare workers do the same with `dist.barrier()`."""
    emit(event="finished")
    sys.stdin.readline()


# ---- workers --------------------------------------------------------------------------------------


def moshpeer_worker(args) -> None:
    import torch  # noqa: F401

    # What a peer logs (rounds, members left out, retries) goes to stderr: discarded unless --worker-logs keeps it.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from moshpeer.averaging import FaultConfig, FaultyLinks, Links, MoshpitAverager
    from moshpeer.dht import start_dht

    dht = start_dht(initial_peers=args.initial_peers, host_maddrs=[f"/ip4/{args.host}/tcp/0"],
                    behind_nat=args.behind_nat)
    relay_wait = time.monotonic() + RELAY_WAIT_S
    while args.behind_nat and args.transport == "libp2p" and not dht.relay_maddrs() and time.monotonic() < relay_wait:
        time.sleep(1.0)  # over libp2p, peers behind other NATs reach it only once a p2pd relay holds a slot for it
    initial = peer_values(args.rank, args.numel)
    errors = ErrorCheck(args.peers, args.numel)
    tensor = initial.clone()
    links = FaultyLinks(FaultConfig(drop_prob=args.drop, seed=args.rank)) if args.drop > 0 else Links()
    extra = {"upload_bandwidth": args.bandwidth} if args.bandwidth else {}
    # One averager per codec (in turn, each in a run of its own), all on this process's DHT.
    averagers = {codec: MoshpitAverager([tensor], dht=dht, run_id=f"bench{k}", target_group_size=args.peers,
                                        min_group_size=args.peers, compression=codec, host=args.host,
                                        chunk_bytes=args.chunk_bytes, matchmaking_time=args.matchmaking_time,
                                        round_timeout=args.round_timeout, links=links, start=False,
                                        partition=args.partition, transport=args.transport, **extra)
                 for k, codec in enumerate(args.compression.split(","))}
    for averager in averagers.values():
        averager.start()
    if args.behind_nat and args.transport != "libp2p":  # its group mates reach it once a relay holds its slot
        for averager in averagers.values():
            averager.wait_for_relay(max(relay_wait - time.monotonic(), 0.0))
    emit(event="ready", maddrs=[str(m) for m in dht.get_visible_maddrs()])
    sys.stdin.readline()  # "go": every peer is ready (one behind a NAT only once a relay holds a slot for it)
    for codec, averager in averagers.items():
        full_err = None
        for round_index in range(args.rounds + 1):
            with averager.get_tensors():
                tensor.copy_(initial)
            cpu_before = resource.getrusage(resource.RUSAGE_SELF)
            report = averager.step(timeout=60)
            cpu_after = resource.getrusage(resource.RUSAGE_SELF)
            ended_at = time.time()
            round_barrier()
            full_err = errors.full(tensor) if round_index == 0 else full_err  # the warm-up round: nobody is timed
            emit(event="round", codec=codec, round=round_index, ok=report.ok, group_size=report.group_size,
                 seconds=report.total_s, started_at=ended_at - report.total_s, ended_at=ended_at,
                 cpu_user_s=cpu_after.ru_utime - cpu_before.ru_utime,
                 cpu_sys_s=cpu_after.ru_stime - cpu_before.ru_stime,
                 matchmaking_s=report.matchmaking_s, reduce_scatter_s=report.reduce_scatter_s,
                 all_gather_s=report.all_gather_s, bytes_sent=report.bytes_sent, lost_fraction=report.lost_fraction,
                 relayed=len(report.relayed), absent=len(report.absent),
                 rel_err=errors.round(tensor), full_rel_err=full_err)
    emit(event="done")
    wait_for_exit()
    for averager in averagers.values():
        averager.shutdown()
    dht.stop()


def hivemind_worker(args) -> None:
    import hivemind
    from hivemind.averaging.control import AveragingStage

    dht = hivemind.DHT(initial_peers=args.initial_peers or None, host_maddrs=[f"/ip4/{args.host}/tcp/0"], start=True)
    initial = peer_values(args.rank, args.numel)
    errors = ErrorCheck(args.peers, args.numel)
    tensor = initial.clone()
    averager = hivemind.DecentralizedAverager(
        [tensor], dht=dht, prefix="bench", target_group_size=args.peers, min_group_size=args.peers,
        min_matchmaking_time=args.matchmaking_time, request_timeout=args.matchmaking_time / 2, start=True,
        bandwidth=args.bandwidth,  # hivemind balances its parts by it (None: equal parts)
    )
    emit(event="ready", maddrs=[str(m) for m in dht.get_visible_maddrs()])
    full_err = None
    for round_index in range(args.rounds + 1):
        with averager.get_tensors() as (averaged,):
            averaged.copy_(initial)
        started = time.monotonic()
        control = averager.step(wait=False, require_trigger=True, timeout=60)
        while control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP) and not control.done():
            time.sleep(0.001)
        matched = time.monotonic()
        control.allow_allreduce()
        ok = True
        try:
            control.result(timeout=args.round_timeout)
        except Exception:
            ok = False
        finished = time.monotonic()
        round_barrier()
        with averager.get_tensors() as (averaged,):
            err = errors.round(averaged)
            full_err = errors.full(averaged) if round_index == 0 else full_err
        emit(event="round", round=round_index, ok=ok, seconds=finished - matched, matchmaking_s=matched - started,
             rel_err=err, full_rel_err=full_err)
    emit(event="done")
    wait_for_exit()
    averager.shutdown()
    dht.shutdown()


def gloo_worker(args) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=args.peers, timeout=datetime.timedelta(seconds=args.round_timeout * 2))
    initial = peer_values(args.rank, args.numel)
    errors = ErrorCheck(args.peers, args.numel)
    tensor = initial.clone()
    emit(event="ready", maddrs=[])
    full_err = None
    for round_index in range(args.rounds + 1):
        tensor.copy_(initial)
        dist.barrier()
        cpu_before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.monotonic()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor.div_(args.peers)
        finished = time.monotonic()
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
        dist.barrier()  # the check below never runs beside another peer's timed round
        full_err = errors.full(tensor) if round_index == 0 else full_err
        emit(event="round", round=round_index, ok=True, seconds=finished - started, rel_err=errors.round(tensor),
             full_rel_err=full_err, bytes_sent=None, cpu_user_s=cpu_after.ru_utime - cpu_before.ru_utime,
             cpu_sys_s=cpu_after.ru_stime - cpu_before.ru_stime)
    emit(event="done")
    dist.destroy_process_group()


def bare_worker(args) -> None:
    from bare_allreduce import bare_worker as run

    run(args, emit, ErrorCheck, peer_values)


WORKERS = {"moshpeer": moshpeer_worker, "hivemind": hivemind_worker, "gloo": gloo_worker, "bare": bare_worker}
# The workers without a torch.distributed barrier, which the orchestrator holds between rounds (`round_barrier`).
BARRIER_SYSTEMS = ("moshpeer", "hivemind")


# ---- orchestration --------------------------------------------------------------------------------


def _read_json(proc, event: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited (rc={proc.poll()}) before {event!r}")
        if line.startswith("{"):
            message = json.loads(line)
            if message.get("event") == event:
                return message
    raise RuntimeError(f"no {event!r} within {timeout} s")


def run_system(system: str, args, compression: str = "none", lab=None) -> Dict[str, List[List[dict]]]:
    """Run `peers` workers of `system` (in the namespaces of a `moshpeer.testing.netlab.Netlab` if given; its
    node k's upload is passed as peer k's bandwidth); returns {codec: rounds[round][peer]} (timed rounds only;
    one codec, "none", for hivemind and gloo)."""
    codecs = compression.split(",") if system in ("moshpeer", "bare") else ["none"]
    base = [sys.executable, os.path.abspath(__file__), "--role", system, "--peers", str(args.peers),
            "--numel", str(args.numel), "--rounds", str(args.rounds), "--compression", ",".join(codecs),
            "--drop", str(args.drop if system == "moshpeer" else 0.0),
            "--matchmaking-time", str(args.matchmaking_time), "--torch-threads", str(args.torch_threads),
            "--round-timeout", str(args.round_timeout), "--chunk-bytes", str(args.chunk_bytes),
            "--partition", getattr(args, "partition", "equal"), "--transport", getattr(args, "transport", "auto")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    master = "127.0.0.1"
    if lab is not None:
        from moshpeer.testing.netlab import IFNAME

        env["GLOO_SOCKET_IFNAME"] = IFNAME  # gloo would otherwise pick an interface by the host name
        master = lab.nodes[0].address
    procs = []

    def spawn(rank: int, extra: List[str]) -> subprocess.Popen:
        argv = [*base, "--rank", str(rank), *extra]
        if lab is not None:
            node = lab.nodes[rank]
            argv += ["--host", node.address]
            if node.upload_bytes_per_s and (system != "moshpeer" or getattr(args, "declare_bandwidth", True)):
                argv += ["--bandwidth", str(node.upload_bytes_per_s)]
            if node.site is not None and system == "moshpeer":
                argv += ["--behind-nat"]
            argv = lab.command(rank, argv)
        logs = getattr(args, "worker_logs", None)  # a folder: each worker's stderr (its log) goes to a file there
        if logs:
            os.makedirs(logs, exist_ok=True)
        # The worker holds its own copy of the file: ours is closed once it started.
        with open(os.path.join(logs, f"{system}-{rank}.log"), "a") if logs else \
                contextlib.nullcontext(subprocess.DEVNULL) as stderr:
            return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                    env=env)

    try:
        if system in ("gloo", "bare"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            procs = [spawn(rank, ["--port", str(port), "--master", master]) for rank in range(args.peers)]
            for proc in procs:
                _read_json(proc, "ready", READY_TIMEOUT_S)
        else:
            procs.append(spawn(0, []))
            maddrs = _read_json(procs[0], "ready", READY_TIMEOUT_S)["maddrs"]
            procs += [spawn(rank, ["--initial-peers", *maddrs]) for rank in range(1, args.peers)]
            for proc in procs[1:]:
                _read_json(proc, "ready", READY_TIMEOUT_S)
        if system == "moshpeer":
            for proc in procs:
                proc.stdin.write("go\n")
                proc.stdin.flush()
        per_peer: List[List[dict]] = [[] for _ in procs]
        for _ in range(len(codecs) * (args.rounds + 1)):
            if system in BARRIER_SYSTEMS:  # the next round once every peer finished this one (`round_barrier`)
                for proc in procs:
                    _read_json(proc, "finished", 600 + 3 * args.round_timeout)
                for proc in procs:
                    proc.stdin.write("next\n")
                    proc.stdin.flush()
            for k, proc in enumerate(procs):
                per_peer[k].append(_read_json(proc, "round", 600 + 3 * args.round_timeout))
        for proc in procs:
            _read_json(proc, "done", 60)
        rounds = args.rounds + 1
        return {codec: [[per_peer[p][k * rounds + r] for p in range(args.peers)] for r in range(1, rounds)]
                for k, codec in enumerate(codecs)}  # skip each codec's warm-up round
    finally:
        for proc in procs:
            try:
                proc.stdin.write("exit\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def summarize(rounds: List[List[dict]]) -> Dict[str, float]:
    """Median over rounds of the slowest peer; worst relative error of any peer in any round."""
    def median_of(key: str, reduce=max):
        values = [reduce(p[key] for p in r) for r in rounds if all(p.get(key) is not None for p in r)]
        return statistics.median(values) if values else float("nan")

    return {
        "seconds": median_of("seconds"),
        "matchmaking_s": median_of("matchmaking_s") if "matchmaking_s" in rounds[0][0] else float("nan"),
        "reduce_scatter_s": median_of("reduce_scatter_s") if "reduce_scatter_s" in rounds[0][0] else float("nan"),
        "all_gather_s": median_of("all_gather_s") if "all_gather_s" in rounds[0][0] else float("nan"),
        "bytes_sent": median_of("bytes_sent", reduce=statistics.mean) if rounds[0][0].get("bytes_sent") else float("nan"),
        "rel_err": max(max(p["rel_err"], p["full_rel_err"]) for r in rounds for p in r),
        # Spread of the instants the peers learned their group (included in the slowest peer's time).
        "start_skew_s": statistics.median(max(p["started_at"] for p in r) - min(p["started_at"] for p in r)
                                          for r in rounds) if "started_at" in rounds[0][0] else float("nan"),
        # From the instant the last peer learned the group to the instant the last peer was done.
        "group_s": statistics.median(max(p["ended_at"] for p in r) - max(p["started_at"] for p in r)
                                     for r in rounds) if "started_at" in rounds[0][0] else float("nan"),
        "cpu_s": statistics.median(statistics.mean(p["cpu_user_s"] + p["cpu_sys_s"] for p in r)
                                   for r in rounds) if "cpu_user_s" in rounds[0][0] else float("nan"),
        "all_ok": all(p["ok"] for r in rounds for p in r),
        # Rounds in which every peer averaged with the whole group: its group complete, nobody absent, and nothing
        # lost (a member that handshook and then broke off mid-round is "departed", not absent).
        "ok_fraction": sum(all(p["ok"] and p.get("group_size", len(r)) == len(r) and not p.get("absent")
                               and not p.get("lost_fraction") for p in r) for r in rounds)
        / max(len(rounds), 1),
        "relayed_members": max((p.get("relayed", 0) for r in rounds for p in r), default=0),
        "rounds": len(rounds),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--numel", type=int, default=16_777_216)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (after one warm-up round)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every system this many times, in turn; ratios are medians of paired repeats")
    parser.add_argument("--compression", default="none", help="moshpeer codec(s), comma-separated")
    parser.add_argument("--drop", type=float, default=0.0, help="moshpeer per-chunk drop probability")
    parser.add_argument("--matchmaking-time", type=float, default=1.5)
    parser.add_argument("--systems", default="moshpeer,hivemind,gloo")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads in every worker of every system (1: no OpenMP spinning "
                             "on top of the communication threads; the same for all systems)")
    parser.add_argument("--round-timeout", type=float, default=60.0, help="seconds a round may take")
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20, help="moshpeer chunk size (fp32 bytes)")
    parser.add_argument("--worker-logs", default=None, help="a folder for each worker's log (default: discarded)")
    parser.add_argument("--role", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--bandwidth", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--partition", default="equal", help=argparse.SUPPRESS)
    parser.add_argument("--transport", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--behind-nat", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        import torch

        torch.set_num_threads(args.torch_threads)
        WORKERS[args.role](args)
        return 0

    systems = args.systems.split(",")
    # Each repeat runs every system afresh, in turn; a system's figures are medians over the rounds of all
    # repeats, and a ratio is the median of the repeats' paired ratios (their range says how noisy the machine is).
    pooled: Dict[str, List[List[dict]]] = {}
    per_repeat: List[Dict[str, float]] = []
    for _ in range(args.repeats):
        seconds: Dict[str, float] = {}
        if "moshpeer" in systems:
            for codec, rounds in run_system("moshpeer", args, args.compression).items():
                pooled.setdefault(f"moshpeer[{codec}]", []).extend(rounds)
                seconds[f"moshpeer[{codec}]"] = summarize(rounds)["seconds"]
        for system in ("hivemind", "bare", "gloo"):
            if system not in systems:
                continue
            # bare runs each codec in a launch of its own (its worker takes one).
            for codec in args.compression.split(",") if system == "bare" else ["none"]:
                name = f"bare[{codec}]" if system == "bare" else system
                rounds = run_system(system, args, codec)[codec]
                pooled.setdefault(name, []).extend(rounds)
                seconds[name] = summarize(rounds)["seconds"]
        per_repeat.append(seconds)
    results: Dict[str, Dict[str, float]] = {name: summarize(rounds) for name, rounds in pooled.items()}

    mb = args.numel * 4 / 1e6
    print(f"\n{args.peers} peers, {args.numel} float32 values ({mb:.0f} MB), median of {args.rounds} rounds x "
          f"{args.repeats} repeats, slowest peer per round; drop={args.drop} (moshpeer only)")
    print(f"{'system':<22}{'round s':>9}{'matchmaking s':>15}{'reduce-sc s':>12}{'all-gath s':>11}"
          f"{'MB sent/peer':>14}{'rel err':>11}{'ok':>4}")
    for name, r in results.items():
        print(f"{name:<22}{r['seconds']:>9.3f}{r['matchmaking_s']:>15.3f}{r['reduce_scatter_s']:>12.3f}"
              f"{r['all_gather_s']:>11.3f}{r['bytes_sent'] / 1e6:>14.1f}{r['rel_err']:>11.2e}{str(r['all_ok'])[0]:>4}")

    primary = results.get(f"moshpeer[{args.compression.split(',')[0]}]", {})
    figures = {
        "peers": args.peers,
        "numel": args.numel,
        "compression": args.compression.split(",")[0],
        "drop": args.drop,
        "moshpeer_s": primary.get("seconds"),
        "moshpeer_matchmaking_s": primary.get("matchmaking_s"),
        "moshpeer_rel_err": primary.get("rel_err"),
        "hivemind_s": results.get("hivemind", {}).get("seconds"),
        "hivemind_matchmaking_s": results.get("hivemind", {}).get("matchmaking_s"),
        "hivemind_rel_err": results.get("hivemind", {}).get("rel_err"),
        "gloo_s": results.get("gloo", {}).get("seconds"),
        "gloo_rel_err": results.get("gloo", {}).get("rel_err"),
        "bytes_sent_per_peer": {name: r["bytes_sent"] for name, r in results.items() if name.startswith("moshpeer")},
        "seconds_per_codec": {name: r["seconds"] for name, r in results.items() if name.startswith("moshpeer")},
    }
    if figures["moshpeer_s"] and figures["hivemind_s"]:
        figures["speedup_vs_hivemind"] = figures["hivemind_s"] / figures["moshpeer_s"]
    if "gloo" in systems and "moshpeer" in systems:
        # Paired per repeat: gloo and moshpeer ran back to back on the same machine state.
        paired = {codec: [r[f"moshpeer[{codec}]"] / r["gloo"] for r in per_repeat]
                  for codec in args.compression.split(",")}
        figures["ratio_vs_gloo_per_codec"] = {codec: statistics.median(v) for codec, v in paired.items()}
        figures["ratio_vs_gloo_runs"] = paired
        figures["ratio_vs_gloo"] = figures["ratio_vs_gloo_per_codec"][args.compression.split(",")[0]]
        for codec, ratios in paired.items():
            print(f"moshpeer[{codec}] / gloo: median {statistics.median(ratios):.2f} over {len(ratios)} repeats "
                  f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    if "bare" in systems and "gloo" in systems:
        # The architecture's floor (bare_allreduce.py) against gloo, and moshpeer against that floor, paired, per
        # codec; the unsuffixed figures are the first codec's.
        figures["bare_over_gloo_per_codec"], figures["moshpeer_over_bare_per_codec"] = {}, {}
        for codec in args.compression.split(","):
            floor = [r[f"bare[{codec}]"] / r["gloo"] for r in per_repeat]
            figures["bare_over_gloo_per_codec"][codec] = statistics.median(floor)
            print(f"bare[{codec}] / gloo: median {statistics.median(floor):.2f} (range {min(floor):.2f}-"
                  f"{max(floor):.2f}); bare CPU per peer per round {results[f'bare[{codec}]']['cpu_s']:.3f} s")
            if "moshpeer" in systems:
                over = [r[f"moshpeer[{codec}]"] / r[f"bare[{codec}]"] for r in per_repeat]
                figures["moshpeer_over_bare_per_codec"][codec] = statistics.median(over)
                print(f"moshpeer[{codec}] / bare[{codec}]: median {statistics.median(over):.2f} "
                      f"(range {min(over):.2f}-{max(over):.2f})")
        primary_codec = args.compression.split(",")[0]
        figures["bare_s"] = results[f"bare[{primary_codec}]"]["seconds"]
        figures["bare_over_gloo"] = figures["bare_over_gloo_per_codec"][primary_codec]
        if "moshpeer" in systems:
            figures["moshpeer_over_bare"] = figures["moshpeer_over_bare_per_codec"][primary_codec]
    figures["repeats"] = args.repeats
    for name, r in results.items():
        if name.startswith("moshpeer"):
            print(f"{name}: peers learned the group {r['start_skew_s']:.3f} s apart (median); from the last one "
                  f"learning it to the last one done: {r['group_s']:.3f} s; CPU per peer per step "
                  f"{r['cpu_s']:.3f} s (user+sys, matchmaking included)")
    if "gloo" in results:
        print(f"gloo: CPU per peer per all_reduce {results['gloo']['cpu_s']:.3f} s (user+sys)")
        figures["gloo_cpu_per_peer_s"] = results["gloo"]["cpu_s"]
    figures["moshpeer_start_skew_s"] = primary.get("start_skew_s")
    figures["moshpeer_cpu_per_peer_s"] = primary.get("cpu_s")
    figures["moshpeer_group_s"] = primary.get("group_s")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
