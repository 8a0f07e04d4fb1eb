"""Streaming DiLoCo's fragments (Douillard et al., 2025): the model's parameters cut into F contiguous runs
of whole parameters, each with its own outer state, synchronised one per collaborative epoch.

`split_fragments` is the cut (pure: parameter sizes in, index ranges out); `make_fragments` gives each
range its views of the strategy's Δ buffer and its own `OuterState` (θ_outer slice, outer momentum, θ_sent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from moshpeer.errors import UserError
from moshpeer.peer.strategies.diloco_outer import OuterOptimizerFactory, OuterState


def split_fragments(numels: Sequence[int], fragments: int) -> List[Tuple[int, int]]:
    """Cut parameters of sizes `numels` (in order) into `fragments` contiguous, non-empty runs balanced by
    size: [(first, end), ...] parameter index ranges covering all of them. Each cut is the parameter
    boundary nearest to an equal share (k x total / fragments; the lower one on a tie), moved only as far
    as needed to leave every run at least one parameter. UserError if fragments < 1 or > len(numels)."""
    count = len(numels)
    if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= count:
        raise UserError(f"fragments must be between 1 and the number of parameters ({count}), got {fragments!r}")
    prefix = [0]
    for numel in numels:
        prefix.append(prefix[-1] + numel)
    cuts = [0]
    for k in range(1, fragments):
        share = k * prefix[-1] / fragments
        allowed = range(cuts[-1] + 1, count - (fragments - k) + 1)  # a parameter left for every later run
        cuts.append(min(allowed, key=lambda i: (abs(prefix[i] - share), i)))
    cuts.append(count)
    return list(zip(cuts[:-1], cuts[1:]))


@dataclass
class Fragment:
    """One fragment: its parameters, its Δ (views of the strategy's buffer), the flat slice of that buffer a
    round of this fragment averages, and its outer state."""

    params: List[torch.nn.Parameter]
    delta: List[torch.Tensor]
    buffer: torch.Tensor
    outer: OuterState


def make_fragments(params: Sequence[torch.nn.Parameter], buffer: torch.Tensor, delta: Sequence[torch.Tensor],
                   fragments: int, outer_optimizer: OuterOptimizerFactory) -> List[Fragment]:
    """The fragments of `params` (`split_fragments`), over `buffer` (flat, one value per parameter value, in
    order) and its per-parameter views `delta`. UserError for a bad fragment count, or from the outer
    optimizer factory."""
    parts, offset = [], 0
    for first, end in split_fragments([p.numel() for p in params], fragments):
        numel = sum(p.numel() for p in params[first:end])
        # Contiguous runs of whole parameters: a fragment's Δ is one slice of the flat buffer, which the
        # averager sends without a copy.
        parts.append(Fragment(params=list(params[first:end]), delta=list(delta[first:end]),
                              buffer=buffer[offset:offset + numel],
                              outer=OuterState(params[first:end], outer_optimizer)))
        offset += numel
    return parts
