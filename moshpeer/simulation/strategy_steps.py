"""`StrategySteps`: how each simulated peer applies a round's outcome, as its production strategy does: the group's
average (or its own contribution, alone), or, for a peer that came late to its group, the group's update.

The batched counterparts of `GradientsStrategy`, `ParametersStrategy` and `DiLoCoStrategy`'s apply methods over the
simulator's (peers x values) models; whether a late peer takes the update at all is the production strategy's own
flag (`rejoins_by_update`), not a test of the mode here.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from moshpeer.peer.strategies import strategy_class
from moshpeer.peer.strategies.diloco_outer import OuterState
from moshpeer.simulation.training_config import TrainingConfig


class StrategySteps:
    """Applies rounds to `x` (one row per peer, updated in place) and, in DiLoCo, to `outer` (θ_outer and its
    optimizer, one row per peer); `carried_grad` holds the gradient a late gradients-mode peer carries into its next
    contribution (weighed there by the samples the simulator carries)."""

    def __init__(self, config: TrainingConfig, dim: int, x: torch.Tensor, outer: Optional[OuterState]):
        self.mode, self.lr, self.dim, self.x, self.outer = config.mode, config.workload.lr, dim, x, outer
        self.carried_grad = torch.zeros_like(x)
        self.rejoins_by_update: bool = strategy_class(config.mode).rejoins_by_update

    def apply(self, peers: np.ndarray, done: np.ndarray, averaged: torch.Tensor) -> None:
        """Each peer that finished the round (in a group or alone) applies what it got, as its strategy does."""
        ok = peers[done]
        if ok.size == 0:
            return
        rows, dim = torch.from_numpy(ok), self.dim
        got = averaged[torch.from_numpy(np.flatnonzero(done))]
        if self.mode == "diloco":
            delta = torch.zeros_like(self.x)
            delta[rows] = got[:, :dim]
            if got.shape[1] > dim:  # outer_params_every: adopt the group's θ_outer, then step from it
                self.outer.anchor[0][rows] = got[:, dim:]
            self._outer_step(rows, delta)
        elif self.mode == "gradients":
            self.x[rows] = self.x[rows] - self.lr * got[:, :dim]
            if got.shape[1] > dim:
                self.x[rows] = got[:, dim:] - self.lr * got[:, :dim]
        else:
            self.x[rows] = got

    def take_update(self, peers: np.ndarray, donors_averaged: torch.Tensor, own: torch.Tensor) -> None:
        """Late `peers` take their group's step on its update (their donors' rows of the round's result), as
        production's `apply_update` does. DiLoCo: the outer step on Δ̄ (never θ_outer), keeping their own progress
        since θ_outer (`OuterState.apply_keeping_progress`, batched as `_outer_step` is). Gradients: the step on the
        averaged gradient, with their `own` contribution's gradient carried into their next one."""
        rows, dim = torch.from_numpy(peers), self.dim
        if self.mode == "gradients":
            self.x[rows] -= self.lr * donors_averaged[:, :dim]
            self.carried_grad[rows] = own[:, :dim]
            return
        delta = torch.zeros_like(self.x)
        delta[rows] = donors_averaged[:, :dim]
        own_progress = self.x[rows] - self.outer.anchor[0][rows]
        self._outer_step(rows, delta)
        self.x[rows] += own_progress

    def _outer_step(self, rows: torch.Tensor, delta: torch.Tensor) -> None:
        """The production outer step (`OuterState.apply`) on all rows at once; rows of peers that took no outer
        step this round (away, or failed) are put back: their θ_outer and momentum do not move."""
        anchor = self.outer.anchor[0]
        skip = torch.ones(anchor.shape[0], dtype=torch.bool)
        skip[rows] = False
        saved_anchor, saved_x = anchor[skip].clone(), self.x[skip].clone()
        momentum = self.outer.optimizer.state.get(anchor, {}).get("momentum_buffer")
        saved_momentum = momentum[skip].clone() if momentum is not None else None
        self.outer.apply([delta], [self.x])
        anchor[skip] = saved_anchor
        self.x[skip] = saved_x
        momentum = self.outer.optimizer.state[anchor]["momentum_buffer"]
        if saved_momentum is not None:
            momentum[skip] = saved_momentum
        else:
            momentum[skip] = 0.0
