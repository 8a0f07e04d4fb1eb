"""A trainer back from an outage gives up the epochs it trained alone (trained_apart.py): the decisions, the
epoch loop acting on them, and how the others read its record (progress.py)."""

from __future__ import annotations

import dataclasses

from moshpeer.averaging.report import RoundResult
from moshpeer.peer.optimizer.epoch_credit import EpochCredit
from moshpeer.peer.optimizer.epoch_loop import NO_FRESH_VIEW, REJOINED
from moshpeer.peer.optimizer.trained_apart import MAX_REJOIN_ATTEMPTS, TrainedApart
from moshpeer.peer.strategies.gradients import GradientsStrategy
from peer_fakes import FakeHost, swarm_view
from test_progress_trust import record, view


def cut_off_at(epoch: int, samples: int = 0) -> TrainedApart:
    apart = TrainedApart()
    assert apart.observe(True, epoch, samples)
    return apart


def test_a_peer_never_cut_off_is_never_apart():
    apart = TrainedApart()
    assert not apart.observe(False, 50, 0)
    assert apart.rejoin_epoch(500, others_epoch=50, max_epoch_lag=1, cut_off=False) is None


def test_back_from_an_outage_far_ahead_the_peer_takes_the_others_epoch():
    apart = cut_off_at(100, samples=1000)
    assert not apart.observe(True, 130, 4000)  # still the same stretch: it started at epoch 100
    assert apart.rejoin_epoch(600, others_epoch=140, max_epoch_lag=1, cut_off=True) is None  # not back yet
    assert apart.rejoin_epoch(600, others_epoch=None, max_epoch_lag=1, cut_off=False) is None  # sees nobody yet
    assert apart.since_epoch == 100
    assert apart.rejoin_epoch(600, others_epoch=140, max_epoch_lag=1, cut_off=False) == 140
    assert apart.samples_apart(9000) == 8000
    assert apart.attempted(adopted=True) and apart.since_epoch is None and apart.samples_apart(9500) == 0


def test_work_a_failed_download_did_not_replace_is_stale_until_the_peer_gives_up():
    """A stretch apart whose download failed (`holds_stale_work`: not averaged) until the last attempt, after which
    the peer keeps its state; behind the swarm without a donor, for MAX_REJOIN_ATTEMPTS epoch ends in a row at most."""
    apart = cut_off_at(100)
    assert not apart.holds_stale_work  # apart, but no download tried yet (still cut off: it averages nothing anyway)
    for _ in range(MAX_REJOIN_ATTEMPTS - 1):
        assert not apart.attempted(adopted=False) and apart.holds_stale_work
    assert apart.attempted(adopted=False) and not apart.holds_stale_work  # gave up: it keeps its state
    behind = TrainedApart()
    for _ in range(MAX_REJOIN_ATTEMPTS - 1):
        behind.note_behind(True)
        assert behind.holds_stale_work
    behind.note_behind(True)
    assert not behind.holds_stale_work  # its group's round takes it along now
    behind.note_behind(False)
    behind.note_behind(True)
    assert behind.holds_stale_work  # in step in between: counted from there


def test_the_stretch_counts_from_the_last_round_with_a_group_not_from_when_the_outage_was_seen():
    """The outage is seen a heartbeat late: lone epochs may have raced ahead of the others meanwhile. The others'
    epoch 12 is past where this peer last averaged with them (epoch 4), though behind where it saw the outage (20)."""
    apart = TrainedApart()
    apart.synced(4, samples_before=400)
    assert apart.observe(True, 20, samples_before=2000)
    assert apart.since_epoch == 4 and apart.samples_apart(2500) == 2100
    apart.synced(21, samples_before=2100)  # a round with a group while apart does not end the stretch
    assert apart.rejoin_epoch(30, others_epoch=12, max_epoch_lag=1, cut_off=False) == 12


def test_nothing_is_given_up_within_the_lag_or_when_the_others_are_behind_where_it_left_them():
    within = cut_off_at(100)
    assert within.rejoin_epoch(101, others_epoch=140, max_epoch_lag=1, cut_off=False) is None  # one epoch alone
    assert within.since_epoch is None
    restarted = cut_off_at(100)  # the swarm it left restarted (or only newcomers are left): its state is ahead
    assert restarted.rejoin_epoch(600, others_epoch=3, max_epoch_lag=1, cut_off=False) is None
    assert restarted.since_epoch is None


