"""A round the group averaged without this peer: `MissedRound` tells whether that happened and fetches its update.

A peer whose round failed (no group, or too late for it) while the others averaged that epoch would otherwise step
alone and drift from them. A strategy that `rejoins_by_update` (DiLoCo, gradients) takes their update instead,
fetched from one of them (one round's bytes); the epoch loop applies it (`MISSED_ROUND_UPDATE`) and carries or drops
the peer's own work of that epoch. A peer that ends its epoch when every other trainer's record is past it already
(`nobody_left_in`: it stalled through their round) takes their update at once (`round_over`) instead of searching
two windows for a group that cannot form, and meeting their next round at the end of that search.

A peer can also miss its mates' round and meet their next one in matchmaking (rounds are not keyed by epoch; with
epochs shorter than a matchmaking window that is common): its round then succeeds, as the group's round of the next
epoch (epoch_agreement.py). It takes the group's count, and (`step_before`) the step of its own epoch that the
others took before it, so that it applies the same steps in the same order and stays on their parameters. Where
that is not enough (`steps_apart`: a round two or more epochs on, or no member served the step), it takes the
group's state instead.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable, Optional

from moshpeer.averaging.report import RoundResult
from moshpeer.dht.records import PeerRecord
from moshpeer.peer.optimizer.epoch_agreement import agreed_epoch
from moshpeer.peer.optimizer.round_timing import other_trainers
from moshpeer.peer.strategies.base import RoundPlan

if TYPE_CHECKING:
    from moshpeer.peer.optimizer.epoch_loop import EpochHost

logger = logging.getLogger(__name__)

# The error of a round this peer missed and made up for with the others' update (`MissedRound.fetch_update`).
MISSED_ROUND_UPDATE = "missed round; took the group's update"
# The error of a round that was over before this peer ended its epoch (`MissedRound.round_over`), where no update came.
ROUND_OVER = "the others averaged this epoch already"


def nobody_left_in(peers: Iterable[PeerRecord], epoch: int, own_peer_id: str) -> bool:
    """Whether every other live trainer's record shows an epoch past `epoch`, and there is one: nobody is left to
    average `epoch` with. A trainer still at `epoch` (computing, or waiting in matchmaking) keeps it False, so one
    record claiming a far epoch moves nothing while an honest mate is still there."""
    others = [r.epoch for r in other_trainers(peers, own_peer_id)]
    return bool(others) and min(others) > epoch


class MissedRound:
    """Reads the swarm and the strategy of `host` (the trainer's `EpochHost`); holds no state of its own."""

    def __init__(self, host: "EpochHost"):
        self.host = host

    def missed(self, result: Optional[RoundResult], plan: RoundPlan) -> bool:
        """Whether this peer's round of `plan` failed while the others averaged it, for a strategy that then
        follows them. One whose state must follow theirs after this round (`needs_state_after_missing`) watches the
        swarm for a grace period (their round may be finishing when ours gives up, and the records show it a heartbeat
        later); one that only prefers their update to a lone step looks once (no wait)."""
        host, strategy = self.host, self.host.strategy
        must_follow = strategy.needs_state_after_missing(plan)
        if (result is not None and result.ok) or not (must_follow or strategy.rejoins_by_update):
            return False
        grace = host.timing.missed_round_grace() if must_follow else 0.0
        return host.swarm.moved_past(plan.epoch, grace, host.should_stop)

    def fetch_update(self, plan: RoundPlan) -> Optional[Any]:
        """The update the others applied in `plan`'s round, fetched from one of them and fitted to this peer
        (`AveragingStrategy.fit_update`); None (logged) when the strategy does not rejoin that way, or not after
        this round (a gradients round that adopted the parameters: their state instead), or no peer delivered one
        that fits."""
        strategy = self.host.strategy
        if not strategy.update_restores(plan):
            return None
        for update in self.host.fetch_updates(plan.epoch):
            try:
                with self.host.lock:
                    return strategy.fit_update(plan, update)
            except ValueError as e:
                logger.warning(f"an update of the round of epoch {plan.epoch} does not fit: {e}")
        return None

    def round_over(self, epoch: int, peers: Iterable[PeerRecord]) -> bool:
        """Whether this peer's round of `epoch` is over before it starts: nobody is left in that epoch
        (`nobody_left_in`, by the records `peers`), and its strategy takes the others' update after a missed round
        (and does not overlap rounds). The epoch loop then skips the search and treats the round as missed
        (`ROUND_OVER`)."""
        strategy = self.host.strategy
        if strategy.overlaps or not strategy.rejoins_by_update:
            return False
        if not nobody_left_in(peers, epoch, self.host.swarm.peer_id):
            return False
        logger.info(f"every other trainer is past epoch {epoch}: taking their round's update without a search")
        return True

    def step_before(self, plan: RoundPlan, result: Optional[RoundResult]) -> Optional[Any]:
        """When `result` is a round of the epoch after `plan`'s (this peer met its mates' next round), the update of
        `plan`'s round, which they applied before that one, fetched and fitted (`fetch_update`); None otherwise, or
        (logged) when no member served one that fits: this peer then stays a step apart from them until the next
        parameters round. Not for a strategy that catches up after a missed round (DiLoCo carries its own Δ into
        the next round and never drops it; its count is taken all the same)."""
        strategy = self.host.strategy
        if result is None or not result.ok or strategy.catches_up_after_missed_round:
            return None
        if agreed_epoch(plan.epoch, result.member_epochs) != plan.epoch + 1:
            return None
        update = self.fetch_update(plan)
        if update is None:
            logger.warning(f"this peer's round of epoch {plan.epoch} was its group's of epoch {plan.epoch + 1}, and no "
                           f"member served the step of epoch {plan.epoch}: one step apart from them")
        return update

    def steps_apart(self, plan: RoundPlan, joined: Optional[int], took_step: bool) -> int:
        """How many of the group's steps this peer's parameters lack after its round of `plan`, which was the group's
        round of `joined` (None: of its own epoch), having taken (`took_step`) or not the step before it. 0 for a
        strategy whose every round averages the parameters or that follows the swarm's state on its own (DiLoCo)."""
        strategy = self.host.strategy
        if joined is None or not strategy.rejoins_by_update or strategy.catches_up_after_missed_round:
            return 0
        return joined - plan.epoch - int(took_step)
