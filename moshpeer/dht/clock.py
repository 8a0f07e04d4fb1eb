"""Is this machine's clock where its peers' clocks are? Asked when a round found no group.

Peers compare wall-clock times: a matchmaking declaration in the DHT expires by its owner's clock. hivemind checks
clocks once, when a peer starts (it pings its initial peers and refuses to join past 3 s; moshpeer turns that into
one line: node.py). A clock that jumps later (a VM resumed without NTP, a hand-set date) goes unnoticed, and the
peer can no longer form groups: measured in session 35 (libfaketime), a peer whose clock jumped 10 s either way
found no group in any later round while its three mates averaged without it, and nothing said why.

`measure_offsets` pings a few of the DHT's neighbours the way hivemind's start check does and returns each one's
clock minus ours at the middle of the call. `clock_offset` decides from those samples; `ClockWatch` measures at most
once per `interval_s` (only after a round without a group, so a healthy peer never pays for it) and logs a warning
when the verdict changes.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time
from typing import Callable, List, Optional, Sequence

from hivemind.dht import DHT, DHTNode
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

# hivemind refuses a start past this discrepancy (MAX_DHT_TIME_DISCREPANCY_SECONDS); past it, groups do not form.
ALLOWED_OFFSET_S = 3.0
PEERS_TO_ASK = 3
PING_TIMEOUT_S = 5.0
CHECK_INTERVAL_S = 60.0

Starter = Callable[[Callable[[], None]], None]  # runs a callable in the background


async def _ping_offsets(_dht: DHT, node: DHTNode, peers: int, timeout: float) -> List[float]:
    """(In the DHT process.) Each answering neighbour's clock minus ours, at most `peers` of them."""
    protocol = node.protocol
    offsets = []
    for peer_id in list(protocol.routing_table.peer_id_to_uid)[:peers]:
        before = get_dht_time()
        try:  # no `peer` in the request: the neighbour answers without adding us to its routing table again
            response = await protocol.get_stub(peer_id).rpc_ping(dht_pb2.PingRequest(validate=False), timeout=timeout)
        except Exception as e:  # a neighbour that left: ask the next one
            logger.debug(f"clock check: {peer_id} did not answer ({e!r})")
            continue
        after = get_dht_time()
        if response.dht_time:
            offsets.append(response.dht_time - (before + after) / 2)
    return offsets


def measure_offsets(dht: DHT, peers: int = PEERS_TO_ASK, timeout: float = PING_TIMEOUT_S) -> List[float]:
    """Up to `peers` neighbours' clocks minus ours, in seconds; [] if none answered within about
    `peers` x `timeout` or the DHT cannot be asked (it is stopping)."""
    try:
        future = dht.run_coroutine(functools.partial(_ping_offsets, peers=peers, timeout=timeout), return_future=True)
        return list(future.result(timeout=peers * timeout + 1.0))
    except Exception as e:
        logger.debug(f"clock check failed: {e!r}")
        return []


def clock_offset(samples: Sequence[float], allowed: float = ALLOWED_OFFSET_S) -> Optional[float]:
    """Our clock minus our peers' (the median of `samples`, each a peer's clock minus ours, negated) when it is
    off by more than `allowed` seconds; None when it is within bounds or nobody answered."""
    if not samples:
        return None
    offset = -statistics.median(samples)
    return offset if abs(offset) > allowed else None


def describe_offset(offset: float, peers: str = "its peers'", allowed: float = ALLOWED_OFFSET_S,
                    consequence: str = "no group can form until it is set right") -> str:
    """The problem in one line: `offset` is our clock minus `peers`' in seconds."""
    return (f"this machine's clock is {abs(offset):.1f} s {'ahead of' if offset > 0 else 'behind'} {peers} "
            f"(they must agree within {allowed:g} s): {consequence} (e.g. `timedatectl set-ntp true`)")


class ClockWatch:
    """Checks this peer's clock against its neighbours' after a round without a group: `after_no_group()` starts a
    measurement in the background (at most one per `interval_s`, never two at once) and returns the problem in words
    as the last finished measurement found it, or None. A change of verdict is logged when it is found.

    :param measure: -> offset samples (`measure_offsets`); may block for seconds, so it runs on `start`'s thread
    :param start: runs a callable in the background (default: a daemon thread; a test runs it in place)
    """

    def __init__(self, measure: Callable[[], List[float]], interval_s: float = CHECK_INTERVAL_S,
                 now: Callable[[], float] = time.monotonic, start: Optional[Starter] = None):
        self._measure, self._interval_s, self._now = measure, interval_s, now
        self._start = start or (lambda work: threading.Thread(target=work, name="moshpeer-clock-check",
                                                              daemon=True).start())
        self._lock = threading.Lock()
        self._started_at: Optional[float] = None
        self._running = False
        self.offset: Optional[float] = None  # our clock minus our peers' when off by too much, else None

    def after_no_group(self) -> Optional[str]:
        now = self._now()
        with self._lock:
            due = not self._running and (self._started_at is None or now - self._started_at >= self._interval_s)
            if due:
                self._started_at, self._running = now, True
        if due:
            self._start(self._check)
        with self._lock:
            return describe_offset(self.offset) if self.offset is not None else None

    def _check(self) -> None:
        try:
            offset = clock_offset(self._measure())
        except Exception as e:  # the verdict stays as it was
            logger.debug(f"clock check failed: {e!r}")
            with self._lock:
                self._running = False
            return
        with self._lock:
            self._running = False
            changed, self.offset = (offset is None) != (self.offset is None), offset
        if changed:
            if offset is not None:
                logger.warning(describe_offset(offset))
            else:
                logger.info("this machine's clock agrees with its peers' again")
