"""`AuxPeer` against a fake host: it follows the trainers' epoch and averages with weight 0."""

from __future__ import annotations

import threading
from typing import Any, List

from moshpeer.averaging.report import RoundResult
from moshpeer.peer.optimizer.aux_peer import AuxPeer
from moshpeer.peer.optimizer.counters import EpochCounters
from moshpeer.peer.strategies.base import RoundPlan
from peer_fakes import FakeFuture, swarm_view


class FakeAuxHost:
    def __init__(self, view, outcome=None):
        self.counters, self.lock = EpochCounters([]), threading.RLock()
        self.view, self.outcome = view, outcome
        self.started: List[tuple] = []
        self.finished: List[dict] = []
        self.reports: List[bool] = []
        self.refreshes = 0
        self.reached = 0  # the epoch the swarm was seen to reach, also after its trainers left

    def snapshot(self):
        return self.view

    def swarm_epoch_reached(self) -> int:
        return self.reached

    def wait_for_refresh(self, timeout: float) -> None:
        self.refreshes += 1

    def report_progress(self, force: bool = False) -> None:
        self.reports.append(force)

    def group_target(self, snapshot) -> int:
        return 3

    def plan_round(self, snapshot) -> RoundPlan:
        return RoundPlan(tensors=(), averages=("gradients",), epoch=0)

    def start_round(self, plan, weight: float, target: int, window: float) -> Any:
        self.started.append((weight, target, window))
        return FakeFuture(self.outcome)

    def await_result(self, future):
        return future.result() if not future.pending else None

    def aux_window(self) -> float:
        return 10.0

    def finish_round(self, plan, result, error, **facts):
        self.finished.append(dict(facts, result=result, error=error))
        self.counters.epoch += 1
        return "record"


def test_an_aux_follows_the_trainers_epoch_and_averages_with_weight_zero():
    host = FakeAuxHost(swarm_view(trainers=2, epoch=5, samples=40), RoundResult(ok=True, group_size=3))
    aux = AuxPeer(host, round_timeout=1.0)
    assert aux.step(batch_size=None) == "record"
    assert host.started == [(0.0, 3, 10.0)]  # no weight, the aux's long follower window
    assert host.reports == [True]  # its new epoch was published at once
    facts = host.finished[0]
    assert (facts["epoch"], facts["samples"], facts["swarm_samples"], facts["num_trainers"]) == (5, 0, 40, 2)
    assert host.counters.epoch == 6


def test_an_aux_whose_round_fails_changes_nothing():
    host = FakeAuxHost(swarm_view(trainers=2), RoundResult(ok=False, error="no group"))
    assert AuxPeer(host, round_timeout=1.0).wait_and_average(timeout=5.0) is None
    assert host.finished == [] and host.counters.epoch == 0 and len(host.started) == 1


def test_an_aux_without_trainers_waits_until_its_timeout_or_a_stop():
    host = FakeAuxHost(swarm_view(trainers=0, aux=1))
    assert AuxPeer(host, round_timeout=1.0).wait_and_average(timeout=0.05) is None
    assert host.started == [] and host.refreshes >= 1
    stopped = FakeAuxHost(swarm_view(trainers=2), RoundResult(ok=True, group_size=3))
    assert AuxPeer(stopped, round_timeout=1.0, should_stop=lambda: True).wait_and_average() is None
    assert stopped.started == []


def test_an_aux_follows_the_epoch_its_trainers_reached_after_they_withdrew():
    """test_training_aux's hang: the trainers ended their last epoch without the aux and withdrew at once; with no
    live trainer to follow, the aux stayed one epoch short of --max-epochs forever."""
    host = FakeAuxHost(swarm_view(trainers=0, epoch=15, samples=0))
    host.counters.epoch, host.reached = 15, 16  # their leaving records said 16
    assert AuxPeer(host, round_timeout=1.0).wait_and_average(timeout=0.05) is None
    assert host.counters.epoch == 16 and host.reports == [True] and host.started == []
