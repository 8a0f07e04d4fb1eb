"""`RecordPublisher`: this peer's signed record in its run's DHT membership dictionary, kept in one place.

A `PeerDaemon` (runtime/daemon.py) heartbeats its record through one; an optimizer used without a daemon
(optimizer/swarm_link.py) has one of its own. Either way the record is changed under a lock (`update`), every
publication carries a fresh `updated_at`, and `withdraw` marks it leaving with the same expiration as the
heartbeats (the DHT keeps whichever version expires last).

Failure: `publish` and `withdraw` return False when no node accepted the record in time, and raise what the DHT
raises when it is gone (the daemon's heartbeat logs it); `publish_quietly` logs (debug) instead of raising, for
best-effort progress. `update` raises ValueError for a value the record's schema rejects.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional, Sequence

from hivemind.utils import get_dht_time

from moshpeer.dht import PeerRecord, SwarmDHT, publish_record, withdraw
from moshpeer.dht.records import MAX_ADDRESSES
from moshpeer.version import PROTOCOL_VERSION, __version__

logger = logging.getLogger(__name__)

# How often `refresh_addresses` asks the DHT for this peer's visible addresses (one call to the DHT process).
ADDRESS_CHECK_S = 10.0


def fresh_record(dht: SwarmDHT, role: str, addresses: Optional[Sequence[str]] = None) -> PeerRecord:
    """A new record for this DHT node's identity, started now."""
    now = get_dht_time()
    addresses = list(addresses) if addresses is not None else [str(m) for m in dht.get_visible_maddrs()]
    return PeerRecord(peer_id=dht.identity.peer_id, role=role, addresses=addresses[:MAX_ADDRESSES],
                      version=__version__, protocol=PROTOCOL_VERSION, started_at=now, updated_at=now)


class RecordPublisher:
    """Holds and publishes one peer record (see the module docstring).

    :param expiration: seconds a publication lives in the DHT
    """

    def __init__(self, dht: SwarmDHT, run_id: str, record: PeerRecord, expiration: float):
        self.dht, self.run_id, self.expiration = dht, run_id, expiration
        self._record = record
        self._lock = threading.Lock()
        self._last_publish = 0.0
        self._addresses_checked = time.monotonic()  # the record was just made with the current addresses

    @property
    def record(self) -> PeerRecord:
        """The record as last published (or about to be)."""
        with self._lock:
            return self._record

    def update(self, **fields: Any) -> PeerRecord:
        """Change record fields locally (published with the next `publish`); the new record."""
        with self._lock:
            self._record = self._record.updated(**fields)
            return self._record

    def publish(self, timeout: Optional[float] = None) -> bool:
        """Publish the record with a fresh timestamp; True if some node accepted it."""
        with self._lock:
            self._record = self._record.updated(updated_at=get_dht_time())
            record = self._record
        self._last_publish = time.monotonic()
        return publish_record(self.dht, self.run_id, record, self.expiration, timeout=timeout)

    def publish_quietly(self, timeout: float = 2.0) -> None:
        """`publish`, best effort: a DHT that went away (shutdown) is logged at debug level."""
        try:
            self.publish(timeout=timeout)
        except Exception as e:
            logger.debug(f"could not publish this peer's record: {e}")

    def update_and_publish(self, **fields: Any) -> None:
        """`update`, then `publish_quietly`."""
        self.update(**fields)
        self.publish_quietly()

    def refresh_addresses(self, now: Optional[float] = None) -> bool:
        """Take the DHT's visible addresses into the record (published with the next `publish`) if they changed
        since the record was made: a machine whose address changes (a roaming laptop, a new DHCP lease) is still
        listed where it is, and others that lost the swarm dial it there (reconnect.py). Asks the DHT at most every
        ADDRESS_CHECK_S; True if the addresses changed. A DHT that does not answer leaves them as they were."""
        now = time.monotonic() if now is None else now
        if now - self._addresses_checked < ADDRESS_CHECK_S:
            return False
        self._addresses_checked = now
        try:
            addresses = [str(m) for m in self.dht.get_visible_maddrs(latest=True)][:MAX_ADDRESSES]  # not cached
        except Exception as e:  # the DHT process is gone or busy: the heartbeat says so
            logger.debug(f"could not read this peer's addresses: {e}")
            return False
        if not addresses or addresses == list(self.record.addresses):
            return False
        logger.info(f"this peer's addresses changed: now {', '.join(addresses[:2])}")
        self.update(addresses=addresses)
        return True

    def refresh_if_stale(self) -> None:
        """Re-publish when a third of the expiration passed since the last publication (the record never lapses
        while the peer lives)."""
        if time.monotonic() - self._last_publish > self.expiration / 3:
            self.publish_quietly()

    def withdraw(self, timeout: Optional[float] = None) -> bool:
        """Mark the record as leaving, so readers stop counting this peer at once; True if a node accepted it."""
        return withdraw(self.dht, self.run_id, self.record, self.expiration, timeout=timeout)
