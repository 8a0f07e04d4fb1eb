"""Checking a `CollaborativeOptimizer`'s settings and deriving its averager's options, before anything starts.

Failure: settings that cannot work raise `UserError` with one line (the CLI prints it and exits non-zero);
nothing has been started or allocated then.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from moshpeer.averaging.loss_budget import LossBudget
from moshpeer.errors import UserError
from moshpeer.peer.optimizer.error_feedback import ERROR_FEEDBACK_MODES, make_error_feedback

ROLES = ("trainer", "aux")


def checked_params(optimizer: Any, *, role: str, target_batch_size: int, batch_size_per_step: Optional[int],
                   group_size: int) -> List[torch.nn.Parameter]:
    """The wrapped optimizer's parameters, in group order; UserError for a setting that cannot work."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"CollaborativeOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if role not in ROLES:
        raise UserError(f"role must be 'trainer' or 'aux', got {role!r}")
    if target_batch_size < 1 or (batch_size_per_step is not None and batch_size_per_step < 1):
        raise UserError("target_batch_size and batch_size_per_step must be positive")
    if group_size < 2:
        raise UserError(f"group size must be at least 2, got {group_size}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        raise UserError("the wrapped optimizer has no parameters")
    return params


def averager_options(optimizer: torch.optim.Optimizer, *, averaging: str, role: str, compression: str,
                     error_feedback: bool, loss_budget: LossBudget,
                     averager_kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """`MoshpitAverager` keyword arguments beyond the group settings: the caller's `averager_kwargs`, plus an aux
    peer's client mode, a fresh EF21M state with `error_feedback`, and the loss budget. UserError when error
    feedback meets a mode or codec it does not suit."""
    options = dict(averager_kwargs or {})
    if role == "aux":  # an aux never leads: it sits in matchmaking far longer than any trainer would wait
        options.setdefault("client_mode", True)
    if error_feedback and options.get("error_feedback") is None:
        options["error_feedback"] = make_error_feedback(optimizer, averaging, compression)
    # Error feedback replaces the averaged vector by its own estimate: (pseudo-)gradients, never parameters.
    if options.get("error_feedback") is not None and averaging not in ERROR_FEEDBACK_MODES:
        raise UserError(f"error feedback needs averaging in {ERROR_FEEDBACK_MODES}")
    options.setdefault("loss_budget", loss_budget)
    return options
