"""One group all-reduce on the direct-TCP data plane: reduce-scatter then all-gather, chunked and pipelined.

`GroupAllReduce` is the orchestrator: it builds the round's shared context (round_context.py), starts the
threads, waits out the two phases against their deadlines and the loss budget, tears down, and reports.
Threads (all blocking sockets, which release the GIL in send/recv; torch ops release it too):

- one sender per other member j, on its own outgoing connection (`PartSender`, part_sender.py): first the
  chunks of part j (this peer's contribution, encoded with the reduce codec), then an END_REDUCE marker, then
  the chunks of this peer's own part as each one is finalized (averaged), then END_GATHER;
- one receiver per other member i, on the connection i opened to us, handed over by `DataPlane`
  (`PartReceiver`, part_receiver.py): REDUCE chunks go to the `PartReducer`, which decodes and accumulates
  them in fp32; GATHER chunks (i's averaged part) are decoded and written into the flat vector.

A chunk of our part is finalized as soon as every other member either delivered it or is known to
send nothing more (END_REDUCE, connection closed, protocol violation), or at the reduce deadline.
Finalization uses the unbiased estimator of `estimator.py`; members that sent nothing in the whole
round are "departed" and leave the weights. The gather sender of a chunk starts right after its
finalization, so reduce-scatter and all-gather overlap. A receiver that never gets an averaged
chunk keeps its own value for it. Every wait is bounded by the round's absolute deadlines.

Connections (member_connector.py): direct TCP to a member's announced address, else a libp2p stream
through `relay`; each is authenticated (handshake.py), every frame carries a MAC. A direct connection that ended
cleanly is kept for the next all-reduce between the same two peers (kept_links.py). One inbound connection
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

from moshpeer.averaging import wire
from moshpeer.averaging.aggregation import DEFAULT_MAX_BUFFER_BYTES
from moshpeer.averaging.dataplane import DataPlane, _close
from moshpeer.averaging.deadline import reduce_scatter_end
from moshpeer.averaging.handshake import FrameAuth, RoundCredentials
from moshpeer.averaging.kept_links import KeptLinks
from moshpeer.averaging.links import PLAIN_LINKS, Links
from moshpeer.averaging.member_connector import GroupMember, MemberConnector, RelayConnect
from moshpeer.averaging.part_receiver import PartReceiver
from moshpeer.averaging.part_reducer import PartReducer
from moshpeer.averaging.part_sender import PartSender
from moshpeer.averaging.partition import Partition
from moshpeer.averaging.report import DataPlaneStats
from moshpeer.averaging.round_context import RoundContext
from moshpeer.averaging.scratch import ScratchLease, ScratchPool
from moshpeer.averaging.staging import HostStaging, staging_for
from moshpeer.averaging.uplink import UplinkMeter
from moshpeer.compression.codec import Compression
from moshpeer.errors import ProtocolError

logger = logging.getLogger(__name__)

__all__ = ["AllReduceResult", "GroupAllReduce", "GroupMember", "RelayConnect"]

# At the end of a round, how long to wait for the end marker of a member whose averaged part all arrived (it follows
# the last chunk at once; waiting for it lets the connection be kept instead of closed).
END_MARKER_GRACE_S = 0.1

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
    :param sampled_member: a robust mode keeps a copy of what this member contributed to our part
        (`DataPlaneStats.member_sample`), for a spot check
    :param kept: direct connections kept between all-reduces (kept_links.py; the averager keeps one across its
        rounds): ours are rebound from it and, when they end cleanly, kept in it; None = new ones, closed at the end
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
        sampled_member: Optional[int] = None,
        kept: Optional[KeptLinks] = None,
    ):
        if not 0.0 <= loss_budget < 1.0:
            raise ValueError(f"loss_budget must be within [0, 1), got {loss_budget}")
        if flat.dtype != torch.float32 or flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError("flat must be a contiguous 1-D float32 tensor")
        if credentials.index != my_index or credentials.group_prefix != wire.tag_group(tag):
            raise ValueError("credentials were made for another group or member index")
        self.plane, self.members, self.group_size = plane, list(members), len(members)
        self.secret, self.credentials = secret, credentials  # handshake.accept reads them (this is its session)
        self.sampled_member = sampled_member
        partition = Partition(flat.numel(), self.group_size, chunk_numel, part_sizes).pipelined()
        chunk_seed = functools.partial(wire.chunk_seed, tag, my_index)
        staging = staging if staging is not None else staging_for(flat.device)
        cond = threading.Condition()
        self._scratch = ScratchLease(scratch, flat.device)
        # The owner's bookkeeping; its shared counters are guarded by `cond`, each chunk by a lock of its own.
        reducer = PartReducer(flat, partition, my_index, [m.weight for m in self.members],
                              gather_codec=compression.gather_codec, chunk_seed=chunk_seed, aggregation=aggregation,
                              distrusted=distrusted, loss_budget=loss_budget, max_buffer_bytes=max_buffer_bytes,
                              buffer=self._scratch.take, lock=cond, chunk_lock=threading.Lock, on_final=self._on_final)
        self.ctx = ctx = RoundContext(
            flat=flat, partition=partition, my_index=my_index, tag=tag, compression=compression,
            loss_budget=loss_budget, staging=staging, links=links.for_allreduce(), deadline=deadline,
            reduce_deadline=reduce_deadline if reduce_deadline is not None else reduce_scatter_end(time.monotonic(),
                                                                                                   deadline),
            chunk_seed=chunk_seed, reducer=reducer, cond=cond, take_bytes=self._scratch.take_bytes)
        connector = MemberConnector(self.members, tag=tag, secret=secret, credentials=credentials, deadline=deadline,
                                    relay=relay, force_relay=force_relay, closing=lambda: ctx.closing,
                                    on_unauthentic=plane.count_rejected, kept=kept)
        self.sender, self.receiver = PartSender(ctx, connector), PartReceiver(ctx)

    # ---- public -------------------------------------------------------------------------------

    def run(self) -> DataPlaneStats:
        """Run the all-reduce until it is done or `deadline`; -> what it did. Losses (absent or departed members,
        missing chunks, rejected messages) are counted in the result, not raised."""
        ctx, reducer = self.ctx, self.ctx.reducer
        started = time.monotonic()
        ctx.arrivals["reduce"].start = started
        rejected_before = self.plane.rejected_connections
        ctx.reduce.chunks_expected = ctx.num_my_chunks * len(ctx.others)
        ctx.gather.chunks_expected = sum(ctx.partition.num_chunks(j) for j in ctx.others)
        if ctx.num_my_chunks == 0 or not ctx.others:
            reducer.finalize_all()
        self.plane.register(ctx.tag, self)
        ctx.uplink = UplinkMeter()
        try:
            for j in ctx.others:
                thread = threading.Thread(target=self.sender.run, args=(j,), name=f"moshpeer-send-{j}", daemon=True)
                ctx.threads.append(thread)
                thread.start()
            with ctx.cond:
                ctx.wait(lambda: reducer.all_final or ctx.within_budget(ctx.reduce, "reduce", time.monotonic()),
                         ctx.reduce_deadline)
            # No-op unless the reduce deadline passed or the budget allowed stopping.
            reducer.finalize_all()
            if self.sampled_member is not None:  # every chunk of our part is final: its contributions stay as they are
                ctx.stats.member_sample = reducer.member_contribution(self.sampled_member)
                ctx.stats.member_sample_start = reducer.part_start
            with ctx.cond:
                ctx.arrivals["gather"].start = time.monotonic()
                ctx.wait(self._gather_done_or_within_budget, ctx.deadline)
        finally:
            self.plane.unregister(ctx.tag)
            upload_bps = ctx.uplink.stop()
            alive = self._teardown()
            # Once every chunk is final no thread writes the owner's buffers (late chunks are refused), and once the
            # senders and receivers are gone none writes their slices; else one that outlived the teardown might,
            # so they are not lent again.
            self._scratch.end(reusable=reducer.all_final and not alive)
        finished = time.monotonic()
        reduce_done = ctx.reduce_done_at or finished
        stats = ctx.stats
        stats.missing_chunks = ctx.receipts.missing()
        stats.gather.chunks_lost = len(stats.missing_chunks)
        stats.reduce.chunks_lost = stats.reduce.chunks_expected - stats.reduce.chunks_received
        stats.reduce.seconds = stats.reduce_scatter_s = reduce_done - started
        stats.gather.seconds = stats.all_gather_s = finished - reduce_done
        stats.total_s = finished - started
        stats.departed, stats.late = sorted(reducer.departed), sorted(reducer.late)
        stats.absent.sort()
        stats.relayed.sort()
        stats.rejected_connections = self.plane.rejected_connections - rejected_before
        stats.staged_bytes, stats.upload_bps = ctx.staging.bytes_copied, upload_bps
        stats.nonfinite_averages, stats.robust_too_few = reducer.nonfinite_averages, reducer.robust_too_few
        stats.evidence_by_index = reducer.evidence()
        return stats

    def peer_id_of(self, index: int) -> bytes:
        """The libp2p peer id of member `index` (bound into the handshake MACs)."""
        return self.members[index].peer_id

    def admit_inbound(self, i: int) -> None:
        """The data plane authenticated a connection from member i: refuse it (ProtocolError) if it is not
        the first in this all-reduce (a member has one connection to us; a second one is an attack or a bug)."""
        with self.ctx.cond:
            if self.ctx.inbound_admitted[i]:
                raise ProtocolError(f"second connection from member {i} in this round")
            self.ctx.inbound_admitted[i] = 1

    def serve_inbound(self, i: int, sock: socket.socket, auth: FrameAuth) -> Optional[FrameAuth]:
        """Called by DataPlane (in its connection thread) with an authenticated connection from member i; returns
        when member i's part of the round is over. -> `auth` if the connection ended cleanly and is handed back
        (DataPlane keeps it for i's next all-reduce with us), else None: this all-reduce closes it."""
        ctx = self.ctx
        with ctx.cond:
            if ctx.closing or ctx.reducer.finished[i] and ctx.gather_finished[i]:
                _close(sock)
                return None
            ctx.sockets.append(sock)
            ctx.threads.append(threading.current_thread())
        clean = False
        try:
            clean = self.receiver.receive(i, sock, auth)
        except (OSError, ConnectionError) as e:
            logger.debug(f"connection from member {i} ended: {e}")
        except ProtocolError as e:
            ctx.reject(i, str(e))
        finally:
            ctx.give_up_on(i)
            with ctx.cond:
                ctx.inbound_ended[i] = 1
                handed_back = clean and not ctx.closing
                if handed_back:  # this thread is done with the round: the teardown neither closes nor joins it
                    ctx.sockets.remove(sock)
                    ctx.threads.remove(threading.current_thread())
                ctx.cond.notify_all()
        return auth if handed_back else None

    # ---- waiting and teardown ---------------------------------------------------------------------

    def _gather_done_or_within_budget(self) -> bool:
        ctx = self.ctx
        if ctx.senders_done < len(ctx.others):
            return False  # our averaged chunks are still on their way out
        done = ctx.reducer.all_final and all(ctx.gather_finished[j] or ctx.receipts.complete(j) for j in ctx.others)
        return done or ctx.within_budget(ctx.gather, "gather", time.monotonic())

    def _on_final(self, chunk: int) -> None:
        """The reducer finalized `chunk` (it holds the chunk's lock): wake its gather senders at once."""
        ctx = self.ctx
        with ctx.cond:
            if ctx.reducer.all_final:
                ctx.reduce_done_at = time.monotonic()
            ctx.cond.notify_all()

    def _teardown(self) -> bool:
        """Close the round's connections and join its threads (a second at most each); -> is one still alive?
        A member whose averaged part all arrived gets END_MARKER_GRACE_S for its end marker, right behind it: its
        connection then ends cleanly and is kept (kept_links.py) instead of closed."""
        ctx = self.ctx
        with ctx.cond:
            marker_due = [i for i in ctx.others if ctx.inbound_admitted[i] and not ctx.inbound_ended[i]
                          and ctx.receipts.complete(i)]
            ctx.wait(lambda: all(ctx.inbound_ended[i] for i in marker_due),
                     min(ctx.deadline, time.monotonic() + END_MARKER_GRACE_S))
            ctx.closing = True
            sockets = list(ctx.sockets)
            ctx.cond.notify_all()
        for sock in sockets:
            _close(sock)
        current = threading.current_thread()
        others = [thread for thread in list(ctx.threads) if thread is not current]
        for thread in others:
            thread.join(timeout=1.0)
        return any(thread.is_alive() for thread in others)
