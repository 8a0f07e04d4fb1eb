"""The receiving side of a group all-reduce: one `PartReceiver.receive(i, ...)` per connection member i opened.

REDUCE chunks (i's contribution to our part) go to the `PartReducer`, which validates, decodes and accumulates
them; GATHER chunks (i's averaged part) are validated and decoded into the vector, once our own contribution to
them has left. Payloads land in consecutive rows of a batch inbox and a batch is decoded in O(1) backend calls;
the batch is taken in when it is full, at a phase change, or when the connection has been quiet for
`IDLE_FLUSH_S`, so that a chunk counts when it arrives. Shared state: round_context.py.
"""

from __future__ import annotations

import socket
import time

import torch

from moshpeer.averaging import handshake, wire
from moshpeer.averaging.frame_pump import RunReader
from moshpeer.averaging.handshake import FrameAuth
from moshpeer.averaging.part_sender import is_batched, pipeline_slices
from moshpeer.averaging.round_context import RoundContext
from moshpeer.errors import ProtocolError

# A receiver decodes the payloads it holds once its connection has been quiet this long (a pause, not a gap
# between two frames of a burst).
IDLE_FLUSH_S = 0.002


class PartReceiver:
    """Takes in what the other members of one all-reduce send us (see the module docstring)."""

    def __init__(self, ctx: RoundContext):
        self.ctx = ctx

    def receive(self, i: int, sock: socket.socket, auth: FrameAuth) -> bool:
        """Read member i's frames until its END_GATHER marker, its connection's end or the round's deadline:
        contributions to our part go to the reducer, averaged chunks of its part into the vector. -> True if the
        marker came (nothing of this round follows on the connection: it may be kept, kept_links.py). Raises what
        `FrameReader.read` raises (the caller ends the connection and gives up on i)."""
        reduce_codec, gather_codec = self.ctx.compression.reduce_codec, self.ctx.compression.gather_codec
        chunk_numel = self.ctx.partition.chunk_numel
        max_payload = max(reduce_codec.max_encoded_nbytes(chunk_numel), gather_codec.max_encoded_nbytes(chunk_numel))
        batched = is_batched(reduce_codec) or is_batched(gather_codec)
        if batched:
            # A pipeline slice of payloads lands in consecutive rows and is validated and decoded at once.
            most = max(self.ctx.num_my_chunks, self.ctx.partition.num_chunks(i), 1)
            inbox = self.ctx.staging.batch_inbox((max_payload + 3) & ~3, len(pipeline_slices(most, chunk_numel)[0]),
                                                 take=self.ctx.take_bytes)
        else:
            inbox = self.ctx.staging.inbox(max_payload)  # payloads are received into it, then (on a device) copied
        # Both phases batched: frames arrive a run at a time, each payload in the next row (frame_pump.py).
        frames = RunReader(handshake.FrameReader(sock, auth, tag=self.ctx.tag, max_payload=max_payload, inbox=inbox),
                           batched=is_batched(reduce_codec) and is_batched(gather_codec))
        pending = []  # (phase, part, chunk, nbytes) of the rows in the batch inbox, in arrival order
        wire.block_until(sock, self.ctx.deadline)
        try:
            while time.monotonic() < self.ctx.deadline:
                if pending and not wire.readable_within(sock, IDLE_FLUSH_S):
                    # The sender paused (a lost chunk, a slice being encoded): take in what has arrived rather
                    # than wait for a later chunk to fill the batch, so that it counts (for the loss budget, and
                    # for finalizing) when it arrives.
                    self._flush(i, inbox, pending)
                for frame in frames.read_run(pending[-1][0] if pending else 0, IDLE_FLUSH_S):
                    self._take(i, frame, inbox, pending, batched)
                    if frame.phase == wire.PHASE_END_GATHER:
                        return True
            return False
        finally:
            if batched and not self.ctx.closing:
                self._flush(i, inbox, pending)  # what arrived (MACs checked) before the connection ended

    def _take(self, i: int, frame, inbox, pending: list, batched: bool) -> None:
        """One frame from member i: an end marker, or a chunk into the batch (`pending`) or taken in at once."""
        reduce_codec, gather_codec = self.ctx.compression.reduce_codec, self.ctx.compression.gather_codec
        if frame.phase == wire.PHASE_END_REDUCE:
            self._flush(i, inbox, pending)
            self.ctx.reducer.member_finished(i)
            with self.ctx.cond:
                self.ctx.cond.notify_all()
            self.ctx.reducer.finalize_ready()
        elif frame.phase == wire.PHASE_END_GATHER:
            self._flush(i, inbox, pending)
            with self.ctx.cond:
                self.ctx.gather_finished[i] = 1
                self.ctx.cond.notify_all()
        else:
            reduce = frame.phase == wire.PHASE_REDUCE
            phase_stats = self.ctx.reduce if reduce else self.ctx.gather
            phase_stats.bytes_received += wire.HEADER.size + frame.payload_len
            codec = reduce_codec if reduce else gather_codec
            if batched and is_batched(codec):
                if pending and pending[-1][0] != frame.phase:
                    # the row just received starts the next batch: decode the others, keep it
                    self._decode_pending(i, inbox, pending)
                    inbox.restart_with(len(pending))
                    pending.clear()
                pending.append((frame.phase, frame.part, frame.chunk, frame.payload_len))
                if len(pending) == inbox.capacity:  # (not `inbox.full`: a run's later frames are in it already)
                    self._flush(i, inbox, pending)
            else:
                if batched:
                    self._decode_pending(i, inbox, pending)
                    pending.clear()
                if reduce:
                    self._on_reduce_chunk(i, frame.part, frame.chunk, frame.payload, codec)
                else:
                    self._on_gather_chunk(i, frame.part, frame.chunk, frame.payload, codec)
                if batched:
                    inbox.reset()

    def _flush(self, i: int, inbox, pending: list) -> None:
        if not pending:
            return
        self._decode_pending(i, inbox, pending)
        inbox.reset()
        pending.clear()

    def _decode_pending(self, i: int, inbox, pending: list) -> None:
        """Decode the batch of payloads in the first len(pending) rows of `inbox` (`pending`: their phase, part,
        chunk and size, in arrival order): one batch per run of consecutive chunks of one phase and part."""
        count = len(pending)
        if not count:
            return
        rows = inbox.rows()[:count]
        first = 0
        while first < count:
            phase, part, chunk, _ = pending[first]
            end = first + 1
            while end < count and pending[end][0] == phase and pending[end][1] == part and \
                    pending[end][2] == pending[end - 1][2] + 1:
                end += 1
            nbytes = [entry[3] for entry in pending[first:end]]
            if phase == wire.PHASE_REDUCE:
                self._on_reduce_chunks(i, part, chunk, rows[first:end], nbytes)
            else:
                self._on_gather_chunks(i, part, chunk, rows[first:end], nbytes)
            first = end

    def _on_reduce_chunks(self, i: int, part: int, first_chunk: int, rows: torch.Tensor, nbytes) -> None:
        codec = self.ctx.compression.reduce_codec
        verdicts = self.ctx.reducer.add_contributions(i, part, first_chunk, rows, nbytes, codec)
        accepted = []
        for r, verdict in enumerate(verdicts):
            if verdict.rejected:
                self.ctx.reject(i, verdict.rejected)
            elif verdict.accepted:
                accepted.append(first_chunk + r)
        if not accepted:
            return
        with self.ctx.cond:
            self.ctx.reduce.chunks_received += len(accepted)
            self.ctx.note_arrivals("reduce")
            if self.ctx.loss_budget > 0:
                self.ctx.cond.notify_all()  # the main thread checks the budget
        self.ctx.reducer.finalize_ready(accepted)

    def _on_gather_chunks(self, i: int, part: int, first_chunk: int, rows: torch.Tensor, nbytes) -> None:
        codec = self.ctx.compression.gather_codec
        count = len(nbytes)
        modes = []
        for r in range(count):
            why = self.ctx.receipts.check(i, part, first_chunk + r, nbytes[r], codec)
            if why is not None:
                self.ctx.reject(i, why)
            modes.append(None if why is not None else "into")
        errors: list = [None] * count
        r = 0
        while r < count:  # each run of acceptable rows (all of them, normally) in one batch
            if modes[r] is None:
                r += 1
                continue
            end = r + 1
            while end < count and modes[end] is not None:
                end += 1
            last = first_chunk + end - 1
            with self.ctx.cond:
                # Our own contribution to these chunks must have left before we overwrite them.
                if not self.ctx.wait(lambda: self.ctx.sent_progress[i] > last, self.ctx.deadline):
                    modes[r:] = [None] * (count - r)  # the round is over: these rows are not taken
                    break
            start = self.ctx.partition.chunk_range(part, first_chunk + r)[0]
            stop = self.ctx.partition.chunk_range(part, last)[1]
            # Straight into the vector; the codec validates every payload before writing it.
            errors[r:end] = codec.decode_chunks(rows[r:end], nbytes[r:end], self.ctx.flat[start:stop],
                                                self.ctx.partition.chunk_numel, modes[r:end])
            r = end
        received = 0
        for r in range(count):
            if modes[r] is None:
                continue
            if errors[r] is not None:
                self.ctx.reject(i, f"gather chunk {first_chunk + r}: {errors[r]}")
                continue
            received += 1
            self.ctx.receipts.note(i, first_chunk + r)
        if received:
            with self.ctx.cond:
                self.ctx.gather.chunks_received += received
                self.ctx.note_arrivals("gather")
                self.ctx.cond.notify_all()

    def _on_reduce_chunk(self, i: int, part: int, chunk: int, payload: torch.Tensor, codec) -> None:
        verdict = self.ctx.reducer.add_contribution(i, part, chunk, payload, codec)
        if verdict.rejected:
            return self.ctx.reject(i, verdict.rejected)
        if not verdict.accepted:
            return
        with self.ctx.cond:
            self.ctx.reduce.chunks_received += 1
            self.ctx.note_arrivals("reduce")
            if self.ctx.loss_budget > 0:
                self.ctx.cond.notify_all()  # the main thread checks the budget
        self.ctx.reducer.finalize_ready((chunk,))

    def _on_gather_chunk(self, i: int, part: int, chunk: int, payload, codec) -> None:
        why = self.ctx.receipts.check(i, part, chunk, payload.numel(), codec)
        if why is not None:
            return self.ctx.reject(i, why)
        with self.ctx.cond:
            # Our own contribution to this chunk must have left before we overwrite it.
            if not self.ctx.wait(lambda: self.ctx.sent_progress[i] > chunk, self.ctx.deadline):
                return
        start, end = self.ctx.partition.chunk_range(part, chunk)
        try:
            # One pass straight into the vector; the codec validates the whole payload before writing.
            codec.decode_into(payload, self.ctx.flat[start:end])
        except ProtocolError as e:
            return self.ctx.reject(i, f"gather chunk {chunk}: {e}")
        with self.ctx.cond:
            self.ctx.receipts.note(i, chunk)
            self.ctx.gather.chunks_received += 1
            self.ctx.note_arrivals("gather")
            self.ctx.cond.notify_all()
