"""`EpochLoop` against a fake host: when an epoch ends, what its round averages, how outcomes are applied."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moshpeer.averaging.report import RoundResult
from moshpeer.errors import SwarmLost
from moshpeer.peer.optimizer.epoch_loop import NO_DONOR, NO_FRESH_VIEW, ROUND_HISTORY
from moshpeer.peer.optimizer.trained_apart import MAX_REJOIN_ATTEMPTS
from moshpeer.peer.strategies.diloco import DiLoCoStrategy
from moshpeer.peer.strategies.gradients import GradientsStrategy
from peer_fakes import FakeHost, swarm_view


def gradients_host(**kwargs) -> FakeHost:
    return FakeHost(GradientsStrategy(average_parameters=False), **kwargs)


def snapshot_params(host: FakeHost) -> list:
    return [p.detach().clone() for p in host.params]


def test_a_lone_peer_steps_on_its_sample_weighted_mean_gradient():
    host = gradients_host(lr=0.1)
    host.swarm.progress.view = swarm_view(trainers=1)  # share: the whole target batch of 64
    before = snapshot_params(host)
    host.backward(1.0)
    assert host.epochs.account(16) is None  # 16 of 64 samples: the epoch goes on
    host.backward(3.0)
    record = host.epochs.account(48)
    assert record is not None and record.error == "alone" and not record.ok
    assert (record.epoch, record.samples, record.group_size) == (0, 64, 1)
    mean = (1.0 * 16 + 3.0 * 48) / 64
    for p, q in zip(host.params, before):
        assert torch.allclose(p, q - 0.1 * mean)
    assert host.counters.epoch == 1 and host.counters.samples == 0 and host.counters.total_samples == 64
    assert all(float(acc.abs().sum()) == 0 for acc in host.counters.grad_sums)
    assert host.averager.calls == []  # nobody to average with: no round was started
    assert list(host.epochs.rounds) == [record] and host.epochs.rounds_total == 1 and host.epochs.rounds_ok == 0


def test_an_epoch_end_without_a_dht_raises_instead_of_training_alone():
    host = gradients_host(lr=0.1)
    host.swarm.progress.view = swarm_view(trainers=2)
    host.swarm.dht_gone = True
    before = snapshot_params(host)
    host.backward(1.0)
    with pytest.raises(SwarmLost):
        host.epochs.account(64)
    assert all(torch.equal(p, q) for p, q in zip(host.params, before)) and host.averager.calls == []


def test_a_group_round_applies_the_groups_average_gradient():
    host = gradients_host(lr=0.1)
    host.averager.average = lambda tensors: [t.fill_(5.0) for t in tensors]  # the group's mean gradient
    host.averager.queue(RoundResult(ok=True, group_size=2, matchmaking_s=0.05, averaged=("gradients",),
                                    contributors=["QmOther"]))
    before = snapshot_params(host)
    host.backward(1.0)
    record = host.epochs.account(32)  # two trainers: this peer's share is 32 of 64
    assert record.ok and record.error is None and record.group_size == 2 and record.group_target == 2
    assert host.swarm.progress.rounds_noted == [(0, ["QmOther"])]  # its samples count from now on (witnesses.py)
    call = host.averager.calls[0]
    assert call["weight"] == 32.0 and call["averaged"] == ("gradients",) and call["wait"] is False
    assert call["matchmaking_time"] == host.timing.matchmaking_window() == 1.0 and call["timeout"] == 2.0
    for p, q in zip(host.params, before):
        assert torch.allclose(p, q - 0.1 * 5.0)
    assert host.epochs.rounds_ok == 1 and host.advertised[-1] is True  # the new epoch's state is offered


@pytest.mark.parametrize("outcome, error", [({"result": RoundResult(ok=False, error="no group")}, "no group"),
                                            ({}, "abandoned"),
                                            ({"error": RuntimeError("boom")}, "abandoned")])
def test_a_round_without_a_group_ends_the_epoch_with_the_peers_own_step(outcome, error):
    host = gradients_host(lr=0.1)
    if outcome:
        host.averager.queue(**outcome)
    before = snapshot_params(host)
    host.backward(2.0)
    record = host.epochs.account(32)
    assert not record.ok and record.error == error and host.counters.epoch == 1
    for p, q in zip(host.params, before):
        assert torch.allclose(p, q - 0.1 * 2.0)


class _CountingFeedback:
    def __init__(self):
        self.commits = 0

    def commit(self) -> bool:
        self.commits += 1
        return True


@pytest.mark.parametrize("outcome, commits", [({"result": RoundResult(ok=True, group_size=2)}, 1),
                                              ({"result": RoundResult(ok=False, error="no group")}, 0),
                                              ({}, 0)])  # abandoned: its data plane may still finish later
def test_error_feedback_commits_a_round_only_when_the_loop_takes_it(outcome, commits):
    host = gradients_host(lr=0.1)
    host.averager.error_feedback = feedback = _CountingFeedback()
    host.averager.queue(**outcome)
    host.backward(1.0)
    host.epochs.account(32)
    assert feedback.commits == commits


def test_the_swarm_reaching_the_target_ends_the_epoch_before_this_peers_share():
    host = gradients_host()
    host.swarm.progress.view = swarm_view(trainers=4, samples=10)  # this peer's share: 16 of 64
    host.backward()
    assert host.epochs.account(1) is None
    host.swarm.progress.view = swarm_view(trainers=4, samples=64)  # the others gathered the target
    assert host.epochs.account(1) is not None and host.counters.epoch == 1


def test_a_peer_behind_the_swarm_adopts_a_donors_state_and_drops_its_samples():
    host = gradients_host()
    host.swarm.progress.view = swarm_view(trainers=2, epoch=3)  # more than max_epoch_lag=1 ahead
    host.donor_state = object()
    host.backward()
    record = host.epochs.account(32)
    assert host.downloads == [2] and record.error == "caught up" and record.dropped_samples == 32
    assert host.counters.dropped_samples == 32 and host.averager.calls == []


def test_a_peer_whose_process_was_paused_reads_the_swarm_again_and_catches_up_instead_of_averaging():
    """SIGSTOP for 30 s at epoch 0: the cached view still says the swarm is at epoch 0 (in step), the swarm is at
    90. The epoch end decides on a fresh read (`current`), so the peer takes a donor's state; on the cached view it
    averaged its stale gradients with the swarm."""
    host = gradients_host()
    host.swarm.progress.view_after_pause = swarm_view(trainers=2, epoch=90)
    host.donor_state = object()
    host.backward()
    record = host.epochs.account(32)
    assert host.swarm.progress.current_calls == 1
    assert host.downloads == [89] and record.error == "caught up" and host.averager.calls == []


def test_behind_the_swarm_with_no_donor_a_peer_steps_alone_before_its_group_takes_it_along():
    """Its gradients are for parameters the swarm has left: when no donor delivers the state it asks for, it does not
    average them into the swarm's round (test_pause, under load: it did, once). After MAX_REJOIN_ATTEMPTS epoch ends
    in a row without a donor it averages again, and its group's round takes it along (epoch_agreement.py)."""
    host = gradients_host(lr=0.1)
    host.swarm.progress.view = swarm_view(trainers=3, epoch=90)
    for attempt in range(1, MAX_REJOIN_ATTEMPTS):
        host.backward(1.0)
        record = host.epochs.account(64)
        assert record.error == NO_DONOR and record.group_size == 1 and host.averager.calls == []
        assert len(host.downloads) == attempt  # it asked each time
    host.averager.queue(RoundResult(ok=True, group_size=3, matchmaking_s=0.05, averaged=("gradients",),
                                    contributors=["QmOther"]))
    host.backward(1.0)
    assert host.epochs.account(64).ok and len(host.averager.calls) == 1
    host.swarm.progress.view = swarm_view(trainers=3, epoch=host.counters.epoch)  # in step again: the count restarts
    host.backward(1.0)
    host.epochs.account(64)
    host.swarm.progress.view = swarm_view(trainers=3, epoch=90)
    host.backward(1.0)
    assert host.epochs.account(64).error == NO_DONOR


