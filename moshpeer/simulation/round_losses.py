"""What lost chunks cost a group round's time in the training simulation, as production's loss budget decides it.

A receiver of a phase (an owner in the reduce phase, every member in the gather phase) waits for the chunks it
expects. Nothing it lost will come, so without a loss budget, or with more lost than the budget covers, it waits
until the round's deadline. With budget P (DBLP; `averaging/budget_stall.py`) it stops once at least (1 - P) of
them arrived and arrivals stalled: production's `PhaseArrivals.earliest_stop`, for arrivals spread evenly over the
phase. The round ends with its slowest receiver.

The chunks are the production layout of the model the clock moves (`Partition(model_params, ...).pipelined()`
with the averager's default chunk, `wire.DEFAULT_CHUNK_BYTES`), and each is lost on a link with probability
`chunk_loss`, independently in each phase. (The math, which trains a small stand-in, draws its own losses over
the stand-in's chunks: group_aggregation.py.)
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from moshpeer.averaging.budget_stall import PhaseArrivals, quorum
from moshpeer.averaging.partition import Partition
from moshpeer.averaging.wire import DEFAULT_CHUNK_BYTES


def phase_end(seconds: float, expected: int, missing: int, loss_budget: float) -> float:
    """When a receiver's phase that takes `seconds` ends with `missing` of its `expected` chunks lost: `seconds` if
    none is; with loss budget P, when production's `PhaseArrivals` lets it stop (arrivals spread evenly over the
    phase, then none); inf when P does not cover the loss (the receiver waits for the round's deadline)."""
    if missing <= 0:
        return seconds
    received = expected - missing
    if received <= 0 or loss_budget <= 0:
        return math.inf
    gap = seconds / received
    arrivals = PhaseArrivals(loss_budget, start=0.0, first=gap, last=seconds)
    needed = quorum(loss_budget, expected)
    if received >= needed:
        arrivals.quorum_reached = gap * max(needed, 1)
    return arrivals.earliest_stop(received, expected)


def lossy_round_seconds(rng: np.random.Generator, numel: int, part_sizes: Sequence[int], data_s: float,
                        chunk_loss: float, loss_budget: float) -> float:
    """The data plane's seconds of one group round (`data_s` without loss; half per phase) whose parts are
    `part_sizes` of a `numel`-value vector, when each chunk on each link is lost with probability `chunk_loss`:
    the slowest receiver of the reduce phase plus that of the gather phase; inf if one must wait for the deadline."""
    n = len(part_sizes)
    if chunk_loss <= 0 or n < 2:
        return data_s
    partition = Partition(numel, n, DEFAULT_CHUNK_BYTES // 4, sizes=list(part_sizes)).pipelined()
    chunks = np.array([partition.num_chunks(k) for k in range(n)])
    expected = {"reduce": chunks * (n - 1),  # an owner gets its part from every other member
                "gather": chunks.sum() - chunks}  # a member gets every other member's averaged part
    total = 0.0
    for phase in ("reduce", "gather"):
        missing = rng.binomial(expected[phase], chunk_loss)
        total += max(phase_end(data_s / 2, int(e), int(m), loss_budget) for e, m in zip(expected[phase], missing))
    return total
