"""Where a peer trains: `--device auto|cpu|cuda|cuda:N` turned into a `torch.device` that exists.

A device that this machine does not have is a user mistake: `resolve_device` raises `UserError` with one
line saying what exists, before anything starts (the CLI then exits with code 2).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from moshpeer.errors import UserError

DEVICE_CHOICES = "auto|cpu|cuda|cuda:N"


def resolve_device(spec: Optional[str] = "auto") -> torch.device:
    """`auto` (or None): the current CUDA device when CUDA is available, else the CPU; `cpu`; `cuda` (the
    current CUDA device); `cuda:N`. Raises UserError for anything else or a device that does not exist."""
    text = "auto" if spec is None else str(spec).strip().lower()
    if text == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UserError(f"unknown device {spec!r}; expected {DEVICE_CHOICES}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise UserError(f"unsupported device {spec!r}; expected {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise UserError(f"device {spec!r} does not exist: CUDA is not available on this machine "
                        f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use --device cpu")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < count:
        raise UserError(f"device {spec!r} does not exist: this machine has {count} CUDA device(s) "
                        f"(cuda:0 to cuda:{count - 1})")
    return torch.device("cuda", index)


def common_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """The device of the first tensor (where buffers for all of them go); CPU when there is none.

    Tensors on several devices (a model split across GPUs) are fine for the callers: they copy to and from
    this device explicitly.
    """
    for tensor in tensors:
        return tensor.device
    return torch.device("cpu")
