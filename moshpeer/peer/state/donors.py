"""Which donors a state download asks, and when their signatures confirm each other: plain functions of the
offers on the DHT (no I/O), used by `sync.download_state`."""

from __future__ import annotations

from typing import Dict, List

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
