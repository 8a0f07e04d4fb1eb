"""The tensors a `CollaborativeOptimizer` averages: their layout in one flat buffer, the optimizer
statistic averaged with each parameter (parameters mode), and how far a peer was from its group.

gradients mode: [mean gradients..., parameters...] (gradients only with error feedback);
parameters mode: [parameters..., one optimizer statistic per parameter...].

`values_digest`: what a member tells its group of values the members should already hold alike (RoundPlan.digest).
"""

from __future__ import annotations

import hashlib
import math
from typing import Dict, List, Sequence, Tuple

import torch

from moshpeer.peer.device import common_device

# Per-parameter optimizer state that is averaged in parameters mode, the first one present wins:
# Adam's second moment, SGD's momentum, RMSprop's square average, Adagrad's sum.
AVERAGED_STATISTICS = ("exp_avg_sq", "momentum_buffer", "square_avg", "sum")
# values_digest hashes at most this many values, evenly strided: 16 MB to hash (~20 ms) whatever the model's size.
DIGEST_SAMPLE = 1 << 22


def flat_buffer_views(params: Sequence[torch.nn.Parameter], copies: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """One zeroed flat fp32 buffer for `copies` tensors shaped like each of `params`, and its views in
    that order (the averager then works on the flat buffer without copying).

    The buffer lives on the parameters' device (the first parameter's, if they are spread over several), so
    filling it, averaging it and applying it never cross PCIe; it is fp32 whatever the parameters' dtype
    (bf16 / fp16 values are averaged in fp32 and rounded once, when written back)."""
    sizes = [p.numel() for p in params] * copies
    flat = torch.zeros(sum(sizes), dtype=torch.float32, device=common_device(params))
    views = list(torch.split(flat, sizes))
    shapes = [p.shape for p in params] * copies
    return flat, [view.view(shape) for view, shape in zip(views, shapes)]


def optimizer_statistics(optimizer: torch.optim.Optimizer,
                         params: Sequence[torch.nn.Parameter]) -> Dict[torch.nn.Parameter, torch.Tensor]:
    """One averaged statistic per parameter (see AVERAGED_STATISTICS), for the parameters that have one."""
    found = {}
    for p in params:
        state = optimizer.state.get(p, {})
        for name in AVERAGED_STATISTICS:
            if isinstance(state.get(name), torch.Tensor) and state[name].shape == p.shape:
                found[p] = state[name]
                break
    return found


def param_spread(params: Sequence[torch.Tensor], averaged: Sequence[torch.Tensor]) -> float:
    """||params - averaged|| / ||averaged||: how far this peer's parameters were from its group's mean.

    Any dtypes and devices: each parameter is compared in fp32 on its average's device, and the sums are
    accumulated there, so a round costs one device-to-host transfer of two numbers."""
    if not params:
        return 0.0
    diff = norm = None
    for p, a in zip(params, averaged):
        a = a.detach().float()
        d = (p.detach().to(device=a.device, dtype=torch.float32) - a).pow(2).sum()
        n = a.pow(2).sum()
        if diff is not None:
            d, n = d.to(diff.device) + diff, n.to(norm.device) + norm
        diff, norm = d, n
    totals = torch.stack([diff, norm]).double().cpu()
    return math.sqrt(float(totals[0])) / max(math.sqrt(float(totals[1])), 1e-12)


def values_digest(flat: torch.Tensor) -> bytes:
    """16 bytes that differ, but for a hash collision, between two copies of the 1-D fp32 tensor `flat` whose bits
    differ in any run of more than len(flat) / DIGEST_SAMPLE consecutive values (a lost chunk's, a missed step's: every
    value): a BLAKE2b of an evenly strided sample of its bits, the same on every device for the same bits."""
    stride = max(1, -(-flat.numel() // DIGEST_SAMPLE))
    sample = flat.detach()[::stride].contiguous().view(torch.int32).cpu()
    return hashlib.blake2b(sample.numpy().tobytes(), digest_size=16).digest()
