"""Back into the swarm after an outage: a DHT node that lost every neighbour asks its contacts again.

hivemind drops a neighbour from its routing table at the first request it does not answer
(`DHTProtocol.update_routing_table`), and dials its initial peers only at start. So a peer whose network goes away
for more than a few requests (wifi lost, a cable pulled, a VM paused) empties its routing table, and when the
network comes back it is a swarm of one: it publishes its record to itself, lists only itself, and trains alone;
its mates forgot it the same way. Measured (session 36, netlab, a bootstrap node and three `moshpeer join`): one
peer's link down for 30 s, and that peer found itself "alone" in every one of its ~780 rounds of the 100 s left,
never back, while the other two averaged in pairs; nothing but the rounds' `"error": "alone"` said so.

`neighbour_count` asks the DHT process how many neighbours its routing table holds; `rejoin` does what hivemind
does at start: dial the contacts (the initial peers, and peers this one listed lately: the initial ones may be
gone), ping them, which puts each side in the other's routing table, then look up this node's own id to fill the
table again. `Reconnector` decides when: at once at a heartbeat that finds no neighbour, then after `retry_s`, and
each later wait twice the one before, up to `max_retry_s` (a bootstrap node whose peers all left keeps asking the
last ones it knew, ever more rarely); it logs once when the peer is cut off and once when it is back.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Callable, Dict, List, Optional, Sequence

from hivemind.dht import DHT, DHTNode
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from moshpeer.dht.records import PeerRecord

logger = logging.getLogger(__name__)

RETRY_S = 10.0  # from the first attempt to the second while cut off; each later wait doubles, up to MAX_RETRY_S
# An attempt costs a few dials and pings; the cap bounds how long a peer stays cut off after its network is back
# (measured, library path: a 40 s outage, back 36 s after the link with a cap of 120 s: the waits had reached 40 s).
MAX_RETRY_S = 30.0
REJOIN_TIMEOUT_S = 10.0  # one attempt: dials, pings and the lookup
MAX_RECENT_CONTACTS = 8  # peers from the last listing kept as contacts besides the initial peers


async def _neighbours(_dht: DHT, node: DHTNode) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def neighbour_count(dht: DHT, timeout: float = 5.0) -> Optional[int]:
    """How many neighbours the DHT's routing table holds; None if the DHT process did not say in time."""
    try:
        return int(dht.run_coroutine(_neighbours, return_future=True).result(timeout=timeout))
    except Exception as e:  # stopping, or a DHT process too busy to answer: the next heartbeat asks again
        logger.debug(f"could not count the DHT's neighbours: {e!r}")
        return None


def _by_peer(contacts: Sequence[str]) -> Dict[PeerID, List[Multiaddr]]:
    grouped: Dict[PeerID, List[Multiaddr]] = {}
    for text in contacts:
        try:
            maddr = Multiaddr(text)
            peer_id = PeerID.from_base58(maddr["p2p"])
        except Exception:  # a contact without /p2p/<id>, or not a multiaddr: nothing to dial
            continue
        grouped.setdefault(peer_id, []).append(maddr.decapsulate(Multiaddr(f"/p2p/{peer_id.to_base58()}")))
    return grouped


async def _rejoin(_dht: DHT, node: DHTNode, contacts: Sequence[str], timeout: float) -> int:
    """(In the DHT process.) Dial and ping `contacts`, then refill the routing table; its size afterwards."""
    targets = {peer_id: maddrs for peer_id, maddrs in _by_peer(contacts).items() if peer_id != node.peer_id}

    async def one(peer_id: PeerID, maddrs: List[Multiaddr]) -> bool:
        try:  # p2pd forgets a disconnected peer's addresses after a while: give them again (hivemind: no public call)
            await asyncio.wait_for(node.p2p._client.connect(peer_id, maddrs), timeout / 2)
        except Exception as e:
            logger.debug(f"rejoin: could not dial {peer_id}: {e!r}")
        return await node.protocol.call_ping(peer_id, validate=False, strict=False) is not None

    answered = await asyncio.gather(*(one(peer_id, maddrs) for peer_id, maddrs in targets.items()))
    if any(answered):
        try:
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), timeout / 2)
        except asyncio.TimeoutError:
            pass  # what the pings added stays: the lookup only adds more
    return len(node.protocol.routing_table.uid_to_peer_id)


