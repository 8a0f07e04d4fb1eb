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

import torch


def estimate_over_sum(
    own: torch.Tensor, own_weight: float, arrived_sum: torch.Tensor, arrived_weight: float, others_weight: float
) -> torch.Tensor:
    """The estimate above, written over `arrived_sum` (S, the weighted sum: scratch once a chunk is final) and
    returned, so that `own` stays intact until the caller has checked the result. Returns `own` itself when
    nothing arrived (or no others are left): then our own value is the estimate."""
    total = own_weight + others_weight
    if arrived_weight <= 0 or others_weight <= 0 or total <= 0:
        return own
    return arrived_sum.mul_(others_weight / (arrived_weight * total)).add_(own, alpha=own_weight / total)


def biased_estimate(
    own: torch.Tensor, own_weight: float, arrived_sum: torch.Tensor, arrived_weight: float
) -> torch.Tensor:
    """The biased alternative (own value always counted, divide by arrived weight); for tests and docs."""
    total = own_weight + arrived_weight
    if total <= 0:
        return own.clone()
    return (own * own_weight + arrived_sum) / total
