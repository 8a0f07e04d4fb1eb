"""One group all-reduce on the direct-TCP data plane: reduce-scatter then all-gather, chunked and pipelined.

Threads (all blocking sockets, which release the GIL in send/recv; torch ops release it too):

- one sender per other member j, on its own outgoing connection: first the chunks of part j
  (this peer's contribution, encoded with the reduce codec), then an END_REDUCE marker, then the
  chunks of this peer's own part as each one is finalized (averaged), then END_GATHER;
- one receiver per other member i, on the connection i opened to us (handed over by `DataPlane`):
  REDUCE chunks are decoded and accumulated in fp32 into `others_sum` as they arrive; GATHER chunks
  (i's averaged part) are decoded and written into the flat vector.

A chunk of our part is finalized as soon as every other member either delivered it or is known to
send nothing more (END_REDUCE, connection closed, protocol violation), or at the reduce deadline.
Finalization uses the unbiased estimator of `estimator.py`; members that sent nothing in the whole
round are "departed" and leave the weights. The gather sender of a chunk starts right after its
finalization, so reduce-scatter and all-gather overlap. A receiver that never gets an averaged
chunk keeps its own value for it. Every wait is bounded by the round's absolute deadlines.

Connections: direct TCP to a member's announced address; when a member announced none, or the
direct connection cannot be opened, the sender asks `relay` for a libp2p stream to the member's peer
id (bridged into a local socket pair, see relay.py) and runs the same handshake and protocol on it.
Every connection is authenticated (`handshake.py`): each end proves it is the libp2p peer that
matchmaking named for its index, and every frame carries a MAC under a key only the two ends hold.
One inbound connection per member per all-reduce: a second one is refused. A frame whose MAC fails
ends its connection; what it would have delivered counts as lost. A member that refuses our hello
(it is not in this round: matchmaking disagreed) or cannot prove its identity is "absent": nothing
is expected from it and the report says so.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from moshpeer.averaging import handshake, wire
from moshpeer.averaging.aggregation import (DEFAULT_MAX_BUFFER_BYTES, cap_weights, check_aggregation, robust_combine,
                                            weight_cap_factor)
from moshpeer.averaging.dataplane import DataPlane, _close
from moshpeer.averaging.handshake import FrameAuth, PeerNotAuthentic, PeerRefused, RoundCredentials
from moshpeer.averaging.estimator import estimate_over_sum
from moshpeer.averaging.links import PLAIN_LINKS, ChunkStream, Links, StreamSpec
from moshpeer.averaging.partition import Partition
from moshpeer.averaging.report import PhaseStats
from moshpeer.averaging.scratch import ScratchPool
from moshpeer.averaging.staging import HostStaging, Outbox, staging_for
from moshpeer.averaging.uplink import UplinkMeter
from moshpeer.compression.codec import Compression, NoCompression, all_finite
from moshpeer.errors import ProtocolError

logger = logging.getLogger(__name__)

CONNECT_RETRIES = 3
CONNECT_TIMEOUT = 2.0  # per direct connection attempt; an unreachable (NAT'ed) address then falls back to libp2p
# While a sender waits for chunks to be finalized, how often it checks that its peer is still there.
PEER_CHECK_SECONDS = 0.05
_DONE = float("inf")
# Loss budget: chunks still streaming in are not lost. A phase stops at the budget only once its arrivals
# have stalled for this many mean inter-arrival gaps (and at least BUDGET_STALL_FLOOR_S), and once it
# has waited, past its quorum, BUDGET_QUORUM_FACTOR times as long as the quorum took to arrive: a burst or
# a retransmitting link, not the ordinary trickle of the last chunks, nor a machine that is slow all over
# (on a loaded host every thread stalls now and then, and the whole round is slow in proportion).
BUDGET_STALL_GAPS = 5.0
BUDGET_STALL_FLOOR_S = 0.05
BUDGET_QUORUM_FACTOR = 1.0
BUDGET_POLL_S = 0.01


@dataclass(frozen=True)
class GroupMember:
    """A member as the data plane sees it: where to connect, its averaging weight and libp2p peer id.

    port 0 (or an empty host) = no direct address: reach this member over libp2p only.
    """

    host: str
    port: int
    weight: float
    peer_id: bytes = b""

    @property
    def has_direct_address(self) -> bool:
        return bool(self.host) and self.port > 0


# (peer id, absolute time.monotonic() deadline) -> a connected socket carrying a libp2p stream to that peer
RelayConnect = Callable[[bytes, float], socket.socket]


@dataclass
class _Outbound:
    """Our authenticated connection to one member: the socket and the MACs of our frames on it."""

    sock: socket.socket
    auth: FrameAuth

    def send(self, header: bytes, payload=b"") -> None:
        handshake.send_frame(self.sock, self.auth, header, payload)


@dataclass
class _PhaseStream:
    """The real `ChunkStream` of one phase on our connection to a member: frames, counted in `stats`."""

    link: _Outbound
    stats: PhaseStats
    closing: Callable[[], bool]

    def send(self, header: bytes, data) -> None:
        self.link.send(header, data)
        self.stats.chunks_sent += 1
        self.stats.bytes_sent += len(header) + len(data) + handshake.MAC_BYTES

    def end(self, marker: bytes) -> None:
        self.link.send(marker)


@dataclass
class AllReduceResult:
    reduce: PhaseStats
    gather: PhaseStats
    departed: List[int]
    rejected_messages: int
    rejected_connections: int
    missing_chunks: List[Tuple[int, int]]  # (part, chunk) averaged chunks this peer never received
    reduce_scatter_s: float
    all_gather_s: float
    total_s: float
    absent: List[int] = field(default_factory=list)  # members that refused us, could not prove the secret, or were unreachable
    relayed: List[int] = field(default_factory=list)  # members our chunks reached over libp2p streams (no direct TCP connection)
    staged_bytes: int = 0  # encoded bytes copied between the device and pinned host memory (0 on a CPU peer)
    upload_bps: Optional[float] = None  # this peer's upload rate measured on its direct connections (uplink.py)
    # Per member index: chunks of our part in which the robust aggregation clipped or trimmed its contribution.
    flagged: List[int] = field(default_factory=list)
    nonfinite_averages: int = 0  # chunks whose average was not finite: our own value was kept and sent instead
    # Per member index: chunks of our part its contribution reached us in (what `flagged` is out of).
    contributed: List[int] = field(default_factory=list)


class GroupAllReduce:
    """Average `flat` (1-D contiguous fp32, modified in place) with the group; `run()` blocks until done.

    `flat` may live on any device: chunks are encoded and decoded there, and only encoded bytes are staged
    through pinned host memory to and from the sockets (staging.py).

    :param plane: this peer's data-plane server (already listening at members[my_index])
    :param tag: 8-byte tag of this all-reduce (see `wire.allreduce_tag`); secret: the group secret
    :param credentials: this member's signed round key (`RoundCredentials.create(identity,
        wire.tag_group(tag), my_index)`); every member's `peer_id` must be its libp2p peer id
    :param deadline: absolute `time.monotonic()` by which everything ends; reduce_deadline: by which
        owners stop waiting for contributions (defaults to 60% of the way to `deadline`)
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
        self.my_index, self.group_size = my_index, len(self.members)
        self.tag, self.secret = tag, secret
        if credentials.index != my_index or credentials.group_prefix != wire.tag_group(tag):
            raise ValueError("credentials were made for another group or member index")
        self.credentials = credentials
        self.compression, self.loss_budget = compression, loss_budget
        self.links = links.for_allreduce()
        self.deadline = deadline
        self.relay, self.force_relay = relay, force_relay
        if force_relay and relay is None:
            raise ValueError("force_relay needs a relay")
        now = time.monotonic()
        self.reduce_deadline = reduce_deadline if reduce_deadline is not None else now + 0.6 * (deadline - now)
        self.partition = Partition(flat.numel(), self.group_size, chunk_numel, part_sizes)
        self.aggregation = check_aggregation(aggregation)
        self.distrusted = frozenset(distrusted) - {my_index}
        self.weights = cap_weights([float(m.weight) for m in self.members], weight_cap_factor(aggregation))
        self.others = [i for i in range(self.group_size) if i != my_index]
        self.staging = staging if staging is not None else staging_for(flat.device)

        me = my_index
        self.num_my_chunks = self.partition.num_chunks(me)
        start, end = self.partition.part_range(me)
        # S in estimator.py, per value. Not zeroed: a chunk's first arrival overwrites its slice (decode_into), later
        # ones accumulate, and a chunk that nobody delivered is never read (the estimate then keeps our value).
        self._scratch = scratch
        self._scratch_buffers: List[torch.Tensor] = []
        self.others_sum = self._take_scratch(end - start)
        # Robust modes: each member's contribution to our part, a row per member (ours stays in `flat`).
        self.contributions: Optional[torch.Tensor] = None
        if self.aggregation != "mean":
            if self.group_size * (end - start) * 4 > max_buffer_bytes:
                raise ValueError(f"{self.aggregation} aggregation would buffer {self.group_size * (end - start) * 4} "
                                 f"bytes, over the limit of {max_buffer_bytes}")
            self.contributions = self._take_scratch(self.group_size * (end - start)).view(self.group_size, end - start)
        self.flagged = [0] * self.group_size
        self.nonfinite_averages = 0
        # Per chunk of our part: lock, who delivered it, weight that arrived, finalized?
        self.chunk_locks = [threading.Lock() for _ in range(self.num_my_chunks)]
        self.arrived_from = [bytearray(self.group_size) for _ in range(self.num_my_chunks)]
        self.arrived_weight = [0.0] * self.num_my_chunks
        self.finalized = [False] * self.num_my_chunks

        self.cond = threading.Condition()
        # Guarded by cond:
        self.finalized_count = 0
        self.sent_any = bytearray(self.group_size)  # sender delivered at least one valid REDUCE chunk
        self.inbound_admitted = bytearray(self.group_size)  # one authenticated connection per member
        self.reduce_finished = bytearray(self.group_size)  # sender will send no more REDUCE chunks
        self.gather_finished = bytearray(self.group_size)
        self.gather_received = [bytearray(self.partition.num_chunks(j)) for j in range(self.group_size)]
        self.sent_progress = [0.0] * self.group_size  # how many REDUCE chunks our sender to j is past
        self.senders_done = 0
        self.departed: List[int] = []
        self.absent: List[int] = []
        self.relayed: List[int] = []
        self.reduce, self.gather = PhaseStats(), PhaseStats()
        self.rejected_messages = 0
        self._sockets: List[socket.socket] = []
        self._uplink: Optional[UplinkMeter] = None
        self._threads: List[threading.Thread] = []
        self._closing = False
        self._reduce_done_at: Optional[float] = None
        # Lossy gather codec: each averaged chunk of our part is encoded once, at finalization (not once per
        # receiver), and we keep its decoded value ourselves, so that every member holds the same bits.
        self._gather_payloads: List[Optional[torch.Tensor]] = [None] * self.num_my_chunks
        # Per phase: [phase start, first arrival, last arrival, quorum reached] (0.0: not yet).
        self._arrivals = {"reduce": [0.0, 0.0, 0.0, 0.0], "gather": [0.0, 0.0, 0.0, 0.0]}

    # ---- public -------------------------------------------------------------------------------

    def run(self) -> AllReduceResult:
        started = time.monotonic()
        self._arrivals["reduce"][0] = started
        rejected_before = self.plane.rejected_connections
        self.reduce.chunks_expected = self.num_my_chunks * len(self.others)
        self.gather.chunks_expected = sum(self.partition.num_chunks(j) for j in self.others)
        if self.num_my_chunks == 0 or not self.others:
            self._force_finalize_all()
        self.plane.register(self.tag, self)
        self._uplink = UplinkMeter()
        try:
            for j in self.others:
                thread = threading.Thread(target=self._sender, args=(j,), name=f"moshpeer-send-{j}", daemon=True)
                self._threads.append(thread)
                thread.start()
            with self.cond:
                self._wait(self._reduce_done_or_within_budget, self.reduce_deadline)
            self._force_finalize_all()  # no-op unless the reduce deadline passed or the budget allowed stopping
            with self.cond:
                self._arrivals["gather"][0] = time.monotonic()
                self._wait(self._gather_done_or_within_budget, self.deadline)
        finally:
            self.plane.unregister(self.tag)
            upload_bps = self._uplink.stop()
            self._teardown()
            self._give_back_scratch()
        finished = time.monotonic()
        reduce_done = self._reduce_done_at or finished
        missing = [
            (j, c) for j in self.others for c, got in enumerate(self.gather_received[j]) if not got
        ]
        self.gather.chunks_lost = len(missing)
        self.reduce.chunks_lost = self.reduce.chunks_expected - self.reduce.chunks_received
        self.reduce.seconds, self.gather.seconds = reduce_done - started, finished - reduce_done
        return AllReduceResult(
            reduce=self.reduce,
            gather=self.gather,
            departed=sorted(self.departed),
            rejected_messages=self.rejected_messages,
            rejected_connections=self.plane.rejected_connections - rejected_before,
            missing_chunks=missing,
            reduce_scatter_s=reduce_done - started,
            all_gather_s=finished - reduce_done,
            total_s=finished - started,
            absent=sorted(self.absent),
            relayed=sorted(self.relayed),
            staged_bytes=self.staging.bytes_copied,
            upload_bps=upload_bps,
            flagged=list(self.flagged),
            contributed=[sum(arrived[i] for arrived in self.arrived_from) for i in range(self.group_size)],
            nonfinite_averages=self.nonfinite_averages,
        )

    def _take_scratch(self, numel: int) -> torch.Tensor:
        if self._scratch is None:
            return torch.empty(numel, dtype=torch.float32, device=self.flat.device)
        buffer = self._scratch.take(numel, self.flat.device)
        self._scratch_buffers.append(buffer)
        return buffer[:numel]

    def _give_back_scratch(self) -> None:
        # Once every chunk is final no thread writes the buffers (late chunks are refused); else a receiver
        # that outlived the teardown might, so they are not lent again.
        if self._scratch is not None and self.finalized_count == self.num_my_chunks:
            for buffer in self._scratch_buffers:
                self._scratch.give_back(buffer)
        self._scratch_buffers = []

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
        """Loss budget P (DBLP): enough of the phase arrived that the rest may be reconstructed, and the
        rest is overdue (arrivals stalled), not merely still on its way."""
        if self.loss_budget <= 0:
            return False
        received = stats.chunks_received
        if received < self._quorum(stats):
            return False
        start, first, last, reached = self._arrivals[phase]
        now = time.monotonic()
        mean_gap = (last - first) / (received - 1) if received > 1 else 0.0
        if now - last < max(BUDGET_STALL_FLOOR_S, BUDGET_STALL_GAPS * mean_gap):
            return False
        reached = reached or last
        return now - reached >= max(BUDGET_STALL_FLOOR_S, BUDGET_QUORUM_FACTOR * (reached - start))

    def _quorum(self, stats: PhaseStats) -> int:
        """Chunks that must arrive before the budget lets a phase stop: (1 - P) of those expected."""
        return math.ceil((1.0 - self.loss_budget) * stats.chunks_expected)

    def _note_arrival(self, phase: str, stats: PhaseStats) -> None:
        """With self.cond held: a chunk of `phase` arrived now (after `stats` counted it)."""
        times = self._arrivals[phase]
        times[2] = time.monotonic()
        if not times[1]:
            times[1] = times[2]
        if not times[3] and self.loss_budget > 0 and stats.chunks_received >= self._quorum(stats):
            times[3] = times[2]

    def _reduce_done_or_within_budget(self) -> bool:
        return self.finalized_count == self.num_my_chunks or self._within_budget(self.reduce, "reduce")

    def _gather_done_or_within_budget(self) -> bool:
        if self._everything_done():
            return True
        return self.senders_done == len(self.others) and self._within_budget(self.gather, "gather")

    def _everything_done(self) -> bool:
        if self.finalized_count < self.num_my_chunks or self.senders_done < len(self.others):
            return False
        return all(self.gather_finished[j] or all(self.gather_received[j]) for j in self.others)

    # ---- finalization (owner side) ------------------------------------------------------------

    def _finalize_ready_chunks(self, chunks) -> None:
        """Finalize each chunk in `chunks` whose every other member delivered it or finished the phase."""
        for c in chunks:
            with self.chunk_locks[c]:
                if self.finalized[c]:
                    continue
                with self.cond:
                    ready = all(self.arrived_from[c][i] or self.reduce_finished[i] for i in self.others)
                if ready:
                    self._finalize_locked(c)

    def _force_finalize_all(self) -> None:
        for c in range(self.num_my_chunks):
            with self.chunk_locks[c]:
                if not self.finalized[c]:
                    self._finalize_locked(c)

    def _finalize_locked(self, c: int) -> None:
        """With chunk lock c held: write the estimate of chunk c's average into the flat vector."""
        me = self.my_index
        with self.cond:
            # "Departed" is decided once per member and never revised within the round, so every chunk
            # of the part is estimated with the same set of weights.
            for i in self.others:
                if not self.sent_any[i] and i not in self.departed:
                    self.departed.append(i)
            present = [i for i in self.others if i not in self.departed]
        start, end = self.partition.chunk_range(me, c)
        part_start = self.partition.part_starts[me]
        values = self.flat[start:end]
        # The average is computed beside our value and checked before it replaces it (no copy of our value).
        if self.contributions is None:
            average = estimate_over_sum(values, self.weights[me], self.others_sum[start - part_start : end - part_start],
                                        self.arrived_weight[c], sum(self.weights[i] for i in present))
        else:
            average = self._combine_robust(c, values, start - part_start, end - part_start)
        if average is not values:
            if all_finite(average):  # e.g. finite contributions can overflow in the sum
                values.copy_(average)
            else:
                self.nonfinite_averages += 1
                logger.warning(f"average of chunk {c} is not finite: keeping and sending this peer's own value")
        self._encode_gather_chunk(c, start, end)
        self.finalized[c] = True
        with self.cond:
            self.finalized_count += 1
            if self.finalized_count == self.num_my_chunks:
                self._reduce_done_at = time.monotonic()
            self.cond.notify_all()

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
        for i, hit in zip(rows, flagged.tolist()):
            self.flagged[i] += int(hit)
        return result

    def _encode_gather_chunk(self, c: int, start: int, end: int) -> None:
        """Encode finalized chunk c of our part for the all-gather and replace our values by the decoded ones."""
        codec = self.compression.gather_codec
        if isinstance(codec, NoCompression):
            return  # its payload is a view of the finalized values: nothing to precompute, nothing lost
        values = self.flat[start:end]
        try:
            payload = codec.encode(values, seed=self._chunk_seed(self.my_index, c))
        except ValueError as e:  # non-finite average: the sender's own encode reports it
            logger.warning(f"cannot encode averaged chunk {c}: {e}")
            return
        codec.decode_into(payload, values)
        self._gather_payloads[c] = payload

    def _chunk_seed(self, part: int, chunk: int) -> int:
        # The sender's index is in the seed: members sharing rounding noise would not average it out.
        return int.from_bytes(self.tag[:4], "big") ^ (self.my_index << 40) ^ (part << 20) ^ chunk

    # ---- sending ------------------------------------------------------------------------------

    def _connect(self, j: int) -> Optional[_Outbound]:
        """An authenticated connection to member j: direct TCP if possible, else a libp2p stream; None if
        neither opens. Raises PeerRefused / PeerNotAuthentic when j answers but is not in this round."""
        member = self.members[j]
        if member.has_direct_address and not self.force_relay:
            last_error: Optional[BaseException] = None
            for attempt in range(CONNECT_RETRIES):
                remaining = self.deadline - time.monotonic()
                if remaining <= 0 or self._closing:
                    return None
                try:
                    sock = socket.create_connection((member.host, member.port), timeout=min(remaining, CONNECT_TIMEOUT))
                except OSError as e:
                    last_error = e
                    logger.debug(f"connect to member {j} failed ({e}); attempt {attempt + 1}")
                    time.sleep(min(0.05 * (attempt + 1), max(self.deadline - time.monotonic(), 0)))
                    continue
                return self._handshake(sock, j)
            if self.relay is None:
                return None
            logger.info(f"no direct connection to member {j} at {member.host}:{member.port} ({last_error}); "
                        f"sending over libp2p")
        if self.relay is None:
            logger.warning(f"member {j} has no direct address and this peer has no libp2p relay")
            return None
        try:
            sock = self.relay(member.peer_id, self.deadline)
        except Exception as e:  # the libp2p stream did not open (peer gone, unreachable, timeout)
            logger.warning(f"could not open a libp2p stream to member {j}: {type(e).__name__}: {e}")
            return None
        link = self._handshake(sock, j)
        with self.cond:
            self.relayed.append(j)
        return link

    def _handshake(self, sock: socket.socket, j: int) -> _Outbound:
        """Run the sender's side of the authenticated handshake (handshake.py) on a fresh connection to member j."""
        try:
            wire.tune_socket(sock)
            # The receiver may wait a little for its session to be registered: allow up to the deadline.
            auth = handshake.connect(sock, self.deadline, credentials=self.credentials, tag=self.tag, receiver=j,
                                     receiver_peer=self.peer_id_of(j), group_secret=self.secret)
            wire.block_until(sock, self.deadline)
            return _Outbound(sock, auth)
        except BaseException:
            _close(sock)
            raise

    def _sender(self, j: int) -> None:
        link = None
        try:
            try:
                link = self._connect(j)
            except (PeerRefused, PeerNotAuthentic, socket.timeout) as e:
                if isinstance(e, PeerNotAuthentic):
                    self.plane.count_rejected(str(e), f"member {j}")
                logger.warning(f"group member {j} is not in this round: {e}")
            except (OSError, ProtocolError) as e:
                logger.warning(f"handshake with group member {j} failed: {type(e).__name__}: {e}")
            if link is None:
                if not self._closing:
                    logger.warning(f"group member {j} is absent from this round; averaging without it")
                    with self.cond:
                        self.absent.append(j)
                self._give_up_on(j)
                return
            with self.cond:
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

    def _wait_finalized_watching(self, link: _Outbound, j: int, c: int) -> bool:
        """Wait for chunk c of our part to be finalized; meanwhile notice if member j's end of our connection
        closed (it never sends on it, so readable means EOF or reset: j is gone). False = stop sending."""
        while True:
            with self.cond:
                if self._wait(lambda: self.finalized[c], min(self.deadline, time.monotonic() + PEER_CHECK_SECONDS)):
                    return True
                if time.monotonic() >= self.deadline or self._closing:
                    return False
            if _peer_closed(link.sock):
                logger.debug(f"member {j} closed its connection: it left the round")
                self._give_up_on(j)
                return False

    def _give_up_on(self, j: int) -> None:
        """Member j is not in this round (unreachable, or it refused our hello): expect nothing from it."""
        with self.cond:
            self.reduce_finished[j] = self.gather_finished[j] = 1
            self.cond.notify_all()
        self._finalize_ready_chunks(range(self.num_my_chunks))

    def _stream(self, link: _Outbound, j: int, phase: str) -> ChunkStream:
        """Our stream of `phase` to member j, through `self.links` (the real one unless a wrapper was injected)."""
        stats, deadline = (self.reduce, self.reduce_deadline) if phase == "reduce" else (self.gather, self.deadline)
        spec = StreamSpec(round_seed=int.from_bytes(self.tag[:4], "big"), sender=self.my_index, receiver=j,
                          phase=phase, deadline=deadline, droppable=self._allowance_share(j, phase),
                          selective=self.loss_budget > 0)
        return self.links.stream(_PhaseStream(link, stats, lambda: self._closing), spec)

    def _allowance_share(self, j: int, phase: str) -> int:
        """DBLP's budget is per receiver and phase: receiver j may miss floor(P x every chunk it expects
        in the phase, from all its senders). Each sender leaves at most its share of that lost, the shares
        split by sender rank so that they add up to the receiver's allowance without coordination."""
        senders = [k for k in range(self.group_size) if k != j]
        if phase == "reduce":  # j owns part j: every other member sends it its slice of that part
            expected = self.partition.num_chunks(j) * len(senders)
        else:  # each other member k sends j its averaged part k
            expected = sum(self.partition.num_chunks(k) for k in senders)
        allowance = math.floor(self.loss_budget * expected + 1e-9)
        rank = senders.index(self.my_index)
        return allowance // len(senders) + (1 if rank < allowance % len(senders) else 0)

    def _send_chunk(self, stream: ChunkStream, phase: int, part: int, chunk: int, codec, outbox: Outbox,
                    staged: dict, lookahead: Optional[int] = None) -> None:
        """Encode and send one chunk. `staged`: chunks of this stream already encoded and on their way to host
        memory; with a device outbox, chunk `lookahead` is encoded and staged before this one is sent, so its
        copy overlaps with this send."""
        ready = staged.pop(chunk, None)
        if ready is None:
            ready = outbox.prepare(self._encode_chunk(phase, part, chunk, codec))
        if outbox.lookahead and lookahead is not None and lookahead not in staged:
            staged[lookahead] = outbox.prepare(self._encode_chunk(phase, part, lookahead, codec))
        data = outbox.host_bytes(ready)
        stream.send(wire.pack_header(phase, part, chunk, len(data), self.tag), data)

    def _encode_chunk(self, phase: int, part: int, chunk: int, codec):
        payload = self._gather_payloads[chunk] if phase == wire.PHASE_GATHER and part == self.my_index else None
        if payload is None:
            start, end = self.partition.chunk_range(part, chunk)
            payload = codec.encode(self.flat[start:end], seed=self._chunk_seed(part, chunk))
        return payload

    def _send_reduce(self, link: _Outbound, j: int) -> None:
        stream = self._stream(link, j, "reduce")
        codec = self.links.contribution_codec(self.compression.reduce_codec)
        outbox, staged = self.staging.outbox(codec.max_encoded_nbytes(self.partition.chunk_numel)), {}
        num_chunks = self.partition.num_chunks(j)
        for c in range(num_chunks):
            if time.monotonic() > self.reduce_deadline:
                break
            self._send_chunk(stream, wire.PHASE_REDUCE, j, c, codec, outbox, staged,
                             lookahead=c + 1 if c + 1 < num_chunks else None)
            with self.cond:
                self.sent_progress[j] = c + 1
                self.cond.notify_all()
        with self.cond:
            self.sent_progress[j] = _DONE  # a stream that holds chunks back (to resend them) keeps their bytes
            self.cond.notify_all()
        stream.end(wire.pack_header(wire.PHASE_END_REDUCE, 0, 0, 0, self.tag))

    def _send_gather(self, link: _Outbound, j: int) -> None:
        stream = self._stream(link, j, "gather")
        codec = self.compression.gather_codec
        outbox, staged = self.staging.outbox(codec.max_encoded_nbytes(self.partition.chunk_numel)), {}
        for c in range(self.num_my_chunks):
            if not self._wait_finalized_watching(link, j, c):
                return
            # Stage the next chunk early only if it is already averaged (finalized chunks never change).
            ahead = c + 1 if c + 1 < self.num_my_chunks and self.finalized[c + 1] else None
            self._send_chunk(stream, wire.PHASE_GATHER, self.my_index, c, codec, outbox, staged, lookahead=ahead)
        stream.end(wire.pack_header(wire.PHASE_END_GATHER, 0, 0, 0, self.tag))

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
            if self._closing or self.reduce_finished[i] and self.gather_finished[i]:
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
            with self.cond:
                self.reduce_finished[i] = self.gather_finished[i] = 1
                self.cond.notify_all()
            self._finalize_ready_chunks(range(self.num_my_chunks))

    def _reject(self, i: int, why: str) -> None:
        with self.cond:
            self.rejected_messages += 1
        logger.warning(f"data plane: rejected a message from member {i}: {why}")

    def _receive(self, i: int, sock: socket.socket, auth: FrameAuth) -> None:
        reduce_codec, gather_codec = self.compression.reduce_codec, self.compression.gather_codec
        chunk_numel = self.partition.chunk_numel
        max_payload = max(reduce_codec.max_encoded_nbytes(chunk_numel), gather_codec.max_encoded_nbytes(chunk_numel))
        header = bytearray(wire.HEADER.size)
        header_view = memoryview(header)
        inbox = self.staging.inbox(max_payload)  # received bytes, then (on a device) copied to it
        mac = bytearray(handshake.MAC_BYTES)
        mac_view = memoryview(mac)
        wire.block_until(sock, self.deadline)
        while True:
            if time.monotonic() >= self.deadline:
                return
            wire.recv_exactly(sock, header_view)
            # A bad header desynchronizes the stream: the connection is dropped (ProtocolError).
            phase, part, chunk, payload_len, tag = wire.parse_header(header)
            if tag != self.tag:
                raise ProtocolError("chunk of another round")
            if payload_len > max_payload:
                raise ProtocolError(f"payload of {payload_len} bytes exceeds the limit {max_payload}")
            if phase == wire.PHASE_END_REDUCE or phase == wire.PHASE_END_GATHER:
                if payload_len:
                    raise ProtocolError("end marker with a payload")
                wire.recv_exactly(sock, mac_view)
                auth.check(header, b"", mac)
                with self.cond:
                    if phase == wire.PHASE_END_REDUCE:
                        self.reduce_finished[i] = 1
                    else:
                        self.gather_finished[i] = 1
                    self.cond.notify_all()
                if phase == wire.PHASE_END_REDUCE:
                    self._finalize_ready_chunks(range(self.num_my_chunks))
                continue
            received = inbox.buffer(payload_len)
            wire.recv_exactly(sock, received)
            wire.recv_exactly(sock, mac_view)
            auth.check(header, received, mac)  # before anything reads the payload
            payload = inbox.payload(payload_len)
            if phase == wire.PHASE_REDUCE:
                self.reduce.bytes_received += wire.HEADER.size + payload_len
                self._on_reduce_chunk(i, part, chunk, payload, reduce_codec)
            else:
                self.gather.bytes_received += wire.HEADER.size + payload_len
                self._on_gather_chunk(i, part, chunk, payload, gather_codec)

    def _on_reduce_chunk(self, i: int, part: int, chunk: int, payload: torch.Tensor, codec) -> None:
        me = self.my_index
        if part != me or not 0 <= chunk < self.num_my_chunks:
            return self._reject(i, f"reduce chunk ({part}, {chunk}) is not ours")
        start, end = self.partition.chunk_range(me, chunk)
        if payload.numel() > codec.max_encoded_nbytes(end - start):
            return self._reject(i, f"reduce chunk {chunk}: {payload.numel()} bytes for {end - start} values")
        part_start = self.partition.part_starts[me]
        with self.chunk_locks[chunk]:
            if self.finalized[chunk]:
                if self.loss_budget > 0:  # a selective resend the budget stopped waiting for: late, not bad
                    return
                return self._reject(i, f"reduce chunk {chunk} arrived after its deadline")
            if self.arrived_from[chunk][i]:
                return self._reject(i, f"duplicate reduce chunk {chunk}")
            with self.cond:
                departed = i in self.departed
            if departed:
                return self._reject(i, f"reduce chunk {chunk} from a member already counted as departed")
            try:
                if self.contributions is not None:  # robust: keep each member's values apart
                    codec.decode_into(payload, self.contributions[i, start - part_start : end - part_start])
                else:
                    decode = codec.decode_accumulate if any(self.arrived_from[chunk]) else codec.decode_into
                    decode(payload, self.others_sum[start - part_start : end - part_start], self.weights[i])
            except ProtocolError as e:
                return self._reject(i, f"reduce chunk {chunk}: {e}")
            self.arrived_from[chunk][i] = 1
            self.arrived_weight[chunk] += self.weights[i]
            with self.cond:
                self.reduce.chunks_received += 1
                self._note_arrival("reduce", self.reduce)
                self.sent_any[i] = 1
                if self.loss_budget > 0:
                    self.cond.notify_all()  # the main thread checks the budget
        self._finalize_ready_chunks((chunk,))

    def _on_gather_chunk(self, i: int, part: int, chunk: int, payload, codec) -> None:
        if part != i or not 0 <= chunk < len(self.gather_received[i]):
            return self._reject(i, f"gather chunk ({part}, {chunk}) does not belong to member {i}")
        start, end = self.partition.chunk_range(part, chunk)
        if payload.numel() > codec.max_encoded_nbytes(end - start):
            return self._reject(i, f"gather chunk {chunk}: {payload.numel()} bytes for {end - start} values")
        if self.gather_received[i][chunk]:
            return self._reject(i, f"duplicate gather chunk {chunk}")
        with self.cond:
            # Our own contribution to this chunk must have left before we overwrite it.
            if not self._wait(lambda: self.sent_progress[i] > chunk, self.deadline):
                return
        try:
            # One pass straight into the vector; the codec validates the whole payload before writing.
            codec.decode_into(payload, self.flat[start:end])
        except ProtocolError as e:
            return self._reject(i, f"gather chunk {chunk}: {e}")
        with self.cond:
            self.gather_received[i][chunk] = 1
            self.gather.chunks_received += 1
            self._note_arrival("gather", self.gather)
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


def _peer_closed(sock: socket.socket) -> bool:
    """True if the other end closed or reset `sock` (checked without blocking or consuming data; no select(),
    which fails on descriptors >= 1024)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True
