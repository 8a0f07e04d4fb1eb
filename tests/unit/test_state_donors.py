"""Which donors a state download asks, and when identical signatures are enough (peer/state/donors.py): plain
functions of the offers, checked without a DHT; and when a download stops waiting for one."""

from __future__ import annotations

import time

import pytest

from moshpeer.peer.state import sync
from moshpeer.peer.state.donors import MisfitDonors, cross_checkable_first, dissenters
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


def test_a_training_peer_does_not_wait_out_the_timeout_for_a_donor_nobody_offers(monkeypatch):
    """The donors on offer are all behind the epochs asked for (the peer ahead of them offers nothing: behind a
    NAT): with `offer_wait_s` the download gives up then, not at its 60 s timeout."""
    listings = []
    monkeypatch.setattr(sync, "list_state_offers", lambda dht, run_id, timeout: listings.append(1) or [offer("b", 5)])
    started = time.monotonic()
    with pytest.raises(sync.StateDownloadFailed, match=r"no donor offers epochs 9\.\.12 \(on offer: \[5\]\)"):
        sync.download_state(None, "run", min_epoch=9, max_epoch=12, timeout=60.0, offer_wait_s=0.6,
                            show_progress=False)
    assert time.monotonic() - started < 5.0 and 2 <= len(listings) <= 4  # listed again every 0.5 s meanwhile


def test_donors_whose_state_does_not_fit_are_set_aside_for_a_while_and_named_once():
    misfits = MisfitDonors(set_aside_s=600.0)
    assert misfits.note(["a", "b"], now=0.0) == ["a", "b"]  # named in the log
    assert sorted(misfits.excluded(now=10.0)) == ["a", "b"]
    assert misfits.note(["a", "c"], now=20.0) == ["c"]  # "a" was set aside already: not named again
    assert sorted(misfits.excluded(now=601.0)) == ["a", "c"]  # "b" is asked again after 10 minutes
    assert misfits.excluded(now=621.0) == []
