"""`Heartbeat`: the thread that keeps this peer's record alive in its run's membership dictionary.

Every `interval` seconds (at once when woken: a record change to publish now) it re-publishes the record through
the peer's `RecordPublisher`, with the peer's current addresses, and logs when publications start and stop failing.
A peer whose DHT lost every neighbour (an outage) asks its contacts again first (reconnect.py). It asks the peer
to stop when the DHT process died (`dht_died`: the peer then exits with an error), and when another machine runs with
this peer's identity and this one is the newer (twins.py: every few heartbeats it reads the run's records just before
it publishes); `fatal` then holds the error the peer exits with.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from moshpeer.dht import SwarmDHT, list_peers
from moshpeer.dht.reconnect import SwarmReconnection
from moshpeer.dht.twins import TwinWatch
from moshpeer.errors import UserError
from moshpeer.peer.record_publisher import RecordPublisher

logger = logging.getLogger(__name__)


class Heartbeat:
    """Publishes `publisher`'s record every `interval` seconds until `stop`; `request_stop(reason)` stops the peer."""

    def __init__(self, dht: SwarmDHT, run_id: str, publisher: RecordPublisher, interval: float,
                 request_stop: Callable[[str], None]):
        self.dht, self.run_id, self.publisher, self.interval = dht, run_id, publisher, interval
        self._request_stop = request_stop
        self._twins = TwinWatch(heartbeat_s=interval)
        self._reconnection = SwarmReconnection(dht)
        self.fatal: Optional[UserError] = None  # why the peer must not go on (another machine has its identity)
        self.dht_died = False  # the DHT process ended while this peer ran (killed, or its p2pd was)
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="moshpeer-heartbeat", daemon=True)

    @property
    def cut_off(self) -> bool:
        """Whether the DHT had no neighbour at the last beat (an outage: reconnect.py)."""
        return self._reconnection.cut_off

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Publish now rather than at the next beat."""
        self._wake.set()

    def stop(self, timeout: float) -> None:
        """End the thread, waiting at most `timeout` seconds for a publication in flight."""
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        failing = False
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stopped.is_set():
                return
            if not self.dht.is_alive():
                # Without its DHT process this peer can neither be seen nor see the swarm: stop.
                logger.error("the DHT process died; stopping this peer")
                self.dht_died = True
                self._request_stop("the DHT process died")
                return
            self._reconnection.check()
            self.publisher.refresh_addresses()
            if self._twins.due() and self._stop_after_reading_records():
                return
            try:
                ok = self.publisher.publish(timeout=self.interval)
            except Exception as e:  # the DHT process died or its pipe closed: keep the thread alive
                logger.debug("heartbeat failed", exc_info=True)
                ok, error = False, e
            else:
                error = None
            if ok and self._reconnection.cut_off:  # only this node took it (a DHT of one stores locally)
                ok, error = False, "this peer has no DHT neighbours"
            if not ok and not failing:
                logger.warning(f"heartbeat could not publish this peer's record ({error or 'no node accepted it'})")
            elif ok and failing:
                logger.info("heartbeat publishes again")
            failing = not ok

    def _stop_after_reading_records(self) -> bool:
        """Read the run's records before this beat publishes: look for a twin (twins.py), and keep the other peers
        as contacts for an outage (reconnect.py). True if this peer must stop."""
        started = time.monotonic()
        try:
            records = list_peers(self.dht, self.run_id, timeout=self.interval)
        except Exception as e:  # a DHT timeout under load: the next check tries again
            logger.debug(f"could not read the run's records: {e}")
            return False
        logger.debug(f"read {len(records)} records in {time.monotonic() - started:.2f} s")
        self._reconnection.note_listing(records, self.publisher.record.peer_id)
        self.fatal = self._twins.check(records, self.publisher.record)
        if self.fatal is not None:
            self._request_stop("another machine runs with this peer's identity")
        return self.fatal is not None
