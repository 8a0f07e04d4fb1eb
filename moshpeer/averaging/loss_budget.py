"""Phase-aware loss budget for averaging rounds (DBLP, "Dynamic Bounded-Loss Protocol").

A round's owner stops waiting for contributions once the fraction of expected chunks still missing
is within the budget P (the round deadline still bounds everything); receivers stop waiting for
averaged chunks the same way. What did not arrive is reconstructed without bias (estimator.py).

P follows the phase of training: `p_low` while training is "critical" (at the start, and whenever
the gradient norm changed by a relative amount >= `eta` between two collaborative epochs, the
signal DBLP borrows from Accordion), `p_high` otherwise. `LossBudget.fixed(P)` keeps P constant;
`fixed(0.0)` is the baseline that waits for everything until the deadline.

Settings as text (`moshpeer join --loss-budget`, `CollaborativeOptimizer(loss_budget=...)`):
`parse_loss_budget("fixed")` = the baseline, `"0.1"` = fixed P, `"0.02,0.42"` = phase-aware P_low,P_high,
`"phase"` = phase-aware with the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from moshpeer.errors import UserError

CRITICAL, NORMAL, FIXED = "critical", "normal", "fixed"
# DBLP: P_low about 1-2.5%, P_high = P_low + about 40 points; Accordion's threshold eta = 0.5.
DEFAULT_P_LOW, DEFAULT_P_HIGH, DEFAULT_ETA = 0.02, 0.42, 0.5


@dataclass
class LossBudget:
    """Current budget and phase; call `on_epoch(grad_norm)` at the start of every collaborative epoch."""

    p_low: float = DEFAULT_P_LOW
    p_high: float = DEFAULT_P_HIGH
    eta: float = DEFAULT_ETA
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
        self.relative_change: Optional[float] = None  # of the last on_epoch() signal, None before two epochs

    @classmethod
    def fixed(cls, budget: float) -> "LossBudget":
        """A budget that never changes; `fixed(0.0)` waits for everything until the deadline (the baseline)."""
        return cls(fixed_budget=budget)

    @property
    def phase_aware(self) -> bool:
        return self.fixed_budget is None

    def describe(self) -> dict:
        """The settings, for logs and JSON event lines."""
        if self.fixed_budget is not None:
            return {"mode": "fixed", "budget": self.fixed_budget}
        return {"mode": "phase", "p_low": self.p_low, "p_high": self.p_high, "eta": self.eta}

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
            self.relative_change = None
            self.phase = CRITICAL  # the first epoch is critical
        elif previous == 0:
            self.relative_change = math.inf if grad_norm > 0 else 0.0
            self.phase = CRITICAL if grad_norm > 0 else NORMAL
        else:
            self.relative_change = abs(grad_norm - previous) / previous
            self.phase = CRITICAL if self.relative_change >= self.eta else NORMAL
        return self.phase


def parse_loss_budget(setting: Union["LossBudget", str, float, None], eta: float = DEFAULT_ETA) -> LossBudget:
    """A `LossBudget` from a setting: None / "fixed" / "none" (the baseline: wait for everything until
    the deadline), a number P or "P" (fixed budget P), "P_LOW,P_HIGH" or "phase" (phase-aware, with the
    phase threshold `eta`). A `LossBudget` is returned as is."""
    if isinstance(setting, LossBudget):
        return setting
    if setting is None:
        return LossBudget.fixed(0.0)
    if isinstance(setting, (int, float)):
        return LossBudget.fixed(float(setting))
    text = str(setting).strip().lower()
    if text in ("", "fixed", "none", "baseline"):
        return LossBudget.fixed(0.0)
    if text in ("phase", "dblp"):
        return LossBudget(eta=eta)
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"bad loss budget {setting!r}: use fixed, a fraction P, P_LOW,P_HIGH or phase") from None
    if len(values) == 1:
        return LossBudget.fixed(values[0])
    if len(values) == 2:
        if values[0] > values[1]:
            raise UserError(f"loss budget P_LOW,P_HIGH must have P_LOW <= P_HIGH, got {setting!r}")
        return LossBudget(p_low=values[0], p_high=values[1], eta=eta)
    raise UserError(f"bad loss budget {setting!r}: use fixed, a fraction P, P_LOW,P_HIGH or phase")
