"""`LoneStepFetch`: the group's update of a round whose contribution came pending with an adopted state.

With overlap (DiLoCo's one-outer-step delay) a peer always has a round in flight, so the state a donor serves, or a
checkpoint holds, carries a Δ that a round of the donor's (or of the process before a restart) is averaging. No
round of this process will resolve it: at its first epoch end the peer takes that outer step on the Δ alone (its
plan needs the slot), while the donor's group takes it on the group's Δ̄. Their θ_outer would part by the
difference, for good where θ_outer is never averaged (a lossy codec and a swarm that one group holds).

The group's members keep that Δ̄ from their epoch end after the round (when they apply it) until the next one (when
the fragment's next round replaces it: round_update.py), and this peer ends its own epochs at about the same
moments: asked at either, they may not have it, or no longer. So it is asked for in the background over the epoch
in between (`start`, after the plan that took the lone step), at growing intervals until it comes, and at the next
epoch end, before that epoch's round is resolved, the step is taken again on it (`settle`;
`AveragingStrategy.retake_lone_step`). None by then: the lone step stands, with a warning. The fit is checked and
the step retaken under the optimizer's lock, so the two never interleave.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

from moshpeer.peer.strategies.base import RoundPlan

if TYPE_CHECKING:
    from moshpeer.peer.optimizer.epoch_loop import EpochHost

logger = logging.getLogger(__name__)

# Between two askings of the donors (each one a listing of their offers in the DHT): RETRY_S at first, when they are
# about to apply the update, then twice as long each time, up to MAX_RETRY_S over a long epoch.
RETRY_S, MAX_RETRY_S = 1.0, 30.0


class LoneStepFetch:
    """Fetches and applies the group's update of the strategy's `lone_step()` (see the module docstring)."""

    def __init__(self, host: "EpochHost", retry_s: float = RETRY_S,
                 start: Optional[Callable[[Callable[[], None]], None]] = None):
        self.host, self.retry_s = host, retry_s
        # How the search runs (tests: inline, where an update is on offer at once).
        self._start = start or (lambda work: threading.Thread(target=work, name="moshpeer-lone-step",
                                                              daemon=True).start())
        # (the round, its fetching thread's stop event, what it fitted) while one is looked for.
        self._looking: Optional[Tuple[RoundPlan, threading.Event, List[Any]]] = None

    def start(self) -> None:
        """After an epoch's plan: if the strategy stepped alone on a pending Δ, look for the group's update of its
        round in the background (one thread, until `settle`)."""
        plan = self.host.strategy.lone_step()
        if plan is None or self._looking is not None:
            return
        stop, fitted = threading.Event(), []
        self._looking = (plan, stop, fitted)
        self._start(lambda: self._fetch(plan, stop, fitted))

    def _fetch(self, plan: RoundPlan, stop: threading.Event, fitted: List[Any]) -> None:
        wait = self.retry_s
        try:
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
                stop.wait(wait)
                wait = min(2 * wait, MAX_RETRY_S)
        except Exception as e:  # a fetch that broke must not take the peer down: the lone step stands
            logger.warning(f"looking for the update of the round of epoch {plan.epoch} failed: {e!r}")

    def settle(self) -> Optional[bool]:
        """Before the next round is resolved: take the lone step again on the group's update if it came (the
        thread stops either way). -> whether it was retaken; None when nothing was looked for."""
        if self._looking is None:
            return None
        (plan, stop, fitted), self._looking = self._looking, None
        with self.host.lock:
            stop.set()
            retaken = self.host.strategy.retake_lone_step(plan, fitted[0] if fitted else None)
        if retaken:
            logger.info(f"took the group's update of the round of epoch {plan.epoch} instead of the step on the Δ "
                        "that came pending with this peer's state: its θ_outer is the group's")
        else:
            logger.warning(f"no peer served the group's update of the round of epoch {plan.epoch} within an epoch: "
                           "the step on the Δ that came pending with this peer's state stands, and its θ_outer "
                           "stays apart from the group's until a round that averages θ_outer")
        return retaken
