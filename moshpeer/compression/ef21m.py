"""EF21M: error feedback with momentum around an all-reduce compatible compressor (ARC-Top-K).

Per peer i, with gradient g_i, momentum eta and compressor C (docs/compression.md has the sources):

    h_i   <- (1 - eta) h_i + eta g_i          momentum of the local gradient (h_i = g_i on the first step)
    c_i    = C(h_i - e_i)                      only the selected rows of the difference travel
    e_i   <- e_i + c_i                         what the group knows of h_i
    e_bar <- e_bar + mean_i c_i                the group's estimate of mean_i h_i: the update direction
    x     <- x - lr * e_bar                    (done by the caller's optimizer)

With ARC-Top-K, C selects the same rows S on every member, so mean_i c_i is exactly the all-reduce of the
selected rows and C is contractive on the averaged difference. The state (h_i, e_i, e_bar) is part of the peer's
training state: `state_dict` / `load_state_dict` put it in checkpoints.

With low-bit rows (`topk-int2`), c_i is the difference after the codec's round trip (what the group receives), so
its rounding error stays in h_i - e_i and is sent in a later round. A chunk lost on the way is not fed back: the
data plane's estimator reconstructs the average without it (unbiased over the members that arrived), e_i still
counts c_i as sent, and e_bar takes the reconstructed average, the same on every member that received it.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from moshpeer.compression.arc_topk import ArcTopK, DenseAllReduce
from moshpeer.errors import UserError

STATE_VERSION = 1


class EF21M:
    """Error-feedback state of one peer for a flat vector of `numel` values.

    `warmup_steps` first steps all-reduce the difference densely (the ARC-Top-K authors warm up with dense steps).
    """

    kind = "ef21m"
    state_tensors = ("h", "e", "e_bar")
    shared = True  # a newcomer adopts a donor's state: e and e_bar are what the group knows

    def __init__(self, numel: int, sparsifier: ArcTopK, momentum: float = 0.1, warmup_steps: int = 0,
                 device: Optional[torch.device] = None):
        if not 0.0 < momentum <= 1.0:
            raise ValueError(f"momentum (eta) must be in (0, 1], got {momentum}")
        self.numel = int(numel)
        self.sparsifier = sparsifier
        self.momentum = float(momentum)
        self.warmup_steps = int(warmup_steps)
        self.steps = 0
        self.h = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.e = torch.zeros_like(self.h)
        self.e_bar = torch.zeros_like(self.h)

    async def step(self, grad: torch.Tensor, seed: int, dense_allreduce: DenseAllReduce) -> torch.Tensor:
        """Fold `grad` in, run one compressed all-reduce, and return the update direction e_bar (a view).

        Every member of the group must call it together with the same `seed` (see ArcTopK.allreduce).
        """
        grad = grad.reshape(-1).to(self.h.device, torch.float32)
        if grad.numel() != self.numel:
            raise ValueError(f"gradient has {grad.numel()} values; this state holds {self.numel}")
        if self.steps == 0:
            self.h.copy_(grad)
        else:
            self.h.mul_(1.0 - self.momentum).add_(grad, alpha=self.momentum)
        delta = self.h - self.e
        if self.steps < self.warmup_steps:
            own, average = delta, await dense_allreduce(delta)
        else:
            result = await self.sparsifier.allreduce_selected(delta, seed, dense_allreduce)
            own, average = self.sparsifier.contribution(delta, result.rows), result.average
        self.e.add_(own)
        self.e_bar.add_(average.reshape(-1).to(self.e_bar.device))
        self.steps += 1
        return self.e_bar

    def commit(self) -> bool:
        """Nothing to commit: `step` updates the state at once (a round the optimizer then drops leaves the estimates
        one step ahead; the next rounds pull them back). Always False."""
        return False

    def state_dict(self) -> Dict[str, Any]:
        """Tensors and counters to checkpoint (clones: later steps do not change a saved state)."""
        return {"version": STATE_VERSION, "kind": self.kind, "steps": self.steps, "momentum": self.momentum,
                "h": self.h.clone(), "e": self.e.clone(), "e_bar": self.e_bar.clone()}

    def check_state(self, state: Any) -> None:
        """Raise ValueError unless `state` is a `state_dict` of this kind (states from before "kind" existed are
        EF21M's) that fits this state: version, sizes, finite values, counters."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            version = state.get("version") if isinstance(state, dict) else None
            raise ValueError(f"EF21M state: unknown version {version}")
        if state.get("kind", self.kind) != self.kind:
            raise ValueError(f"EF21M state: a {state.get('kind')!r:.20} error-feedback state")
        for name in self.state_tensors:
            value = state.get(name)
            if not isinstance(value, torch.Tensor) or value.numel() != self.numel:
                raise ValueError(f"EF21M state: {name!r} must be a tensor of {self.numel} values")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"EF21M state: {name!r} holds non-finite values")
        steps = state.get("steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError("EF21M state: 'steps' must be a non-negative integer")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a `state_dict`; UserError, with nothing changed, if it does not fit (`check_state`)."""
        try:
            self.check_state(state)
        except ValueError as e:
            raise UserError(str(e)) from None
        for name in self.state_tensors:
            getattr(self, name).copy_(state[name].reshape(-1))
        self.steps = state["steps"]
        self.momentum = float(state.get("momentum", self.momentum))
