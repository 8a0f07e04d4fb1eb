"""`RoundTiming` on a fake clock: the epoch's compute budget and how long its round waits."""

from __future__ import annotations

import time
from typing import Optional

import pytest

from moshpeer.averaging.adaptive_deadlines import DeadlineLearner
from moshpeer.averaging.report import RoundResult
from moshpeer.peer.optimizer.round_timing import (ASSEMBLY_MARGIN, AUX_WINDOW_FACTOR, MIN_BUDGET_WINDOW_S,
                                                  MISSED_ROUND_GRACE_S, STRAGGLER_WAIT_WINDOWS, RoundTiming,
                                                  quorum_eta_s, stragglers_eta_s)
from peer_fakes import FakeClock, FakeFuture, peer_record as record


def budgeted(seconds: float = 0.4, matchmaking_time: float = 1.0, fastest_assembly: Optional[float] = 0.05):
    """A budgeted RoundTiming whose averager saw full groups assemble in `fastest_assembly` seconds (0.05: the floor
    is MIN_BUDGET_WINDOW_S; None: nothing learned yet)."""
    clock = FakeClock()
    return RoundTiming(matchmaking_time, seconds, 4, clock=clock, fastest_assembly=lambda size: fastest_assembly), clock


def test_without_a_budget_a_round_waits_the_matchmaking_time():
    timing = RoundTiming(1.5, None, 4)
    assert timing.matchmaking_window() == 1.5 and not timing.budget_spent() and timing.end_compute() is False
    assert not timing.too_late_for_round()
    assert timing.aux_window() == AUX_WINDOW_FACTOR * 1.5 and timing.search_time_for(1.5) == 3.0


def test_the_window_ends_at_the_budget_deadline_but_never_below_the_floor():
    timing, clock = budgeted(0.4)
    assert timing.matchmaking_window() == pytest.approx(0.4)  # the epoch just began
    clock.advance(0.1)
    assert timing.matchmaking_window() == pytest.approx(0.3)
    clock.advance(0.5)  # past the deadline
    assert timing.matchmaking_window() == pytest.approx(MIN_BUDGET_WINDOW_S)
    timing.fastest_assembly = lambda size: 0.15  # the averager saw complete groups take 0.15 s (a loaded machine)
    assert timing.assembly_floor() == pytest.approx(0.45)
    assert timing.matchmaking_window() == pytest.approx(0.45)


def test_before_any_full_group_assembled_a_budgeted_window_is_the_whole_matchmaking_time():
    """Peers 200 ms apart take 1.1 s to assemble a group; a budget of 0.25 s cut every window to the 0.2 s floor, no
    group ever formed, so none was measured either (48 of 55 rounds found no group, session 50)."""
    timing, clock = budgeted(0.25, matchmaking_time=3.0, fastest_assembly=None)
    clock.advance(0.3)  # past the deadline
    assert timing.matchmaking_window() == 3.0 and not timing.too_late_for_round()
    timing.fastest_assembly = lambda size: 1.1  # then one formed in 1.1 s
    assert timing.matchmaking_window() == pytest.approx(3.0) and timing.assembly_floor() == pytest.approx(3.0)
    timing.fastest_assembly = lambda size: 0.5
    assert timing.matchmaking_window() == pytest.approx(1.5)


def test_the_budget_stops_compute_after_tau_and_says_so():
    timing, clock = budgeted(0.4)
    timing.record_micro_batch(8)
    assert not timing.budget_spent()
    clock.advance(0.5)
    assert timing.budget_spent() and timing.end_compute() is True
    timing.begin_epoch()  # the next epoch's clock starts now
    assert not timing.budget_spent()


def test_a_peer_is_too_late_once_every_window_of_its_epoch_closed():
    timing, clock = budgeted(0.4)
    clock.advance(0.4 + MIN_BUDGET_WINDOW_S - 0.01)
    assert not timing.too_late_for_round()
    clock.advance(0.02)
    assert timing.too_late_for_round()


