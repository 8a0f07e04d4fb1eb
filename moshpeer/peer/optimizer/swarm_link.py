"""How a `CollaborativeOptimizer` is present in its swarm: through a `PeerDaemon`, a bare DHT, or a DHT
node of its own; its signed record is published and the swarm's progress read (`SwarmProgress`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence

from moshpeer.dht import Admission, SwarmDHT, start_dht
from moshpeer.dht.admission import install as install_admission
from moshpeer.dht.reconnect import SwarmReconnection
from moshpeer.dht.records import MAX_FLAGGED_PEERS
from moshpeer.errors import SwarmLost, UserError
from moshpeer.peer.optimizer.progress import SwarmProgress
from moshpeer.peer.optimizer.progress_cadence import ProgressCadence
from moshpeer.peer.record_publisher import RecordPublisher, fresh_record

logger = logging.getLogger(__name__)

# Without a daemon's heartbeat, our record lives this long per publication (SwarmProgress's refresh thread
# re-publishes it every third of that).
OWN_RECORD_EXPIRATION_S = 15.0
# ... and that thread looks at most this often whether the DHT lost every neighbour, as a daemon's heartbeat does.
RECONNECT_CHECK_S = 5.0


@dataclass
class SwarmLink:
    """This optimizer's presence in its swarm: the DHT, the swarm's progress, and how our record is published.
    What it does with the DHT (waiting for trainers, watching the swarm move on) fails soft: it returns what it
    saw, never raises for a slow or failing DHT."""

    dht: SwarmDHT
    progress: SwarmProgress
    publish: Callable[..., Any]  # update fields of our record and publish it
    # Whether the DHT had no neighbour at its last check (an outage: reconnect.py).
    cut_off: Callable[[], bool] = lambda: False
    own_dht: Optional[SwarmDHT] = None  # started for this optimizer: stopped at its shutdown
    publisher: Optional[RecordPublisher] = None  # None when a daemon publishes the record
    _published_flagged: Dict[str, int] = field(default_factory=dict)

    @property
    def peer_id(self) -> str:
        """This peer's id (its record's)."""
        return self.dht.identity.peer_id

    def publish_flagged(self, flagged: Dict[str, int]) -> None:
        """Robust aggregation clipped or trimmed someone: say so in our record (the most flagged peers)."""
        if flagged != self._published_flagged:
            self._published_flagged = dict(flagged)
            self.publish(flagged=dict(sorted(flagged.items(), key=lambda kv: -kv[1])[:MAX_FLAGGED_PEERS]))

    def check_alive(self) -> None:
        """Raise `SwarmLost` if the DHT process is gone (this peer would train alone for ever). With a daemon, its
        heartbeat stops the peer instead, and this does nothing."""
        if self.publisher is not None and not self.dht.is_alive():
            raise SwarmLost("this peer's DHT process is gone (killed, or its libp2p daemon was): it can reach no "
                            "one; start it again to rejoin the swarm")

    def wait_for_trainers(self, min_trainers: int, timeout: float, should_stop: Callable[[], bool]) -> int:
        """Wait until at least `min_trainers` trainers past their startup are visible (`PeerRecord.training`:
        a record published when a peer's DHT started says nothing of when it will train), `timeout` passes or
        `should_stop()`; returns how many are visible."""
        deadline = time.monotonic() + timeout
        while True:
            visible = self.progress.refresh_now().trainers_past_startup
            if visible >= min_trainers or time.monotonic() >= deadline or should_stop():
                return visible
            self.progress.wait_for_refresh(timeout=min(0.5, max(0.0, deadline - time.monotonic())))

    def moved_past(self, epoch: int, within: float, should_stop: Callable[[], bool]) -> bool:
        """Whether a trainer's record shows an epoch past `epoch` within `within` seconds (the others
        averaged that epoch without us; their round may still be finishing when ours gives up)."""
        deadline = time.monotonic() + within
        while not should_stop():
            if self.progress.refresh_now(timeout=1.0).global_epoch > epoch:
                return True
            if deadline <= time.monotonic():
                return False
            self.progress.wait_for_refresh(timeout=min(0.5, deadline - time.monotonic()))
        return False

    def close(self) -> None:
        """Stop reading progress; withdraw our record and stop the DHT if they are ours. Idempotent; a
        failing step is logged (debug) and the others still run."""
        own_dht, self.own_dht = self.own_dht, None
        steps = [("progress", self.progress.shutdown)]
        if own_dht is not None:
            steps += [("record", lambda: self.publisher.withdraw(timeout=1.0)), ("dht", own_dht.stop)]
        for name, stop in steps:
            try:
                stop()
            except Exception:
                logger.debug(f"shutting down {name} failed", exc_info=True)


def link_to_swarm(run_id: str, role: str, target_batch_size: int, *, daemon: Any = None,
                  dht: Optional[SwarmDHT] = None, initial_peers: Sequence[str] = (), host: str = "127.0.0.1",
                  progress_refresh: float = 0.3, admission: Optional[Admission] = None,
                  cadence: Optional[ProgressCadence] = None) -> SwarmLink:
    """The daemon's DHT and record, else `dht` (with a record of our own), else a DHT node of our own
    joined through `initial_peers`; UserError when none of the three is given. `admission` (a private run)
    becomes that DHT node's policy (UserError if it already has another one). Progress is read on `cadence`,
    by default `ProgressCadence.fastest(progress_refresh)`."""
    cadence = cadence or ProgressCadence.fastest(progress_refresh)
    if daemon is not None:
        install_admission(daemon.dht, admission)
        def publish(**fields: Any) -> None:
            daemon.update_record(publish_now=True, **fields)

        progress = SwarmProgress(daemon.dht, run_id, target_batch_size=target_batch_size,
                                 own_record=lambda: daemon.record, cadence=cadence, publish=publish)
        if role == "trainer":
            publish(training=True)  # the daemon published our record at its start: now we can train
        return SwarmLink(daemon.dht, progress, publish, cut_off=lambda: daemon.cut_off)
    own_dht = None
    if dht is None:
        if not initial_peers:
            raise UserError("give the optimizer daemon=, dht= or initial_peers=")
        dht = own_dht = start_dht(initial_peers=initial_peers, run_ids=[run_id], host_maddrs=[f"/ip4/{host}/tcp/0"],
                                  admission=admission)
    install_admission(dht, admission)
    record = fresh_record(dht, role).updated(training=role == "trainer")
    publisher = RecordPublisher(dht, run_id, record, expiration=OWN_RECORD_EXPIRATION_S)
    publisher.publish_quietly()
    reconnection = SwarmReconnection(dht, min_interval_s=RECONNECT_CHECK_S)

    def after_refresh() -> None:  # in the progress thread, after each read of the records
        publisher.refresh_addresses()
        publisher.refresh_if_stale()
        reconnection.note_listing(progress.snapshot().peers, publisher.record.peer_id)
        reconnection.check()

    progress = SwarmProgress(dht, run_id, target_batch_size=target_batch_size, own_record=lambda: publisher.record,
                             publish=publisher.update_and_publish, cadence=cadence, on_refresh=after_refresh)
    return SwarmLink(dht, progress, publisher.update_and_publish, lambda: reconnection.cut_off, own_dht, publisher)
