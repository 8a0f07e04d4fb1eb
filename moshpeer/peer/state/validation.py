"""Checks of a downloaded training state against this peer's own model, before anything is adopted.

A donor is a stranger: its state must have exactly our parameters (names, shapes, dtypes), finite
values of plausible size, an optimizer state that fits those parameters (every per-parameter tensor
finite and shaped like its parameter, a reduction of it or a scalar, the same param groups and hyperparameter
names: `moshpeer.peer.tensor_checks`), and epoch and step counters within range. Each check raises `ValueError` with what is wrong; the
downloader then moves on to the next donor. Agreement between two donors is checked separately
(`disagreeing_tensors`).
"""

from __future__ import annotations

import os
from typing import Any, List, Mapping, Optional

import torch

from moshpeer.peer.tensor_checks import MAX_COUNTER, check_tensor_values

# Two donors' states "agree" when a sample of their parameters is this close (relative L2): honest peers of
# one run differ by what their groups have not averaged yet (Moshpit groups: peers of two groups at one epoch
# differed by up to 8 % in a digits swarm of groups of 2, early in training; 5 % refused honest pairs), a
# forged state by orders of magnitude.
AGREEMENT_TOLERANCE = 0.25
SAMPLE_VALUES = 4096


def validate_model_state(ours: Mapping[str, torch.Tensor], theirs: Any) -> None:
    """Same names, shapes and dtypes as `ours`; finite and plausibly sized values."""
    if not isinstance(theirs, dict) or set(theirs) != set(ours):
        raise ValueError("state has different parameter names")
    for name, tensor in ours.items():
        other = theirs[name]
        if not isinstance(other, torch.Tensor) or other.shape != tensor.shape or other.dtype != tensor.dtype:
            raise ValueError(f"state tensor {name} does not match the model")
        check_tensor_values(name, other, tensor)


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
