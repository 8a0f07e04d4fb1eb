"""In-process fakes for unit tests of the peer layer: no DHT, no sockets, no threads, no sleeps.

`FakeHost` is what a `CollaborativeOptimizer` is to its parts (`StrategyHost`, `EpochHost`, `StateHost`): it
holds a tiny model, an SGD optimizer, the shared `EpochCounters`, a real `RoundTiming` on a fake clock, and
fakes of the averager (`FakeAverager`: every round resolves at once to the `RoundResult` a test queued) and
of the swarm (`FakeSwarm`: a `ProgressSnapshot` the test sets).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Optional

import torch

from moshpeer.averaging.loss_budget import parse_loss_budget
from moshpeer.averaging.report import RoundResult
from moshpeer.dht.records import PeerRecord
from moshpeer.errors import SwarmLost
from moshpeer.peer.optimizer.counters import EpochCounters
from moshpeer.peer.optimizer.epoch_loop import EpochLoop
from moshpeer.peer.optimizer.progress import ProgressSnapshot
from moshpeer.peer.optimizer.round_timing import RoundTiming
from moshpeer.peer.strategies.base import AveragingStrategy


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def swarm_view(trainers: int = 2, aux: int = 0, epoch: int = 0, samples: int = 0, target: int = 64,
               others_epoch: Optional[int] = None, peers: tuple = ()) -> ProgressSnapshot:
    return ProgressSnapshot(global_epoch=epoch, samples_accumulated=samples, target_batch_size=target,
                            num_trainers=trainers, num_aux=aux, samples_per_second=0.0, fetched_at=0.0,
                            others_epoch=others_epoch, peers=peers)


def peer_record(k: int, epoch: int = 3, samples: int = 100, rate: float = 50.0, updated_at: float = 0.0,
                **fields: Any) -> PeerRecord:
    """Peer k's record in the run (k < 8): a trainer unless `role` says otherwise."""
    return PeerRecord(peer_id="Qm" + "abcdefgh"[k] * 44, role=fields.pop("role", "trainer"), epoch=epoch,
                      samples_accumulated=samples, samples_per_second=rate, version="test", protocol=2,
                      started_at=0.0, updated_at=updated_at, **fields)


class _Deadline:
    def __init__(self, remaining: float):
        self._remaining = remaining

    def remaining(self) -> float:
        return self._remaining


