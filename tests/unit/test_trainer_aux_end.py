"""When an aux peer's training loop ends: with the trainers' last epoch, or when they left without it seeing it."""

from __future__ import annotations

from moshpeer.peer.runtime.trainer import AUX_ORPHANED_S, _trainers_finished


def test_an_aux_one_epoch_short_whose_trainers_left_is_done():
    assert _trainers_finished(15, 16, trainers_seen_at=100.0, now=100.0 + AUX_ORPHANED_S + 0.1)


def test_an_aux_keeps_waiting_while_trainers_may_come_back():
    later = 100.0 + AUX_ORPHANED_S + 0.1
    assert not _trainers_finished(15, 16, trainers_seen_at=100.0, now=100.0 + AUX_ORPHANED_S / 2)  # not long yet
    assert not _trainers_finished(14, 16, trainers_seen_at=100.0, now=later)  # more than one epoch to go
    assert not _trainers_finished(15, None, trainers_seen_at=100.0, now=later)  # no epoch limit: runs until stopped
    assert not _trainers_finished(0, 1, trainers_seen_at=None, now=later)  # never saw a trainer: still starting