def test_the_assembly_floor_asks_the_averager_for_the_rounds_group_size():
    asked = []
    timing = RoundTiming(1.0, 0.4, 4, clock=FakeClock(),
                         fastest_assembly=lambda size: asked.append(size) or {2: 0.1, 4: 0.2}.get(size))
    assert timing.assembly_floor() == pytest.approx(ASSEMBLY_MARGIN * 0.2) and asked == [4]  # default: group_size
    assert timing.assembly_floor(2) == pytest.approx(max(MIN_BUDGET_WINDOW_S, ASSEMBLY_MARGIN * 0.1))
    assert timing.assembly_floor(3) == 1.0  # nothing learned for groups of 3 yet: the whole matchmaking time
    timing.fastest_assembly = lambda size: 5.0  # never more than the matchmaking time
    assert timing.assembly_floor() == 1.0


def test_the_floor_follows_what_a_real_averagers_learner_measured():
    learner = DeadlineLearner(matchmaking_floor=0.2, matchmaking_cap=5.0, round_floor=0.1, round_cap=30.0)
    timing = RoundTiming(1.0, 0.4, 4, clock=FakeClock(), fastest_assembly=learner.fastest_assembly_s)
    assert timing.assembly_floor() == 1.0  # nothing measured yet: the whole matchmaking time
    learner.observe_result(RoundResult(ok=True, group_id="ab", group_size=2, matchmaking_s=0.01), target=4,
                           payload_bytes=400)  # not a complete group: says nothing
    assert timing.assembly_floor() == 1.0
    learner.observe_result(RoundResult(ok=True, group_id="ab", group_size=4, matchmaking_s=0.15), target=4,
                           payload_bytes=400)
    assert timing.assembly_floor() == pytest.approx(0.45)


def test_await_result_returns_abandons_or_swallows_a_failure():
    timing, _ = budgeted()
    done = RoundResult(ok=True, group_size=4, matchmaking_s=0.05)
    assert timing.await_result(FakeFuture(done), lambda: False) is done
    pending = FakeFuture()  # its deadline has passed
    assert timing.await_result(pending, lambda: False) is None and pending.cancelled
    assert timing.await_result(FakeFuture(error=RuntimeError("boom")), lambda: False) is None


def test_await_result_abandons_a_round_when_asked_to_stop():
    timing, _ = budgeted()
    pending = FakeFuture()
    pending.deadline._remaining = 10.0  # still inside its deadline: only the stop request ends the wait
    assert timing.await_result(pending, lambda: True) is None and pending.cancelled


def test_missed_round_grace_is_bounded_by_the_round_timeout():
    assert RoundTiming(1.0, None, 4, round_timeout=2.0).missed_round_grace() == 2.0
    assert RoundTiming(1.0, None, 4, round_timeout=60.0).missed_round_grace() == MISSED_ROUND_GRACE_S


# ---- rounds of strategies that count their own epochs wait for the trainers still computing -------------------

def test_the_slowest_trainer_still_in_the_epoch_sets_the_wait():
    me = record(0, samples=200)
    peers = [me, record(1, samples=100, rate=50.0), record(2, samples=150, rate=10.0),  # 2 s and 5 s to go
             record(3, epoch=4, samples=0), record(4, epoch=2, samples=0),  # done with it; behind (catches up)
             record(5, samples=0, role="aux"), record(6, samples=0, leaving=True), record(7, samples=0, rate=0.0)]
    assert stragglers_eta_s(peers, 3, 200, me.peer_id, now=0.0) == 5.0
    # Time since a record was published counts as computed: a silent (stopped) peer soon counts for nothing.
    assert stragglers_eta_s(peers, 3, 200, me.peer_id, now=1.0) == 4.0
    assert stragglers_eta_s(peers, 3, 200, me.peer_id, now=10.0) == 0.0
    assert stragglers_eta_s([me, record(1, samples=200)], 3, 200, me.peer_id) == 0.0  # everyone is done
    # Time since the samples were counted, not since the record was published: a heartbeat re-publishes a stalled
    # peer's record with the same count, and does not make it look due in full again.
    stalled = record(2, samples=150, rate=10.0, samples_counted_at=100.0, updated_at=104.0)  # counted 5 s to go
    assert stragglers_eta_s([me, stalled], 3, 200, me.peer_id, now=104.0) == 1.0
    assert stragglers_eta_s([me, stalled], 3, 200, me.peer_id, now=106.0) == 0.0


