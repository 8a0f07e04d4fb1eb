"""When the loss budget lets a phase of an all-reduce stop waiting, and how much each sender may leave lost.

Pure decisions: times are passed in (`time.monotonic()` values from the caller, or a simulator's virtual
clock); nothing here reads a clock, sleeps or touches a socket. `GroupAllReduce` keeps one `PhaseArrivals`
per phase, notes every arrival, and asks `may_stop` while it waits.

Chunks still streaming in are not lost. A phase stops at the budget only once its arrivals have stalled for
BUDGET_STALL_GAPS mean inter-arrival gaps (and at least BUDGET_STALL_FLOOR_S), and once it has waited,
past its quorum, BUDGET_QUORUM_FACTOR times as long as the quorum took to arrive: a burst or a
retransmitting link, not the ordinary trickle of the last chunks, nor a machine that is slow all over (on a
loaded host every thread stalls now and then, and the whole round is slow in proportion).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moshpeer.averaging.partition import Partition

BUDGET_STALL_GAPS = 5.0
BUDGET_STALL_FLOOR_S = 0.05
BUDGET_QUORUM_FACTOR = 1.0


def quorum(loss_budget: float, expected: int) -> int:
    """Chunks that must arrive before the budget lets a phase stop: (1 - P) of those expected."""
    return math.ceil((1.0 - loss_budget) * expected)


@dataclass
class PhaseArrivals:
    """Arrival times of one phase under loss budget P (0.0: not yet). The caller sets `start` when the phase
    starts."""

    loss_budget: float = 0.0
    start: float = 0.0
    first: float = 0.0
    last: float = 0.0
    quorum_reached: float = 0.0

    def note(self, now: float, received: int, expected: int) -> None:
        """A chunk arrived at `now`; `received` (of `expected` in the phase) counts it."""
        self.last = now
        if not self.first:
            self.first = now
        if not self.quorum_reached and self.loss_budget > 0 and received >= quorum(self.loss_budget, expected):
            self.quorum_reached = now

    def may_stop(self, now: float, received: int, expected: int) -> bool:
        """Loss budget P (DBLP): enough of the phase arrived that the rest may be reconstructed, and the
        rest is overdue (arrivals stalled), not merely still on its way. Always False when P is 0."""
        return now >= self.earliest_stop(received, expected)

    def earliest_stop(self, received: int, expected: int) -> float:
        """When `may_stop` turns True if nothing more arrives: the last arrival plus BUDGET_STALL_GAPS mean gaps,
        and the quorum's time plus BUDGET_QUORUM_FACTOR times what the quorum took (each at least
        BUDGET_STALL_FLOOR_S), whichever is later; inf when P is 0 or fewer than the quorum arrived (a simulator
        asks this once per phase instead of polling)."""
        if self.loss_budget <= 0 or received < quorum(self.loss_budget, expected):
            return math.inf
        mean_gap = (self.last - self.first) / (received - 1) if received > 1 else 0.0
        reached = self.quorum_reached or self.last
        return max(self.last + max(BUDGET_STALL_FLOOR_S, BUDGET_STALL_GAPS * mean_gap),
                   reached + max(BUDGET_STALL_FLOOR_S, BUDGET_QUORUM_FACTOR * (reached - self.start)))


def allowance_share(loss_budget: float, partition: Partition, phase: str, sender: int, receiver: int) -> int:
    """How many chunks `sender` may leave lost on its stream of `phase` ("reduce" or "gather") to `receiver`.

    DBLP's budget is per receiver and phase: the receiver may miss floor(P x every chunk it expects in the
    phase, from all its senders). Each sender leaves at most its share of that lost, the shares split by
    sender rank so that they add up to the receiver's allowance without coordination.
    """
    senders = [k for k in range(partition.group_size) if k != receiver]
    if phase == "reduce":  # the receiver owns its part: every other member sends it its slice of that part
        expected = partition.num_chunks(receiver) * len(senders)
    else:  # each other member k sends the receiver its averaged part k
        expected = sum(partition.num_chunks(k) for k in senders)
    allowance = math.floor(loss_budget * expected + 1e-9)
    rank = senders.index(sender)
    return allowance // len(senders) + (1 if rank < allowance % len(senders) else 0)
