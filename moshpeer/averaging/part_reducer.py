"""The owner's side of an all-reduce, without sockets, threads or clocks: `PartReducer`; and the receiver's
record of averaged chunks: `GatherReceipts`.

`PartReducer` keeps, for each chunk of the part this peer owns, who delivered it and the weight that
arrived, and decides when the chunk is final: every other member delivered it or is known to send nothing
more (`member_finished`), or the caller says time is up (`finalize_all`). Finalizing writes the estimate of
the chunk's average into the owner's vector: the unbiased estimator of `estimator.py` for "mean", the robust
combination of `aggregation.py` for "clipped" / "trimmed". Members that sent nothing in the whole round are
"departed" and leave the weights. `GroupAllReduce` feeds it from its receiver threads; a test or a
simulator calls the same methods directly.

Concurrency: the reducer does not start threads or read clocks. It guards what several chunks share
(departed members, counters) with `lock`, and each chunk's own state with a lock made by `chunk_lock`
(default: no locking, for single-threaded callers). Decoding a chunk holds only that chunk's lock, so
receivers decode different chunks in parallel.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, List, Optional, Sequence

import torch

from moshpeer.averaging.aggregation import (DEFAULT_MAX_BUFFER_BYTES, cap_weights, check_aggregation, robust_combine,
                                            weight_cap_factor)
from moshpeer.averaging.estimator import estimate_over_sum
from moshpeer.averaging.partition import Partition
from moshpeer.compression.codec import Codec, NoCompression, all_finite
from moshpeer.errors import ProtocolError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """What became of a received chunk: accepted, refused (`rejected` says why: the sender broke the
    protocol), or neither (a late resend the loss budget stopped waiting for)."""

    accepted: bool
    rejected: str = ""


ACCEPTED = Verdict(True)
LATE = Verdict(False)


def _refuse(why: str) -> Verdict:
    return Verdict(False, why)


class PartReducer:
    """Bookkeeping and averaging of the part `my_index` owns in `flat` (modified in place when chunks finalize).

    :param flat: the all-reduce's 1-D fp32 vector; our part's values in it are our contribution until final
    :param weights: every member's declared averaging weight (capped here: `aggregation.cap_weights`)
    :param gather_codec: the all-gather codec; a lossy one encodes each final chunk once (`gather_payload`) and
        our values become its decoded bits, so that every member holds the same ones
    :param chunk_seed: (part, chunk) -> the codec seed of our encoding of that chunk
    :param aggregation: "mean", "clipped" or "trimmed"; distrusted: members "clipped" weighs at zero
    :param loss_budget: > 0: a chunk that arrives after its chunk is final is late, not a protocol violation
    :param buffer: numel -> an fp32 working buffer on flat's device (contents irrelevant); default: allocate
    :param lock, chunk_lock: see the module docstring
    :param on_final: called with each chunk as soon as it is final (with its chunk lock held), e.g. to wake the
        senders of its average
    Raises ValueError if a robust mode would buffer more than `max_buffer_bytes`.
    """

    def __init__(self, flat: torch.Tensor, partition: Partition, my_index: int, weights: Sequence[float], *,
                 gather_codec: Codec, chunk_seed: Callable[[int, int], int], aggregation: str = "mean",
                 distrusted: Iterable[int] = (), loss_budget: float = 0.0,
                 max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
                 buffer: Optional[Callable[[int], torch.Tensor]] = None,
                 lock: Optional[ContextManager] = None,
                 chunk_lock: Callable[[], ContextManager] = contextlib.nullcontext,
                 on_final: Callable[[int], None] = lambda chunk: None):
        self.flat, self.partition, self.my_index = flat, partition, my_index
        self.group_size = partition.group_size
        self.others = [i for i in range(self.group_size) if i != my_index]
        self.gather_codec, self.chunk_seed = gather_codec, chunk_seed
        self.aggregation = check_aggregation(aggregation)
        self.weights = cap_weights([float(w) for w in weights], weight_cap_factor(self.aggregation))
        self.distrusted = frozenset(distrusted) - {my_index}
        self.loss_budget = loss_budget
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._on_final = on_final
        buffer = buffer or (lambda numel: torch.empty(numel, dtype=torch.float32, device=flat.device))
        self.num_chunks = partition.num_chunks(my_index)
        start, end = partition.part_range(my_index)
        self.part_start, part_numel = start, end - start
        # S in estimator.py, per value. Not zeroed: a chunk's first arrival overwrites its slice (decode_into), later
        # ones accumulate, and a chunk that nobody delivered is never read (the estimate then keeps our value).
        self.others_sum = buffer(part_numel)
        # Robust modes: each member's contribution to our part, a row per member (ours stays in `flat`).
        self.contributions: Optional[torch.Tensor] = None
        if self.aggregation != "mean":
            if self.group_size * part_numel * 4 > max_buffer_bytes:
                raise ValueError(f"{self.aggregation} aggregation would buffer {self.group_size * part_numel * 4} "
                                 f"bytes, over the limit of {max_buffer_bytes}")
            self.contributions = buffer(self.group_size * part_numel).view(self.group_size, part_numel)
        # Per chunk of our part (under its chunk lock): who delivered it, the weight that arrived, final?
        self.chunk_locks = [chunk_lock() for _ in range(self.num_chunks)]
        self.arrived_from = [bytearray(self.group_size) for _ in range(self.num_chunks)]
        self.arrived_weight = [0.0] * self.num_chunks
        self.finalized = [False] * self.num_chunks
        # Lossy gather codec: each final chunk's encoding, made once at finalization.
        self.gather_payloads: List[Optional[torch.Tensor]] = [None] * self.num_chunks
        # Under `lock`:
        self.finalized_count = 0
        self.sent_any = bytearray(self.group_size)  # delivered at least one valid chunk
        self.finished = bytearray(self.group_size)  # will send no more chunks of our part
        self.departed: List[int] = []
        self.flagged = [0] * self.group_size
        self.nonfinite_averages = 0

    # ---- arrivals -----------------------------------------------------------------------------

    def add_contribution(self, member: int, part: int, chunk: int, payload: torch.Tensor, codec: Codec) -> Verdict:
        """Member `member` delivered (`part`, `chunk`) encoded with `codec`: check it and take it in. A refused
        chunk changes nothing. Does not finalize: call `finalize_ready((chunk,))` after an accepted one."""
        if part != self.my_index or not 0 <= chunk < self.num_chunks:
            return _refuse(f"reduce chunk ({part}, {chunk}) is not ours")
        start, end = self.partition.chunk_range(part, chunk)
        if payload.numel() > codec.max_encoded_nbytes(end - start):
            return _refuse(f"reduce chunk {chunk}: {payload.numel()} bytes for {end - start} values")
        lo, hi = start - self.part_start, end - self.part_start
        with self.chunk_locks[chunk]:
            if self.finalized[chunk]:
                if self.loss_budget > 0:  # a selective resend the budget stopped waiting for: late, not bad
                    return LATE
                return _refuse(f"reduce chunk {chunk} arrived after its deadline")
            if self.arrived_from[chunk][member]:
                return _refuse(f"duplicate reduce chunk {chunk}")
            with self._lock:
                departed = member in self.departed
            if departed:
                return _refuse(f"reduce chunk {chunk} from a member already counted as departed")
            try:
                if self.contributions is not None:  # robust: keep each member's values apart
                    codec.decode_into(payload, self.contributions[member, lo:hi])
                else:
                    decode = codec.decode_accumulate if any(self.arrived_from[chunk]) else codec.decode_into
                    decode(payload, self.others_sum[lo:hi], self.weights[member])
            except ProtocolError as e:
                return _refuse(f"reduce chunk {chunk}: {e}")
            self.arrived_from[chunk][member] = 1
            self.arrived_weight[chunk] += self.weights[member]
            with self._lock:
                self.sent_any[member] = 1
        return ACCEPTED

    def member_finished(self, member: int) -> None:
        """`member` will deliver no more chunks (its end marker, a closed connection, absent). Does not finalize:
        call `finalize_ready()` after."""
        with self._lock:
            self.finished[member] = 1

    # ---- finalization -------------------------------------------------------------------------

    @property
    def all_final(self) -> bool:
        return self.finalized_count == self.num_chunks

    def finalize_ready(self, chunks: Optional[Iterable[int]] = None) -> List[int]:
        """Finalize each of `chunks` (default: all) whose every other member delivered it or finished;
        -> the chunks finalized by this call."""
        done = []
        for c in range(self.num_chunks) if chunks is None else chunks:
            with self.chunk_locks[c]:
                if self.finalized[c]:
                    continue
                with self._lock:
                    ready = all(self.arrived_from[c][i] or self.finished[i] for i in self.others)
                if ready:
                    self._finalize_locked(c)
                    done.append(c)
        return done

    def finalize_all(self) -> List[int]:
        """Time is up (the reduce deadline, or the loss budget allows stopping): finalize every chunk not final
        yet with what arrived; -> the chunks finalized by this call."""
        done = []
        for c in range(self.num_chunks):
            with self.chunk_locks[c]:
                if not self.finalized[c]:
                    self._finalize_locked(c)
                    done.append(c)
        return done

    def _finalize_locked(self, c: int) -> None:
        """With chunk lock c held: write the estimate of chunk c's average into the flat vector."""
        with self._lock:
            # "Departed" is decided once per member and never revised within the round, so every chunk
            # of the part is estimated with the same set of weights.
            for i in self.others:
                if not self.sent_any[i] and i not in self.departed:
                    self.departed.append(i)
            present = [i for i in self.others if i not in self.departed]
        start, end = self.partition.chunk_range(self.my_index, c)
        lo, hi = start - self.part_start, end - self.part_start
        values = self.flat[start:end]
        # The average is computed beside our value and checked before it replaces it (no copy of our value).
        if self.contributions is None:
            average = estimate_over_sum(values, self.weights[self.my_index], self.others_sum[lo:hi],
                                        self.arrived_weight[c], sum(self.weights[i] for i in present))
        else:
            average = self._combine_robust(c, values, lo, hi)
        if average is not values:
            if all_finite(average):  # e.g. finite contributions can overflow in the sum
                values.copy_(average)
            else:
                with self._lock:
                    self.nonfinite_averages += 1
                logger.warning(f"average of chunk {c} is not finite: keeping and sending this peer's own value")
        self._encode_gather_chunk(c, values)
        self.finalized[c] = True
        with self._lock:
            self.finalized_count += 1
        self._on_final(c)

    def _combine_robust(self, c: int, values: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """With chunk lock c held: CenteredClip or trimmed mean of our value (`values`) and every contribution that
        arrived -> the aggregate (`values` itself when nothing arrived)."""
        me = self.my_index
        rows = [me] + [i for i in self.others if self.arrived_from[c][i]]
        if len(rows) == 1:
            return values
        self.contributions[me, lo:hi].copy_(values)  # our row: what it contributes is our own value
        if len(rows) == self.group_size:  # everyone's chunk arrived: the rows as they lie in the buffer
            rows, own = list(range(self.group_size)), me
            stacked = self.contributions[:, lo:hi]
        else:  # rows of members whose chunk never came hold no data: one gather copy of the others, ours first
            own = 0
            stacked = self.contributions[rows, lo:hi]
        weights = [0.0 if i in self.distrusted else self.weights[i] for i in rows]
        result, flagged = robust_combine(self.aggregation, stacked, weights, own)
        with self._lock:
            for i, hit in zip(rows, flagged.tolist()):
                self.flagged[i] += int(hit)
        return result

    def _encode_gather_chunk(self, c: int, values: torch.Tensor) -> None:
        """Encode final chunk c for the all-gather and replace our values by the decoded ones."""
        codec = self.gather_codec
        if isinstance(codec, NoCompression):
            return  # its payload is a view of the final values: nothing to precompute, nothing lost
        try:
            payload = codec.encode(values, seed=self.chunk_seed(self.my_index, c))
        except ValueError as e:  # non-finite average: the sender's own encode reports it
            logger.warning(f"cannot encode averaged chunk {c}: {e}")
            return
        codec.decode_into(payload, values)
        self.gather_payloads[c] = payload

    # ---- results ------------------------------------------------------------------------------

    def contributed(self) -> List[int]:
        """Per member index: the chunks of our part its contribution reached us in."""
        return [sum(arrived[i] for arrived in self.arrived_from) for i in range(self.group_size)]


class GatherReceipts:
    """The receiver's record of the averaged chunks (all-gather) it got from each part's owner."""

    def __init__(self, partition: Partition, my_index: int):
        self.others = [j for j in range(partition.group_size) if j != my_index]
        self.received = [bytearray(partition.num_chunks(j)) for j in range(partition.group_size)]
        self.partition = partition

    def check(self, owner: int, part: int, chunk: int, payload_nbytes: int, codec: Codec) -> Optional[str]:
        """Why a gather chunk (`part`, `chunk`) from `owner` must be refused, or None if it is acceptable."""
        if part != owner or not 0 <= chunk < len(self.received[owner]):
            return f"gather chunk ({part}, {chunk}) does not belong to member {owner}"
        start, end = self.partition.chunk_range(part, chunk)
        if payload_nbytes > codec.max_encoded_nbytes(end - start):
            return f"gather chunk {chunk}: {payload_nbytes} bytes for {end - start} values"
        if self.received[owner][chunk]:
            return f"duplicate gather chunk {chunk}"
        return None

    def note(self, owner: int, chunk: int) -> None:
        self.received[owner][chunk] = 1

    def complete(self, owner: int) -> bool:
        return all(self.received[owner])

    def missing(self) -> List[tuple]:
        """(part, chunk) averaged chunks never received, over every other member's part."""
        return [(j, c) for j in self.others for c, got in enumerate(self.received[j]) if not got]
