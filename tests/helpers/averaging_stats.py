"""Statistics shared by the averaging tests (in-process estimator check and the multi-process swarm)."""

from __future__ import annotations

import math
from typing import Sequence


def owner_pull(errors_by_owner: Sequence[float], owner_offsets: Sequence[float]) -> float:
    """How much a round's per-part error leans toward each part's owner: sum_k error_k * offset_k.

    error_k = mean over part k of (result - exact mean); offset_k = mean over part k of (owner's own
    value - exact mean). An estimator biased toward the owner makes this positive on average; an
    unbiased one makes it zero on average.
    """
    return sum(e * d for e, d in zip(errors_by_owner, owner_offsets))


def mean_within_bound(samples: Sequence[float], sigmas: float = 4.0) -> tuple:
    """(|mean|, bound): the bound is `sigmas` standard errors of the mean, computed from the samples."""
    n = len(samples)
    mean = sum(samples) / n
    var = sum((x - mean) ** 2 for x in samples) / (n - 1)
    return abs(mean), sigmas * math.sqrt(var / n)
