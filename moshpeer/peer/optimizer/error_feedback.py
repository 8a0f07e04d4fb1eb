"""Error-feedback (EF21M) state of a `CollaborativeOptimizer`: creating it and checking a state before
adopting it (from a checkpoint or a donor). Gradients or DiLoCo (its pseudo-gradient changes slowly,
which error feedback suits) with a sparsifying codec only."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from moshpeer.errors import UserError
from moshpeer.peer.device import common_device

# Averaging modes whose averaged vector may be EF21M's estimate: a gradient or a pseudo-gradient, never parameters.
ERROR_FEEDBACK_MODES = ("gradients", "diloco")
# The tensors of an EF21M state (momentum estimate, what the group knows, the update estimate).
STATE_TENSORS = ("h", "e", "e_bar")


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
    """A fresh `EF21M` over all of `optimizer`'s parameters, using `compression`'s sparsifier; UserError
    unless averaging is one of ERROR_FEEDBACK_MODES and the codec sparsifies."""
    from moshpeer.compression.ef21m import EF21M

    sparsifier = error_feedback_sparsifier(averaging, compression)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # On the parameters' device, like the averaged buffers it is folded into (averaged_buffers.py).
    return EF21M(sum(p.numel() for p in params), sparsifier, device=common_device(params))


def error_feedback_state(error_feedback: Any) -> Optional[Dict[str, Any]]:
    """`error_feedback`'s state dict, or None without error feedback."""
    return error_feedback.state_dict() if error_feedback is not None else None


def fresh_error_feedback_state(error_feedback: Any) -> Dict[str, Any]:
    """A state of the same shape as `error_feedback`'s, zeroed, as if no step had been taken."""
    state = error_feedback.state_dict()
    for name in STATE_TENSORS:
        state[name].zero_()
    state["steps"] = 0
    return state


def check_error_feedback_state(error_feedback: Any, feedback: Any) -> None:
    """Raise ValueError unless `feedback` is an error-feedback state that fits `error_feedback` (before
    adopting it)."""
    if not isinstance(feedback, dict):
        raise ValueError("error-feedback state must be a dict")
    for name in STATE_TENSORS:
        value = feedback.get(name)
        if not isinstance(value, torch.Tensor) or value.numel() != error_feedback.numel:
            raise ValueError(f"error-feedback tensor {name} does not fit this model")
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"error-feedback tensor {name} has non-finite values")
