"""Which donors a state download asks, and when their signatures confirm each other: plain functions of the
offers on the DHT (no I/O), used by `sync.download_state`; and which donors a peer sets aside because their state
does not fit its model (`MisfitDonors`, used by the optimizer's state exchange)."""

from __future__ import annotations

import math
from typing import Dict, Iterable, List

from moshpeer.bounded_memory import remember
from moshpeer.peer.state.framing import StateOffer


def dissenters(listed: List[StateOffer], tried: set, epoch: int) -> List[StateOffer]:
    """Donors on offer at `epoch` that were not asked yet: after a download from a group of donors that signed one
    manifest, those that signed another one. (Donors at other epochs hold other states by right.)"""
    return [o for o in listed if o.peer_id not in tried and o.epoch == epoch]


def cross_checkable_first(offers: List[StateOffer]) -> List[StateOffer]:
    """Offers ordered so that the first two can confirm each other: the most advanced epoch that two or more
    donors hold first (one donor claiming an epoch ahead of the rest cannot jump the queue that way), then
    the lone offers, most advanced first."""
    counts: Dict[int, int] = {}
    for offer in offers:
        counts[offer.epoch] = counts.get(offer.epoch, 0) + 1
    return sorted(offers, key=lambda o: (counts[o.epoch] < 2, -o.epoch, o.peer_id))


# How long a donor whose state did not fit this peer's model is not asked again, and how many such donors are kept.
MISFIT_SET_ASIDE_S = 600.0
MAX_MISFITS = 1024


class MisfitDonors:
    """Donors whose state did not fit this peer's model (another --task-arg, another task), set aside for
    MISFIT_SET_ASIDE_S: a peer configured unlike the swarm downloaded the whole state from every donor at every
    epoch end before (measured: 12 downloads and 24 warnings in 30 s), and would hammer donors of a large model."""

    def __init__(self, set_aside_s: float = MISFIT_SET_ASIDE_S):
        self.set_aside_s = set_aside_s
        self._until: Dict[str, float] = {}

    def note(self, misfits: Iterable[str], now: float) -> List[str]:
        """Set these donors aside from `now` -> those that were not set aside already (to be named in the log)."""
        new = []
        for peer_id in misfits:
            if self._until.get(peer_id, -math.inf) <= now:
                new.append(peer_id)
            remember(self._until, peer_id, now + self.set_aside_s, limit=MAX_MISFITS)  # identities are cheap
        return new

    def excluded(self, now: float) -> List[str]:
        """The donors not to ask at `now`."""
        self._until = {peer_id: until for peer_id, until in self._until.items() if until > now}
        return list(self._until)