class FakeFuture:
    """A `RoundFuture` that is done from the start (`result`), raises (`error`), or never finishes (`pending`:
    its deadline has passed, so a waiter abandons it at once)."""

    def __init__(self, result: Optional[RoundResult] = None, error: Optional[BaseException] = None):
        self._result, self._error = result, error
        self.pending = result is None and error is None
        self.deadline = _Deadline(0.0 if self.pending else 1.0)
        self.cancelled = False

    def result(self, timeout: Optional[float] = None) -> RoundResult:
        if self._error is not None:
            raise self._error
        if self.pending:
            import concurrent.futures

            raise concurrent.futures.TimeoutError()
        return self._result

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeAverager:
    """Rounds resolve to the queued outcomes, in order (default: a pending round that is abandoned).
    `average(tensors)` may rewrite the round's tensors in place, as the group's average would."""

    def __init__(self) -> None:
        self.min_group_size = 2
        self.loss_budget = parse_loss_budget(None)
        self.upload_bandwidth: Optional[float] = None
        self.flagged_peers: Dict[str, int] = {}
        self.error_feedback: Any = None  # the loop commits it when it takes a round
        self.outcomes: List[FakeFuture] = []
        self.calls: List[Dict[str, Any]] = []
        self.average = None  # optional callable(tensors) run when a round "completes"

    def queue(self, result: Optional[RoundResult] = None, error: Optional[BaseException] = None) -> None:
        self.outcomes.append(FakeFuture(result, error))

    def step(self, **kwargs: Any) -> FakeFuture:
        self.calls.append(kwargs)
        future = self.outcomes.pop(0) if self.outcomes else FakeFuture()
        if self.average is not None and future._result is not None and future._result.ok:
            self.average(kwargs["tensors"])
        return future

    def get_tensors(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class FakeProgress:
    def __init__(self) -> None:
        self.view = swarm_view()
        self.reports: List[Dict[str, Any]] = []
        self.rounds_noted: List[Any] = []  # (epoch, contributors) of each round that averaged
        self.view_after_pause: Optional[ProgressSnapshot] = None  # what `current` reads (then `view`)
        self.current_calls = 0

    def snapshot(self) -> ProgressSnapshot:
        return self.view

    @property
    def swarm_epoch_reached(self) -> int:
        return self.view.global_epoch

    def current(self, timeout: float = 5.0) -> ProgressSnapshot:
        self.current_calls += 1
        if self.view_after_pause is not None:  # this process was paused: the read brings the swarm's new view
            self.view, self.view_after_pause = self.view_after_pause, None
        return self.view

    def refresh_now(self, timeout: float = 2.0, **kwargs: Any) -> ProgressSnapshot:
        return self.view

    def wait_for_refresh(self, timeout: float) -> bool:
        return True

    def report(self, **fields: Any) -> None:
        self.reports.append(fields)

    def corroborated_peers(self) -> None:
        return None  # witnessed nobody: every donor may be asked

    def note_round(self, epoch: int, contributors: Any) -> None:
        self.rounds_noted.append((epoch, list(contributors)))


class FakeSwarm:
    """A `SwarmLink` without a DHT: `moved_on` says whether the others finished the epoch this peer missed, or
    `moved_on_within` how long after the question the records show it (a watch that long or longer sees it)."""

    def __init__(self) -> None:
        self.progress = FakeProgress()
        self.moved_on = False
        self.moved_on_within: Optional[float] = None
        self.flagged: List[Dict[str, int]] = []
        self.peer_id = "self"
        self.is_cut_off = False  # the DHT has no neighbour (an outage)
        self.published: List[Dict[str, Any]] = []  # record fields published through `publish`
        self.dht_gone = False  # the DHT process died

    def cut_off(self) -> bool:
        return self.is_cut_off

    def check_alive(self) -> None:
        if self.dht_gone:
            raise SwarmLost("the DHT process is gone")

    def publish(self, **fields: Any) -> None:
        self.published.append(fields)

    def publish_flagged(self, flagged: Dict[str, int]) -> None:
        self.flagged.append(dict(flagged))

    def moved_past(self, epoch: int, within: float, should_stop: Any) -> bool:
        return self.moved_on or (self.moved_on_within is not None and within >= self.moved_on_within)

    def wait_for_trainers(self, min_trainers: int, timeout: float, should_stop: Any) -> int:
        return self.progress.view.num_trainers


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


class FakeHost:
    """What a `CollaborativeOptimizer` is to its parts, in process (see the module docstring)."""

    def __init__(self, strategy: AveragingStrategy, *, model: Optional[torch.nn.Module] = None, lr: float = 0.1,
                 compression: str = "none", group_size: int = 4, budget: Any = None, matchmaking_time: float = 1.0,
                 error_feedback: Any = None, target_batch_size: int = 64, max_epoch_lag: int = 1):
        self.model = model if model is not None else tiny_model()
        self.params = list(self.model.parameters())
        self.inner = torch.optim.SGD(self.params, lr=lr)
        self.compression, self.group_size, self.error_feedback = compression, group_size, error_feedback
        self.lock = threading.RLock()
        self.counters = EpochCounters([torch.zeros_like(p) for p in self.params])
        self.clock = FakeClock()
        self.timing = RoundTiming(matchmaking_time, budget, group_size, clock=self.clock)
        self.averager, self.swarm = FakeAverager(), FakeSwarm()
        self.strategy = strategy
        self.stop = False
        self.donor_state: Optional[Any] = None  # what catch_up adopts (None: no donor delivers)
        self.downloads: List[int] = []
        self.updates: List[Any] = []  # what fetch_updates yields: other peers' kept updates (kept_update)
        self.update_requests: List[int] = []
        self.advertised: List[bool] = []
        strategy.bind(self)
        self.epochs = EpochLoop(self, target_batch_size=target_batch_size, group_size=group_size,
                                max_epoch_lag=max_epoch_lag, loss_budget=self.averager.loss_budget)

    # StrategyHost
    @property
    def grad_sums(self) -> List[torch.Tensor]:
        return self.counters.grad_sums

    @property
    def samples_accumulated(self) -> int:
        return self.counters.samples

    def inner_step(self) -> None:
        self.inner.step()
        self.counters.steps += 1

    # EpochHost
    def should_stop(self) -> bool:
        return self.stop

    def catch_up(self, min_epoch: int, max_epoch: Optional[int] = None,
                 offer_wait_s: Optional[float] = None) -> Optional[Any]:
        self.downloads.append(min_epoch if max_epoch is None else (min_epoch, max_epoch))
        if self.donor_state is None:
            return None
        self.counters.epoch = max(min_epoch, self.counters.epoch)
        self.restart_epoch()
        return self.donor_state

    def fetch_updates(self, epoch: int) -> Iterator[Any]:
        self.update_requests.append(epoch)
        return iter(self.updates)

    def advertise(self, force: bool = False) -> None:
        self.advertised.append(force)

    # StateHost
    def restart_epoch(self) -> None:
        self.epochs.restart_epoch()

    def averaging_paused(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    # helpers for tests
    def backward(self, value: float = 1.0) -> None:
        """Set every parameter's `.grad` to `value`."""
        for p in self.params:
            p.grad = torch.full_like(p, value)
