"""Which donors a state download asks, and when identical signatures are enough (peer/state/donors.py): plain
functions of the offers, checked without a DHT."""

from __future__ import annotations

from moshpeer.peer.state.donors import cross_checkable_first, dissenters
from moshpeer.peer.state.framing import StateOffer


def offer(peer: str, epoch: int) -> StateOffer:
    return StateOffer(peer_id=peer, host="127.0.0.1", port=1, epoch=epoch)


def test_an_epoch_two_donors_hold_goes_before_a_lone_donor_further_ahead():
    offers = [offer("forger", 9), offer("b", 5), offer("a", 5), offer("c", 4)]
    assert [o.peer_id for o in cross_checkable_first(offers)] == ["a", "b", "forger", "c"]


def test_dissenters_are_the_untried_donors_at_the_same_epoch_only():
    listed = [offer("sybil1", 5), offer("sybil2", 5), offer("honest", 5), offer("ahead", 6)]
    tried = {"sybil1", "sybil2"}  # the group that signed one manifest, just downloaded
    assert [o.peer_id for o in dissenters(listed, tried, 5)] == ["honest"]
    assert dissenters(listed, tried | {"honest"}, 5) == []  # nobody contradicts: the signatures confirm
