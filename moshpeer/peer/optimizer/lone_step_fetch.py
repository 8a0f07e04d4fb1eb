"""`LoneStepFetch`: the group's update of a round whose contribution came pending with an adopted state.

With overlap (DiLoCo's one-outer-step delay) a peer always has a round in flight, so the state a donor serves, or a
checkpoint holds, carries a Δ that a round of the donor's (or of the process before a restart) is averaging. No
round of this process will resolve it: at its first epoch end the peer takes that outer step on the Δ alone (its
plan needs the slot), while the donor's group takes it on the group's Δ̄. Their θ_outer would part by the
difference, for good where θ_outer is never averaged (a lossy codec and a swarm that one group holds: measured, a
late joiner's θ_outer ended 12% apart).

When to ask for that Δ̄: the group's members apply it at their epoch end, start their next round, and keep it until
their epoch end after that (round_update.py: the latest round of each fragment), and this peer ends its epochs at
about the same moments, so asked at either it may not be there, or no longer. Once this peer's own round of the next
epoch is over, though, its mates (the donors among them) started theirs after applying the update: so a thread
(`start`, right after that round is launched) waits for that round, then asks, and again every `retry_s` until an
update fits. At the next epoch end, after that round and before its outcome is applied, the lone step is taken again
on the update (`settle`; `AveragingStrategy.retake_lone_step`); if the first asking after the round is still under
way then, settle waits for it (at most FIRST_ASK_WAIT_S). No update: the lone step stands, with a warning. An update
is fitted and the step retaken under the optimizer's lock, so the two never interleave. One exception: a group still
matching for the pending Δ's round when this peer came with its next one averages the two (rounds are not keyed by
epoch), and its average is then the very Δ̄ sought, which that round applies: the lone step is undone instead.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

from moshpeer.averaging.report import RoundResult
from moshpeer.peer.optimizer.epoch_agreement import group_epoch
from moshpeer.peer.strategies.base import RoundPlan

if TYPE_CHECKING:
    from moshpeer.peer.optimizer.epoch_loop import EpochHost

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # between two askings of the donors (each one a listing of their offers in the DHT)
# The longest an epoch end waits for the first asking after its round (a DHT listing, then one round's bytes from a
# donor): it is under way when that round ended just before the epoch end.
FIRST_ASK_WAIT_S = 10.0


class LoneStepFetch:
    """Fetches and applies the group's update of the strategy's `lone_step()` (see the module docstring)."""

    def __init__(self, host: "EpochHost", retry_s: float = RETRY_S,
                 start: Optional[Callable[[Callable[[], None]], None]] = None):
        self.host, self.retry_s = host, retry_s
        # How the search runs (tests: inline, where the round is over and an update is on offer at once).
        self._start = start or (lambda work: threading.Thread(target=work, name="moshpeer-lone-step",
                                                              daemon=True).start())
        # While one is looked for: (its round, stop, the first asking after the round is done, what was fitted).
        self._looking: Optional[Tuple[RoundPlan, threading.Event, threading.Event, List[Any]]] = None

    def start(self, next_round: Optional[Any]) -> None:
        """Right after an epoch end launched `next_round` (a `RoundFuture`; None: no round), if its plan took a step
        alone on a pending Δ: look for the group's update of that Δ's round in the background, until `settle`."""
        plan = self.host.strategy.lone_step()
        if plan is None or self._looking is not None:
            return
        stop, asked, fitted = threading.Event(), threading.Event(), []
        self._looking = (plan, stop, asked, fitted)
        self._start(lambda: self._look(plan, next_round, stop, asked, fitted))

    def _look(self, plan: RoundPlan, next_round: Optional[Any], stop: threading.Event, asked: threading.Event,
              fitted: List[Any]) -> None:
        try:
            while next_round is not None and not stop.is_set():
                try:
                    next_round.result(timeout=self.retry_s)
                    break
                except concurrent.futures.TimeoutError:
                    continue
                except Exception:  # failed or cancelled: over all the same
                    break
            while not stop.is_set():
                for update in self.host.fetch_updates(plan.epoch):
                    with self.host.lock:
                        if stop.is_set():
                            return
                        try:
                            fitted.append(self.host.strategy.fit_update(plan, update))
                            return
                        except ValueError as e:
                            logger.warning(f"an update of the round of epoch {plan.epoch} does not fit: {e}")
                asked.set()
                stop.wait(self.retry_s)
        except Exception as e:  # a search that broke must not take the peer down: the lone step stands
            logger.warning(f"looking for the update of the round of epoch {plan.epoch} failed: {e!r}")
        finally:
            asked.set()

    def settle(self, next_round: Optional[RoundResult] = None) -> Optional[bool]:
        """After the round launched with `start` is over (`next_round`: its result), before that result is applied:
        take the lone step again on the group's update if one came (the search stops either way). -> whether it was
        retaken (or undone); None when nothing was looked for.

        When that round was its group's round of the lone step's epoch (the group, still matching when this peer
        came with its next epoch's Δ, declared that epoch: epoch_agreement.group_epoch), its average is the group's
        Δ̄ of that round and the round applies it: the lone step is undone instead, or this peer would take the
        group's step twice."""
        if self._looking is None:
            return None
        (plan, stop, asked, fitted), self._looking = self._looking, None
        met = next_round is not None and next_round.ok and group_epoch(next_round.member_epochs) == plan.epoch
        if not fitted and not met:
            asked.wait(FIRST_ASK_WAIT_S)
        with self.host.lock:
            stop.set()
            retaken = self.host.strategy.retake_lone_step(plan, fitted[0] if fitted else None, undo=met)
        if retaken and met:
            logger.info(f"this peer's first round met its group's round of epoch {plan.epoch}: that round's average "
                        "takes the step on the Δ that came pending with this peer's state")
        elif retaken:
            logger.info(f"took the group's update of the round of epoch {plan.epoch} instead of the step on the Δ "
                        "that came pending with this peer's state: its θ_outer is the group's")
        else:
            logger.warning(f"no peer served the group's update of the round of epoch {plan.epoch} within an epoch: "
                           "the step on the Δ that came pending with this peer's state stands, and its θ_outer "
                           "stays apart from the group's until a round that averages θ_outer")
        return retaken