def test_on_a_stale_view_of_the_swarm_a_peer_steps_alone_and_says_why():
    host = gradients_host(lr=0.1)
    host.swarm.progress.view = dataclasses.replace(swarm_view(trainers=3), stale=True)
    host.backward(1.0)
    record = host.epochs.account(64)
    assert record.error == NO_FRESH_VIEW and record.group_size == 1 and host.averager.calls == []


def test_a_spent_compute_budget_ends_the_epoch_and_says_so():
    host = gradients_host(budget=1.0)
    host.timing.begin_epoch()
    host.backward()
    assert host.epochs.account(1) is None
    host.clock.advance(1.5)  # past the budget of 1 s
    record = host.epochs.account(1)
    assert record is not None and record.stopped_by_budget and record.samples == 2


def test_a_peer_too_late_for_its_round_catches_up_when_the_others_moved_on():
    host = gradients_host(budget=1.0)
    host.timing.begin_epoch()
    host.swarm.moved_on, host.donor_state = True, object()
    host.backward()
    host.clock.advance(5.0)  # every window of this epoch has closed
    record = host.epochs.account(1)
    assert record.error == "missed round; caught up" and host.downloads == [1]


def test_diloco_catches_up_after_a_missed_round_instead_of_stepping_alone():
    host = FakeHost(DiLoCoStrategy(inner_steps=1))
    host.averager.queue(RoundResult(ok=False, error="no group"))
    host.swarm.moved_on, host.donor_state = True, object()
    host.backward()
    record = host.epochs.account(8)
    assert record.error == "missed round; caught up" and host.downloads == [1]


