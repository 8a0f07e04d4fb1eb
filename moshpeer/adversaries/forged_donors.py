"""Sybil donors that serve one forged state (issue 26's `sybil_state`), for benchmarks and tests.

One process runs `--count` identities, each with a DHT node and a state server of the product's own code. It
downloads the swarm's state once (as a newcomer would), forges it (every model tensor times FORGE_SCALE:
plausible in shape, norm and format, wrong in direction) and serves the very same forged bytes from every
identity, always at the swarm's current epoch (the upper median of the live trainers' epochs), re-advertised
every REFRESH_S. Each identity also publishes a trainer record at that epoch naming the others as witnessed (what a
newcomer's choice of donors reads, witnesses.py). It never trains and never averages.

    python -m moshpeer.adversaries.forged_donors --run-id RUN --initial-peers MADDR [MADDR ...] [--count 2]

Prints {"event": "ready", "peer_ids": [...]} once every identity advertises, then runs until it is killed
(SIGTERM or SIGINT end it at the next refresh). Exit code 2 for a bad argument or when no state could be had.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import Dict, Tuple

from moshpeer.adversaries.process import run_until_signalled, swarm_epoch
from moshpeer.dht import start_dht
from moshpeer.errors import UserError
from moshpeer.peer.optimizer.witnesses import witness_tag
from moshpeer.peer.record_publisher import RecordPublisher, fresh_record
from moshpeer.peer.state.framing import serialize_state
from moshpeer.peer.state.sync import StateDownloadFailed, StateServer, download_state

FORGE_SCALE = -3.0
REFRESH_S = 0.5


class ForgedState:
    """The forged state at each epoch asked for: the honest state's other fields, the model times FORGE_SCALE, and
    the epoch set to the one served (one serialization per epoch, shared by every identity)."""

    def __init__(self, honest: Dict):
        self._state = dict(honest, model={name: tensor * FORGE_SCALE for name, tensor in honest["model"].items()})
        self._lock = threading.Lock()
        self._cached: Tuple[int, bytes] = (-1, b"")
        self.epoch = int(honest["epoch"])

    def __call__(self) -> Tuple[int, bytes]:
        with self._lock:
            if self._cached[0] != self.epoch:
                self._cached = (self.epoch, serialize_state(dict(self._state, epoch=self.epoch)))
            return self._cached


def forge(run_id: str, initial_peers, count: int, host: str, stop: threading.Event) -> None:
    """Serve the forged state from `count` identities until `stop` is set."""
    nodes = [start_dht(initial_peers=initial_peers, run_ids=[run_id], host_maddrs=[f"/ip4/{host}/tcp/0"])
             for _ in range(count)]
    servers = []
    try:
        own = tuple(node.identity.peer_id for node in nodes)
        try:
            honest = download_state(nodes[0], run_id, exclude=own, timeout=60.0, show_progress=False)
        except StateDownloadFailed as e:
            raise UserError(f"no state to forge: {e}") from e
        forged = ForgedState(honest.state)
        servers = [StateServer(forged, run_id=run_id, identity=node.identity, host=host) for node in nodes]
        publishers = [RecordPublisher(node, run_id, fresh_record(node, "trainer").updated(
            training=True, witnessed=[witness_tag(other) for other in own if other != node.identity.peer_id]),
            expiration=10.0) for node in nodes]
        announced = False
        while not stop.is_set():
            forged.epoch = max(forged.epoch, swarm_epoch(nodes[0], run_id, own))
            advertised = [server.advertise(node, forged.epoch) for server, node in zip(servers, nodes)]
            for publisher in publishers:
                publisher.update(epoch=forged.epoch)
                publisher.publish_quietly()
            if all(advertised) and not announced:
                print(json.dumps({"event": "ready", "peer_ids": list(own)}), flush=True)
                announced = True
            stop.wait(REFRESH_S)
    finally:
        for server in servers:
            server.shutdown()
        for node in nodes:
            node.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moshpeer.adversaries.forged_donors",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--count", type=int, default=2, help="Sybil identities serving the forgery")
    parser.add_argument("--host", default="127.0.0.1", help="address their DHT nodes and servers listen on")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count must be at least 1")
    return run_until_signalled("forged_donors",
                               lambda stop: forge(args.run_id, args.initial_peers, args.count, args.host, stop))


if __name__ == "__main__":
    sys.exit(main())