def test_a_round_waits_for_stragglers_up_to_a_bound_and_a_budget_keeps_its_own_window():
    timing = RoundTiming(2.0, None, 4)
    assert timing.matchmaking_window(4, 0.0) == 2.0
    assert timing.matchmaking_window(4, 1.5) == 3.5  # their time to go, then one window to find the group
    assert timing.matchmaking_window(4, 60.0) == STRAGGLER_WAIT_WINDOWS * 2.0
    budget, _ = budgeted(seconds=10.0, matchmaking_time=2.0)
    assert budget.matchmaking_window(4, 60.0) == 2.0  # the budget deadline rules there


def test_a_round_waits_for_a_straggler_whether_its_strategy_counts_steps_or_shares():
    from moshpeer.averaging.report import RoundResult as Result
    from moshpeer.peer.strategies.diloco import DiLoCoStrategy
    from moshpeer.peer.strategies.gradients import GradientsStrategy
    from peer_fakes import FakeHost, swarm_view

    # The straggler needs 10 s: the wait is capped at STRAGGLER_WAIT_WINDOWS windows (8 s), however slow the test.
    for strategy, swarm_samples, expected in ((DiLoCoStrategy(inner_steps=1), 32, 8.0),
                                              (GradientsStrategy(), 32, 8.0),
                                              (GradientsStrategy(), 64, 2.0)):  # the swarm has its target batch
        host = FakeHost(strategy, matchmaking_time=2.0)
        view = swarm_view(trainers=2, samples=swarm_samples)
        straggler = record(1, epoch=0, samples=12, rate=2.0, updated_at=time.time())  # 10 s to go, published now
        host.swarm.progress.view = type(view)(**{**view.__dict__, "peers": (straggler,)})
        host.averager.queue(Result(ok=True, group_size=2))
        host.backward(1.0)
        host.epochs.account(32)  # DiLoCo: its one inner step; gradients: this peer's share (32 of 64)
        assert host.averager.calls[0]["matchmaking_time"] == expected
        # The round holds its group open that long: the averager's learned window (how long a group of ready
        # members takes to assemble) must not close it before the straggler is ready (bench_diloco: four peers
        # formed two pairs in most rounds while their windows asked for up to 8 s).
        assert host.averager.calls[0]["hold_s"] == (expected if expected > 2.0 else 0.0)


def test_a_hold_keeps_the_group_open_past_the_learned_window_up_to_the_cap():
    learner = DeadlineLearner(matchmaking_floor=0.2, matchmaking_cap=2.0, round_floor=0.1, round_cap=30.0)
    for _ in range(10):
        learner.observe_assembly(4, 0.3, full=True)  # groups of ready members assemble fast
    learned = learner.matchmaking_window(4)
    assert learned < 1.0
    window, _ = learner.next_round(4, 1000, 30.0, grace_s=1.0, window_cap=8.0)
    assert window == learned  # nobody on the way: the learned window
    window, _ = learner.next_round(4, 1000, 30.0, grace_s=1.0, window_cap=8.0, hold_s=5.0)
    assert window == 5.0
    window, _ = learner.next_round(4, 1000, 30.0, grace_s=1.0, window_cap=4.0, hold_s=5.0)
    assert window == 4.0  # never past the caller's cap
    timing = RoundTiming(2.0, None, 4)
    assert timing.straggler_hold(0.0) == 0.0 and timing.straggler_hold(2.0) == 0.0  # due within a window
    assert timing.straggler_hold(2.5) == 4.5
    assert timing.straggler_hold(60.0) == STRAGGLER_WAIT_WINDOWS * 2.0
    budget, _ = budgeted(seconds=10.0, matchmaking_time=2.0)
    assert budget.straggler_hold(60.0) == 0.0  # the budget deadline rules there


