"""Capturing and restoring the process-wide random number generators.

What is captured: Python's `random`, NumPy's legacy global generator (`np.random.*`), torch's CPU
generator, and every CUDA device's generator when CUDA has been initialized in this process (an
uninitialized CUDA generator is still at the seed `torch.manual_seed` gave it, which a restarted
process that seeds the same way reproduces). Generators a program creates itself
(`np.random.default_rng()`, `torch.Generator()`) are its own state: put them in a checkpoint part
(for example the data position).

The captured state holds only tensors, numbers, strings and tuples, so it loads with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Dict

import numpy as np
import torch

logger = logging.getLogger(__name__)


def capture_rng_state() -> Dict[str, Any]:
    """The current state of every process-wide generator, as a checkpoint part."""
    algorithm, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: Dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "algorithm": str(algorithm),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    """Put every generator back where `capture_rng_state` found it.

    Generators missing from `state` are left alone. CUDA states are restored only when this process
    sees the same number of CUDA devices; otherwise that is logged and CUDA generators are not
    touched (the run continues, but GPU randomness will differ from the original run).
    """
    if "python" in state:
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
    if "numpy" in state:
        numpy_state = state["numpy"]
        keys = torch.as_tensor(numpy_state["keys"]).numpy().astype(np.uint32)
        np.random.set_state(
            (
                numpy_state["algorithm"],
                keys,
                int(numpy_state["position"]),
                int(numpy_state["has_gauss"]),
                float(numpy_state["cached_gaussian"]),
            )
        )
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu())
    if "cuda" in state:
        cuda_states = list(state["cuda"])
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])
        else:
            available = torch.cuda.device_count() if torch.cuda.is_available() else 0
            logger.warning(
                f"checkpoint holds RNG states of {len(cuda_states)} CUDA device(s), this process has {available}: "
                "CUDA generators not restored"
            )
