"""`AuxPeer`: what a `CollaborativeOptimizer` with role="aux" does instead of training.

An aux peer never computes: it lends its bandwidth to the trainers' rounds, averaging with weight 0 (it
owns a part of every reduce-scatter and all-gather of its group, adds no samples and no weight). It follows
the trainers' epoch and waits in matchmaking as a follower (`client_mode`), for far longer than the trainers'
matchmaking time (`RoundTiming.aux_window`), so that the trainers' leader finds it there.

Failure: a round that finds no group, fails or is abandoned returns None and changes nothing; the aux
tries again at its next call.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Protocol

from moshpeer.averaging.report import RoundResult
from moshpeer.peer.optimizer.counters import EpochCounters
from moshpeer.peer.optimizer.progress import ProgressSnapshot
from moshpeer.peer.optimizer.rounds import CollaborativeRound
from moshpeer.peer.strategies.base import RoundPlan


class AuxHost(Protocol):
    """What an `AuxPeer` uses of the epoch machinery (in practice an `EpochLoop` and its optimizer's parts)."""

    counters: EpochCounters
    lock: threading.RLock

    def snapshot(self) -> ProgressSnapshot: ...

    def swarm_epoch_reached(self) -> int: ...

    def wait_for_refresh(self, timeout: float) -> None: ...

    def report_progress(self, force: bool = False) -> None: ...

    def group_target(self, snapshot: ProgressSnapshot) -> int: ...

    def plan_round(self, snapshot: ProgressSnapshot) -> RoundPlan: ...

    def start_round(self, plan: RoundPlan, weight: float, target: int, window: float) -> Any: ...

    def await_result(self, future: Any) -> Optional[RoundResult]: ...

    def aux_window(self) -> float: ...

    def finish_round(self, plan: RoundPlan, result: Optional[RoundResult], error: Optional[str],
                     **facts: Any) -> CollaborativeRound: ...


class AuxPeer:
    """An aux peer's rounds; see the module docstring.

    :param host: the epoch machinery (`AuxHost`)
    :param round_timeout: seconds; `wait_and_average` without a timeout gives up after three of them
    :param should_stop: polled between attempts; True ends the wait at once
    """

    def __init__(self, host: AuxHost, *, round_timeout: float, should_stop: Callable[[], bool] = lambda: False):
        self.host, self.round_timeout = host, round_timeout
        self.should_stop = should_stop

    def step(self, batch_size: Optional[int] = None) -> Optional[CollaborativeRound]:
        """What `optimizer.step()` does on an aux peer: `wait_and_average()` (an aux has no batch)."""
        return self.wait_and_average()

    def wait_and_average(self, timeout: Optional[float] = None) -> Optional[CollaborativeRound]:
        """Take part in the swarm's next averaging round with weight 0. Returns the round's record if it
        averaged; None if no group formed, the round failed, or no trainer showed up by `timeout` (default:
        three round timeouts)."""
        host = self.host
        deadline = time.monotonic() + (timeout if timeout is not None else self.round_timeout * 3)
        while time.monotonic() < deadline and not self.should_stop():
            snapshot = host.snapshot()
            # The swarm's epoch, also once its trainers are gone: trainers that end their last epoch without the
            # aux (its round failed) and withdraw at once leave their final epoch in their leaving records.
            followed = max(snapshot.global_epoch if snapshot.num_trainers > 0 else 0, host.swarm_epoch_reached())
            if followed > host.counters.epoch:
                with host.lock:
                    host.counters.epoch = followed
                host.report_progress(force=True)
            if snapshot.num_trainers > 0:
                target, plan = host.group_target(snapshot), host.plan_round(snapshot)
                future = host.start_round(plan, 0.0, target, host.aux_window())
                result = host.await_result(future)
                if result is None or not result.ok:
                    return None
                return host.finish_round(plan, result, None, epoch=host.counters.epoch, samples=0,
                                         group_target=target, swarm_samples=snapshot.samples_accumulated,
                                         swarm_samples_capped=snapshot.samples_capped,
                                         num_trainers=snapshot.num_trainers)
            host.wait_for_refresh(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        return None
