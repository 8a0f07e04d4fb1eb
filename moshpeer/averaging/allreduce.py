"""One group all-reduce on the direct-TCP data plane: reduce-scatter then all-gather, chunked and pipelined.

Threads (all blocking sockets, which release the GIL in send/recv; torch ops release it too):

- one sender per other member j, on its own outgoing connection: first the chunks of part j
  (this peer's contribution, encoded with the reduce codec), then an END_REDUCE marker, then the
  chunks of this peer's own part as each one is finalized (averaged), then END_GATHER;
- one receiver per other member i, on the connection i opened to us (handed over by `DataPlane`):
  REDUCE chunks go to the `PartReducer`, which decodes and accumulates them in fp32; GATHER chunks
  (i's averaged part) are decoded and written into the flat vector.

A chunk of our part is finalized as soon as every other member either delivered it or is known to
send nothing more (END_REDUCE, connection closed, protocol violation), or at the reduce deadline.
Finalization uses the unbiased estimator of `estimator.py`; members that sent nothing in the whole
round are "departed" and leave the weights. The gather sender of a chunk starts right after its
finalization, so reduce-scatter and all-gather overlap. A receiver that never gets an averaged
chunk keeps its own value for it. Every wait is bounded by the round's absolute deadlines.

Connections (member_connector.py): direct TCP to a member's announced address, else a libp2p stream
through `relay`; each is authenticated (handshake.py), every frame carries a MAC. One inbound connection
per member per all-reduce: a second one is refused. A frame whose MAC fails ends its connection; what it
would have delivered counts as lost. A member that refuses our hello (it is not in this round: matchmaking
disagreed) or cannot prove its identity is "absent": nothing is expected from it and the report says so.

Decisions live apart from the threads: the owner's bookkeeping and averaging in `PartReducer`
(part_reducer.py), when the loss budget lets a phase stop in budget_stall.py.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from typing import Optional, Sequence

import torch

from moshpeer.averaging import handshake, wire
from moshpeer.averaging.aggregation import DEFAULT_MAX_BUFFER_BYTES
from moshpeer.averaging.budget_stall import PhaseArrivals, allowance_share
from moshpeer.averaging.dataplane import DataPlane, _close
from moshpeer.averaging.deadline import reduce_scatter_end
from moshpeer.averaging.handshake import FrameAuth, RoundCredentials
from moshpeer.averaging.links import PLAIN_LINKS, ChunkStream, Links, StreamSpec, WireStream
from moshpeer.averaging.member_connector import (GroupMember, MemberConnector, OutboundLink, RelayConnect,
                                                 peer_closed)
from moshpeer.averaging.part_reducer import GatherReceipts, PartReducer
from moshpeer.averaging.partition import Partition
from moshpeer.averaging.report import DataPlaneStats, PhaseStats
from moshpeer.averaging.scratch import ScratchLease, ScratchPool
from moshpeer.averaging.staging import HostStaging, Outbox, staging_for
from moshpeer.averaging.uplink import UplinkMeter
from moshpeer.compression.codec import Compression
from moshpeer.errors import ProtocolError

logger = logging.getLogger(__name__)

__all__ = ["AllReduceResult", "GroupAllReduce", "GroupMember", "RelayConnect"]

# While a sender waits for chunks to be finalized, how often it checks that its peer is still there.
PEER_CHECK_SECONDS = 0.05
# With a loss budget, how often a waiting phase re-checks whether its arrivals stalled (budget_stall.py).
BUDGET_POLL_S = 0.01
_DONE = float("inf")
# A receiver decodes the payloads it holds once its connection has been quiet this long (a pause, not a gap
# between two frames of a burst).
IDLE_FLUSH_S = 0.002
# A part's chunks go through the codec in at most this many batches ("pipeline slices") per direction: encoding
# slice k+1 overlaps sending slice k, and host syncs per part are bounded independently of its chunk count.
PART_SLICES = 4


def _slices(num_chunks: int, slices: int = PART_SLICES):
    """range(num_chunks) cut into at most `slices` consecutive ranges of equal length (the last may be shorter)."""
    size = max(1, -(-num_chunks // slices))
    return [range(first, min(num_chunks, first + size)) for first in range(0, num_chunks, size)]


def _batched(codec) -> bool:
    """Does `codec` take a pipeline slice of chunks at a time (`decode_chunks`, and `encode_chunks` unless raw)?"""
    return bool(getattr(codec, "batched", False))


def _raw(codec) -> bool:
    """Is a payload of `codec` the chunk's own bytes (so a run of chunks is sent straight from the vector)?"""
    return bool(getattr(codec, "raw", False))

