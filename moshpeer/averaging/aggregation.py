"""How a part's owner combines its group's contributions: mean, CenteredClip or a trimmed mean.

Every mode first caps declared weights (`weight_cap_factor`, `cap_weights`): a member cannot buy
the average by announcing a huge weight. Then, per chunk of the owner's part:

- `mean`: the weighted mean, with loss-tolerant unbiased reconstruction (estimator.py). Cheapest;
  one hostile member moves the result arbitrarily far.
- `clipped`: CenteredClip (Karimireddy, He & Jaggi 2021; the aggregator of Gorbunov et al.'s BTARD):
  start from the owner's own value x_o, clip radius tau = CLIP_RADIUS_FACTOR x the median distance of
  the other contributions to x_o, then iterate (CLIP_ITERATIONS times)
  v <- v + sum_i w_i min(1, tau / |x_i - v|) (x_i - v) / sum_i w_i
  (on the n coefficients of v over the contributions, through their Gram matrix: two passes over the
  chunk's data in all, so a clipped round costs about what a mean round does).
  A contribution farther than tau from the result counts as clipped for its member. One farther than
  REJECT_RADIUS_FACTOR x `rejection_distance` from x_o (a median that counts x_o's own 0, so that colluders
  who are most of the others cannot set it) is weighed at zero from the start: clipping bounds a far
  contribution's pull to about tau / n per round, but does not remove it, and a value that far is no
  honest member's (see REJECT_RADIUS_FACTOR).
- `trimmed`: coordinate-wise trimmed mean: per value, drop the floor(TRIM_FRACTION x n) (at least one
  with three or more contributions) highest and lowest, average the rest (unweighted). A member most
  of whose values were trimmed in a chunk counts as trimmed there.

The robust modes need every contribution to a chunk at once, so the owner keeps each member's
decoded chunks (about the size of the averaged vector in all) instead of a running sum; a round
whose buffer would exceed `max_buffer_bytes` is refused. They aggregate what arrived: a lost
contribution simply is not there (no reweighting needed).
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from moshpeer.errors import UserError

AGGREGATIONS = ("mean", "clipped", "trimmed")
# A declared weight counts for at most this many times the group's median (positive) weight; in the
# robust modes for at most the median (a hostile member's pull on CenteredClip grows with its weight).
WEIGHT_CAP_FACTOR = 2.0
ROBUST_WEIGHT_CAP_FACTOR = 1.0
# Clip radius in median distances: at 2, honest contributions (whose distances to the center concentrate
# in high dimension) are practically never clipped, so a member that is flagged again and again stands out.
CLIP_RADIUS_FACTOR = 2.0
# Rejection radius in median distances. Honest members' distances to the owner's value concentrate (each is
# the norm of a difference of two noisy estimates of one mean), so in a chunk of more than a few values none
# is 10 median distances out; a member sending -100x its gradient is hundreds out. A hostile member that
# stays inside this radius is clipped instead, and weighed at zero once it becomes a suspect (suspects.py).
REJECT_RADIUS_FACTOR = 10.0
CLIP_ITERATIONS = 3
TRIM_FRACTION = 0.25
# A member counts as trimmed in a chunk when at least this fraction of its values was trimmed
# (an honest member of n loses about 2k/n of them to chance).
TRIMMED_MEMBER_FRACTION = 0.9
DEFAULT_MAX_BUFFER_BYTES = 4 << 30


def check_aggregation(name: str) -> str:
    """`name` if it is a known aggregation, else UserError."""
    if name not in AGGREGATIONS:
        raise UserError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {name!r}")
    return name


def weight_cap_factor(mode: str) -> float:
    """How many group medians a declared weight may reach under aggregation `mode`."""
    return WEIGHT_CAP_FACTOR if mode == "mean" else ROBUST_WEIGHT_CAP_FACTOR


def cap_weights(weights: Sequence[float], factor: float = WEIGHT_CAP_FACTOR) -> List[float]:
    """Each weight capped at `factor` x the median of the positive weights (all members compute the same)."""
    positive = sorted(w for w in weights if w > 0)
    if not positive:
        return [float(w) for w in weights]
    n = len(positive)
    median = positive[n // 2] if n % 2 else 0.5 * (positive[n // 2 - 1] + positive[n // 2])
    return [min(float(w), factor * median) for w in weights]


def alignments(gram: List[List[float]], numel: int, reference: Sequence[bool]) -> List[Optional[float]]:
    """Per row i of a chunk (its Gram matrix `gram`, rows of `numel` values): z_i = sqrt(numel) cos(x_i, mean of the
    other rows marked in `reference`), None where that is undefined (no other reference row, or a zero vector).

    The scale: two independent random vectors give z ~ N(0, 1), so z counts standard deviations of chance. Honest
    members' updates estimate one mean, so their z is positive on average however noisy each chunk is; a member
    that sends the reverse of its update has a negative one (suspects.py turns that into evidence over rounds)."""
    n = len(gram)
    kept = [j for j in range(n) if reference[j]]
    to_kept = [sum(row[j] for j in kept) for row in gram]  # x_i . (sum of the reference rows)
    kept_sq = sum(to_kept[j] for j in kept)  # |sum of the reference rows|^2
    result: List[Optional[float]] = []
    for i in range(n):
        mine = reference[i]  # then the others' sum is the reference sum less x_i
        cross = to_kept[i] - gram[i][i] if mine else to_kept[i]
        others_sq = kept_sq - 2 * to_kept[i] + gram[i][i] if mine else kept_sq
        norms = gram[i][i] * others_sq
        result.append(math.sqrt(numel) * cross / math.sqrt(norms) if len(kept) > int(mine) and norms > 1e-30 else None)
    return result


class Combined(NamedTuple):
    """What a robust aggregation made of one chunk's contributions (rows)."""

    values: torch.Tensor  # the aggregate
    flagged: torch.Tensor  # bool per row: clipped or trimmed (a rejected row counts as clipped too)
    rejected: List[bool]  # per row: farther than REJECT_RADIUS_FACTOR median distances, weighed at zero from the start
    alignments: List[Optional[float]]  # per row ("clipped" only): `alignments` against the rows that kept a weight


