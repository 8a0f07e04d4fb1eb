"""`DiLoCoStrategy`: rare, compressed outer steps (averaging="diloco"; the math is in diloco_outer.py).

Every `step()` is an inner optimizer step (AdamW in the paper). After `inner_steps` (H) of them the
epoch is over: the round averages the pseudo-gradient Δ = θ_outer − θ_local with a Moshpit group (any
codec: int8 and int4 suit Δ, and `arc-topk` with EF21M error feedback, which suits a slowly changing
signal), and the outer optimizer (default SGD with Nesterov momentum, lr 0.7, momentum 0.9) applies the
group's Δ̄ to θ_outer. Successive rounds meet different groups (the averager rotates the group key, as
in Moshpit SGD), so with more peers than one group the outer steps mix the whole swarm over rounds.

Loss tolerance is the averager's: a chunk of Δ whose contributions partly arrived is the unbiased
reconstruction, a chunk of Δ̄ this peer never received is its own Δ there. The outer step is linear in
Δ̄, so it stays unbiased. No group while others averaged (this peer was late): it downloads their
state, θ_outer included, instead (a lone outer step would leave its θ_outer apart from the swarm's for
good). No group at all (alone, or nobody else finished the round): the outer step on its own Δ.

overlap=True (one-outer-step delay): the round of Δ_t runs in the background while the peer computes
the next H inner steps; the outer step on Δ̄_t is taken at the next epoch end, keeping the local
progress made meanwhile (OuterState.apply_delayed). The optimizer runs such a strategy's rounds with
`MoshpitAverager.step(wait=False)` and resolves them one epoch later.

Buffer: [Δ...] (one value per parameter). State (checkpoints, downloads): θ_outer, the outer optimizer's
state (momentum), the outer step count, the inner steps taken in the current epoch and the pending θ_sent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from moshpeer.errors import UserError
from moshpeer.peer.strategies.averaged_buffers import flat_buffer_views
from moshpeer.peer.strategies.diloco_outer import (OuterOptimizer, OuterOptimizerFactory, OuterState,
                                                   describe_outer_optimizer)
from moshpeer.peer.strategies.base import AveragingStrategy, RoundPlan, StrategyHost

if TYPE_CHECKING:  # the swarm view a strategy is handed; strategies do not depend on the optimizer
    from moshpeer.peer.optimizer.progress import ProgressSnapshot

DEFAULT_INNER_STEPS = 50


class DiLoCoStrategy(AveragingStrategy):
    """H inner steps, then an outer step on the group's average pseudo-gradient.

    :param inner_steps: H, inner optimizer steps per outer step (per collaborative epoch)
    :param outer_optimizer: factory `(list of tensors) -> torch.optim.Optimizer` over θ_outer; default
        `OuterOptimizer()` (SGD, Nesterov, lr 0.7, momentum 0.9)
    :param overlap: average Δ_t while computing the next H inner steps (one-outer-step delay)
    """

    name = "diloco"
    steps_locally = True
    catches_up_after_missed_round = True  # nothing else would bring a lone outer step back to the swarm's θ_outer

    def __init__(self, inner_steps: int = DEFAULT_INNER_STEPS, outer_optimizer: Optional[OuterOptimizerFactory] = None,
                 overlap: bool = False):
        if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
            raise UserError(f"inner_steps must be a positive integer, got {inner_steps!r}")
        self.inner_steps = inner_steps
        self.outer_optimizer = outer_optimizer if outer_optimizer is not None else OuterOptimizer()
        if not callable(self.outer_optimizer):
            raise UserError("outer_optimizer must be a factory: (list of tensors) -> torch.optim.Optimizer")
        self.overlap = self.overlaps = bool(overlap)
        self.steps_this_epoch = 0

    def bind(self, host: StrategyHost) -> None:
        super().bind(host)
        self.buffer, self.delta = flat_buffer_views(host.params, 1)
        self.outer = OuterState(host.params, self.outer_optimizer)

    def on_micro_batch(self, batch_size: int) -> None:
        self.steps_this_epoch += 1

    def epoch_is_over(self) -> bool:
        """H inner steps since the last outer step."""
        return self.steps_this_epoch >= self.inner_steps

    def plan_round(self, epoch: int, swarm: ProgressSnapshot) -> RoundPlan:
        self.steps_this_epoch = 0
        if self.overlap:
            self.outer.send(self.host.params, self.delta)
        else:
            self.outer.pseudo_gradient(self.host.params, self.delta)
        return RoundPlan(tensors=(self.buffer,), averages=("pseudo_gradient",))

    @torch.no_grad()
    def apply_averaged(self, plan: RoundPlan) -> Optional[float]:
        if self.overlap:
            self.outer.apply_delayed(self.delta, self.host.params)
        else:
            self.outer.apply(self.delta, self.host.params)
        return None  # every member restarts from its θ_outer: there is no parameter spread to report

    @torch.no_grad()
    def apply_alone(self, plan: Optional[RoundPlan]) -> None:
        # Recomputed rather than read from the buffer: an abandoned round may still be writing to it.
        if self.overlap:
            if self.outer.pending:
                self.outer.apply_delayed(self.outer.pending_delta(), self.host.params)
        else:
            self.outer.apply(self._own_delta(), self.host.params)

    def _own_delta(self) -> List[torch.Tensor]:
        own = [torch.empty_like(d) for d in self.delta]
        self.outer.pseudo_gradient(self.host.params, own)
        return own

    def settings(self) -> Dict[str, Any]:
        """What the join event line and every round result show of this strategy."""
        return {"inner_steps": self.inner_steps, "outer_optimizer": describe_outer_optimizer(self.outer_optimizer),
                "overlap": self.overlap, "delta_codec": self.host.compression}

    def state_dict(self) -> Dict[str, Any]:
        return {"outer": self.outer.state_dict(), "steps_this_epoch": self.steps_this_epoch}

    def check_state_dict(self, state: Dict[str, Any]) -> None:
        steps = state.get("steps_this_epoch") if isinstance(state, dict) else None
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= self.inner_steps:
            raise ValueError("DiLoCo state: bad inner step count (another inner_steps setting?)")
        self.outer.check_state(state.get("outer"))

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.check_state_dict(state)
        self.outer.load_state_dict(state["outer"])
        self.steps_this_epoch = state["steps_this_epoch"]

