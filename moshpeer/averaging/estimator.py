"""Reconstructing a part's average from the contributions that arrived (loss-tolerant, unbiased).

The owner of a part always has its own value x_o (weight w_o); each other member i (weight w_i) is
"present" unless it departed (sent nothing in the whole round). Let A be the set of present others
whose chunk arrived, W = sum of present others' weights, S = sum_{i in A} w_i x_i, a = sum_{i in A} w_i:

    avg = (w_o x_o + W * S / a) / (w_o + W)         (a > 0)
    avg = x_o                                       (a == 0: nothing to estimate the others from)

Why: the true average is (w_o x_o + W m) / (w_o + W) with m the weighted mean of the present
others. Under i.i.d. chunk loss with equal weights, A given |A| = k is a uniformly random k-subset,
and the mean of a uniformly random subset is an unbiased estimate of m; so E[avg | a > 0] is the
true average. With unequal weights S / a is the classical ratio estimator: consistent, with a bias
of order Var(a) / E[a]^2 that vanishes as loss -> 0. The owner's own value enters with its true
share w_o / (w_o + W) whatever was lost, so it cannot pull the estimate toward itself.

The "divide by what arrived" estimator `(w_o x_o + S) / (w_o + a)` (own value always counted) gives
the owner a larger share whenever something is lost: biased toward x_o. `biased_estimate` keeps it
for the tests that show the difference.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from moshpeer.compression.kernels import backend_for


def _coefficients(own_weight: float, arrived_weight: float, others_weight: float) -> Optional[Tuple[float, float]]:
    """(k_sum, k_own) with avg = S * k_sum + x_o * k_own; None when our own value is the estimate (nothing arrived,
    or no others are left)."""
    total = own_weight + others_weight
    if arrived_weight <= 0 or others_weight <= 0 or total <= 0:
        return None
    return others_weight / (arrived_weight * total), own_weight / total


def estimate_over_sum(
    own: torch.Tensor, own_weight: float, arrived_sum: torch.Tensor, arrived_weight: float, others_weight: float
) -> torch.Tensor:
    """The estimate above, written over `arrived_sum` (S, the weighted sum: scratch once a chunk is final) and
    returned, so that `own` stays intact until the caller has checked the result. Returns `own` itself when
    nothing arrived (or no others are left): then our own value is the estimate."""
    k = _coefficients(own_weight, arrived_weight, others_weight)
    if k is None:
        return own
    return arrived_sum.mul_(k[0]).add_(own, alpha=k[1])


def estimate_chunks_into_own(own: torch.Tensor, own_weight: float, arrived_sum: torch.Tensor, arrived_weight: float,
                             others_weight: float, chunk_numel: int) -> Optional[List[int]]:
    """`estimate_over_sum`, written into `own` chunk by chunk (of `chunk_numel` values; the last may be shorter)
    wherever it is finite: a finite contribution can still overflow in the sum. -> per chunk, 1 if its estimate
    was not finite (`own` keeps its values there), else 0; None when `own` is the estimate and nothing was
    written. `arrived_sum` is scratch afterwards. On the CPU one compiled pass per chunk blends and checks it, and
    the copy follows while it is in cache (kernels.reference.estimate_chunks has the contract)."""
    k = _coefficients(own_weight, arrived_weight, others_weight)
    if k is None:
        return None
    return backend_for(own.device).estimate_chunks(arrived_sum, own, chunk_numel, k[0], k[1])


def biased_estimate(
    own: torch.Tensor, own_weight: float, arrived_sum: torch.Tensor, arrived_weight: float
) -> torch.Tensor:
    """The biased alternative (own value always counted, divide by arrived weight); for tests and docs."""
    total = own_weight + arrived_weight
    if total <= 0:
        return own.clone()
    return (own * own_weight + arrived_sum) / total
