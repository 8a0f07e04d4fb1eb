"""When a collaborative epoch ends, how long its round waits for a group, and waiting for the round: `RoundTiming`.

The DropCompute budget (dropcompute.py) bounds an epoch's compute; with a budget, the swarm waits for
nobody past the budget deadline of the epoch (a straggler still inside a micro-batch is left out), but
at least the time a complete group needs to assemble. Without a budget a round waits `matchmaking_time`.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any, Callable, List, Optional

from moshpeer.averaging.report import RoundResult
from moshpeer.peer.dropcompute import BudgetedStep, BudgetSetting, ComputeBudget

# With a compute budget, how long a peer waits for its group at least (finding each other over the DHT
# takes a few round trips), even when the budget deadline is closer than this. Under load the round
# trips take longer: the floor is then ASSEMBLY_MARGIN x the fastest recent assembly of a full group.
MIN_BUDGET_WINDOW_S = 0.2
ASSEMBLY_MARGIN = 3.0
ASSEMBLY_HISTORY = 8
STOP_POLL_S = 0.1  # how often a round in flight checks `should_stop`

logger = logging.getLogger(__name__)


class RoundTiming:
    """The compute budget of the current epoch and the matchmaking window of its round.

    :param budget: DropCompute threshold per epoch: None, seconds, or "auto" ("auto" simulates a
        synchronous group of `group_size` workers from this peer's own times)
    """

    def __init__(self, matchmaking_time: float, budget: BudgetSetting, group_size: int):
        self.matchmaking_time = matchmaking_time
        self.budget = ComputeBudget(budget, num_workers=group_size) if budget is not None else None
        self.step: Optional[BudgetedStep] = None
        self.assembly_s: List[float] = []  # matchmaking times of recent rounds whose group was complete
        self.begin_epoch()

    def begin_epoch(self) -> None:
        """The DropCompute clock of an epoch starts when the previous epoch ended."""
        self.step = self.budget.begin_step(None) if self.budget is not None else None

    def record(self, batch_size: int) -> None:
        if self.step is not None:
            self.step.record(batch_size)

    def budget_spent(self) -> bool:
        return self.step is not None and not self.step.should_continue()

    def finish(self) -> bool:
        """End the epoch's compute; True if the budget stopped it."""
        return self.step.finish().stopped_by_budget if self.step is not None else False

    def window(self) -> float:
        """How long this round waits for its group to fill (see the module docstring)."""
        step = self.step
        if step is None or step.tau_s is None:
            return self.matchmaking_time
        return min(self.matchmaking_time, max(step.tau_s - step.elapsed_s, self.floor()))

    def floor(self) -> float:
        """The shortest matchmaking window worth trying: how long a complete group took to assemble
        recently (its fastest case, i.e. no member was late), with a margin; at least MIN_BUDGET_WINDOW_S."""
        fastest = min(self.assembly_s, default=0.0)
        return min(self.matchmaking_time, max(MIN_BUDGET_WINDOW_S, ASSEMBLY_MARGIN * fastest))

    def note_assembly(self, result: Optional[RoundResult], target: int) -> None:
        if result is not None and result.ok and result.group_size >= target:
            self.assembly_s = (self.assembly_s + [result.matchmaking_s])[-ASSEMBLY_HISTORY:]

    def await_result(self, future: Any, target: int, should_stop: Callable[[], bool]) -> Optional[RoundResult]:
        """A started round's `RoundResult` (from its `RoundFuture`); None if it failed, or if it is abandoned
        because `should_stop()` or its own deadline passed."""
        while True:
            try:
                result = future.result(timeout=STOP_POLL_S)
                self.note_assembly(result, target)
                return result
            except concurrent.futures.TimeoutError:
                if should_stop() or future.deadline.remaining() == 0.0:
                    future.cancel()
                    return None
            except Exception as e:
                logger.warning(f"averaging round failed: {type(e).__name__}: {e}")
                return None

    def every_window_closed(self) -> bool:
        """With a budget: has every window of this epoch closed (the peer is too late for its round)?"""
        step = self.step
        return step is not None and step.tau_s is not None and step.elapsed_s >= step.tau_s + self.floor()
