"""What every adversary process shares: the swarm epoch it lies at, and running until it is signalled."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Callable, Collection

from moshpeer.dht import list_peers
from moshpeer.errors import UserError
from moshpeer.peer.optimizer.progress import robust_epoch


def swarm_epoch(dht, run_id: str, own_peer_ids: Collection[str]) -> int:
    """The epoch honest readers compute: the upper median of the other live trainers' epochs (0 when none)."""
    epochs = [r.epoch for r in list_peers(dht, run_id, timeout=2.0)
              if r.role == "trainer" and r.peer_id not in own_peer_ids]
    return robust_epoch(epochs) if epochs else 0


def run_until_signalled(name: str, body: Callable[[threading.Event], None]) -> int:
    """Run `body(stop)` with `stop` set by SIGTERM or SIGINT; exit code 0, or 2 with one line on stderr for a
    UserError (a bad argument, nothing to forge)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        body(stop)
    except UserError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    return 0