def test_lone_epochs_that_kept_pace_with_the_others_are_given_up_too():
    """Its DHT process stalled for 20 s while it trained on alone (test_pause's p2pd case): back at the others'
    count, but 40 epochs of its own parameters, which it would otherwise average into theirs."""
    level = cut_off_at(24)
    assert level.rejoin_epoch(64, others_epoch=64, max_epoch_lag=1, cut_off=False) == 64
    behind = cut_off_at(24)  # or slower than them: their state too (the epoch loop asks up to its own or theirs)
    assert behind.rejoin_epoch(60, others_epoch=64, max_epoch_lag=1, cut_off=False) == 64


def test_without_a_donor_the_peer_keeps_its_state_after_a_few_tries():
    apart = cut_off_at(100)
    for _ in range(MAX_REJOIN_ATTEMPTS - 1):
        assert apart.rejoin_epoch(600, others_epoch=140, max_epoch_lag=1, cut_off=False) == 140
        assert not apart.attempted(adopted=False)
    assert apart.rejoin_epoch(600, others_epoch=140, max_epoch_lag=1, cut_off=False) == 140
    assert apart.attempted(adopted=False) and apart.since_epoch is None
    assert apart.rejoin_epoch(600, others_epoch=140, max_epoch_lag=1, cut_off=False) is None


def test_the_epoch_loop_marks_its_record_and_adopts_the_swarms_state_on_its_return():
    host = FakeHost(GradientsStrategy(average_parameters=False))
    host.donor_state = object()
    host.averager.queue(RoundResult(ok=True, group_size=2, contributors=["QmOther"]))
    host.backward()
    assert host.epochs.account(32).ok  # epoch 0 with a group: in step with the swarm from epoch 1 on
    host.swarm.is_cut_off = True
    host.swarm.progress.view = swarm_view(trainers=1)  # cut off: its DHT lists only itself
    for _ in range(5):
        host.backward()
        assert host.epochs.account(64).error == "alone"
    assert host.swarm.published == [{"apart_since": 1}] and host.counters.epoch == 6
    host.swarm.is_cut_off = False  # back: the others are at epoch 3
    host.swarm.progress.view = swarm_view(trainers=3, epoch=6, others_epoch=3)
    host.backward()
    back = host.epochs.account(22)  # its share of 64 among 3
    assert back.error == "back from an outage; took the swarm's state"
    assert host.downloads == [(2, 6)]  # a donor of the others' epoch or later, never past its own
    assert back.dropped_samples == 5 * 64 + 22 and host.counters.dropped_samples == 5 * 64 + 22
    assert host.swarm.published[-1] == {"apart_since": None}  # others count its epochs again
    assert len(host.averager.calls) == 1  # only the round of epoch 0


def test_epochs_stepped_alone_on_a_stale_view_are_given_up_as_after_an_outage():
    """A peer whose DHT process stalls keeps its neighbours (it is not cut off) but reads nothing: on its stale view
    it steps alone, far faster than a swarm that averages. Back, it gives those epochs up as after an outage, rather
    than having the others chase them (its DHT process stopped for 60 s: ~35 s of lone epochs)."""
    host = FakeHost(GradientsStrategy(average_parameters=False))
    host.donor_state = object()
    host.averager.queue(RoundResult(ok=True, group_size=2, contributors=["QmOther"]))
    host.backward()
    assert host.epochs.account(32).ok
    host.swarm.progress.view = dataclasses.replace(swarm_view(trainers=3), stale=True)
    for _ in range(5):
        host.backward()
        assert host.epochs.account(64).error == NO_FRESH_VIEW
    assert host.swarm.published == [{"apart_since": 1}] and host.counters.epoch == 6
    host.swarm.progress.view = swarm_view(trainers=3, epoch=6, others_epoch=3)  # a fresh read again
    host.backward()
    back = host.epochs.account(22)
    assert back.error == REJOINED and host.downloads == [(2, 6)]
    assert host.swarm.published[-1] == {"apart_since": None}


def test_others_leave_a_peer_back_from_an_outage_out_of_the_swarm_epoch():
    """Three trainers, one back from an outage far ahead: the other two do not chase it (they used to take the
    upper median of their two others, its epoch); it compares its epoch with theirs."""
    own, mate = record(0, 40), record(1, 40)
    returning = record(2, 490).model_copy(update={"apart_since": 30})
    mates_view = view(EpochCredit(), [mate, returning], own)
    assert mates_view.global_epoch == 40 and mates_view.others_epoch == 40
    returning_view = view(EpochCredit(), [own, mate], returning)
    assert returning_view.global_epoch == 490 and returning_view.others_epoch == 40
    alone = view(EpochCredit(), [returning], own)  # of two, the other one is apart: no other epoch counts
    assert alone.global_epoch == 40 and alone.others_epoch is None
    rejoined = returning.model_copy(update={"apart_since": None, "epoch": 40})
    assert view(EpochCredit(), [mate, rejoined], own).others_epoch == 40
