"""In-process: a newcomer never adopts a state older than it asked for, whatever donors' offers claimed.

The swarm failure behind this (test_preemption_swarm under load): survivors advertised epoch 18 but,
their optimizer lock busy with a round, served the snapshot they had cut at epoch 1 for an earlier
newcomer; two of them signed the same bytes, and the rejoined peer adopted epoch 1.
"""

from __future__ import annotations

import hashlib

import pytest

from moshpeer.peer.state import swarm as state_swarm
from moshpeer.peer.state.pieces import Manifest
from moshpeer.peer.state.swarm import download_swarmed, manifest_epoch_ok
from moshpeer.peer.state.framing import StateOffer

PIECE = 4


def _manifest(epoch: int, data: bytes) -> Manifest:
    hashes = tuple(hashlib.sha256(data[i:i + PIECE]).digest() for i in range(0, len(data), PIECE))
    return Manifest(epoch, len(data), hashlib.sha256(data).hexdigest(), PIECE, hashes)


def test_manifest_epoch_rule():
    assert manifest_epoch_ok(18, offered_epoch=18, min_epoch=17)
    assert manifest_epoch_ok(17, offered_epoch=18, min_epoch=17)  # mid-way through its epoch's end
    assert not manifest_epoch_ok(16, offered_epoch=17, min_epoch=17)  # below what the caller needs
    assert not manifest_epoch_ok(1, offered_epoch=18, min_epoch=0)  # far below its own offer
    assert manifest_epoch_ok(3, offered_epoch=3, min_epoch=0)


def test_stale_majority_loses_to_a_fresh_donor(monkeypatch):
    stale, fresh = b"epoch-one-state!", b"epoch-18-state!!"
    served = {"a": (1, stale), "b": (1, stale), "c": (18, fresh)}  # a and b agree on the same stale bytes

    def fetch_manifest(offer, run_id, **kwargs):
        return _manifest(*served[offer.peer_id])

    def fetch_pieces(donor, run_id, manifest, first, count, **kwargs):
        data = served[donor.peer_id][1]
        return [data[i * PIECE:(i + 1) * PIECE] for i in range(first, first + count)]

    monkeypatch.setattr(state_swarm, "fetch_manifest", fetch_manifest)
    monkeypatch.setattr(state_swarm, "fetch_pieces", fetch_pieces)
    offers = [StateOffer(peer_id, "127.0.0.1", 1, 18) for peer_id in "abc"]
    failed = []
    got = download_swarmed(offers, "run", timeout=5.0, max_bytes=1 << 20, failed=failed, min_epoch=17)
    assert got.manifest.epoch == 18 and got.data == fresh and got.agreeing == ("c",)
    assert sorted(peer_id for peer_id, _ in failed) == ["a", "b"]
    assert all("serves epoch 1" in why for _, why in failed)


def test_only_stale_donors_fail_the_download(monkeypatch):
    monkeypatch.setattr(state_swarm, "fetch_manifest", lambda offer, run_id, **kw: _manifest(1, b"x" * 8))
    offers = [StateOffer("a", "127.0.0.1", 1, 18)]
    with pytest.raises(Exception, match="no donor sent a valid manifest"):
        download_swarmed(offers, "run", timeout=5.0, max_bytes=1 << 20, failed=[], min_epoch=17)
