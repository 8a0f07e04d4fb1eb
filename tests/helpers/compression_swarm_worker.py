"""A peer process for the end-to-end codec tests: one DHT node, one MoshpitAverager per codec, driven over stdin.

    python tests/helpers/compression_swarm_worker.py --index K [--initial-peers MADDR ...] [--numel N] ...

Prints {"event": "ready", "maddrs": [...]} once its DHT runs, then answers one JSON command per stdin line:

    {"cmd": "open", "codec": SPEC, "mode": "params"|"ef"}   a new averager for SPEC -> "opened" (the previous one
        is shut down); mode "ef": with a fresh EF21M error-feedback state (arc-topk, gradients)
    {"cmd": "round", "seed": S, "path": P}   tensor <- peer_values(S, K, numel); one round with weight
        peer_weight(K); torch.save(tensor, P) -> {"event": "report", ...RoundReport}
    {"cmd": "exit"}

The test opens the same codec on every worker, waits for every "opened", then starts the round everywhere, so
matchmaking sees all peers at once. Averagers of different codecs use different run ids (never grouped together).
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

from moshpeer.averaging import MoshpitAverager  # noqa: E402
from moshpeer.compression import get_compression  # noqa: E402
from moshpeer.compression.ef21m import EF21M  # noqa: E402
from moshpeer.logs import quiet_expected_peer_failures  # noqa: E402
from moshpeer.dht import start_dht  # noqa: E402


def peer_values(seed: int, index: int, numel: int) -> torch.Tensor:
    """Deterministic per-peer values (different scales and means, one loud stretch) that the test recomputes."""
    gen = torch.Generator().manual_seed(seed * 7919 + index)
    values = torch.randn(numel, generator=gen) * (1 + index) + index
    values[numel // 3 : numel // 3 + 300] *= 40.0
    return values


def peer_weight(index: int) -> float:
    return 1.0 + index


def run_id_for(spec: str, mode: str) -> str:
    return "codec-" + "".join(ch if ch.isalnum() else "-" for ch in f"{spec}-{mode}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--chunk-bytes", type=int, default=1 << 16)
    parser.add_argument("--matchmaking-time", type=float, default=2.0)
    parser.add_argument("--round-timeout", type=float, default=30.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_expected_peer_failures()  # a peer leaving: one line, not hivemind's traceback
    torch.set_num_threads(1)  # four peers share a small machine

    dht = start_dht(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    print(json.dumps({"event": "ready", "maddrs": [str(m) for m in dht.get_visible_maddrs()], "index": args.index,
                      "pid": os.getpid()}), flush=True)
    tensor = torch.zeros(args.numel)
    averager = None
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "open":
            if averager is not None:
                averager.shutdown()  # the next averager shares this DHT (and its p2p daemon)
            spec, mode = command["codec"], command.get("mode", "params")
            feedback = None
            if mode == "ef":
                feedback = EF21M(args.numel, get_compression(spec).sparsifier)
            averager = MoshpitAverager(
                [tensor], dht=dht, run_id=run_id_for(spec, mode), target_group_size=args.group_size,
                min_group_size=2, compression=spec, chunk_bytes=args.chunk_bytes,
                matchmaking_time=args.matchmaking_time, round_timeout=args.round_timeout, error_feedback=feedback,
            )
            print(json.dumps({"event": "opened", "codec": spec, "mode": mode}), flush=True)
        elif command["cmd"] == "round":
            with averager.get_tensors() as (t,):
                t.copy_(peer_values(command["seed"], args.index, args.numel))
            started = time.monotonic()
            report = averager.step(weight=peer_weight(args.index))
            with averager.get_tensors() as (t,):
                torch.save(t.clone(), command["path"])
            print(json.dumps({"event": "report", "wall_s": time.monotonic() - started, **report.to_dict()}),
                  flush=True)
        elif command["cmd"] == "exit":
            break
    if averager is not None:
        averager.shutdown()
    dht.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