def centered_clip(values: torch.Tensor, weights: torch.Tensor, own: int = 0) -> Combined:
    """CenteredClip of the rows of `values` (n x d, fp32; row `own` the owner's own) -> `Combined`.

    Starts from the owner's own row: robust aggregation defends an honest owner against its contributors
    (a hostile owner is out of its reach anyway), and it saves a coordinate-wise median. Every iterate is a
    combination of the rows, v = beta . X (it starts at row `own`, and v <- (1 - sum s_i) v + sum s_i x_i),
    so the iteration runs on beta alone: with the Gram matrix G = X X^T, |x_i - v|^2 = G_ii - 2 (G beta)_i +
    beta.G.beta. The d-long rows are read twice in all (G, then the result), whatever the iteration count;
    `values` may be a strided view (rows of a larger buffer).
    """
    n = values.shape[0]
    if n == 1:
        return Combined(values[own].clone(), torch.zeros(1, dtype=torch.bool), [False], [None])
    # The iteration itself is n x n arithmetic: plain Python floats (float64), a few microseconds, where a
    # torch op per step would cost more than reading the rows.
    gram = (values @ values.T).double().tolist()

    def distances(beta: List[float]) -> List[float]:
        g_beta = [sum(g * b for g, b in zip(row, beta)) for row in gram]
        quadratic = sum(b * gb for b, gb in zip(beta, g_beta))
        return [math.sqrt(max(gram[i][i] - 2 * g_beta[i] + quadratic, 0.0)) for i in range(n)]

    beta = [0.0] * n
    beta[own] = 1.0
    from_own = distances(beta)
    # The clip radius from the others alone: with the owner's own zero among them, a group of two would never
    # average, and an honest member farther than twice the nearest one would be clipped (more chance flags).
    median = sorted(d for i, d in enumerate(from_own) if i != own)[(n - 2) // 2]  # the lower median
    tau = CLIP_RADIUS_FACTOR * median
    kept_weights = [float(w) for w in weights.tolist()]
    rejected = [False] * n
    if math.isfinite(tau) and tau > 0:
        reject_radius = REJECT_RADIUS_FACTOR * rejection_distance(from_own, own)
        rejected = [d > reject_radius for d in from_own]
        kept_weights = [0.0 if out else w for out, w in zip(rejected, kept_weights)]
        total = sum(kept_weights)
        shares = [w / total for w in kept_weights] if total > 0 else [0.0] * n
        for _ in range(CLIP_ITERATIONS):
            scale = [min(1.0, tau / max(d, 1e-30)) * share for d, share in zip(distances(beta), shares)]
            kept = 1.0 - sum(scale)
            beta = [b * kept + s for b, s in zip(beta, scale)]
        clipped = [out or d > tau * (1 + 1e-4) for out, d in zip(rejected, distances(beta))]
    else:
        clipped = [d > 0 for d in distances(beta)]
    coefficients = torch.tensor(beta, dtype=values.dtype, device=values.device)
    aligned = alignments(gram, values.shape[1], [w > 0 for w in kept_weights])
    return Combined(coefficients @ values, torch.tensor(clipped, dtype=torch.bool), rejected, aligned)


def rejection_distance(from_own: Sequence[float], own: int) -> float:
    """The distance the rejection radius is a multiple of: the lower median of the contributions' distances to the
    owner's value, its own 0 included. The owner counts itself: in a group of 4, two colluders are 2 of the 3
    others, and a median over the others alone would be one of theirs (two members sending 707x the signal moved
    the result by half of it, unflagged: issue 26). With its own 0 the median is the nearest other in a group of 3
    or 4, and the k-th nearest of 2k or 2k + 1 others: a part's owner and its honest members outvote hostile ones
    up to half of the others. Others at distance 0 (a member holding the owner's very value) do not count, and a
    group of two takes the other's distance: either would leave nothing to average."""
    others = sorted(d for i, d in enumerate(from_own) if i != own and d > 0)
    if len(others) < 2:
        return others[0] if others else 0.0
    return ([0.0] + others)[len(others) // 2]


def trimmed_mean(values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Coordinate-wise trimmed mean of the rows of `values` -> (aggregate, bool mask of mostly trimmed rows)."""
    n = values.shape[0]
    k = max(int(TRIM_FRACTION * n), 1) if n >= 3 else 0
    if k == 0:
        return values.mean(dim=0), torch.zeros(n, dtype=torch.bool)
    ordered, order = values.sort(dim=0)
    result = ordered[k : n - k].mean(dim=0)
    trimmed = torch.zeros_like(values, dtype=torch.bool)
    trimmed.scatter_(0, order[:k], True)
    trimmed.scatter_(0, order[n - k :], True)
    return result, trimmed.float().mean(dim=1) >= TRIMMED_MEMBER_FRACTION


# A robust mode needs a majority to tell the honest values from a hostile one: with two contributions (ours and
# one other) neither can be told apart, so a part of ours that fewer than this many members reached keeps our own
# value in "clipped" and "trimmed" (a hostile peer that forms groups of two moves nobody; issue 26).
MIN_ROBUST_CONTRIBUTIONS = 3


def robust_combine(mode: str, rows: torch.Tensor, weights: Sequence[float], own: int = 0) -> Combined:
    """Aggregate the contributions `rows` (n x d; row `own` the owner's) with `mode` ("clipped" or "trimmed").
    Only "clipped" rejects rows and measures alignments (from the Gram matrix it has). Raises ValueError for
    another mode."""
    if mode == "clipped":
        return centered_clip(rows, torch.tensor(weights, dtype=torch.float32), own)
    if mode == "trimmed":
        n = rows.shape[0]
        return Combined(*trimmed_mean(rows), [False] * n, [None] * n)
    raise ValueError(f"not a robust aggregation: {mode}")
