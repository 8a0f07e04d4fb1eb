"""Phase-aware loss budget for averaging rounds (DBLP, "Dynamic Bounded-Loss Protocol").

A round's owner stops waiting for contributions once the fraction of expected chunks still missing
is within the budget P (the round deadline still bounds everything); receivers stop waiting for
averaged chunks the same way. What did not arrive is reconstructed without bias (estimator.py).

P follows the phase of training: `p_low` while training is "critical" (at the start, and whenever
the gradient norm changed by a relative amount >= `eta` between two collaborative epochs, the
signal DBLP borrows from Accordion), `p_high` otherwise. `LossBudget.fixed(P)` keeps P constant;
`fixed(0.0)` is the baseline that waits for everything until the deadline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from moshpeer.errors import UserError

CRITICAL, NORMAL, FIXED = "critical", "normal", "fixed"


@dataclass
class LossBudget:
    """Current budget and phase; call `on_epoch(grad_norm)` at the start of every collaborative epoch."""

    p_low: float = 0.02
    p_high: float = 0.42
    eta: float = 0.5
    fixed_budget: Optional[float] = None

    def __post_init__(self):
        for name in ("p_low", "p_high"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise UserError(f"loss budget {name} must be within [0, 1), got {value}")
        if self.fixed_budget is not None and not 0.0 <= self.fixed_budget < 1.0:
            raise UserError(f"fixed loss budget must be within [0, 1), got {self.fixed_budget}")
        if self.eta <= 0:
            raise UserError("eta must be positive")
        self.phase = FIXED if self.fixed_budget is not None else CRITICAL
        self._previous_norm: Optional[float] = None

    @classmethod
    def fixed(cls, budget: float) -> "LossBudget":
        return cls(fixed_budget=budget)

    @property
    def budget(self) -> float:
        """The fraction of a round's chunks that may be missing when we stop waiting."""
        if self.fixed_budget is not None:
            return self.fixed_budget
        return self.p_low if self.phase == CRITICAL else self.p_high

    def on_epoch(self, grad_norm: float) -> str:
        """New collaborative epoch with this gradient norm: update and return the phase."""
        if self.fixed_budget is not None:
            return self.phase
        if not math.isfinite(grad_norm) or grad_norm < 0:
            self.phase = CRITICAL  # something is off: be careful
            return self.phase
        previous, self._previous_norm = self._previous_norm, grad_norm
        if previous is None:
            self.phase = CRITICAL  # the first epoch is critical
        elif previous == 0:
            self.phase = CRITICAL if grad_norm > 0 else NORMAL
        else:
            self.phase = CRITICAL if abs(grad_norm - previous) / previous >= self.eta else NORMAL
        return self.phase