AllReduceResult = DataPlaneStats  # what `GroupAllReduce.run()` returns (report.py); the older name, kept


class GroupAllReduce:
    """Average `flat` (1-D contiguous fp32, modified in place) with the group; `run()` blocks until done.

    `flat` may live on any device: chunks are encoded and decoded there, and only encoded bytes are staged
    through pinned host memory to and from the sockets (staging.py).

    :param plane: this peer's data-plane server (already listening at members[my_index])
    :param tag: 8-byte tag of this all-reduce (see `wire.allreduce_tag`); secret: the group secret
    :param credentials: this member's signed round key (`RoundCredentials.create(identity,
        wire.tag_group(tag), my_index)`); every member's `peer_id` must be its libp2p peer id
    :param deadline: absolute `time.monotonic()` by which everything ends; reduce_deadline: by which
        owners stop waiting for contributions (default: `deadline.reduce_scatter_end(now, deadline)`)
    :param links: how our chunks reach the wire (links.py): the real transport by default; a wrapper such as
        `faults.FaultyLinks` injects faults
    :param loss_budget: DBLP budget P: stop waiting once at most this fraction of a phase's chunks is missing
        (0 = wait for everything until the deadlines)
    :param relay: opens a libp2p stream to a member (see `RelayConnect`); None = direct TCP only
    :param force_relay: send to every member over `relay`, never directly
    :param part_sizes: values per member's part (e.g. `partition.bandwidth_part_sizes`; every member must pass
        the same); default: equal parts
    :param aggregation: how this owner combines its part's contributions: "mean", "clipped" or "trimmed"
        (aggregation.py); declared weights are capped in every mode
    :param distrusted: member indices whose contributions "clipped" weighs at zero in our part (still received,
        checked and flagged; see suspects.py); ignored by the other modes
    :param max_buffer_bytes: the robust modes keep every member's chunks of our part; a larger buffer is refused
    :param scratch: lends the owner's working buffers (scratch.py; the averager keeps one across its rounds);
        None = allocate them for this all-reduce
    Raises ValueError for bad arguments (flat's type, loss_budget, credentials of another round, force_relay
    without a relay, a robust buffer over `max_buffer_bytes`).
    """

    def __init__(
        self,
        plane: DataPlane,
        flat: torch.Tensor,
        *,
        members: Sequence[GroupMember],
        my_index: int,
        tag: bytes,
        secret: bytes,
        credentials: RoundCredentials,
        compression: Compression,
        chunk_numel: int,
        deadline: float,
        reduce_deadline: Optional[float] = None,
        links: Links = PLAIN_LINKS,
        loss_budget: float = 0.0,
        relay: Optional[RelayConnect] = None,
        force_relay: bool = False,
        part_sizes: Optional[Sequence[int]] = None,
        aggregation: str = "mean",
        distrusted: Sequence[int] = (),
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
        staging: Optional[HostStaging] = None,
        scratch: Optional[ScratchPool] = None,
    ):
        if not 0.0 <= loss_budget < 1.0:
            raise ValueError(f"loss_budget must be within [0, 1), got {loss_budget}")
        if flat.dtype != torch.float32 or flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError("flat must be a contiguous 1-D float32 tensor")
        self.plane, self.flat, self.members = plane, flat, list(members)
        self.my_index, self.group_size, self.tag = my_index, len(self.members), tag
        if credentials.index != my_index or credentials.group_prefix != wire.tag_group(tag):
            raise ValueError("credentials were made for another group or member index")
        self.secret, self.credentials = secret, credentials  # handshake.accept reads them (this is its session)
        self.compression, self.loss_budget = compression, loss_budget
        self.links, self.deadline = links.for_allreduce(), deadline
        self.connector = MemberConnector(self.members, tag=tag, secret=secret, credentials=credentials,
                                         deadline=deadline, relay=relay, force_relay=force_relay,
                                         closing=lambda: self._closing, on_unauthentic=plane.count_rejected)
        now = time.monotonic()
        self.reduce_deadline = reduce_deadline if reduce_deadline is not None else reduce_scatter_end(now, deadline)
        self.partition = Partition(flat.numel(), self.group_size, chunk_numel, part_sizes)
        self._chunk_seed = functools.partial(wire.chunk_seed, tag, my_index)
        self.others = [i for i in range(self.group_size) if i != my_index]
        self.staging = staging if staging is not None else staging_for(flat.device)
        self.cond = threading.Condition()
        self._scratch = ScratchLease(scratch, flat.device)
        # The owner's bookkeeping; its shared counters are guarded by `cond`, each chunk by a lock of its own.
        self.reducer = PartReducer(flat, self.partition, my_index, [m.weight for m in self.members],
                                   gather_codec=compression.gather_codec, chunk_seed=self._chunk_seed,
                                   aggregation=aggregation, distrusted=distrusted, loss_budget=loss_budget,
                                   max_buffer_bytes=max_buffer_bytes, buffer=self._scratch.take, lock=self.cond,
                                   chunk_lock=threading.Lock, on_final=self._on_final)
        self.num_my_chunks = self.reducer.num_chunks
        self.receipts = GatherReceipts(self.partition, my_index)
        # Guarded by cond:
        self.inbound_admitted = bytearray(self.group_size)  # one authenticated connection per member
        self.gather_finished = bytearray(self.group_size)  # sender will send no more GATHER chunks
        self.sent_progress = [0.0] * self.group_size  # how many REDUCE chunks our sender to j is past
        self.senders_done = 0
        self.stats = DataPlaneStats()  # what this all-reduce did: counted into while it runs, returned by run()
        self.reduce, self.gather = self.stats.reduce, self.stats.gather
        self._sockets, self._threads = [], []  # to close and to join at teardown
        self._uplink: Optional[UplinkMeter] = None
        self._closing, self._reduce_done_at = False, None
        self._arrivals = {"reduce": PhaseArrivals(loss_budget), "gather": PhaseArrivals(loss_budget)}

    # ---- public -------------------------------------------------------------------------------

    def run(self) -> DataPlaneStats:
        """Run the all-reduce until it is done or `deadline`; -> what it did. Losses (absent or departed members,
        missing chunks, rejected messages) are counted in the result, not raised."""
        started = time.monotonic()
        self._arrivals["reduce"].start = started
        rejected_before = self.plane.rejected_connections
        self.reduce.chunks_expected = self.num_my_chunks * len(self.others)
        self.gather.chunks_expected = sum(self.partition.num_chunks(j) for j in self.others)
        if self.num_my_chunks == 0 or not self.others:
            self.reducer.finalize_all()
        self.plane.register(self.tag, self)
        self._uplink = UplinkMeter()
        try:
            for j in self.others:
                thread = threading.Thread(target=self._sender, args=(j,), name=f"moshpeer-send-{j}", daemon=True)
                self._threads.append(thread)
                thread.start()
            with self.cond:
                self._wait(lambda: self.reducer.all_final or self._within_budget(self.reduce, "reduce"),
                           self.reduce_deadline)
            # No-op unless the reduce deadline passed or the budget allowed stopping.
            self.reducer.finalize_all()
            with self.cond:
                self._arrivals["gather"].start = time.monotonic()
                self._wait(self._gather_done_or_within_budget, self.deadline)
        finally:
            self.plane.unregister(self.tag)
            upload_bps = self._uplink.stop()
            self._teardown()
            # Once every chunk is final no thread writes the buffers (late chunks are refused); else a receiver
            # that outlived the teardown might, so they are not lent again.
            self._scratch.end(reusable=self.reducer.all_final)
        finished = time.monotonic()
        reduce_done = self._reduce_done_at or finished
        stats, reducer = self.stats, self.reducer
        stats.missing_chunks = self.receipts.missing()
        stats.gather.chunks_lost = len(stats.missing_chunks)
        stats.reduce.chunks_lost = stats.reduce.chunks_expected - stats.reduce.chunks_received
        stats.reduce.seconds = stats.reduce_scatter_s = reduce_done - started
        stats.gather.seconds = stats.all_gather_s = finished - reduce_done
        stats.total_s = finished - started
        stats.departed = sorted(reducer.departed)
        stats.absent.sort()
        stats.relayed.sort()
        stats.rejected_connections = self.plane.rejected_connections - rejected_before
        stats.staged_bytes, stats.upload_bps = self.staging.bytes_copied, upload_bps
        stats.nonfinite_averages = reducer.nonfinite_averages
        stats.flagged_by_index, stats.contributed_by_index = list(reducer.flagged), reducer.contributed()
        return stats

    def peer_id_of(self, index: int) -> bytes:
        """The libp2p peer id of member `index` (bound into the handshake MACs)."""
        return self.members[index].peer_id

    # ---- waiting ------------------------------------------------------------------------------

    def _wait(self, predicate, deadline: float) -> bool:
        """With self.cond held: wait until predicate() or the deadline; returns predicate()."""
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.cond.wait(min(remaining, BUDGET_POLL_S if self.loss_budget > 0 else 1.0))
        return True

    def _within_budget(self, stats: PhaseStats, phase: str) -> bool:
        """With self.cond held: may `phase` stop waiting at the loss budget now (budget_stall.py)?"""
        return self._arrivals[phase].may_stop(time.monotonic(), stats.chunks_received, stats.chunks_expected)

    def _gather_done_or_within_budget(self) -> bool:
        if self.senders_done < len(self.others):
            return False  # our averaged chunks are still on their way out
        done = self.reducer.all_final and all(self.gather_finished[j] or self.receipts.complete(j) for j in self.others)
        return done or self._within_budget(self.gather, "gather")

    def _on_final(self, chunk: int) -> None:
        """The reducer finalized `chunk` (it holds the chunk's lock): wake its gather senders at once."""
        with self.cond:
            if self.reducer.all_final:
                self._reduce_done_at = time.monotonic()
            self.cond.notify_all()

    # ---- sending ------------------------------------------------------------------------------

    def _sender(self, j: int) -> None:
        try:
            link = self.connector.reach(j)
            if link is None:
                if not self._closing:
                    logger.warning(f"group member {j} is absent from this round; averaging without it")
                    with self.cond:
                        self.stats.absent.append(j)
                self._give_up_on(j)
                return
            with self.cond:
                if link.relayed:
                    self.stats.relayed.append(j)
                if self._closing:
                    _close(link.sock)
                    return
                self._sockets.append(link.sock)
            self._uplink.add(link.sock)
            self._send_reduce(link, j)
            self._send_gather(link, j)
        except (OSError, ConnectionError) as e:
            logger.debug(f"sending to member {j} stopped: {e}")
            if not self._closing:
                self._give_up_on(j)  # our connection to j broke: j died or left the round, expect nothing more
        finally:
            with self.cond:
                self.sent_progress[j] = _DONE
                self.senders_done += 1
                self.cond.notify_all()

    def _wait_finalized_watching(self, link: OutboundLink, j: int, c: int) -> bool:
        """Wait for chunk c of our part to be finalized; meanwhile notice if member j's end of our connection
        closed (it never sends on it, so readable means EOF or reset: j is gone). False = stop sending."""
        finalized = self.reducer.finalized
        while True:
            with self.cond:
                if self._wait(lambda: finalized[c], min(self.deadline, time.monotonic() + PEER_CHECK_SECONDS)):
                    return True
                if time.monotonic() >= self.deadline or self._closing:
                    return False
            if peer_closed(link.sock):
                logger.debug(f"member {j} closed its connection: it left the round")
                self._give_up_on(j)
                return False

    def _give_up_on(self, j: int) -> None:
        """Member j is not in this round (unreachable, refused our hello) or its connection ended: expect nothing
        more from it."""
        self.reducer.member_finished(j)
        with self.cond:
            self.gather_finished[j] = 1
            self.cond.notify_all()
        self.reducer.finalize_ready()

    def _stream(self, link: OutboundLink, j: int, phase: str) -> ChunkStream:
        """Our stream of `phase` to member j, through `self.links` (the real one unless a wrapper was injected)."""
        stats, deadline = (self.reduce, self.reduce_deadline) if phase == "reduce" else (self.gather, self.deadline)
        spec = StreamSpec(round_seed=int.from_bytes(self.tag[:4], "big"), sender=self.my_index, receiver=j,
                          phase=phase, deadline=deadline, selective=self.loss_budget > 0,
                          droppable=allowance_share(self.loss_budget, self.partition, phase, self.my_index, j))
        return self.links.stream(WireStream(link, stats, lambda: self._closing), spec)

    def _send_chunk(self, stream: ChunkStream, phase: int, part: int, chunk: int, codec, outbox: Outbox,
                    lookahead: Optional[int] = None) -> None:
        """Encode and send one chunk; with a device outbox, chunk `lookahead` is encoded and staged first, so its
        copy to host memory overlaps with this send (staging.py)."""
        data = outbox.next_bytes(chunk, lambda c: self._encode_chunk(phase, part, c, codec), lookahead)
        stream.send(wire.pack_header(phase, part, chunk, len(data), self.tag), data)

    def _encode_chunk(self, phase: int, part: int, chunk: int, codec):
        mine = phase == wire.PHASE_GATHER and part == self.my_index
        payload = self.reducer.gather_payloads[chunk] if mine else None
        if payload is None:
            start, end = self.partition.chunk_range(part, chunk)
            payload = codec.encode(self.flat[start:end], seed=self._chunk_seed(part, chunk))
        return payload

    def _send_reduce(self, link: OutboundLink, j: int) -> None:
        stream = self._stream(link, j, "reduce")
        codec = self.links.contribution_codec(self.compression.reduce_codec)
        num_chunks = self.partition.num_chunks(j)
        if _batched(codec):
            self._send_reduce_batched(stream, j, codec, num_chunks)
        else:
            self._send_reduce_chunks(stream, j, codec, num_chunks)
        with self.cond:
            self.sent_progress[j] = _DONE  # a stream that holds chunks back (to resend them) keeps their bytes
            self.cond.notify_all()
        stream.end(wire.pack_header(wire.PHASE_END_REDUCE, 0, 0, 0, self.tag))

    def _send_reduce_batched(self, stream: ChunkStream, j: int, codec, num_chunks: int) -> None:
        """Part j's chunks a slice at a time: encoded (`codec.encode_chunks`: O(1) backend calls per slice) into one
        buffer each, or for a raw codec taken as they lie in the vector, and staged to host memory with one copy
        per slice; the next slice is encoded and staged before this one is sent when the staging overlaps copies
        with sends (a device)."""
        chunk_numel = self.partition.chunk_numel
        slices = _slices(num_chunks)
        stride = codec.row_stride(chunk_numel)
        outbox = self.staging.outbox(stride * len(slices[0]) if slices else 1)
        buffers = [None, None]  # reused in turn: a slice's bytes have left before the slice after next is encoded

        def encode(k: int):  # -> (the encoding or None if raw, (offset, nbytes) of each chunk, the staged bytes)
            chunks = slices[k]
            if _raw(codec):
                data, spans = self._vector_run(j, chunks[0], chunks[-1] + 1)
                return None, spans, outbox.prepare(data)
            start = self.partition.chunk_range(j, chunks[0])[0]
            end = self.partition.chunk_range(j, chunks[-1])[1]
            encoded = codec.encode_chunks(self.flat[start:end], chunk_numel,
                                          [self._chunk_seed(j, c) for c in chunks], out=buffers[k % 2])
            buffers[k % 2] = encoded.buffer.view(-1)
            spans = [(r * stride, nbytes) for r, nbytes in enumerate(encoded.nbytes)]
            return encoded, spans, outbox.prepare(encoded.buffer.view(-1))

        ahead = None
        for k, chunks in enumerate(slices):
            if time.monotonic() > self.reduce_deadline:
                break
            encoded, spans, staged = ahead if ahead is not None else encode(k)
            ahead = encode(k + 1) if outbox.lookahead and k + 1 < len(slices) else None
            data = outbox.host_bytes(staged)
            for r, c in enumerate(chunks):
                if time.monotonic() > self.reduce_deadline:
                    return
                if encoded is not None and encoded.errors[r] is not None:
                    raise ValueError(encoded.errors[r])
                offset, nbytes = spans[r]
                stream.send(wire.pack_header(wire.PHASE_REDUCE, j, c, nbytes, self.tag), data[offset: offset + nbytes])
                with self.cond:
                    self.sent_progress[j] = c + 1
                    self.cond.notify_all()

    def _send_reduce_chunks(self, stream: ChunkStream, j: int, codec, num_chunks: int) -> None:
        outbox = self.staging.outbox(codec.max_encoded_nbytes(self.partition.chunk_numel))
        for c in range(num_chunks):
            if time.monotonic() > self.reduce_deadline:
                break
            self._send_chunk(stream, wire.PHASE_REDUCE, j, c, codec, outbox,
                             lookahead=c + 1 if c + 1 < num_chunks else None)
            with self.cond:
                self.sent_progress[j] = c + 1
                self.cond.notify_all()

    def _send_gather(self, link: OutboundLink, j: int) -> None:
        stream = self._stream(link, j, "gather")
        codec = self.compression.gather_codec
        finalized = self.reducer.finalized
        if _batched(codec):
            self._send_gather_runs(link, stream, j, codec)
        else:
            outbox = self.staging.outbox(codec.max_encoded_nbytes(self.partition.chunk_numel))
            for c in range(self.num_my_chunks):
                if not self._wait_finalized_watching(link, j, c):
                    return
                # Stage the next chunk early only if it is already averaged (finalized chunks never change).
                ahead = c + 1 if c + 1 < self.num_my_chunks and finalized[c + 1] else None
                self._send_chunk(stream, wire.PHASE_GATHER, self.my_index, c, codec, outbox, lookahead=ahead)
        stream.end(wire.pack_header(wire.PHASE_END_GATHER, 0, 0, 0, self.tag))

    def _send_gather_runs(self, link: OutboundLink, stream: ChunkStream, j: int, codec) -> None:
        """Our averaged chunks, a run of final chunks at a time: each run is one stretch of memory (rows of one
        batch that `PartReducer` encoded, or of the vector itself uncompressed), staged with one copy."""
        reducer, n = self.reducer, self.num_my_chunks
        cap = len(_slices(n)[0]) if n else 1
        stride = 0 if _raw(codec) else codec.row_stride(self.partition.chunk_numel)
        outbox = self.staging.outbox(max(1, cap * (stride or 4 * self.partition.chunk_numel)))
        c = 0
        while c < n:
            if not self._wait_finalized_watching(link, j, c):
                return
            end = c + 1
            if stride:
                rows = reducer.gather_rows
                if rows[c] is None:  # could not be encoded (non-finite average): the sender's encode reports it
                    self._send_chunk(stream, wire.PHASE_GATHER, self.my_index, c, codec, Outbox())
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
                data, offsets = self._vector_run(self.my_index, c, end)
            host = outbox.host_bytes(outbox.prepare(data))
            for r, (offset, nbytes) in enumerate(offsets):
                stream.send(wire.pack_header(wire.PHASE_GATHER, self.my_index, c + r, nbytes, self.tag),
                            host[offset: offset + nbytes])
            c = end

    def _vector_run(self, part: int, first: int, end: int):
        """Chunks first..end-1 of `part` as they lie in the vector: (their bytes, (offset, nbytes) of each)."""
        lo = self.partition.chunk_range(part, first)[0]
        hi = self.partition.chunk_range(part, end - 1)[1]
        spans = []
        for chunk in range(first, end):
            s0, s1 = self.partition.chunk_range(part, chunk)
            spans.append(((s0 - lo) * 4, (s1 - s0) * 4))
        return self.flat[lo:hi].view(torch.uint8), spans

    # ---- receiving ----------------------------------------------------------------------------

    def admit_inbound(self, i: int) -> None:
        """The data plane authenticated a connection from member i: refuse it (ProtocolError) if it is not
        the first in this all-reduce (a member has one connection to us; a second one is an attack or a bug)."""
        with self.cond:
            if self.inbound_admitted[i]:
                raise ProtocolError(f"second connection from member {i} in this round")
            self.inbound_admitted[i] = 1

    def serve_inbound(self, i: int, sock: socket.socket, auth: FrameAuth) -> None:
        """Called by DataPlane (in its connection thread) with an authenticated connection from member i."""
        with self.cond:
            if self._closing or self.reducer.finished[i] and self.gather_finished[i]:
                _close(sock)
                return
            self._sockets.append(sock)
            self._threads.append(threading.current_thread())
        try:
            self._receive(i, sock, auth)
        except (OSError, ConnectionError) as e:
            logger.debug(f"connection from member {i} ended: {e}")
        except ProtocolError as e:
            self._reject(i, str(e))
        finally:
            self._give_up_on(i)

    def _reject(self, i: int, why: str) -> None:
        with self.cond:
            self.stats.rejected_messages += 1
        logger.warning(f"data plane: rejected a message from member {i}: {why}")

    def _receive(self, i: int, sock: socket.socket, auth: FrameAuth) -> None:
        reduce_codec, gather_codec = self.compression.reduce_codec, self.compression.gather_codec
        chunk_numel = self.partition.chunk_numel
        max_payload = max(reduce_codec.max_encoded_nbytes(chunk_numel), gather_codec.max_encoded_nbytes(chunk_numel))
        batched = _batched(reduce_codec) or _batched(gather_codec)
        if batched:
            # A pipeline slice of payloads lands in consecutive rows and is validated and decoded at once.
            most = max(self.num_my_chunks, self.partition.num_chunks(i), 1)
            inbox = self.staging.batch_inbox((max_payload + 3) & ~3, len(_slices(most)[0]))
        else:
            inbox = self.staging.inbox(max_payload)  # payloads are received into it, then (on a device) copied
        frames = handshake.FrameReader(sock, auth, tag=self.tag, max_payload=max_payload, inbox=inbox)
        pending = []  # (phase, part, chunk, nbytes) of the rows in the batch inbox, in arrival order
        wire.block_until(sock, self.deadline)
        try:
            while time.monotonic() < self.deadline:
                if pending and not wire.readable_within(sock, IDLE_FLUSH_S):
                    # The sender paused (a lost chunk, a slice being encoded): take in what has arrived rather
                    # than wait for a later chunk to fill the batch, so that it counts (for the loss budget, and
                    # for finalizing) when it arrives.
                    self._flush(i, inbox, pending)
                frame = frames.read()
                if frame.phase == wire.PHASE_END_REDUCE:
                    self._flush(i, inbox, pending)
                    self.reducer.member_finished(i)
                    with self.cond:
                        self.cond.notify_all()
                    self.reducer.finalize_ready()
                elif frame.phase == wire.PHASE_END_GATHER:
                    self._flush(i, inbox, pending)
                    with self.cond:
                        self.gather_finished[i] = 1
                        self.cond.notify_all()
                else:
                    reduce = frame.phase == wire.PHASE_REDUCE
                    phase_stats = self.reduce if reduce else self.gather
                    phase_stats.bytes_received += wire.HEADER.size + frame.payload_len
                    codec = reduce_codec if reduce else gather_codec
                    if batched and _batched(codec):
                        if pending and pending[-1][0] != frame.phase:
                            # the row just received starts the next batch: decode the others, keep it
                            self._decode_pending(i, inbox, pending)
                            inbox.restart_with(len(pending))
                            pending.clear()
                        pending.append((frame.phase, frame.part, frame.chunk, frame.payload_len))
                        if inbox.full:
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
        finally:
            if batched and not self._closing:
                self._flush(i, inbox, pending)  # what arrived (MACs checked) before the connection ended

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
        verdicts = self.reducer.add_contributions(i, part, first_chunk, rows, nbytes, self.compression.reduce_codec)
        accepted = []
        for r, verdict in enumerate(verdicts):
            if verdict.rejected:
                self._reject(i, verdict.rejected)
            elif verdict.accepted:
                accepted.append(first_chunk + r)
        if not accepted:
            return
        with self.cond:
            self.reduce.chunks_received += len(accepted)
            self._arrivals["reduce"].note(time.monotonic(), self.reduce.chunks_received, self.reduce.chunks_expected)
            if self.loss_budget > 0:
                self.cond.notify_all()  # the main thread checks the budget
        self.reducer.finalize_ready(accepted)

    def _on_gather_chunks(self, i: int, part: int, first_chunk: int, rows: torch.Tensor, nbytes) -> None:
        codec = self.compression.gather_codec
        count = len(nbytes)
        modes = []
        for r in range(count):
            why = self.receipts.check(i, part, first_chunk + r, nbytes[r], codec)
            if why is not None:
                self._reject(i, why)
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
            with self.cond:
                # Our own contribution to these chunks must have left before we overwrite them.
                if not self._wait(lambda: self.sent_progress[i] > last, self.deadline):
                    modes[r:] = [None] * (count - r)  # the round is over: these rows are not taken
                    break
            start = self.partition.chunk_range(part, first_chunk + r)[0]
            stop = self.partition.chunk_range(part, last)[1]
            # Straight into the vector; the codec validates every payload before writing it.
            errors[r:end] = codec.decode_chunks(rows[r:end], nbytes[r:end], self.flat[start:stop],
                                                self.partition.chunk_numel, modes[r:end])
            r = end
        received = 0
        for r in range(count):
            if modes[r] is None:
                continue
            if errors[r] is not None:
                self._reject(i, f"gather chunk {first_chunk + r}: {errors[r]}")
                continue
            received += 1
            self.receipts.note(i, first_chunk + r)
        if received:
            with self.cond:
                self.gather.chunks_received += received
                self._arrivals["gather"].note(time.monotonic(), self.gather.chunks_received,
                                              self.gather.chunks_expected)
                self.cond.notify_all()

    def _on_reduce_chunk(self, i: int, part: int, chunk: int, payload: torch.Tensor, codec) -> None:
        verdict = self.reducer.add_contribution(i, part, chunk, payload, codec)
        if verdict.rejected:
            return self._reject(i, verdict.rejected)
        if not verdict.accepted:
            return
        with self.cond:
            self.reduce.chunks_received += 1
            self._arrivals["reduce"].note(time.monotonic(), self.reduce.chunks_received, self.reduce.chunks_expected)
            if self.loss_budget > 0:
                self.cond.notify_all()  # the main thread checks the budget
        self.reducer.finalize_ready((chunk,))

    def _on_gather_chunk(self, i: int, part: int, chunk: int, payload, codec) -> None:
        why = self.receipts.check(i, part, chunk, payload.numel(), codec)
        if why is not None:
            return self._reject(i, why)
        with self.cond:
            # Our own contribution to this chunk must have left before we overwrite it.
            if not self._wait(lambda: self.sent_progress[i] > chunk, self.deadline):
                return
        start, end = self.partition.chunk_range(part, chunk)
        try:
            # One pass straight into the vector; the codec validates the whole payload before writing.
            codec.decode_into(payload, self.flat[start:end])
        except ProtocolError as e:
            return self._reject(i, f"gather chunk {chunk}: {e}")
        with self.cond:
            self.receipts.note(i, chunk)
            self.gather.chunks_received += 1
            self._arrivals["gather"].note(time.monotonic(), self.gather.chunks_received, self.gather.chunks_expected)
            self.cond.notify_all()

    # ---- teardown -----------------------------------------------------------------------------

    def _teardown(self) -> None:
        with self.cond:
            self._closing = True
            sockets = list(self._sockets)
            self.cond.notify_all()
        for sock in sockets:
            _close(sock)
        current = threading.current_thread()
        for thread in list(self._threads):
            if thread is not current:
                thread.join(timeout=1.0)
