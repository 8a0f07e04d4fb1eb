"""How far a peer believes the epochs other peers' records claim, across its reads of the swarm's progress
(progress.py): plain functions and one small stateful object, no I/O.

- the swarm epoch is a robust statistic of the other live trainers' epochs (`robust_epoch`: their upper median):
  fewer than half of the trainers cannot raise it, however far they claim to be ahead, and a minority of
  laggards cannot hold it back; whose epochs count is `epoch_sources`;
- claims only move forward by plausible steps (`EpochCredit`): across reads, a record is credited with at most
  one epoch beyond the swarm epoch or beyond what it was credited before, and the view of the swarm epoch itself
  rises by at most one per read or `MAX_EPOCHS_PER_SECOND`, whichever is more.
"""

from __future__ import annotations

import logging
import time
from typing import Collection, Dict, Optional, Sequence, Tuple

from moshpeer.dht import PeerRecord

logger = logging.getLogger(__name__)


def robust_epoch(epochs: Sequence[int]) -> int:
    """The upper median of `epochs` (non-empty). Raising it above every honest claim takes lies from at least
    half of the records; lowering it below every up-to-date one takes more than half lagging behind (peers
    that just joined, or resumed from an old checkpoint, still show old epochs)."""
    ordered = sorted(epochs)
    return ordered[len(ordered) // 2]


# How fast this peer's view of the swarm epoch may rise: this many epochs per second (at least one per
# refresh). An epoch is a group round; the 2-core soak's swarm of small models ran 2.6 per second, and a
# limit of 4 whose fractions were dropped at every refresh held a peer's view below that, so it fell ever
# further behind without catching up. Sybils claiming epoch 2^62 still gain only this many per second.
MAX_EPOCHS_PER_SECOND = 10.0
# ... and the unused allowance it may save up, in seconds (a view that waited gets no burst beyond this). The time
# between two views counts in full, however long: a peer whose process was paused for 30 s (SIGSTOP, a suspended VM)
# came back to a swarm 90 epochs ahead and, allowed 20 epochs and then 10 a second, took 12 s to see it, averaging
# its stale gradients with the swarm all the while (the pair's loss rose 10x). Sybils gain nothing by it: a view
# that looks every second lets them rise just as far in the same time.
RISE_ALLOWANCE_S = 2.0


class EpochCredit:
    """How far this peer believes each record's epoch claim, across refreshes (see the module docstring)."""

    def __init__(self):
        self._credited: Dict[str, int] = {}
        self.swarm_epoch: Optional[int] = None  # the last view's swarm epoch; None before the first
        self._viewed_at: Optional[float] = None
        self._allowance = 0.0  # epochs the view may still rise by (MAX_EPOCHS_PER_SECOND, fractions kept)
        self.reached = 0  # the highest epoch the swarm is known to have reached, also after its trainers left

    def apply(self, records: Sequence[PeerRecord], own_peer_id: Optional[str] = None,
              now: Optional[float] = None, uncorroborated: Collection[str] = ()) -> Tuple[PeerRecord, ...]:
        """`records` with each epoch capped at what is plausible; remembers the caps for the next call. The
        records of `uncorroborated` peers (nobody this peer averaged with saw them average: witnesses.py) do not
        move the swarm epoch."""
        now = time.monotonic() if now is None else now
        corroborated = [r for r in records if r.peer_id not in uncorroborated]
        sources = [r for r in epoch_sources(corroborated, own_peer_id) if r.peer_id != own_peer_id]
        if not sources:
            # Nobody else's claim yet (a newcomer whose DHT has not found the swarm): no anchor. Anchoring on
            # this peer's own epoch 0 would then let its view of a swarm at epoch 200 rise one step per refresh.
            return tuple(records)
        swarm = robust_epoch([r.epoch for r in sources])
        if self.swarm_epoch is not None:
            # Unused allowance is saved up to RISE_ALLOWANCE_S, but the time since the last view counts in full: the
            # swarm may have run on that long unseen (this process paused, or a large swarm's slow read cadence).
            gap = max(0.0, now - self._viewed_at)
            self._allowance = min(self._allowance + gap * MAX_EPOCHS_PER_SECOND,
                                  max(RISE_ALLOWANCE_S, gap) * MAX_EPOCHS_PER_SECOND)
            swarm = min(swarm, self.swarm_epoch + max(1, int(self._allowance)))
            self._allowance = max(0.0, self._allowance - max(0, swarm - self.swarm_epoch))
        credited = []
        for record in records:
            before = self._credited.get(record.peer_id)
            limit = swarm + 1 if before is None else max(before + 1, swarm)
            epoch = min(record.epoch, limit)
            self._credited[record.peer_id] = epoch
            if epoch != record.epoch:
                logger.debug(f"crediting {record.peer_id[-8:]} with epoch {epoch}, not its claimed {record.epoch}")
                record = record.model_copy(update={"epoch": epoch, "samples_accumulated": 0})
            credited.append(record)
        self.swarm_epoch, self._viewed_at = swarm, now
        self.reached = max(self.reached, swarm)
        return tuple(credited)

    def note_departures(self, leaving: Sequence[PeerRecord]) -> None:
        """Trainers that withdrew: the epoch each left at counts towards `reached`, at most one above what this
        peer credited it with while it was live (a record never seen live, or a leaving claim of epoch 2^62,
        raises nothing)."""
        for record in leaving:
            before = self._credited.get(record.peer_id)
            if record.role == "trainer" and before is not None:
                self.reached = max(self.reached, min(record.epoch, before + 1))


def epoch_sources(records: Sequence[PeerRecord], own_peer_id: Optional[str]) -> list:
    """Whose epochs say where the swarm is: the other trainers (this peer asks whether it is behind them),
    else the other aux peers, else this peer itself. A peer back from an outage that has not taken the swarm's
    state yet (`apart_since`) is nobody's source: it trained its later epochs alone (trained_apart.py)."""
    others = [r for r in records if r.peer_id != own_peer_id and r.apart_since is None]
    return ([r for r in others if r.role == "trainer"] or [r for r in others if r.role == "aux"]
            or [r for r in records if r.peer_id == own_peer_id])
