"""Connections kept between all-reduces: `KeptLinks`, a sender's pool of them, and how long either end keeps one.

A connection costs a TCP handshake, the authenticated handshake (two round trips before the first frame, two
signature checks and a key exchange) and a thread on each end; on a 100 ms path that is 0.2-0.3 s of every round
before a byte moves, and on a CPU-bound host part of the per-round fixed cost (docs/benchmarks.md). A member meets
the same peers again in later rounds (always in a swarm no larger than a group), so a sender keeps a direct
connection that ended cleanly (both end markers sent) and the receiver keeps serving it; the next all-reduce with
that peer rebinds it in one round trip (`handshake.rebind`). A kept connection that is gone (its receiver timed it
out or restarted, or refuses the rebind) costs that round trip: the sender then opens a fresh one, as it would have;
one a middlebox dropped silently, at most `member_connector.REBIND_UNACKED_S`.

Only direct connections are kept: a relay's circuits and libp2p streams are bounded by the round that opened them.
The receiver keeps a connection longer than the sender (`dataplane.KEEP_INBOUND_S` > SENDER_KEEP_S), so a rebind
rarely meets one the receiver has just closed; each end keeps at most 64 (`dataplane.MAX_KEPT_INBOUND`, MAX_KEPT).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Hashable, Optional, Tuple

from moshpeer.averaging.dataplane import _close
from moshpeer.averaging.member_connector import OutboundLink, peer_closed

SENDER_KEEP_S = 60.0  # a sender rebinds a kept connection at most this long after its last round
MAX_KEPT = 64  # kept connections; past it, the least recently used one is closed


class KeptLinks:
    """A sender's kept connections, one per (peer id, address), least recently used first. Thread-safe.

    :param clock: time.monotonic, or a fake one in tests
    """

    def __init__(self, keep_s: float = SENDER_KEEP_S, max_kept: int = MAX_KEPT,
                 clock: Callable[[], float] = time.monotonic):
        self.keep_s, self.max_kept, self.clock = keep_s, max_kept, clock
        self._links: "OrderedDict[Hashable, Tuple[OutboundLink, float]]" = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def __len__(self) -> int:
        return len(self._links)

    def put(self, peer: bytes, address: Tuple[str, int], link: OutboundLink) -> None:
        """Keep `link` (it ended cleanly) for the next all-reduce with `peer` at `address`; one that was kept for
        them before, or the least recently used past `max_kept`, is closed."""
        closing = []
        with self._lock:
            if self._closed:
                closing.append(link)
            else:
                old = self._links.pop((peer, address), None)
                if old is not None:
                    closing.append(old[0])
                self._links[(peer, address)] = (link, self.clock())
                while len(self._links) > self.max_kept:
                    closing.append(self._links.popitem(last=False)[1][0])
        for stale in closing:
            _close(stale.sock)

    def take(self, peer: bytes, address: Tuple[str, int]) -> Optional[OutboundLink]:
        """The connection kept for `peer` at `address`, now no longer kept; None if there is none, or it was kept
        too long or its receiver closed it (then it is closed)."""
        with self._lock:
            kept = self._links.pop((peer, address), None)
        if kept is None:
            return None
        link, since = kept
        if self.clock() - since > self.keep_s or peer_closed(link.sock):
            _close(link.sock)
            return None
        return link

    def close(self) -> None:
        """Close every kept connection; later `put`s close theirs at once."""
        with self._lock:
            self._closed = True
            links = [link for link, _ in self._links.values()]
            self._links.clear()
        for link in links:
            _close(link.sock)