def test_the_quorum_is_in_when_trainers_holding_that_share_of_the_swarms_rate_are_done():
    me = record(0, samples=20)
    # Three trainers at rate 2 (done: past the epoch; done: all samples in; 5 s to go), this peer at rate 1, 30 s.
    peers = [me, record(1, epoch=4, samples=0, rate=2.0), record(2, samples=200, rate=2.0),
             record(3, samples=190, rate=2.0), record(4, samples=0, role="aux"), record(5, samples=0, leaving=True)]
    eta = quorum_eta_s(peers, 3, 200, me.peer_id, own_eta_s=30.0, own_rate=1.0, quorum=0.5, now=0.0)
    assert eta == 0.0  # 4 of the swarm's 7 samples/s are done
    assert quorum_eta_s(peers, 3, 200, me.peer_id, 30.0, 1.0, quorum=0.75, now=0.0) == 5.0  # 6 of 7 in 5 s
    assert quorum_eta_s(peers, 3, 200, me.peer_id, 30.0, 1.0, quorum=0.75, now=5.0) == 0.0  # its record aged
    assert quorum_eta_s(peers, 3, 200, me.peer_id, 30.0, 1.0, quorum=1.0, now=0.0) == 30.0  # everyone: this one too
    # A trainer behind the epoch, or without a rate, is never done: too few others leave the quorum out of reach.
    behind = [me, record(1, epoch=2, samples=0, rate=2.0), record(2, samples=0, rate=0.0)]
    assert quorum_eta_s(behind, 3, 200, me.peer_id, 30.0, 1.0, quorum=0.5, now=0.0) == float("inf")


def test_a_diloco_peer_with_a_quorum_ends_its_epoch_early_once_the_others_are_done():
    """Three trainers are done with the epoch (their records count all of its samples: they wait for a group): with
    a quorum of 0.75 this peer ends it after its first inner step (not before: its round needs a Δ), and without
    one after its H inner steps. (Trainers past the epoch would have averaged it already: missed_round.py.)"""
    from moshpeer.averaging.report import RoundResult as Result
    from moshpeer.peer.strategies.diloco import DiLoCoStrategy
    from peer_fakes import FakeHost, swarm_view

    from moshpeer.errors import UserError
    for bad in (1.5, -0.1, True):
        with pytest.raises(UserError, match="quorum"):
            DiLoCoStrategy(quorum=bad)
    for quorum, rounds_after_one_step in ((0.0, 0), (0.75, 1)):
        host = FakeHost(DiLoCoStrategy(inner_steps=4, quorum=quorum), matchmaking_time=2.0)
        host.swarm.progress.view = swarm_view(trainers=4, samples=32, peers=tuple(
            record(k, epoch=0, samples=32, rate=8.0, updated_at=time.time()) for k in (1, 2, 3)))  # H x 8 samples
        host.averager.queue(Result(ok=True, group_size=4))
        host.backward(1.0)
        host.epochs.account(8)  # one inner step of four
        assert len(host.averager.calls) == rounds_after_one_step, quorum
        if rounds_after_one_step:
            assert host.averager.calls[0]["weight"] == 8.0  # its Δ counts by the samples it computed
        else:
            for _ in range(3):
                host.backward(1.0)
                host.epochs.account(8)
            assert len(host.averager.calls) == 1  # H inner steps end it as before

