"""What one group all-reduce's parts share: its settings, its owner's reducer, and the state its threads change.

`GroupAllReduce` (allreduce.py) builds one `RoundContext` per all-reduce and hands it to its senders
(`PartSender`, part_sender.py) and receivers (`PartReceiver`, part_receiver.py). The settings never change once
the round runs; the mutable fields below `cond` are read and written with `cond` held (each chunk of the
reducer has a lock of its own, see part_reducer.py), and every wait on `cond` is bounded by a deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, List, Optional

import torch

from moshpeer.averaging.budget_stall import PhaseArrivals
from moshpeer.averaging.links import Links
from moshpeer.averaging.part_reducer import GatherReceipts, PartReducer
from moshpeer.averaging.partition import Partition
from moshpeer.averaging.report import DataPlaneStats, PhaseStats
from moshpeer.averaging.staging import HostStaging
from moshpeer.averaging.uplink import UplinkMeter
from moshpeer.compression.codec import Compression

logger = logging.getLogger(__name__)

# With a loss budget, how often a waiting phase re-checks whether its arrivals stalled (budget_stall.py).
BUDGET_POLL_S = 0.01
# `sent_progress` of a sender that will send no more reduce chunks.
DONE = float("inf")


class RoundContext:
    """One all-reduce's shared settings and state (see the module docstring)."""

    def __init__(self, *, flat: torch.Tensor, partition: Partition, my_index: int, tag: bytes,
                 compression: Compression, loss_budget: float, staging: HostStaging, links: Links,
                 deadline: float, reduce_deadline: float, chunk_seed: Callable[[int, int], int],
                 reducer: PartReducer, cond: threading.Condition,
                 take_bytes: Optional[Callable[[int], torch.Tensor]] = None):
        self.flat, self.partition, self.my_index, self.tag = flat, partition, my_index, tag
        self.group_size = partition.group_size
        self.others = [i for i in range(self.group_size) if i != my_index]
        self.compression, self.loss_budget, self.staging, self.links = compression, loss_budget, staging, links
        self.deadline, self.reduce_deadline, self.chunk_seed = deadline, reduce_deadline, chunk_seed
        self.reducer, self.num_my_chunks = reducer, reducer.num_chunks
        self.receipts = GatherReceipts(partition, my_index)
        self.cond = cond
        # Byte buffers for encoded slices and inboxes, lent for this all-reduce (scratch.py); default: fresh ones.
        self.take_bytes = take_bytes or (lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, device=flat.device))
        # Guarded by cond:
        self.stats = DataPlaneStats()  # what this all-reduce did: counted into while it runs
        self.inbound_admitted = bytearray(self.group_size)  # one authenticated connection per member
        self.gather_finished = bytearray(self.group_size)  # member will send no more GATHER chunks
        self.inbound_ended = bytearray(self.group_size)  # member's connection to us is no longer read
        self.sent_progress = [0.0] * self.group_size  # how many REDUCE chunks our sender to j is past
        self.senders_done = 0
        self.sockets: List = []  # to close at teardown
        self.threads: List[threading.Thread] = []  # to join at teardown
        self.closing = False
        self.reduce_done_at: Optional[float] = None
        self.arrivals = {"reduce": PhaseArrivals(loss_budget), "gather": PhaseArrivals(loss_budget)}
        self.uplink: Optional[UplinkMeter] = None  # set when the round starts, before any sender

    @property
    def reduce(self) -> PhaseStats:
        return self.stats.reduce

    @property
    def gather(self) -> PhaseStats:
        return self.stats.gather

    def wait(self, predicate: Callable[[], bool], deadline: float) -> bool:
        """With cond held: wait until predicate() or the deadline; returns predicate()."""
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.cond.wait(min(remaining, BUDGET_POLL_S if self.loss_budget > 0 else 1.0))
        return True

    def within_budget(self, stats: PhaseStats, phase: str, now: float) -> bool:
        """With cond held: may `phase` stop waiting at the loss budget at `now` (budget_stall.py)?"""
        return self.arrivals[phase].may_stop(now, stats.chunks_received, stats.chunks_expected)

    def note_arrivals(self, phase: str) -> None:
        """With cond held: record `phase`'s arrivals so far (budget_stall.py decides from them when it stalled)."""
        stats = self.stats.reduce if phase == "reduce" else self.stats.gather
        self.arrivals[phase].note(time.monotonic(), stats.chunks_received, stats.chunks_expected)

    def give_up_on(self, j: int) -> None:
        """Member j is not in this round (unreachable, refused our hello) or its connection ended: expect nothing
        more from it."""
        self.reducer.member_finished(j)
        with self.cond:
            self.gather_finished[j] = 1
            self.cond.notify_all()
        self.reducer.finalize_ready()

    def outbound_broke(self, j: int) -> None:
        """Our connection to member j broke or j closed its end: we can send j nothing more. That says nothing of
        what j sends us, which comes over j's own connection: j may simply have had all it needed and closed
        first, with its averaged part still on its way to us. So while j has a connection to us, its receiver
        decides when j is done (its end marker, the connection's end, the deadline); without one, expect nothing
        more from j."""
        with self.cond:
            inbound = bool(self.inbound_admitted[j])
        if not inbound:
            self.give_up_on(j)

    def reject(self, i: int, why: str) -> None:
        """Count and log a message from member i that was refused (it changed nothing)."""
        with self.cond:
            self.stats.rejected_messages += 1
        logger.warning(f"data plane: rejected a message from member {i}: {why}")
