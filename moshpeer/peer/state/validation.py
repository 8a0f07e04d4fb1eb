"""Checks of a downloaded training state against this peer's own model, before anything is adopted.

A donor is a stranger: its state must have exactly our parameters (names, shapes, dtypes), finite
values of plausible size, an optimizer state that fits those parameters (every per-parameter tensor
finite and shaped like its parameter, a reduction of it or a scalar, the same param groups and hyperparameter names),
and epoch and step counters within range. Each check raises `ValueError` with what is wrong; the
downloader then moves on to the next donor. Agreement between two donors is checked separately
(`disagreeing_tensors`).
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

MAX_COUNTER = 1 << 40
# A parameter tensor's norm may exceed this many times the larger of our own tensor's norm and
# sqrt(numel) (unit-scale values) only in a state that is not a trained copy of our model.
MAX_NORM_RATIO = 1e4
# Two donors' states "agree" when a sample of their parameters is this close (relative L2): honest peers of
# one run differ by what their groups have not averaged yet (Moshpit groups: peers of two groups at one epoch
# differed by up to 8 % in a digits swarm of groups of 2, early in training; 5 % refused honest pairs), a
# forged state by orders of magnitude.
AGREEMENT_TOLERANCE = 0.25
SAMPLE_VALUES = 4096


def _check_tensor_values(name: str, tensor: torch.Tensor, reference: torch.Tensor) -> None:
    if tensor.is_floating_point():
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"state tensor {name} has non-finite values")
        limit = MAX_NORM_RATIO * max(float(reference.detach().float().norm()), math.sqrt(max(reference.numel(), 1)))
        if float(tensor.float().norm()) > limit:
            raise ValueError(f"state tensor {name} is implausibly large (norm {float(tensor.float().norm()):.3g})")


def _fits_parameter(value: torch.Tensor, param: torch.Tensor) -> bool:
    """A per-parameter optimizer tensor: a scalar (step counts), the parameter's shape (Adam's moments), or
    that shape reduced to 1 along some dimensions (Adafactor's row and column factors)."""
    if value.numel() == 1:
        return True
    return value.dim() == param.dim() and all(v in (p, 1) for v, p in zip(value.shape, param.shape))


def validate_model_state(ours: Mapping[str, torch.Tensor], theirs: Any) -> None:
    """Same names, shapes and dtypes as `ours`; finite and plausibly sized values."""
    if not isinstance(theirs, dict) or set(theirs) != set(ours):
        raise ValueError("state has different parameter names")
    for name, tensor in ours.items():
        other = theirs[name]
        if not isinstance(other, torch.Tensor) or other.shape != tensor.shape or other.dtype != tensor.dtype:
            raise ValueError(f"state tensor {name} does not match the model")
        _check_tensor_values(name, other, tensor)


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
                if not _fits_parameter(value, param):
                    raise ValueError(f"optimizer state {key} of parameter {index} has shape {tuple(value.shape)}, "
                                     f"expected {tuple(param.shape)} (or a reduction of it) or a scalar")
                _check_tensor_values(f"optimizer {key} of parameter {index}", value, param)
            elif isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"optimizer state {key} of parameter {index} is not finite")
            elif isinstance(value, int) and not 0 <= value <= MAX_COUNTER:
                raise ValueError(f"optimizer state {key} of parameter {index} is out of range")


def validate_counters(epoch: Any, steps: Any, max_epoch: int = MAX_COUNTER) -> None:
    """Epoch and step counters are integers in range (epoch at most `max_epoch`: what the swarm confirms)."""
    for name, value, limit in (("epoch", epoch, max_epoch), ("steps", steps, MAX_COUNTER)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
            raise ValueError(f"state {name} {value!r} is out of range [0, {limit}]")


def disagreeing_tensors(first: Mapping[str, torch.Tensor], second: Mapping[str, torch.Tensor],
                        seed: Optional[int] = None) -> List[str]:
    """Names of the parameter tensors on which two donors' model states disagree, compared on a random
    sample of values (both already validated: same names and shapes). The sample is drawn from a fresh secret
    seed unless `seed` is given (tests): a forger who knew which values are compared could forge the others."""
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") if seed is None else seed)
    if set(first) != set(second):
        return sorted(set(first) ^ set(second))
    disagree = []
    for name in sorted(first):
        if not isinstance(first[name], torch.Tensor) or not isinstance(second[name], torch.Tensor) \
                or first[name].shape != second[name].shape:
            disagree.append(name)
            continue
        a, b = first[name].reshape(-1), second[name].reshape(-1)
        if not a.is_floating_point():
            if not torch.equal(a, b):
                disagree.append(name)
            continue
        if a.numel() > SAMPLE_VALUES:
            index = torch.randint(0, a.numel(), (SAMPLE_VALUES,), generator=generator)
            a, b = a[index], b[index]
        scale = max(float(a.float().norm()), float(b.float().norm()), 1e-12)
        if float((a.float() - b.float()).norm()) > AGREEMENT_TOLERANCE * scale:
            disagree.append(name)
    return disagree
