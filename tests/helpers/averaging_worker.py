"""A peer process for the averaging tests and benchmark: a DHT node plus a MoshpitAverager, driven over stdin.

    python tests/helpers/averaging_worker.py --index K [--initial-peers MADDR ...] [averager options]

Prints {"event": "ready", "maddrs": [...], ...} once it can average, then executes one JSON command
per stdin line and answers each with one JSON line on stdout:

    {"cmd": "set", "seed": S}            tensor <- peer_values(S, K, numel)
    {"cmd": "step", "weight": W}         one averaging round -> {"event": "report", ...RoundReport}
    {"cmd": "step", "search_s": T}       ... looking for a group for at most T seconds
    {"cmd": "add", "seed": S, "scale": A} tensor += A * peer_values(S, K, numel)
    {"cmd": "values"}                    -> {"event": "values", "values": [...]}
    {"cmd": "step", "faults": "drop_prob=0.1,..."} also sets this peer's fault injection ("" = none)
    {"cmd": "dump", "path": P}           torch.save(tensor, P) -> {"event": "dumped"}
    {"cmd": "exit"}
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from moshpeer.averaging import FaultyLinks, MoshpitAverager  # noqa: E402
from moshpeer.averaging.links import PLAIN_LINKS  # noqa: E402
from moshpeer.dht import start_dht  # noqa: E402
from moshpeer.logs import quiet_expected_peer_failures  # noqa: E402


def peer_values(seed: int, index: int, numel: int) -> torch.Tensor:
    """Deterministic per-peer values, so any process can compute the exact mean of the swarm."""
    gen = torch.Generator().manual_seed(seed * 100_003 + index)
    return torch.randn(numel, generator=gen) + index  # peers differ in mean too


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--run-id", default="avg-test")
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--target-group-size", type=int, default=2)
    parser.add_argument("--min-group-size", type=int, default=2)
    parser.add_argument("--grid-bits", default=None)
    parser.add_argument("--compression", default="none")
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20)
    parser.add_argument("--matchmaking-time", type=float, default=1.5)
    parser.add_argument("--round-timeout", type=float, default=20.0)
    parser.add_argument("--faults", default="")
    parser.add_argument("--aggregation", default="mean")
    parser.add_argument("--transport", default="auto", help="auto | libp2p (see MoshpitAverager)")
    parser.add_argument("--behind-nat", action="store_true", help="start_dht(behind_nat=True): hold a relay slot")
    parser.add_argument("--host", default="127.0.0.1", help="address of this peer's DHT and data plane")
    parser.add_argument("--partition", default="equal", help="equal | bandwidth (see MoshpitAverager)")
    parser.add_argument("--bandwidth", type=float, default=None, help="declared upload, bytes/s (default: measured)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_expected_peer_failures()  # a peer leaving: one line, not hivemind's traceback

    dht = start_dht(initial_peers=args.initial_peers, host_maddrs=[f"/ip4/{args.host}/tcp/0"],
                    behind_nat=args.behind_nat)
    tensor = peer_values(0, args.index, args.numel)
    averager = MoshpitAverager(
        [tensor],
        dht=dht,
        run_id=args.run_id,
        target_group_size=args.target_group_size,
        min_group_size=args.min_group_size,
        grid_bits=args.grid_bits,
        compression=args.compression,
        chunk_bytes=args.chunk_bytes,
        matchmaking_time=args.matchmaking_time,
        round_timeout=args.round_timeout,
        links=FaultyLinks.parse(args.faults) if args.faults else PLAIN_LINKS,
        transport=args.transport,
        host=args.host,
        partition=args.partition,
        upload_bandwidth=args.bandwidth,
        aggregation=args.aggregation,
    )
    relay = averager.wait_for_relay(60.0 if args.behind_nat else 0.0)  # its mates reach it once a relay holds it
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    print(json.dumps({"event": "ready", "relay": relay, "maddrs": maddrs, "index": args.index,
                      "pid": os.getpid(), "data_address": list(averager.data_address)}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "set":
            with averager.get_tensors() as (t,):
                t.copy_(peer_values(command["seed"], args.index, args.numel))
            print(json.dumps({"event": "set"}), flush=True)
        elif command["cmd"] == "add":
            with averager.get_tensors() as (t,):
                t.add_(peer_values(command["seed"], args.index, args.numel), alpha=command.get("scale", 1.0))
            print(json.dumps({"event": "added"}), flush=True)
        elif command["cmd"] == "values":
            with averager.get_tensors() as (t,):
                print(json.dumps({"event": "values", "values": t.tolist()}), flush=True)
        elif command["cmd"] == "step":
            if "faults" in command:
                averager.links = FaultyLinks.parse(command["faults"]) if command["faults"] else PLAIN_LINKS
            started = time.monotonic()
            report = averager.step(weight=command.get("weight", 1.0), timeout=command.get("search_s"))
            print(json.dumps({"event": "report", "wall_s": time.monotonic() - started, "ended_at": time.time(),
                              **report.to_dict()}), flush=True)
        elif command["cmd"] == "dump":
            with averager.get_tensors() as (t,):
                torch.save(t.clone(), command["path"])
            print(json.dumps({"event": "dumped"}), flush=True)
        elif command["cmd"] == "exit":
            break
    averager.shutdown()
    dht.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
