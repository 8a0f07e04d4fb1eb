"""Phase-aware loss budget for averaging rounds (DBLP, "Dynamic Bounded-Loss Protocol").

A round's owner stops waiting for contributions once the fraction of expected chunks still missing
is within the budget P (the round deadline still bounds everything); receivers stop waiting for
averaged chunks the same way. What did not arrive is reconstructed without bias (estimator.py).

P follows the phase of training: `p_low` while training is "critical", `p_high` otherwise. The phase
signal is Accordion's, as DBLP uses it: the norm of the gradient accumulated over a *window* (Accordion's
epoch: `window` collaborative epochs, aligned on the swarm's epoch number so that every peer's windows
coincide) compared with the previous window's. The first window is critical (P starts at P_low); at
the end of every window P <- P_high unless the relative change |g_w - g_(w-1)| / g_(w-1) is >= `eta`,
which makes the next window critical (P <- P_low). A window compares norms of sums over many steps, so
the noise of single steps (which swing by > 50% near convergence) does not flip the phase. `LossBudget.fixed(P)` keeps P constant;
`fixed(0.0)` is the baseline that waits for everything until the deadline.

Settings as text (`moshpeer join --loss-budget`, `CollaborativeOptimizer(loss_budget=...)`):
`parse_loss_budget("fixed")` = the baseline, `"0.1"` = fixed P, `"0.02,0.42"` = phase-aware P_low,P_high,
`"phase"` = phase-aware with the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

from moshpeer.errors import UserError

CRITICAL, NORMAL, FIXED = "critical", "normal", "fixed"
# DBLP: P_low about 1-2.5%, P_high = P_low + about 40 points; Accordion's threshold eta = 0.5.
DEFAULT_P_LOW, DEFAULT_P_HIGH, DEFAULT_ETA = 0.02, 0.42, 0.5
# Collaborative epochs per signal window. Accordion's window is one pass over the data; a peer does not
# know the swarm's data size, so this is a count: 5 epochs ~ one pass of the built-in digits task at
# global batch 256 (1257 training samples), and enough steps that the summed gradient is not one
# step's noise. Set it to (dataset size / global batch) for a real task.
DEFAULT_WINDOW = 5


@dataclass
class LossBudget:
    """Current budget and phase. The optimizer accumulates the gradients of every collaborative epoch of
    a window (`window_index(epoch)`, `window_ends(epoch)`) and calls `on_window(norm of their mean)`."""

    p_low: float = DEFAULT_P_LOW
    p_high: float = DEFAULT_P_HIGH
    eta: float = DEFAULT_ETA
    fixed_budget: Optional[float] = None
    window: int = DEFAULT_WINDOW

    def __post_init__(self):
        for name in ("p_low", "p_high"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise UserError(f"loss budget {name} must be within [0, 1), got {value}")
        if self.fixed_budget is not None and not 0.0 <= self.fixed_budget < 1.0:
            raise UserError(f"fixed loss budget must be within [0, 1), got {self.fixed_budget}")
        if self.eta <= 0:
            raise UserError("eta must be positive")
        if int(self.window) != self.window or self.window < 1:
            raise UserError(f"phase window must be a whole number of epochs >= 1, got {self.window}")
        self.window = int(self.window)
        self.phase = FIXED if self.fixed_budget is not None else CRITICAL
        self._previous_norm: Optional[float] = None
        self.relative_change: Optional[float] = None  # of the last on_window() signal, None before two windows

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
        return {"mode": "phase", "p_low": self.p_low, "p_high": self.p_high, "eta": self.eta, "window": self.window}

    @property
    def budget(self) -> float:
        """The fraction of a round's chunks that may be missing when we stop waiting."""
        if self.fixed_budget is not None:
            return self.fixed_budget
        return self.p_low if self.phase == CRITICAL else self.p_high

    def window_index(self, epoch: int) -> int:
        """The signal window that collaborative epoch `epoch` (0-based) belongs to."""
        return int(epoch) // self.window

    def window_ends(self, epoch: int) -> bool:
        """Does collaborative epoch `epoch` (0-based, the swarm's number) close a signal window? Windows
        are aligned on the epoch number, so peers of one swarm close the same windows."""
        return (int(epoch) + 1) % self.window == 0

    def on_window(self, grad_norm: float) -> str:
        """A window ended; `grad_norm` is the norm of the gradient accumulated over it. Update and return
        the phase of the next window."""
        if self.fixed_budget is not None:
            return self.phase
        if not math.isfinite(grad_norm) or grad_norm < 0:
            self.phase = CRITICAL  # something is off: be careful
            return self.phase
        previous, self._previous_norm = self._previous_norm, grad_norm
        if previous is None:
            # DBLP: the first window ran at P_low; at each new window P <- P_high unless the signal says
            # critical, and after a single window there is no change to measure yet.
            self.relative_change = None
            self.phase = NORMAL
        elif previous == 0:
            self.relative_change = math.inf if grad_norm > 0 else 0.0
            self.phase = CRITICAL if grad_norm > 0 else NORMAL
        else:
            self.relative_change = abs(grad_norm - previous) / previous
            self.phase = CRITICAL if self.relative_change >= self.eta else NORMAL
        return self.phase


def group_budget(declared: Sequence[Tuple[float, str]]) -> Tuple[float, str]:
    """The (budget, phase) a whole group applies, from what each member declared: the smallest budget.
    Every member computes it from the same gathered list, so the group agrees; a member in a critical
    phase asks for care, and a round with any waiting member lasts as long as that member waits anyway."""
    if not declared:
        raise ValueError("no member declared a budget")
    return min(declared, key=lambda item: (item[0], item[1]))


def parse_loss_budget(setting: Union["LossBudget", str, float, None], eta: float = DEFAULT_ETA,
                      window: int = DEFAULT_WINDOW) -> LossBudget:
    """A `LossBudget` from a setting: None / "fixed" / "none" (the baseline: wait for everything until
    the deadline), a number P or "P" (fixed budget P), "P_LOW,P_HIGH" or "phase" (phase-aware, with the
    phase threshold `eta` and signal window `window`). A `LossBudget` is returned as is."""
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
        return LossBudget(eta=eta, window=window)
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"bad loss budget {setting!r}: use fixed, a fraction P, P_LOW,P_HIGH or phase") from None
    if len(values) == 1:
        return LossBudget.fixed(values[0])
    if len(values) == 2:
        if values[0] > values[1]:
            raise UserError(f"loss budget P_LOW,P_HIGH must have P_LOW <= P_HIGH, got {setting!r}")
        return LossBudget(p_low=values[0], p_high=values[1], eta=eta, window=window)
    raise UserError(f"bad loss budget {setting!r}: use fixed, a fraction P, P_LOW,P_HIGH or phase")