def rejoin(dht: DHT, contacts: Sequence[str], timeout: float = REJOIN_TIMEOUT_S) -> int:
    """Dial and ping `contacts` (multiaddrs ending in /p2p/<peer id>) from the DHT process and refill its routing
    table; returns how many neighbours it then holds (0 if nobody answered or the DHT could not be asked)."""
    if not contacts:
        return 0
    try:
        future = dht.run_coroutine(functools.partial(_rejoin, contacts=list(contacts), timeout=timeout),
                                   return_future=True)
        return int(future.result(timeout=timeout + 5.0))
    except Exception as e:
        logger.debug(f"rejoin failed: {e!r}")
        return 0


def recent_contacts(records: Sequence[PeerRecord], own_peer_id: str, limit: int = MAX_RECENT_CONTACTS) -> List[str]:
    """Multiaddrs (with /p2p/, two at most per peer) of up to `limit` other live peers of a listing, the most
    recently seen first. A record's addresses are its owner's word: a contact is only dialed, a few times while cut
    off, and libp2p's handshake refuses an address where the named peer id does not answer."""
    others = [r for r in records if r.peer_id != own_peer_id and not r.leaving]
    others.sort(key=lambda r: r.updated_at, reverse=True)
    return [address if "/p2p/" in address else f"{address}/p2p/{record.peer_id}"
            for record in others[:limit] for address in record.addresses[:2]]


class Reconnector:
    """When a node without neighbours should try its contacts again, and what to log about it.

    :param clock: monotonic seconds (a fake one in tests)
    """

    def __init__(self, retry_s: float = RETRY_S, max_retry_s: float = MAX_RETRY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.retry_s, self.max_retry_s, self._clock = retry_s, max_retry_s, clock
        self._cut_off_since: Optional[float] = None
        self._next_try = float("-inf")
        self._wait = retry_s

    @property
    def cut_off(self) -> bool:
        return self._cut_off_since is not None

    def observe(self, neighbours: Optional[int], contacts: int) -> bool:
        """Note the routing table's size now (None: unknown) and how many contacts there are; True when they should
        be tried now (then observe the size `rejoin` returns)."""
        if neighbours is None:
            return False
        if neighbours > 0:
            if self._cut_off_since is not None:
                logger.info(f"back in the swarm after {self._clock() - self._cut_off_since:.0f} s cut off "
                            f"({neighbours} DHT neighbours)")
                self._cut_off_since, self._next_try, self._wait = None, float("-inf"), self.retry_s
            return False
        if contacts == 0:
            return False  # the first peer of a swarm, alone: nobody to ask
        now = self._clock()
        if self._cut_off_since is None:
            self._cut_off_since = now
            logger.warning(f"this peer has no DHT neighbours left (its network went away, or every peer left): "
                           f"it sees no swarm; asking {contacts} contacts again, every {self.retry_s:g} s at first")
        if now < self._next_try:
            return False
        self._next_try = now + self._wait
        self._wait = min(2 * self._wait, self.max_retry_s)
        return True


class SwarmReconnection:
    """One DHT node's way back after an outage: its contacts (the DHT's initial peers, and the peers of its latest
    listings: `note_listing`) and a `Reconnector`. `check` (from a thread that may block for `REJOIN_TIMEOUT_S`)
    asks the DHT process for its neighbour count, at most once per `min_interval_s`, and rejoins when it is time."""

    def __init__(self, dht: DHT, min_interval_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.dht, self.min_interval_s, self._clock = dht, min_interval_s, clock
        self._reconnector = Reconnector(clock=clock)
        self._recent: List[str] = []
        self._last_check = float("-inf")

    @property
    def cut_off(self) -> bool:
        """Whether the node had no neighbour at the last check."""
        return self._reconnector.cut_off

    def note_listing(self, records: Sequence[PeerRecord], own_peer_id: str) -> None:
        # A listing made while cut off holds nobody else: the last peers seen stay contacts.
        self._recent = recent_contacts(records, own_peer_id) or self._recent

    def check(self) -> None:
        now = self._clock()
        if now - self._last_check < self.min_interval_s:
            return
        self._last_check = now
        contacts = [str(maddr) for maddr in getattr(self.dht, "initial_peers", None) or ()] + self._recent
        if self._reconnector.observe(neighbour_count(self.dht), len(contacts)):
            self._reconnector.observe(rejoin(self.dht, contacts), len(contacts))
