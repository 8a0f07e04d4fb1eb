"""Residual error feedback (SparseLoCo's) around an all-reduce compatible sparsifier, for a pseudo-gradient that the
outer step applies once per round (DiLoCo).

Per peer i, with this round's pseudo-gradient Δ_i, decay β and sparsifier C (ARC-Top-K rows, low-bit values):

    a_i   = β e_i + Δ_i          this round's Δ plus what earlier rounds did not send (decayed)
    c_i   = C(a_i)                the selected rows, after the rows codec's round trip (what the group receives)
    Δ̄     = mean_i c_i            the group's sparse average: the outer step's input, applied once
    e_i  <- a_i - c_i            what was not sent waits for a later round

Why not EF21M (ef21m.py) here: EF21M returns ē, a running estimate that the caller applies at every step. That suits a
gradient taken with a small step each iteration; DiLoCo's Δ is a whole displacement applied with outer lr ~1, so a row
selected once had its displacement applied again at every later outer step (1.80x the loss after 64 rounds of
bench_diloco's sparse arm, docs/compression.md). Here a row's displacement is either in Δ̄ (applied once) or in e_i
(waiting), and with β = 1 nothing is lost: Σ_t c_i,t + e_i = Σ_t Δ_i,t. β < 1 forgets old residuals; SparseLoCo
(Sarfi et al. 2025) uses the decayed accumulator in place of DiLoCo's outer momentum, the outer step then being plain
SGD (DiLoCoStrategy's default outer optimizer under error feedback).

A lost chunk: the data plane's estimator reconstructs Δ̄ there over the members whose chunk arrived (unbiased over
them), and e_i counts its own chunk as sent (it cannot know it was lost), so that part of its displacement is dropped,
once, as a lost gradient would be. A round that raises leaves e_i as it was: the caller then applies the peer's Δ by
its fallback (alone, or carried into the next round), which must not also wait in e_i. So does a round whose data
plane finished but that the optimizer did not take (it abandoned the round at its deadline a moment before the
round thread finished): `step` only stages the new e_i, and the optimizer `commit`s it when it applies Δ̄; a staged
residual that nobody committed is dropped by the next `step`.

The state (e_i and the round count) is part of the peer's training state: `state_dict` / `load_state_dict` put it in
checkpoints; a newcomer starts with e_i = 0 (the residual is this peer's own unsent work, not the swarm's).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from moshpeer.compression.arc_topk import ArcTopK, DenseAllReduce
from moshpeer.errors import UserError

STATE_VERSION = 1
# SparseLoCo's error-feedback decay.
DEFAULT_DECAY = 0.95


class ResidualFeedback:
    """Residual error-feedback state of one peer for a flat vector of `numel` values (module docstring)."""

    kind = "residual"
    state_tensors = ("e",)
    shared = False  # never handed to a newcomer: the residual is this peer's own unsent work

    def __init__(self, numel: int, sparsifier: ArcTopK, decay: float = DEFAULT_DECAY,
                 device: Optional[torch.device] = None):
        if not 0.0 < decay <= 1.0:
            raise UserError(f"error-feedback decay must be in (0, 1], got {decay}")
        self.numel = int(numel)
        self.sparsifier = sparsifier
        self.decay = float(decay)
        self.steps = 0
        self.e = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self._staged: Optional[torch.Tensor] = None  # the last round's new e until the optimizer commits it

    async def step(self, delta: torch.Tensor, seed: int, dense_allreduce: DenseAllReduce) -> torch.Tensor:
        """Add `delta` to the residual, all-reduce its selected rows with the group and return the group's sparse
        average (zeros outside the selected rows; a new tensor). Every member of the group calls it together with
        the same `seed` (ArcTopK.allreduce). The new residual is staged: it replaces the residual at `commit`, and
        the next `step` drops it if nobody committed it. If the all-reduce raises, nothing is staged."""
        delta = delta.reshape(-1).to(self.e.device, torch.float32)
        if delta.numel() != self.numel:
            raise ValueError(f"pseudo-gradient has {delta.numel()} values; this state holds {self.numel}")
        self._staged = None
        accumulated = torch.add(delta, self.e, alpha=self.decay)
        result = await self.sparsifier.allreduce_selected(accumulated, seed, dense_allreduce)
        self._staged = accumulated.sub_(self.sparsifier.contribution(accumulated, result.rows))
        return result.average.reshape(-1)

    def commit(self) -> bool:
        """The optimizer applied the last round's average: its residual becomes this peer's. False (nothing
        changed) if no round is staged: none ran since the last commit, or it raised."""
        staged, self._staged = self._staged, None
        if staged is None:
            return False
        self.e.copy_(staged)
        self.steps += 1
        return True

    def state_dict(self) -> Dict[str, Any]:
        """Tensors and counters to checkpoint (a clone: later rounds do not change a saved state)."""
        return {"version": STATE_VERSION, "kind": self.kind, "steps": self.steps, "e": self.e.clone()}

    def check_state(self, state: Any) -> None:
        """Raise ValueError unless `state` is a `state_dict` of this kind that fits this state."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or state.get("kind") != self.kind:
            raise ValueError("not a residual error-feedback state of a known version")
        value = state.get("e")
        if not isinstance(value, torch.Tensor) or value.numel() != self.numel:
            raise ValueError(f"residual error-feedback state: 'e' must be a tensor of {self.numel} values")
        if not bool(torch.isfinite(value).all()):
            raise ValueError("residual error-feedback state: 'e' holds non-finite values")
        steps = state.get("steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError("residual error-feedback state: 'steps' must be a non-negative integer")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a `state_dict`; UserError, with nothing changed, if it does not fit (`check_state`)."""
        try:
            self.check_state(state)
        except ValueError as e:
            raise UserError(str(e)) from None
        self.e.copy_(state["e"].reshape(-1))
        self.steps = state["steps"]
        self._staged = None
