"""Error-feedback state of a `CollaborativeOptimizer`: creating it and checking a state before adopting it (from a
checkpoint or a donor). With a sparsifying codec only: EF21M for gradients (compression/ef21m.py), SparseLoCo's residual
feedback for DiLoCo's pseudo-gradient, which the outer step applies once per round (compression/residual_feedback.py
says why EF21M does not suit it)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from moshpeer.errors import UserError
from moshpeer.peer.device import common_device

# Averaging modes whose averaged vector may go through error feedback: a gradient or a pseudo-gradient, never
# parameters.
ERROR_FEEDBACK_MODES = ("gradients", "diloco")


def error_feedback_sparsifier(averaging: str, compression: str) -> Any:
    """The sparsifier error feedback would run around; UserError unless averaging is one of
    ERROR_FEEDBACK_MODES and the codec `compression` (a spec such as arc-topk:0.01) is valid and sparsifies."""
    from moshpeer.compression import get_compression  # peer > compression: allowed

    sparsifier = get_compression(compression).sparsifier
    if averaging not in ERROR_FEEDBACK_MODES or sparsifier is None:
        raise UserError(f"error_feedback needs averaging in {ERROR_FEEDBACK_MODES} and a sparsifying codec such as "
                        f"arc-topk:0.01, got averaging={averaging!r}, compression={compression!r}")
    return sparsifier


def make_error_feedback(optimizer: torch.optim.Optimizer, averaging: str, compression: str) -> Any:
    """A fresh error-feedback state over all of `optimizer`'s parameters, using `compression`'s sparsifier: EF21M
    for gradients, `ResidualFeedback` for DiLoCo. UserError unless averaging is one of ERROR_FEEDBACK_MODES and the
    codec sparsifies."""
    from moshpeer.compression.ef21m import EF21M
    from moshpeer.compression.residual_feedback import ResidualFeedback

    sparsifier = error_feedback_sparsifier(averaging, compression)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    numel = sum(p.numel() for p in params)
    # On the parameters' device, like the averaged buffers it is folded into (averaged_buffers.py).
    if averaging == "diloco":
        return ResidualFeedback(numel, sparsifier, device=common_device(params))
    return EF21M(numel, sparsifier, device=common_device(params))


def error_feedback_state(error_feedback: Any) -> Optional[Dict[str, Any]]:
    """`error_feedback`'s state dict, or None without error feedback."""
    return error_feedback.state_dict() if error_feedback is not None else None


def shared_error_feedback_state(error_feedback: Any) -> Optional[Dict[str, Any]]:
    """What a newcomer gets of `error_feedback`'s state: EF21M's (the group's estimate is the swarm's too), not a
    residual (this peer's own unsent work: a newcomer that sent it too would count it twice); None then, and the
    newcomer starts afresh."""
    return error_feedback.state_dict() if error_feedback is not None and error_feedback.shared else None


def fresh_error_feedback_state(error_feedback: Any) -> Dict[str, Any]:
    """A state of the same shape as `error_feedback`'s, zeroed, as if no step had been taken."""
    state = error_feedback.state_dict()
    for name in error_feedback.state_tensors:
        state[name].zero_()
    state["steps"] = 0
    return state
