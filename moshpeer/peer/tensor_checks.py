"""Checks of tensors that came from a stranger, against this peer's own: values finite and of plausible size, and
an optimizer state that fits its parameters. Used for downloaded training states (state/validation.py) and for the
strategies' own states inside them (a DiLoCo outer state: strategies/diloco_outer.py). Each raises `ValueError`
saying what is wrong."""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Sequence

import torch

MAX_COUNTER = 1 << 40
# A parameter tensor's norm may exceed this many times the larger of our own tensor's norm and
# sqrt(numel) (unit-scale values) only in a state that is not a trained copy of our model.
MAX_NORM_RATIO = 1e4


def check_tensor_values(name: str, tensor: torch.Tensor, reference: torch.Tensor) -> None:
    if tensor.is_floating_point():
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"state tensor {name} has non-finite values")
        limit = MAX_NORM_RATIO * max(float(reference.detach().float().norm()), math.sqrt(max(reference.numel(), 1)))
        if float(tensor.float().norm()) > limit:
            raise ValueError(f"state tensor {name} is implausibly large (norm {float(tensor.float().norm()):.3g})")


def fits_parameter(value: torch.Tensor, param: torch.Tensor) -> bool:
    """A per-parameter optimizer tensor: a scalar (step counts), the parameter's shape (Adam's moments), or
    that shape reduced to 1 along some dimensions (Adafactor's row and column factors)."""
    if value.numel() == 1:
        return True
    return value.dim() == param.dim() and all(v in (p, 1) for v, p in zip(value.shape, param.shape))


def validate_optimizer_state(ours: Mapping[str, Any], params: Sequence[torch.Tensor], theirs: Any) -> None:
    """`theirs` (a torch optimizer state_dict) fits our optimizer (`ours` = its state_dict; `params` its
    parameters in param-group order)."""
    if not isinstance(theirs, dict) or not isinstance(theirs.get("state"), dict) \
            or not isinstance(theirs.get("param_groups"), list):
        raise ValueError("optimizer state is not an optimizer state_dict")
    our_groups, their_groups = ours["param_groups"], theirs["param_groups"]
    if len(our_groups) != len(their_groups):
        raise ValueError("optimizer state has different param groups")
    for mine, other in zip(our_groups, their_groups):
        if not isinstance(other, dict) or set(other) != set(mine) or other.get("params") != mine["params"]:
            raise ValueError("optimizer param group does not match ours")
        for key, value in other.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"optimizer hyperparameter {key} is not finite")
    # torch numbers parameters across groups in order: the i-th index of our groups is params[i].
    by_index: Dict[int, torch.Tensor] = dict(zip((i for group in our_groups for i in group["params"]), params))
    for index, entry in theirs["state"].items():
        param = by_index.get(index)
        if param is None or not isinstance(entry, dict):
            raise ValueError(f"optimizer state for unknown parameter {index!r}")
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                if not fits_parameter(value, param):
                    raise ValueError(f"optimizer state {key} of parameter {index} has shape {tuple(value.shape)}, "
                                     f"expected {tuple(param.shape)} (or a reduction of it) or a scalar")
                check_tensor_values(f"optimizer {key} of parameter {index}", value, param)
            elif isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"optimizer state {key} of parameter {index} is not finite")
            elif isinstance(value, int) and not 0 <= value <= MAX_COUNTER:
                raise ValueError(f"optimizer state {key} of parameter {index} is out of range")
