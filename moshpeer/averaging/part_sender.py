"""The sending side of a group all-reduce: one `PartSender.run(j)` thread per other member j.

On its own outgoing connection to j it sends, first, this peer's contribution to part j (reduce-scatter), a
pipeline slice of chunks at a time (`PART_SLICES`), then an END_REDUCE marker; then the chunks of this peer's own
part as each one is finalized (all-gather), then END_GATHER. A batched codec encodes a slice in O(1) backend calls
(`encode_chunks`); a raw one (`none`) sends a slice straight from the vector. On a device the next slice is
encoded and staged while this one is on the wire (staging.py). Shared state: round_context.py.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from moshpeer.averaging import wire
from moshpeer.averaging.budget_stall import allowance_share
from moshpeer.averaging.dataplane import _close
from moshpeer.averaging.links import ChunkStream, StreamSpec, WireStream, send_run
from moshpeer.averaging.member_connector import LIBP2P, MemberConnector, OutboundLink, peer_closed
from moshpeer.averaging.round_context import DONE, RoundContext
from moshpeer.averaging.staging import Outbox

logger = logging.getLogger(__name__)

# While a sender waits for chunks to be finalized, how often it checks that its peer is still there.
PEER_CHECK_SECONDS = 0.05
# A part's chunks go through the codec in at most this many batches ("pipeline slices") per direction: encoding
# slice k+1 overlaps sending slice k, and host syncs per part are bounded independently of its chunk count. Two, not
# four: each batch costs the interpreter the same whatever its size (the views, checks and calls of an encode or a
# decode: ~30% of a CPU round's time is in the interpreter), and an int8 round on a 2-core host ran ~8% faster
# (docs/benchmarks.md, session 31); on a device the first slice's copy to host memory is still overlapped.
PART_SLICES = 2
# ... and a slice holds at least this many bytes of the part's fp32 values: what overlapping a smaller one hides
# (encoding 16 MiB takes ~3 ms on a CPU core) is less than a batch costs, and a 16 MB part in one slice made an
# int8 round on the 2-core host ~10% faster (docs/benchmarks.md, session 32).
MIN_SLICE_BYTES = 16 << 20


def pipeline_slices(num_chunks: int, chunk_numel: int, slices: int = PART_SLICES):
    """range(num_chunks) (chunks of `chunk_numel` fp32 values) cut into at most `slices` consecutive ranges of equal
    length, each of at least MIN_SLICE_BYTES of values (the last may be shorter)."""
    size = max(1, -(-num_chunks // slices), MIN_SLICE_BYTES // (4 * max(chunk_numel, 1)))
    return [range(first, min(num_chunks, first + size)) for first in range(0, num_chunks, size)]


def encode_runs(num_chunks: int, chunk_numel: int, device: torch.device):
    """The runs of a part's chunks that a sender encodes with one `encode_chunks` call each. On a device, the whole
    part: there the host work of a call, not its kernel, bounds the encode (on an H200 a 64 MB slice's kernel runs
    ~32 us, the call around it ~55 us, so four slices ran at 0.5 of a device copy and one call at 0.8); its bytes
    still go to host memory a pipeline slice at a time. On the CPU, each pipeline slice just before it is sent."""
    if device.type != "cpu" and num_chunks:
        return [range(num_chunks)]
    return pipeline_slices(num_chunks, chunk_numel)


def is_batched(codec) -> bool:
    """Does `codec` take a pipeline slice of chunks at a time (`decode_chunks`, and `encode_chunks` unless raw)?"""
    return bool(getattr(codec, "batched", False))


def is_raw(codec) -> bool:
    """Is a payload of `codec` the chunk's own bytes (so a run of chunks is sent straight from the vector)?"""
    return bool(getattr(codec, "raw", False))


