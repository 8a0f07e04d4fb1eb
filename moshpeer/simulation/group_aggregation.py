"""One group's aggregation in the training simulation (`aggregate_group`): each member owns one part of the
workload vector and aggregates it with the production rules (`estimate_over_sum` for `mean`, `robust_combine` for
`clipped`/`trimmed` with at least MIN_ROBUST_CONTRIBUTIONS, weights capped by `cap_weights`, and for `clipped` each
owner's `SuspectTracker`), chunk by chunk where chunks can be lost."""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch

from moshpeer.averaging.aggregation import MIN_ROBUST_CONTRIBUTIONS, cap_weights, robust_combine, weight_cap_factor
from moshpeer.averaging.estimator import estimate_over_sum
from moshpeer.averaging.partition import Partition
from moshpeer.averaging.suspects import MemberEvidence, SuspectTracker
from moshpeer.simulation.training_config import TrainingConfig


def _tracker_of(suspects: Dict[int, SuspectTracker], peer: int) -> SuspectTracker:
    """The peer's tracker, made on first use (quiet: the simulator's thousands of owners would flood the log)."""
    tracker = suspects.get(peer)
    if tracker is None:
        tracker = suspects[peer] = SuspectTracker(warn=False)
    return tracker


def aggregate_group(config: TrainingConfig, rng: np.random.Generator, rows: np.ndarray, contributions: torch.Tensor,
                    weights: np.ndarray, dying: np.ndarray, averaged: torch.Tensor,
                    suspects: Optional[Dict[int, SuspectTracker]] = None) -> None:
    """Aggregate the group of `rows` (members that died in the round: `dying`) from what arrived, and write what
    each member got back into `averaged` (a receiver keeps its own value where nothing came back). `rng` draws
    the chunk losses. `suspects`: each peer's SuspectTracker by row, created on demand ("clipped" only)."""
    c = config
    n = rows.size
    ids = [str(int(row)) for row in rows]
    v = contributions[torch.from_numpy(rows)]
    dim = v.shape[1]
    w = cap_weights(weights[np.arange(n)].tolist(), weight_cap_factor(c.aggregation))
    present = ~dying
    # A receiver keeps its own (honest) value where nothing comes back; a hostile owner aggregates honestly,
    # from its own honest value (robust aggregation cannot defend against a lying owner anyway).
    own_values = averaged[torch.from_numpy(rows)]
    if c.aggregation == "mean" and c.chunk_loss == 0 and not dying.any():
        # One weighted mean for the whole vector: the same as per part, except that a hostile owner's own
        # share of its own part (1/n of 1/n of the vector) is counted as sent, not as honest.
        wt = torch.tensor(w, dtype=v.dtype)
        averaged[torch.from_numpy(rows)] = (wt @ v / wt.sum()).expand(n, dim)
        return
    partition = Partition(dim, n, c.chunk_numel).pipelined()
    result = own_values.clone()
    v = v.clone()
    wt = torch.tensor(w, dtype=v.dtype)
    for owner in range(n):
        if dying[owner]:
            continue  # its part never comes back: everybody keeps its own value there
        lo_part, hi_part = partition.part_range(owner)
        v[owner, lo_part:hi_part] = own_values[owner, lo_part:hi_part]
        # "clipped": the owner's production SuspectTracker weighs the members it distrusts at zero, and learns
        # from what it flagged and measured in this round's chunks of its part.
        tracker = None if suspects is None else _tracker_of(suspects, int(rows[owner]))
        distrusted = set(tracker.distrusted(ids)) - {owner} if tracker is not None else set()
        owner_w = [0.0 if i in distrusted else weight for i, weight in enumerate(w)]
        evidence = [MemberEvidence() for _ in range(n)]  # per member, as the peer's PartReducer counts it
        contributed = np.zeros(n, dtype=np.int64)
        for chunk in range(partition.num_chunks(owner)):
            lo, hi = partition.chunk_range(owner, chunk)
            arrived = present & (rng.random(n) >= c.chunk_loss)
            arrived[owner] = True
            if c.aggregation == "mean":
                others = present.copy()
                others[owner] = False
                got = arrived & others
                mask = torch.from_numpy(got).to(v.dtype)
                total = (wt * mask) @ v[:, lo:hi]
                value = estimate_over_sum(v[owner, lo:hi].clone(), w[owner], total, float((wt * mask).sum()),
                                          float(wt[torch.from_numpy(others)].sum()))
            else:
                idx = np.flatnonzero(arrived)
                contributed[idx[idx != owner]] += 1
                if idx.size < MIN_ROBUST_CONTRIBUTIONS:
                    value = v[owner, lo:hi]  # too few to outvote a hostile one: the owner keeps its own value
                else:
                    combined = robust_combine(c.aggregation, v[torch.from_numpy(idx), lo:hi],
                                              [owner_w[i] for i in idx], own=int(np.flatnonzero(idx == owner)[0]))
                    value = combined.values
                    for i, flagged, rejected, z in zip(idx, combined.flagged.tolist(), combined.rejected,
                                                       combined.alignments):
                        evidence[i].note(flagged, rejected, z)
            back = present & (rng.random(n) >= c.chunk_loss)
            back[owner] = True
            result[torch.from_numpy(back), lo:hi] = value
        if tracker is not None:
            for seen, chunks in zip(evidence, contributed.tolist()):
                seen.contributed = chunks
            tracker.record_round(ids, evidence)
    averaged[torch.from_numpy(rows)] = result
