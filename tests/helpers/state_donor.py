"""A state donor process for tests/swarm/test_state_swarm.py: a DHT node and a throttled StateServer serving a
deterministic state (seeded tensors), advertised for the run until the process is killed.

It prints one JSON line when ready ({"event": "ready", "peer_id", "sha256"}). With --corrupt it flips one
byte of every piece it sends (the manifest it signs stays the honest one), as a lying donor would.

    python tests/helpers/state_donor.py --initial-peer MADDR --run RUN --seed 1 --floats N --rate BYTES_PER_S [--corrupt]
        [--host ADDRESS]  (benchmarks/bench_wan.py's join scenario runs donors in netlab namespaces)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from moshpeer.dht import start_dht  # noqa: E402
from moshpeer.peer.state.framing import serialize_state  # noqa: E402
from moshpeer.peer.state.sync import StateServer  # noqa: E402

EPOCH = 7


def donor_state(seed: int, floats: int) -> dict:
    """The state every donor of one seed serves (the test rebuilds it to compare)."""
    generator = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(floats, generator=generator)}, "epoch": EPOCH}


class CorruptServer(StateServer):
    """Serves pieces with their first byte flipped."""

    def piece(self, view: memoryview, start: int, end: int) -> bytes:
        data = bytearray(view[start:end])
        data[0] ^= 0xFF
        return bytes(data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peer", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--floats", type=int, default=1 << 18)
    parser.add_argument("--rate", type=float, default=None)
    parser.add_argument("--corrupt", action="store_true")
    parser.add_argument("--host", default="127.0.0.1", help="address of its DHT node and state server")
    args = parser.parse_args()
    dht = start_dht(initial_peers=[args.initial_peer], host_maddrs=[f"/ip4/{args.host}/tcp/0"], run_ids=[args.run])
    data = serialize_state(donor_state(args.seed, args.floats))
    server = (CorruptServer if args.corrupt else StateServer)(lambda: (EPOCH, data), run_id=args.run,
                                                             identity=dht.identity, bytes_per_second=args.rate,
                                                             host=args.host)
    deadline = time.monotonic() + 30
    while not server.advertise(dht, EPOCH, expiration=300):
        if time.monotonic() > deadline:
            sys.exit("could not advertise the state")
        time.sleep(0.5)
    print(json.dumps({"event": "ready", "peer_id": dht.identity.peer_id, "sha256": hashlib.sha256(data).hexdigest()}),
          flush=True)
    try:
        while True:  # the test ends this process
            time.sleep(1.0)
    finally:
        server.shutdown()
        dht.stop()


if __name__ == "__main__":
    main()