class PartSender:
    """Sends this peer's chunks to the other members of one all-reduce (see the module docstring)."""

    def __init__(self, ctx: RoundContext, connector: MemberConnector):
        self.ctx, self.connector = ctx, connector

    def run(self, j: int) -> None:
        """The thread that sends to member j: our contribution to part j, then our averaged part as it becomes
        final. Never raises: a broken connection means j left (nothing more is expected from it)."""
        try:
            link = self.connector.reach(j)
            if link is None:
                if not self.ctx.closing:
                    logger.warning(f"group member {j} is absent from this round; averaging without it")
                    with self.ctx.cond:
                        self.ctx.stats.absent.append(j)
                self.ctx.give_up_on(j)
                return
            with self.ctx.cond:
                self.ctx.stats.connections_kept += link.rebound
                if link.relayed:
                    self.ctx.stats.relayed.append(j)
                if link.path == LIBP2P:
                    self.ctx.stats.over_libp2p.append(j)
                if self.ctx.closing:
                    _close(link.sock)
                    return
                self.ctx.sockets.append(link.sock)
            self.ctx.uplink.add(link.sock)
            self._send_reduce(link, j)
            self._send_gather(link, j)
            if link.ended:  # its last frame was END_GATHER
                self._keep(j, link)
        except (OSError, ConnectionError) as e:
            logger.debug(f"sending to member {j} stopped: {e}")
            if not self.ctx.closing:
                self.ctx.outbound_broke(j)
        finally:
            with self.ctx.cond:
                self.ctx.sent_progress[j] = DONE
                self.ctx.senders_done += 1
                self.ctx.cond.notify_all()

    def _keep(self, j: int, link: OutboundLink) -> None:
        """Our stream to member j ended cleanly: keep its connection for our next all-reduce with j (kept_links.py),
        unless the teardown already holds it to close."""
        with self.ctx.cond:
            if self.ctx.closing:
                return
            self.ctx.sockets.remove(link.sock)
        self.connector.keep(j, link)

    def _wait_finalized_watching(self, link: OutboundLink, j: int, c: int) -> bool:
        """Wait for chunk c of our part to be finalized; meanwhile notice if member j's end of our connection
        closed (it never sends on it, so readable means EOF or reset: see `RoundContext.outbound_broke`). False =
        stop sending."""
        finalized = self.ctx.reducer.finalized
        while True:
            with self.ctx.cond:
                if self.ctx.wait(lambda: finalized[c], min(self.ctx.deadline, time.monotonic() + PEER_CHECK_SECONDS)):
                    return True
                if time.monotonic() >= self.ctx.deadline or self.ctx.closing:
                    return False
            if peer_closed(link.sock):
                logger.debug(f"member {j} closed its end of our connection")
                self.ctx.outbound_broke(j)
                return False

    def _stream(self, link: OutboundLink, j: int, phase: str) -> ChunkStream:
        """Our stream of `phase` to member j, through `self.ctx.links` (the real one unless a wrapper was injected)."""
        ctx = self.ctx
        stats, deadline = (ctx.reduce, ctx.reduce_deadline) if phase == "reduce" else (ctx.gather, ctx.deadline)
        spec = StreamSpec(round_seed=int.from_bytes(ctx.tag[:4], "big"), sender=ctx.my_index, receiver=j,
                          phase=phase, deadline=deadline, selective=ctx.loss_budget > 0,
                          droppable=allowance_share(ctx.loss_budget, ctx.partition, phase, ctx.my_index, j))
        return ctx.links.stream(WireStream(link, stats, lambda: ctx.closing), spec)

    def _send_chunk(self, stream: ChunkStream, phase: int, part: int, chunk: int, codec, outbox: Outbox,
                    lookahead: Optional[int] = None) -> None:
        """Encode and send one chunk; with a device outbox, chunk `lookahead` is encoded and staged first, so its
        copy to host memory overlaps with this send (staging.py)."""
        data = outbox.next_bytes(chunk, lambda c: self._encode_chunk(phase, part, c, codec), lookahead)
        stream.send(wire.pack_header(phase, part, chunk, len(data), self.ctx.tag), data)

    def _encode_chunk(self, phase: int, part: int, chunk: int, codec):
        mine = phase == wire.PHASE_GATHER and part == self.ctx.my_index
        payload = self.ctx.reducer.gather_payloads[chunk] if mine else None
        if payload is None:
            start, end = self.ctx.partition.chunk_range(part, chunk)
            payload = codec.encode(self.ctx.flat[start:end], seed=self.ctx.chunk_seed(part, chunk))
        return payload

    def _send_reduce(self, link: OutboundLink, j: int) -> None:
        stream = self._stream(link, j, "reduce")
        codec = self.ctx.links.contribution_codec(self.ctx.compression.reduce_codec)
        num_chunks = self.ctx.partition.num_chunks(j)
        if is_batched(codec):
            self._send_reduce_batched(stream, j, codec, num_chunks)
        else:
            self._send_reduce_chunks(stream, j, codec, num_chunks)
        with self.ctx.cond:
            self.ctx.sent_progress[j] = DONE  # a stream that holds chunks back (to resend them) keeps their bytes
            self.ctx.cond.notify_all()
        stream.end(wire.pack_header(wire.PHASE_END_REDUCE, 0, 0, 0, self.ctx.tag))

    def _send_reduce_batched(self, stream: ChunkStream, j: int, codec, num_chunks: int) -> None:
        """Part j's chunks a slice at a time, staged to host memory with one copy per slice: encoded
        (`codec.encode_chunks`, see `encode_runs`) into one buffer, or for a raw codec taken as they lie in the
        vector; the next slice is staged before this one is sent when the staging overlaps copies with sends (a
        device)."""
        chunk_numel = self.ctx.partition.chunk_numel
        slices = pipeline_slices(num_chunks, chunk_numel)
        runs = encode_runs(num_chunks, chunk_numel, self.ctx.flat.device)
        stride = codec.row_stride(chunk_numel)
        outbox = self.ctx.staging.outbox(stride * len(slices[0]) if slices else 1)
        # On a device the part is encoded in one call up front (`encode_runs`); its slices are then rows of it.
        whole_part = self._encode_run(j, codec, runs[0]) if len(runs) < len(slices) and not is_raw(codec) else None
        # Else each slice is encoded into one of two buffers lent for the round, in turn (a slice's bytes have left
        # before the slice after next is encoded).
        buffers = [self.ctx.take_bytes(stride * len(slices[0])) for _ in slices[:2]] \
            if whole_part is None and not is_raw(codec) else []

        def encode(k: int):  # -> (the encoding or None if raw, its row of chunk slices[k][0], spans, staged bytes)
            chunks = slices[k]
            if is_raw(codec):
                data, spans = self._vector_run(j, chunks[0], chunks[-1] + 1)
                return None, 0, spans, outbox.prepare(data)
            if whole_part is not None:
                encoded, first = whole_part, chunks[0]
            else:
                encoded, first = self._encode_run(j, codec, chunks, out=buffers[k % 2]), 0
                buffers[k % 2] = encoded.buffer.view(-1)
            spans = [(r * stride, encoded.nbytes[first + r]) for r in range(len(chunks))]
            return encoded, first, spans, outbox.prepare(encoded.buffer[first: first + len(chunks)].view(-1))

        ahead = None
        for k, chunks in enumerate(slices):
            if time.monotonic() > self.ctx.reduce_deadline:
                break
            encoded, first, spans, staged = ahead if ahead is not None else encode(k)
            ahead = encode(k + 1) if outbox.lookahead and k + 1 < len(slices) else None
            data = outbox.host_bytes(staged)
            if time.monotonic() > self.ctx.reduce_deadline:
                return
            # The slice's frames up to its first chunk that could not be encoded (then the sender stops).
            bad = next((r for r in range(len(chunks)) if encoded is not None and encoded.errors[first + r] is not None),
                       None)
            count = len(chunks) if bad is None else bad
            headers = [wire.pack_header(wire.PHASE_REDUCE, j, chunks[r], spans[r][1], self.ctx.tag)
                       for r in range(count)]
            send_run(stream, headers, data, spans[:count])
            with self.ctx.cond:
                self.ctx.sent_progress[j] = chunks[0] + count
                self.ctx.cond.notify_all()
            if bad is not None:
                raise ValueError(encoded.errors[first + bad])

    def _encode_run(self, j: int, codec, chunks: range, out: Optional[torch.Tensor] = None):
        """Chunks `chunks` of part j (consecutive), encoded with one `codec.encode_chunks` call."""
        start = self.ctx.partition.chunk_range(j, chunks[0])[0]
        end = self.ctx.partition.chunk_range(j, chunks[-1])[1]
        return codec.encode_chunks(self.ctx.flat[start:end], self.ctx.partition.chunk_numel,
                                   [self.ctx.chunk_seed(j, c) for c in chunks], out=out)

    def _send_reduce_chunks(self, stream: ChunkStream, j: int, codec, num_chunks: int) -> None:
        outbox = self.ctx.staging.outbox(codec.max_encoded_nbytes(self.ctx.partition.chunk_numel))
        for c in range(num_chunks):
            if time.monotonic() > self.ctx.reduce_deadline:
                break
            self._send_chunk(stream, wire.PHASE_REDUCE, j, c, codec, outbox,
                             lookahead=c + 1 if c + 1 < num_chunks else None)
            with self.ctx.cond:
                self.ctx.sent_progress[j] = c + 1
                self.ctx.cond.notify_all()

    def _send_gather(self, link: OutboundLink, j: int) -> None:
        stream = self._stream(link, j, "gather")
        codec = self.ctx.compression.gather_codec
        finalized = self.ctx.reducer.finalized
        if is_batched(codec):
            self._send_gather_runs(link, stream, j, codec)
        else:
            outbox = self.ctx.staging.outbox(codec.max_encoded_nbytes(self.ctx.partition.chunk_numel))
            for c in range(self.ctx.num_my_chunks):
                if not self._wait_finalized_watching(link, j, c):
                    return
                # Stage the next chunk early only if it is already averaged (finalized chunks never change).
                ahead = c + 1 if c + 1 < self.ctx.num_my_chunks and finalized[c + 1] else None
                self._send_chunk(stream, wire.PHASE_GATHER, self.ctx.my_index, c, codec, outbox, lookahead=ahead)
        stream.end(wire.pack_header(wire.PHASE_END_GATHER, 0, 0, 0, self.ctx.tag))

    def _send_gather_runs(self, link: OutboundLink, stream: ChunkStream, j: int, codec) -> None:
        """Our averaged chunks, a run of final chunks at a time: each run is one stretch of memory (rows of one
        batch that `PartReducer` encoded, or of the vector itself uncompressed), staged with one copy."""
        reducer, n = self.ctx.reducer, self.ctx.num_my_chunks
        cap = len(pipeline_slices(n, self.ctx.partition.chunk_numel)[0]) if n else 1
        stride = 0 if is_raw(codec) else codec.row_stride(self.ctx.partition.chunk_numel)
        outbox = self.ctx.staging.outbox(max(1, cap * (stride or 4 * self.ctx.partition.chunk_numel)))
        c = 0
        while c < n:
            if not self._wait_finalized_watching(link, j, c):
                return
            end = c + 1
            if stride:
                rows = reducer.gather_rows
                if rows[c] is None:  # could not be encoded (non-finite average): the sender's encode reports it
                    self._send_chunk(stream, wire.PHASE_GATHER, self.ctx.my_index, c, codec, Outbox())
                    c += 1
                    continue
                batch, first_row = rows[c]
                while (end < n and end - c < cap and reducer.finalized[end] and rows[end] is not None
                       and rows[end][0] is batch):
                    end += 1
                data = batch.buffer[first_row:first_row + end - c].reshape(-1)
                offsets = [(r * stride, batch.nbytes[first_row + r]) for r in range(end - c)]
            else:
                while end < n and end - c < cap and reducer.finalized[end]:
                    end += 1
                data, offsets = self._vector_run(self.ctx.my_index, c, end)
            headers = [wire.pack_header(wire.PHASE_GATHER, self.ctx.my_index, c + r, nbytes, self.ctx.tag)
                       for r, (_, nbytes) in enumerate(offsets)]
            send_run(stream, headers, outbox.host_bytes(outbox.prepare(data)), offsets)
            c = end

    def _vector_run(self, part: int, first: int, end: int):
        """Chunks first..end-1 of `part` as they lie in the vector: (their bytes, (offset, nbytes) of each)."""
        lo = self.ctx.partition.chunk_range(part, first)[0]
        hi = self.ctx.partition.chunk_range(part, end - 1)[1]
        spans = []
        for chunk in range(first, end):
            s0, s1 = self.ctx.partition.chunk_range(part, chunk)
            spans.append(((s0 - lo) * 4, (s1 - s0) * 4))
        return self.ctx.flat[lo:hi].view(torch.uint8), spans