def test_an_overlapping_round_is_resolved_at_the_next_epoch_end():
    host = FakeHost(DiLoCoStrategy(inner_steps=2, overlap=True))
    host.averager.queue(RoundResult(ok=True, group_size=2, averaged=("pseudo_gradient",)))
    host.backward()
    host.epochs.account(8)
    first = host.epochs.account(8)
    assert first.error == "round in flight" and not host.epochs.rounds and host.counters.epoch == 1
    host.epochs.account(8)
    second = host.epochs.account(8)  # resolves the first round (epoch 0); the second runs in the background
    assert second.ok and second.epoch == 0 and list(host.epochs.rounds) == [second]
    last = host.epochs.settle()  # the second round never finishes: abandoned, the outer step on our own Δ
    assert last.epoch == 1 and last.error == "abandoned" and host.epochs.settle() is None
    assert host.epochs.rounds_total == 2


def test_an_overlapping_peer_left_alone_reports_the_round_it_resolved_and_steps_alone_one_epoch_later():
    """Each epoch end of an overlapping strategy resolves one round and reports it: a peer that finds itself alone
    still reports the previous epoch's round (it used to return only its lone step, and that round's record never
    reached an epoch line), and its lone outer step waits for the next epoch end like any round."""
    host = FakeHost(DiLoCoStrategy(inner_steps=2, overlap=True))
    host.averager.queue(RoundResult(ok=True, group_size=2, averaged=("pseudo_gradient",)))
    host.backward()
    host.epochs.account(8)
    assert host.epochs.account(8).error == "round in flight"  # epoch 0's round runs in the background
    host.swarm.progress.view = swarm_view(trainers=1)  # the others are gone
    host.epochs.account(8)
    second = host.epochs.account(8)
    assert second.ok and second.epoch == 0 and len(host.averager.calls) == 1  # no round started for epoch 1
    host.epochs.account(8)
    third = host.epochs.account(8)
    assert third.epoch == 1 and third.error == "alone" and not third.ok
    assert [r.epoch for r in host.epochs.rounds] == [0, 1] and host.counters.epoch == 3
    assert host.epochs.settle().error == "alone" and host.epochs.settle() is None  # epoch 2's lone step


def test_the_round_history_is_bounded_but_counted():
    host = gradients_host(target_batch_size=1)
    host.swarm.progress.view = swarm_view(trainers=1, target=1)
    for _ in range(ROUND_HISTORY + 5):
        host.backward()
        host.epochs.account(1)
    assert len(host.epochs.rounds) == ROUND_HISTORY and host.epochs.rounds_total == ROUND_HISTORY + 5
    assert host.epochs.rounds[-1].epoch == ROUND_HISTORY + 4


def test_group_target_follows_live_peers():
    host = gradients_host(group_size=4)
    assert [host.epochs.group_target(swarm_view(n)) for n in (1, 2, 3, 4, 9)] == [2, 2, 3, 4, 4]
    assert host.epochs.group_target(swarm_view(2, aux=1)) == 3
    # Of the trainer records nobody saw average (Sybils, or a newcomer: 4 proven peers and 3 others), rounds wait
    # for one: a newcomer gets into a group and is seen averaging, and fakes cost at most one member's wait.
    with_fakes = dataclasses.replace(swarm_view(7), counted_trainers=4)
    assert gradients_host(group_size=8).epochs.group_target(with_fakes) == 5


def test_progress_is_published_after_every_micro_batch():
    host = gradients_host()
    host.averager.flagged_peers = {"peer-a": 2}
    host.backward()
    host.epochs.account(4)
    report = host.swarm.progress.reports[-1]
    assert (report["epoch"], report["samples_accumulated"], report["force"]) == (0, 4, False)
    assert host.swarm.flagged[-1] == {"peer-a": 2}


def test_step_takes_the_default_batch_size_or_refuses_without_one():
    from moshpeer.errors import UserError

    host = gradients_host()
    host.backward()
    with pytest.raises(UserError):
        host.epochs.step()
    host.epochs.batch_size_per_step = 8
    assert host.epochs.step() is None and host.counters.samples == 8
    assert host.epochs.step(4) is None and host.counters.samples == 12
