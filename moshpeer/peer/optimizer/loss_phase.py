"""Loss-phase tracking: feeds each collaborative epoch's gradient to the averager's loss budget (DBLP).

`LossPhaseTracker.after_round` returns, for an epoch's `CollaborativeRound`, the phase and budget P that
round ran with and the norm of the epoch's gradient. With a phase-aware budget it also sums those gradients over
a signal window of epochs (`LossBudget.window_index`) and hands the norm of their mean to
`LossBudget.on_window` when the window ends: that sets the phase (and P) of the rounds that follow.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch

from moshpeer.averaging.report import RoundResult

if TYPE_CHECKING:  # imported for hints only: moshpeer.averaging is heavy and loaded late by the optimizer
    from moshpeer.averaging.loss_budget import LossBudget


def epoch_gradient(averaged: Optional[Sequence[torch.Tensor]], accumulators: Sequence[torch.Tensor],
                   samples: int) -> Optional[List[torch.Tensor]]:
    """The phase signal's input: this epoch's averaged gradient (`averaged`: gradients mode, after a
    round), else this peer's mean local gradient (`accumulators` summed over `samples`); None when there
    is none (an aux peer)."""
    if averaged is not None:
        return list(averaged)
    if samples > 0:
        scale = 1.0 / samples
        return [acc.float() * scale for acc in accumulators]
    return None


class LossPhaseTracker:
    """The gradient sums of the current phase-signal window of one optimizer."""

    def __init__(self) -> None:
        self._window_sum: Optional[List[torch.Tensor]] = None  # gradient summed over the window
        self._window_of, self._window_epochs = -1, 0  # which window it is, how many epochs it holds

    def after_round(self, epoch: int, result: Optional[RoundResult], budget: "LossBudget",
                    grads: Optional[List[torch.Tensor]]) -> Tuple[str, float, Optional[float]]:
        """Feed this epoch's gradient norm to the loss budget (it sets the phase and P of the next round);
        returns the phase and budget this epoch's round ran with, and that norm (None without gradients)."""
        ran_with = result if result is not None and result.loss_phase is not None else None
        phase = ran_with.loss_phase if ran_with is not None else budget.phase
        p = float(ran_with.loss_budget if ran_with is not None else budget.budget)
        if grads is None:
            return phase, p, None
        norm = math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads))
        if budget.phase_aware:
            self._add_to_window(epoch, budget, grads)
        return phase, p, norm

    def _add_to_window(self, epoch: int, budget: "LossBudget", grads: List[torch.Tensor]) -> None:
        # Accordion's signal: the norm of the gradient accumulated over a window of epochs (here its mean,
        # so that a window this peer partly missed compares fairly), window vs window.
        window = budget.window_index(epoch)
        if self._window_epochs and window != self._window_of:
            self._close_window(budget)  # we skipped the epoch that ends that window (caught up)
        if self._window_sum is None:
            self._window_sum = [torch.zeros_like(g, dtype=torch.float32) for g in grads]
        for total, g in zip(self._window_sum, grads):
            total.add_(g.float())
        self._window_of, self._window_epochs = window, self._window_epochs + 1
        if budget.window_ends(epoch):
            self._close_window(budget)

    def _close_window(self, budget: "LossBudget") -> None:
        scale = 1.0 / self._window_epochs
        budget.on_window(math.sqrt(sum(float(t.pow(2).sum()) for t in self._window_sum)) * scale)
        for total in self._window_sum:
            total.zero_()
        self._window_epochs = 0
