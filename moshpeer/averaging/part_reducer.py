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
from dataclasses import dataclass, replace
from typing import Callable, ContextManager, Iterable, List, Optional, Sequence

import torch

from moshpeer.averaging.aggregation import (DEFAULT_MAX_BUFFER_BYTES, MIN_ROBUST_CONTRIBUTIONS, cap_weights,
                                            check_aggregation, robust_combine, weight_cap_factor)
from moshpeer.averaging.estimator import estimate_chunks_into_own
from moshpeer.averaging.partition import Partition
from moshpeer.averaging.suspects import MemberEvidence
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
        self._buffer = buffer
        self._gather_rows_buffer: Optional[torch.Tensor] = None  # the part's gather payloads, a row per chunk
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
        # ... and, for a codec with `encode_chunks`, (the batch it was encoded in, its row): senders stage a run of
        # rows of one batch with one copy.
        self.gather_rows: List[Optional[tuple]] = [None] * self.num_chunks
        # Under `lock`:
        self.finalized_count = 0
        self.sent_any = bytearray(self.group_size)  # delivered at least one valid chunk
        self.finished = bytearray(self.group_size)  # will send no more chunks of our part
        self.departed: List[int] = []
        # Members with a chunk that came after we stopped waiting for it at the deadline (finalized, or they were
        # counted departed; not with a loss budget, which stops waiting by choice): alive, but slower than the
        # deadline, which a deadline learner must tell from a member that sent nothing.
        self.late: List[int] = []
        self._evidence = [MemberEvidence() for _ in range(self.group_size)]  # robust modes: suspects.py's input
        self.nonfinite_averages = 0
        self.robust_too_few = 0  # chunks a robust mode kept our value for: others arrived, fewer than a quorum

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
                self._note_late(member)
                if self.loss_budget > 0:  # a selective resend the budget stopped waiting for: late, not bad
                    return LATE
                return _refuse(f"reduce chunk {chunk} arrived after its deadline")
            if self.arrived_from[chunk][member]:
                return _refuse(f"duplicate reduce chunk {chunk}")
            with self._lock:
                departed = member in self.departed
            if departed:
                self._note_late(member)
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

    def add_contributions(self, member: int, part: int, first_chunk: int, rows: torch.Tensor, nbytes: Sequence[int],
                          codec: Codec) -> List[Verdict]:
        """Member `member` delivered chunks first_chunk, first_chunk + 1, ... of `part`: row r of `rows` (2-D uint8,
        nbytes[r] of it meaningful) is chunk first_chunk + r, encoded with `codec` (one with `decode_chunks`).
        Each chunk is checked and taken in as `add_contribution` would, but the whole batch is validated and
        decoded in O(1) codec backend calls (quantization.py). -> one verdict per row; a refused chunk changes
        nothing, the others are taken in. Does not finalize."""
        count = rows.shape[0]
        chunks = range(first_chunk, first_chunk + count)
        if part != self.my_index or first_chunk < 0 or first_chunk + count > self.num_chunks:
            return [_refuse(f"reduce chunk ({part}, {c}) is not ours") for c in chunks]
        verdicts: List[Optional[Verdict]] = [None] * count
        for r, c in enumerate(chunks):
            start, end = self.partition.chunk_range(part, c)
            if nbytes[r] > codec.max_encoded_nbytes(end - start):
                verdicts[r] = _refuse(f"reduce chunk {c}: {nbytes[r]} bytes for {end - start} values")
        first_start = self.partition.chunk_range(part, first_chunk)[0]
        last_end = self.partition.chunk_range(part, first_chunk + count - 1)[1]
        lo, hi = first_start - self.part_start, last_end - self.part_start
        with contextlib.ExitStack() as held:
            for c in chunks:  # ascending, as every holder of several chunk locks takes them
                held.enter_context(self.chunk_locks[c])
            with self._lock:
                departed = member in self.departed
            modes: List[Optional[str]] = [None] * count
            for r, c in enumerate(chunks):
                if verdicts[r] is not None:
                    continue
                if self.finalized[c]:
                    self._note_late(member)
                    verdicts[r] = LATE if self.loss_budget > 0 else _refuse(f"reduce chunk {c} arrived after its deadline")
                elif self.arrived_from[c][member]:
                    verdicts[r] = _refuse(f"duplicate reduce chunk {c}")
                elif departed:
                    self._note_late(member)
                    verdicts[r] = _refuse(f"reduce chunk {c} from a member already counted as departed")
                elif self.contributions is not None:
                    modes[r] = "into"
                else:
                    modes[r] = "add" if any(self.arrived_from[c]) else "into"
            if any(modes):
                if self.contributions is not None:
                    out, weight = self.contributions[member, lo:hi], 1.0
                else:
                    out, weight = self.others_sum[lo:hi], self.weights[member]
                errors = codec.decode_chunks(rows, nbytes, out, self.partition.chunk_numel, modes, weight)
                for r, c in enumerate(chunks):
                    if modes[r] is None:
                        continue
                    if errors[r] is not None:
                        verdicts[r] = _refuse(f"reduce chunk {c}: {errors[r]}")
                        continue
                    self.arrived_from[c][member] = 1
                    self.arrived_weight[c] += self.weights[member]
                    verdicts[r] = ACCEPTED
                if any(v is ACCEPTED for v in verdicts):
                    with self._lock:
                        self.sent_any[member] = 1
        return verdicts

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
        -> the chunks finalized by this call (together: see `_finalize_many_locked`)."""
        candidates = sorted(set(range(self.num_chunks) if chunks is None else chunks))
        with contextlib.ExitStack() as held:
            for c in candidates:  # ascending, as every holder of several chunk locks takes them
                held.enter_context(self.chunk_locks[c])
            with self._lock:
                finished = bytes(self.finished)
            done = [c for c in candidates if not self.finalized[c]
                    and all(self.arrived_from[c][i] or finished[i] for i in self.others)]
            self._finalize_many_locked(done)
        return done

    def finalize_all(self) -> List[int]:
        """Time is up (the reduce deadline, or the loss budget allows stopping): finalize every chunk not final
        yet with what arrived; -> the chunks finalized by this call."""
        with contextlib.ExitStack() as held:
            for c in range(self.num_chunks):
                held.enter_context(self.chunk_locks[c])
            done = [c for c in range(self.num_chunks) if not self.finalized[c]]
            self._finalize_many_locked(done)
        return done

    def _note_late(self, member: int) -> None:
        if self.loss_budget > 0:  # the budget may have chosen to stop waiting: that says nothing of the deadline
            return
        with self._lock:
            if member not in self.late:
                self.late.append(member)

    def _finalize_locked(self, c: int) -> None:
        """With chunk lock c held: write the estimate of chunk c's average into the flat vector."""
        self._finalize_many_locked([c])

    def _finalize_many_locked(self, chunks: List[int]) -> None:
        """With the chunk locks of `chunks` (ascending) held: write the estimate of each one's average into the flat
        vector, then encode them for the all-gather. Runs of consecutive chunks whose contributions carry the same
        weight are estimated in one pass and checked with one read-back; a lossy gather codec with
        `encode_chunks` encodes (and decodes back) a run in O(1) backend calls."""
        if not chunks:
            return
        with self._lock:
            # "Departed" is decided once per member and never revised within the round, so every chunk
            # of the part is estimated with the same set of weights.
            for i in self.others:
                if not self.sent_any[i] and i not in self.departed:
                    self.departed.append(i)
            present = [i for i in self.others if i not in self.departed]
        present_weight = sum(self.weights[i] for i in present)
        for run in self._runs(chunks, key=lambda c: self.arrived_weight[c]):
            if self.contributions is None:
                self._estimate_run(run, present_weight)
            else:
                for c in run:
                    start, end = self.partition.chunk_range(self.my_index, c)
                    values = self.flat[start:end]
                    self._accept_average(c, values, self._combine_robust(c, values, start - self.part_start,
                                                                         end - self.part_start))
        for run in self._runs(chunks):
            self._encode_gather_run(run)
        for c in chunks:
            self.finalized[c] = True
            with self._lock:
                self.finalized_count += 1
            self._on_final(c)

    @staticmethod
    def _runs(chunks: List[int], key=lambda c: None) -> List[List[int]]:
        """`chunks` (ascending) cut into runs of consecutive chunks with the same key."""
        runs: List[List[int]] = []
        for c in chunks:
            if runs and runs[-1][-1] == c - 1 and key(runs[-1][-1]) == key(c):
                runs[-1].append(c)
            else:
                runs.append([c])
        return runs

    def _range_of(self, run: List[int]):
        start = self.partition.chunk_range(self.my_index, run[0])[0]
        end = self.partition.chunk_range(self.my_index, run[-1])[1]
        return start, end

    def _estimate_run(self, run: List[int], present_weight: float) -> None:
        start, end = self._range_of(run)
        lo, hi = start - self.part_start, end - self.part_start
        # Computed beside our value and written over it only where finite (no copy of our value is kept).
        refused = estimate_chunks_into_own(self.flat[start:end], self.weights[self.my_index], self.others_sum[lo:hi],
                                           self.arrived_weight[run[0]], present_weight, self.partition.chunk_numel)
        for c, bad in zip(run, refused or ()):
            if bad:
                self._note_nonfinite(c)

    def _accept_average(self, c: int, values: torch.Tensor, average: torch.Tensor) -> None:
        if average is values:
            return
        if all_finite(average):  # e.g. finite contributions can overflow in the sum
            values.copy_(average)
        else:
            self._note_nonfinite(c)

    def _note_nonfinite(self, c: int) -> None:
        with self._lock:
            self.nonfinite_averages += 1
        logger.warning(f"average of chunk {c} is not finite: keeping and sending this peer's own value")

    def _encode_gather_run(self, run: List[int]) -> None:
        """Encode the final chunks of `run` for the all-gather and replace our values by the decoded ones."""
        codec = self.gather_codec
        if isinstance(codec, NoCompression):
            return  # its payload is a view of the final values: nothing to precompute, nothing lost
        if not getattr(codec, "batched", False):
            for c in run:
                self._encode_gather_chunk(c, self.flat[slice(*self.partition.chunk_range(self.my_index, c))])
            return
        start, end = self._range_of(run)
        values = self.flat[start:end]
        stride = codec.row_stride(self.partition.chunk_numel)
        with self._lock:  # one buffer for the whole part (from the scratch pool when there is one): runs fill rows
            if self._gather_rows_buffer is None:
                self._gather_rows_buffer = self._buffer(-(-self.num_chunks * stride // 4)).view(torch.uint8)
        encoded = codec.encode_chunks(values, self.partition.chunk_numel,
                                      [self.chunk_seed(self.my_index, c) for c in run],
                                      out=self._gather_rows_buffer[run[0] * stride:])
        modes = [None if error else "into" for error in encoded.errors]
        for c, error in zip(run, encoded.errors):
            if error:  # non-finite average: the sender's own encode reports it
                logger.warning(f"cannot encode averaged chunk {c}: {error}")
        codec.decode_chunks(encoded.buffer, encoded.nbytes, values, self.partition.chunk_numel, modes)
        for r, c in enumerate(run):
            if modes[r] is not None:
                self.gather_payloads[c] = encoded.buffer[r, :encoded.nbytes[r]]
                self.gather_rows[c] = (encoded, r)

    def _combine_robust(self, c: int, values: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """With chunk lock c held: CenteredClip or trimmed mean of our value (`values`) and every contribution that
        arrived -> the aggregate; `values` itself when fewer than MIN_ROBUST_CONTRIBUTIONS (ours included) are there
        (counted in `robust_too_few` when some other arrived)."""
        me = self.my_index
        rows = [me] + [i for i in self.others if self.arrived_from[c][i]]
        if len(rows) < MIN_ROBUST_CONTRIBUTIONS:  # too few to outvote a hostile one: keep our own value
            if len(rows) > 1:
                with self._lock:
                    self.robust_too_few += 1
            return values
        self.contributions[me, lo:hi].copy_(values)  # our row: what it contributes is our own value
        if len(rows) == self.group_size:  # everyone's chunk arrived: the rows as they lie in the buffer
            rows, own = list(range(self.group_size)), me
            stacked = self.contributions[:, lo:hi]
        else:  # rows of members whose chunk never came hold no data: one gather copy of the others, ours first
            own = 0
            stacked = self.contributions[rows, lo:hi]
        weights = [0.0 if i in self.distrusted else self.weights[i] for i in rows]
        combined = robust_combine(self.aggregation, stacked, weights, own)
        with self._lock:
            for i, flagged, rejected, z in zip(rows, combined.flagged.tolist(), combined.rejected, combined.alignments):
                self._evidence[i].note(flagged, rejected, z)
        return combined.values

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

    def member_contribution(self, member: int) -> Optional[torch.Tensor]:
        """A copy of what `member` contributed to our part, NaN where its chunk did not arrive; None in "mean" mode
        (contributions are summed as they arrive, not kept apart) or for our own index. What a spot check compares
        with its recomputation (moshpeer/peer/accountability/)."""
        if self.contributions is None or member == self.my_index:
            return None
        values = self.contributions[member].clone()
        for c in range(self.num_chunks):
            if not self.arrived_from[c][member]:
                start, end = self.partition.chunk_range(self.my_index, c)
                values[start - self.part_start:end - self.part_start] = float("nan")
        return values

    def evidence(self) -> List[MemberEvidence]:
        """Per member index: what robust aggregation saw of its contributions so far (a copy)."""
        with self._lock:
            return [replace(e, contributed=contributed, alignment=replace(e.alignment))
                    for contributed, e in zip(self.contributed(), self._evidence)]


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
