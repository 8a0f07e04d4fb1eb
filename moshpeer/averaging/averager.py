"""`MoshpitAverager`: Moshpit rounds (grid groups via hivemind's matchmaking) over moshpeer's own data plane.

Control plane: the averager owns a hivemind `Matchmaking` (and through it a `GroupKeyManager`,
whose group bits are Moshpit's grid coordinates) and serves its `rpc_join_group` on a P2P replica
of the DHT's daemon. Both run on a private asyncio loop in a background thread. Each member's
metadata (member_info.py) travels inside matchmaking over libp2p's encrypted channel; the group secret
is a hash of the group id and all nonces.

Data plane: `GroupAllReduce` (direct TCP, see allreduce.py; a member behind NAT through the relay that
holds its slot, tcp_relay/; libp2p streams through `StreamRelay` as the last resort), one or two per round
(group_dataplane.py), run in the averager's round thread. After every assembled group the key manager
shifts an index drawn from an RNG seeded by the group id into the group bits, so the next round's group
mixes different peers.

Matchmaking talks to hivemind only through `MatchmakingAdapter` (matchmaking_adapter.py, which also
explains how long a committed peer waits for its group); what members tell each other is member_info.py.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.dht import DHT
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto import averaging_pb2

from moshpeer.averaging import wire
from moshpeer.averaging.aggregation import check_aggregation
from moshpeer.averaging.arguments import check_round_args, check_settings
from moshpeer.averaging.adaptive_deadlines import DeadlineLearner, payload_bytes
from moshpeer.averaging.allreduce import GroupMember
from moshpeer.averaging.dataplane import DataPlane
from moshpeer.averaging.group_dataplane import (GroupDataPlane, flatten, log_round, member_to_sample, round_facts,
                                                round_tensors)
from moshpeer.averaging.deadline import RoundDeadline, RoundFuture
from moshpeer.averaging.handshake import RoundCredentials
from moshpeer.averaging.links import PLAIN_LINKS, Links
from moshpeer.averaging.loss_budget import LossBudget, group_budget, parse_loss_budget
from moshpeer.averaging.loop_thread import LoopThread
from moshpeer.averaging.matchmaking_adapter import (ASSEMBLY_GRACE_S, MatchmakingAdapter, StepRequest,
                                                    initial_group_bits, schema_hash)
from moshpeer.averaging.member_info import MAX_BANDWIDTH, NONCE_BYTES, MemberInfo, pack_member_info, parse_member_info
from moshpeer.averaging.private import dataplane_check, outsider_in_group
from moshpeer.averaging.relay import StreamRelay
from moshpeer.averaging.report import DataPlaneStats, RoundResult
from moshpeer.averaging.kept_links import KeptLinks
from moshpeer.averaging.scratch import ScratchPool
from moshpeer.averaging.pacing import group_links
from moshpeer.averaging.suspects import SuspectTracker
from moshpeer.averaging.tcp_relay.role import NO_RELAY, RelayRole
from moshpeer.averaging.uplink import UploadEstimate
from moshpeer.compression.codec import get_compression
from moshpeer.compression.kernels import load_kernels
from moshpeer.compression.feedback import ErrorFeedback
from moshpeer.dht import admission as private_runs
from moshpeer.dht.clock import ClockWatch, measure_offsets
from moshpeer.dht.keys import averaging_prefix
from moshpeer.dht.node import DHT_CALL_TIMEOUT
from moshpeer.errors import ProtocolError, UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundAsked:
    """What one `step()` asked for, checked, with the deadlines computed there: its round reads it in the round thread."""

    deadline: RoundDeadline
    weight: float
    window: float  # the matchmaking window
    target: int  # the group size
    tensors: List[torch.Tensor]
    averaged: Tuple[str, ...]
    work: Optional[Tuple[int, int]]
    epoch: Optional[int]
    digest: bytes


class MoshpitAverager(ServicerBase):
    """Averages `tensors` in place with the swarm, one Moshpit round per `step()`.

    :param tensors: what to average (any float dtype / shape; averaged in fp32, written back in place)
    :param dht: a running DHT from `moshpeer.dht.start_dht(...)`: its identity (the libp2p key) signs this
        peer's data-plane connections
    :param run_id: run whose peers to average with (group keys live under it)
    :param target_group_size: group size g (a power of two keeps the grid exact); min_group_size: smallest
        group worth averaging with
    :param grid_bits: initial group bits = grid coordinates. An int picks that many random bits; a string
        of '0'/'1' sets them; None (default) = no bits: one pool, groups formed at random every round
        (suits a few to hundreds of peers). A full grid of g^M peers with log2(g)*(M-1) bits reaches the
        exact mean in M rounds.
    :param compression: codec spec (`moshpeer.compression.get_compression`)
    :param chunk_bytes: fp32 bytes per chunk on the wire (before compression)
    :param matchmaking_time: how long a peer waits for others to join its group
    :param request_timeout: matchmaking request timeout (default: matchmaking_time / 2)
    :param round_timeout: absolute budget of the data plane of one round (reduce-scatter ends at 60% of it)
    :param min_matchmaking_time, min_round_timeout: floors of the adaptive deadlines: with them, each round's
        matchmaking window and data-plane budget come from the assembly and round times this averager
        measured (median + k MAD, see `adaptive_deadlines`), between these floors and `matchmaking_time` /
        `round_timeout` as caps. None (default): that deadline is fixed at its cap
    :param links: how this peer's chunks reach the wire (`averaging/links.py`): the real transport by default;
        `FaultyLinks(FaultConfig(...))` injects faults into its outgoing chunks (tests, benchmarks, `join --faults`)
    :param host: the data-plane listener's address, announced to group mates (`announce_host()`, if given, instead)
    :param client_mode: never lead matchmaking (peers that cannot accept libp2p connections; always behind NAT)
    :param start: start the background loop now (else call `start()`)
    :param loss_budget: DBLP loss budget: a `LossBudget` (phase-aware; call `averager.loss_budget.on_window(
        norm)` at the end of each signal window) or a fixed fraction; None/0 = wait for everything until the
        deadline. A group applies the smallest budget its members declared in matchmaking.
    :param error_feedback: sparsifying codecs (arc-topk) only. None (default): a round replaces only the
        selected rows by their group average and keeps the other values (safe for parameters). An `ErrorFeedback`
        state: a round folds the tensors into it and writes back what it returns (compression/feedback.py).
    :param partition: "equal" (default): every member owns an equal part; "bandwidth": parts sized by the
        members' upload bandwidths (`partition.bandwidth_part_sizes`), if every member of the group announces
        one (a member that asks for equal parts, or knows no bandwidth yet, makes the group split equally)
    :param upload_bandwidth: this peer's upload in bytes/s, announced for "bandwidth" partitioning; default:
        measured on the data plane in every round (`upload_bandwidth` property; unknown until a round moved
        enough data)
    :param transport: "auto" (default): direct TCP to members that announced an address and can be reached,
        libp2p streams to the others; "libp2p": announce no direct address and send everything over libp2p
        streams (a peer behind NAT; also for testing)
    :param aggregation: how this peer, as a part's owner, combines contributions: "mean" (default), "clipped"
        (CenteredClip) or "trimmed" (coordinate-wise trimmed mean); see aggregation.py and docs/security.md
    :param swarm_key, allow_peers: a private run: admit only peers that hold this pre-shared secret (bytes) and/or
        whose peer ids are listed; installed as the DHT node's policy (`moshpeer.dht.Admission`, UserError if
        the node already has another one). Others are refused in matchmaking and on the data plane
        (counted in `dht.admission.refused`). Default: the DHT node's policy (open unless set there)
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        dht,
        run_id: str,
        target_group_size: int = 4,
        min_group_size: int = 2,
        grid_bits: Union[int, str, None] = None,
        compression: str = "none",
        chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES,
        matchmaking_time: float = 3.0,
        request_timeout: Optional[float] = None,
        round_timeout: float = 30.0,
        min_matchmaking_time: Optional[float] = None,
        min_round_timeout: Optional[float] = None,
        links: Links = PLAIN_LINKS,
        host: str = "127.0.0.1",
        announce_host: Optional[Callable[[], str]] = None,
        client_mode: bool = False,
        start: bool = True,
        loss_budget: Union[LossBudget, float, None] = None,
        transport: str = "auto",
        error_feedback: Optional[ErrorFeedback] = None,
        partition: str = "equal",
        upload_bandwidth: Optional[float] = None,
        aggregation: str = "mean",
        swarm_key: Optional[bytes] = None,
        allow_peers: Optional[Sequence[str]] = None,
    ):
        check_settings(run_id, tensors, target_group_size, min_group_size, chunk_bytes, matchmaking_time,
                       round_timeout, transport, partition)
        self.identity = getattr(dht, "identity", None)
        if self.identity is None:
            raise UserError("MoshpitAverager needs a DHT started by moshpeer.dht.start_dht (its identity signs "
                            "the data plane)")
        if swarm_key is not None or allow_peers is not None:
            private_runs.install(dht, private_runs.Admission(swarm_key, allow_peers))
        self.admission: private_runs.Admission = dht.admission
        self.aggregation = check_aggregation(aggregation)
        # Per peer id (base58): chunks in which this peer's robust aggregation clipped or trimmed that peer.
        self.flagged_peers: Dict[str, int] = collections.Counter()
        self.suspects = SuspectTracker()  # "clipped": peers flagged round after round, weighed at zero
        self.tensors: List[torch.Tensor] = list(tensors)
        self.dht, self.run_id = dht, run_id
        self._clock = ClockWatch(lambda: measure_offsets(dht))  # asked why after a round without a group
        self.target_group_size, self.min_group_size = target_group_size, min_group_size
        self.compression_spec, self.compression = compression, get_compression(compression)
        load_kernels(self.tensors)  # now, not in the first round: there every member would load them at once
        self.chunk_numel = max(chunk_bytes // 4, 16)
        self.matchmaking_time, self.round_timeout = matchmaking_time, round_timeout
        self.deadlines = DeadlineLearner.for_settings(matchmaking_time, round_timeout, min_matchmaking_time,
                                                      min_round_timeout)
        self.request_timeout = request_timeout if request_timeout is not None else matchmaking_time / 2
        self.links, self.transport = links, transport
        self.behind_nat = getattr(dht, "behind_nat", False)  # start_dht(behind_nat=True): a leader takes requests,
        self.client_mode = client_mode or self.behind_nat  # so a peer nobody can connect to never leads
        if upload_bandwidth is not None and not 0 < upload_bandwidth <= MAX_BANDWIDTH:
            raise UserError(f"upload bandwidth must be positive bytes/s, got {upload_bandwidth}")
        self.partition, self._upload = partition, UploadEstimate(upload_bandwidth)
        self.loss_budget: LossBudget = parse_loss_budget(loss_budget)
        self.prefix = averaging_prefix(run_id)
        self._bits_per_axis = max(1, (target_group_size - 1).bit_length())
        self._initial_bits = initial_group_bits(grid_bits)
        self._schema_hash = schema_hash(self.tensors, compression, self.chunk_numel)
        self._numel = sum(t.numel() for t in self.tensors)
        if error_feedback is not None and (self.compression.sparsifier is None or error_feedback.numel != self._numel):
            raise UserError("error_feedback needs a sparsifying codec (arc-topk) and one value per averaged value")
        self.error_feedback = error_feedback

        self._plane = DataPlane(host, strict=True, admit=dataplane_check(self.admission), announce_host=announce_host)
        # Behind NAT: hold a slot on a relay and announce it; public: serve as a relay (tcp_relay/).
        self._nat = RelayRole(dht, run_id, self._plane, behind_nat=self.behind_nat,
                              serve=transport != "libp2p" and not client_mode, admit=dataplane_check(self.admission))
        self._scratch = ScratchPool(keep=2 + 3 * target_group_size)  # a round's buffers, reused (scratch.py)
        self._kept = KeptLinks()  # our direct connections, kept between rounds (kept_links.py)
        self._relay: Optional[StreamRelay] = None
        self._lock_tensors = threading.RLock()
        # Rounds run here, one at a time (step() queues them; see RoundFuture).
        self._rounds = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="moshpeer-round")
        self._loop_thread = LoopThread("moshpeer-averager-loop")
        self._matchmaking: Optional[MatchmakingAdapter] = None
        self._p2p = None
        self.peer_id = None
        self.rounds_done = 0
        if start:
            self.start()

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        """Start the background matchmaking loop and wait until it serves requests; UserError if it does not
        within `timeout`, or the error that stopped it."""
        self._loop_thread.start(self._setup, self._teardown, timeout)
        self._nat.start()

    async def _setup(self) -> None:
        # A replica of our own: dht.replicate_p2p() hands every caller in a process the same cached replica,
        # bound to the event loop of its first user, so a second averager's streams would be served by the
        # first one's loop (late, or never once that loop stopped).
        daemon = self.dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr, return_future=True)
        self._p2p = await P2P.replicate(daemon.result(timeout=DHT_CALL_TIMEOUT))
        self.peer_id = self._p2p.peer_id
        if self.peer_id.to_bytes() != self.identity.peer_id_bytes:
            raise UserError("the DHT's libp2p daemon does not run under the DHT's identity")
        if not self.client_mode:
            await self.add_p2p_handlers(self._p2p, namespace=self.prefix)
        self._relay = StreamRelay(self._p2p, asyncio.get_running_loop(), self._plane, f"{self.prefix}.dataplane")
        await self._relay.start()
        self._matchmaking = MatchmakingAdapter(
            self._p2p, self._schema_hash, self.dht, servicer_type=MoshpitAverager, prefix=self.prefix,
            target_group_size=self.target_group_size, min_group_size=self.min_group_size,
            matchmaking_time=self.matchmaking_time, request_timeout=self.request_timeout, client_mode=self.client_mode,
            initial_group_bits=self._initial_bits, admission=self.admission, aggregation=self.aggregation)

    async def _teardown(self) -> None:
        if self._relay is not None:
            await self._relay.stop()
        if not self.client_mode and self._p2p is not None:
            with contextlib.suppress(Exception):
                await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        if self._p2p is not None:
            with contextlib.suppress(Exception):
                await self._p2p.shutdown()  # our replica only: the daemon belongs to the DHT

    def shutdown(self) -> None:
        """Stop serving matchmaking and close the data plane; the DHT is left running (the caller owns it).
        Rounds not started yet are cancelled; a round in flight ends by its deadline."""
        self._rounds.shutdown(wait=False, cancel_futures=True)
        self._loop_thread.stop(timeout=5.0)
        self._nat.stop()
        self._kept.close()
        self._plane.close()

    def __enter__(self) -> "MoshpitAverager":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- state --------------------------------------------------------------------------------

    @property
    def group_bits(self) -> str:
        """Current group bits (the key is `{prefix}.0b{bits}`)."""
        if self._matchmaking is None:
            return self._initial_bits
        return self._matchmaking.group_bits

    @property
    def coordinates(self) -> Tuple[int, ...]:
        """Grid coordinates: the group bits read as base-g digits (log2(g) bits per axis)."""
        bits, k = self.group_bits, self._bits_per_axis
        return tuple(int(bits[i : i + k], 2) for i in range(0, len(bits) - len(bits) % k, k))

    @property
    def data_address(self) -> Tuple[str, int]:
        """Where group mates reach the data plane now; ("", 0): through our relay, or over libp2p streams."""
        return ("", 0) if self.transport == "libp2p" or self.behind_nat else self._plane.reachable_address()

    @property
    def upload_bandwidth(self) -> Optional[float]:
        """This peer's upload in bytes/s: the declared one, else the measured one; None while unknown."""
        return self._upload.current

    def wait_for_relay(self, timeout: float = 0.0) -> Optional[Tuple[str, int]]:
        """Behind NAT: the relay group mates reach it through, waiting up to `timeout` s (None: no relay, or public)."""
        return self._nat.wait_for_relay(timeout)

    def fastest_assembly_s(self, target_group_size: Optional[int] = None) -> Optional[float]:
        """The fastest recent assembly of a full group of `target_group_size` (default: the averager's), learned
        from this peer's rounds (adaptive_deadlines.py); None before any such group formed."""
        return self.deadlines.fastest_assembly_s(target_group_size or self.target_group_size)

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[List[torch.Tensor]]:
        """Hold the averaged tensors (no round writes to them while the context is open)."""
        with self._lock_tensors:
            yield self.tensors

    # ---- matchmaking RPC ----------------------------------------------------------------------

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """Another peer asks us to lead its group: `MatchmakingAdapter.join_group` answers."""
        responses = self._matchmaking.join_group(request, context, time.monotonic())
        try:
            async for response in responses:
                yield response
        finally:
            await responses.aclose()  # closes hivemind's handler too: an asker that closed the stream leaves our group

    # ---- one round ----------------------------------------------------------------------------

    def step(self, weight: float = 1.0, timeout: Optional[float] = None, *,
             target_group_size: Optional[int] = None, matchmaking_time: Optional[float] = None,
             tensors: Optional[Sequence[torch.Tensor]] = None, averaged: Sequence[str] = (),
             upload_spread_s: float = 0.0, hold_s: float = 0.0, work: Optional[Tuple[int, int]] = None,
             epoch: Optional[int] = None, digest: bytes = b"", wait: bool = True) -> Union[RoundResult, "RoundFuture"]:
        """Find a group and average `self.tensors` (or this round's `tensors`) with it in place.

        wait=True (default): block until the round is over and return its `RoundResult`. wait=False: return at once
        a `RoundFuture` of it, resolved by its `deadline`. Rounds run one at a time, in order, in the averager's round
        thread; their deadlines are computed here, once (`RoundDeadline`). Bad arguments raise UserError here; an error
        in the round is the future's exception (raised by wait=True); no group found is a result with ok=False.

        :param weight: this peer's weight (e.g. samples contributed); >= 0
        :param timeout: how long to look for a group (default: 5 x matchmaking_time); a peer that a leader has
            accepted by then waits up to request_timeout + ASSEMBLY_GRACE_S longer for that group (see
            matchmaking_adapter.py); the data plane then has the deadline in force from the group's assembly
            (`round_timeout`, or the adaptive one between `min_round_timeout` and it)
        :param target_group_size: this round only: a group this large assembles at once (e.g. the live peers, when
            fewer than the configured group)
        :param matchmaking_time: this round only: how long to wait for the group to fill (e.g. to a budget deadline)
        :param tensors: this round only: average these instead of `self.tensors` (e.g. views of a part of
            them: a round that needs less sends less). Peers group only with peers whose round averages the
            same shapes (the schema hash covers them); UserError for non-float tensors
        :param averaged: what the tensors hold, e.g. ("gradients",); the result reports it
        :param upload_spread_s: this round only: spread its upload over about this many seconds (pacing.py: a round
            nobody waits for; the group paces by its smallest spread, within the deadline)
        :param hold_s: this round only: keep the group open at least this long (up to `matchmaking_time`; e.g. for
            members still computing), even where the learned window is shorter
        :param epoch, work: told to the group (None: not): this round's training epoch (`member_epochs`), and the
            (epoch, micro-batch size) of the data it was computed on, for spot checks (peer/accountability/)
        :param digest: told to the group: <= 32 bytes digesting values all members should hold (`members_diverged`)
        """
        check_round_args(self.min_group_size, weight=weight, upload_spread_s=upload_spread_s, hold_s=hold_s,
                         target_group_size=target_group_size, matchmaking_time=matchmaking_time, digest=digest)
        if not self._loop_thread.running:
            raise UserError("averager is not started")
        tensors = round_tensors(tensors, self.tensors, self._numel if self.error_feedback is not None else None)
        target = target_group_size or self.target_group_size
        window, deadline = self.deadlines.next_round(target, payload_bytes(tensors), self.round_timeout,
                                                     grace_s=self.request_timeout + ASSEMBLY_GRACE_S, timeout=timeout,
                                                     window_cap=matchmaking_time, spread_s=upload_spread_s,
                                                     hold_s=hold_s)
        future = RoundFuture(deadline)
        asked = RoundAsked(deadline, float(weight), window, target, tensors, tuple(averaged), work, epoch, digest)
        try:
            self._rounds.submit(self._run_round, future, asked)
        except RuntimeError:  # the executor is shut down
            raise UserError("averager is shut down") from None
        return future.result() if wait else future

    def _run_round(self, future: "RoundFuture", asked: RoundAsked) -> None:
        if not future.set_running_or_notify_cancel():
            return  # cancelled before it started
        try:
            result = self._round(asked)
            self.deadlines.observe_result(result, target=asked.target, payload_bytes=payload_bytes(asked.tensors))
            future.set_result(result)
        except BaseException as e:
            future.set_exception(e)

    def _round(self, asked: RoundAsked) -> RoundResult:
        started, (host, port), deadline = time.monotonic(), self.data_address, asked.deadline
        relay, unreachable = self._nat.round_relay(max(deadline.search_end - started, 0.0), self.transport)
        gathered = pack_member_info(host, port, self.links.declared_weight(asked.weight), os.urandom(NONCE_BYTES),
                                    (self.loss_budget.budget, self.loss_budget.phase),
                                    (self.upload_bandwidth or 0.0) if self.partition == "bandwidth" else 0.0,
                                    self.admission.tag(self.identity.peer_id), pace_s=deadline.paced_s,
                                    relay=relay, group_size=self.target_group_size, work=asked.work,
                                    answer_wait_s=self._matchmaking.answer_wait(asked.window), epoch=asked.epoch,
                                    digest=asked.digest)
        request = StepRequest.for_round(deadline, gathered, asked.weight, asked.window, asked.target,
                                        schema_hash(asked.tensors, self.compression_spec, self.chunk_numel))
        bits_before = self.group_bits
        with self._plane.matchmaking():  # connections for a group we may be about to learn of wait meanwhile
            group, error = (None, NO_RELAY) if unreachable else \
                self._matchmaking.find_group(request, self._loop_thread.loop, deadline.end)
            group_prefix = wire.group_tag_prefix(group.group_id) if group is not None else None
            if group_prefix is not None:
                self._plane.open_group(group_prefix)  # before leaving matchmaking: no refusal in between
        common = dict(averaged=asked.averaged, weight=asked.weight, matchmaking_s=time.monotonic() - started,
                      matchmaking_window_s=asked.window, compression=self.compression_spec,
                      round_deadline_s=deadline.budget_s)
        if group is None:
            if error is not None:
                logger.warning(f"matchmaking: {error}")
            clock = self._clock.after_no_group()  # a clock that jumped since the start keeps every group away
            return RoundResult(ok=False, error="; ".join(filter(None, (error or "no group found", clock))),
                               group_bits=bits_before, coordinates=self.coordinates, **common)
        try:
            return self._round_with_group(group, asked.tensors, deadline, bits_before, common)
        finally:
            self._plane.close_group(group_prefix)

    def _round_with_group(self, group: GroupInfo, tensors: List[torch.Tensor], deadline: "RoundDeadline",
                          bits_before: str, common: dict) -> RoundResult:
        group_id = group.group_id.hex()
        ids = dict(group_id=group_id, group_size=group.group_size, my_index=group.peer_ids.index(self.peer_id))
        try:
            members = [parse_member_info(data) for data in group.gathered]
        except ProtocolError as e:
            logger.warning(f"round {group_id[:8]}: bad group metadata: {e}")
            return RoundResult(ok=False, error=f"bad group metadata: {e}", group_bits=bits_before,
                               coordinates=self.coordinates, **ids, **common)
        outsider = outsider_in_group(self.admission, [str(p) for p in group.peer_ids], [m.tag for m in members])
        if outsider is not None:
            return RoundResult(ok=False, error=f"group has a peer this private run does not admit ({outsider[-8:]})",
                               group_bits=bits_before, coordinates=self.coordinates, **ids, **common)
        logger.info(f"round {group_id[:8]}: group of {group.group_size} assembled in {common['matchmaking_s']:.2f} s, "
                    f"my index {ids['my_index']}")
        assembled = time.monotonic()  # the data plane has the round's data budget from now, never past its end
        data_deadline = deadline.data_plane_end(assembled)
        loss_budget, loss_phase, data, extra = self._average_with_group(group, members, ids["my_index"], tensors,
                                                                          data_deadline)
        self.rounds_done += 1
        return RoundResult(ok=True, group_bits=self.group_bits, coordinates=self.coordinates, loss_budget=loss_budget,
                           loss_phase=loss_phase, aggregation=self.aggregation,
                           data_deadline_s=data_deadline - assembled, data=data, **extra, **ids, **common)

    def _average_with_group(self, group: GroupInfo, members: List[MemberInfo], my_index: int,
                            tensors: List[torch.Tensor], deadline: float
                            ) -> Tuple[float, str, DataPlaneStats, Dict[str, Any]]:
        """Average `tensors` with the group by `deadline` -> the group's loss budget, phase, the data plane's counters
        (summed over the round's all-reduces) and more `RoundResult` fields: `flagged` (peer id -> chunks of our part
        clipped or trimmed), `distrusted` (weighed at zero), `contributors`, `part_sizes`, `upload_paced_s`."""
        peer_ids = [str(peer_id) for peer_id in group.peer_ids]
        distrusted = self.suspects.distrusted(peer_ids) if self.aggregation == "clipped" else []
        sampled = member_to_sample(my_index, len(members), self.aggregation)
        secret = self.admission.connection_secret(wire.group_secret(group.group_id, [m.nonce for m in members]))
        # One signature per round, shared by the round's all-reduces (ARC-Top-K runs two).
        credentials = RoundCredentials.create(self.identity, wire.group_tag_prefix(group.group_id), my_index)
        # One budget per group: every member computes the same one from the same gathered list.
        declared = [m.loss_budget for m in members if m.loss_budget is not None]
        loss_budget, loss_phase = group_budget(declared or [(self.loss_budget.budget, self.loss_budget.phase)])
        links, spread = group_links(self.links, [m.pace_s for m in members], sum(t.numel() for t in tensors),
                                    self.compression, self.chunk_numel)
        dataplane = GroupDataPlane(
            self._plane, [GroupMember(m.host, m.port, m.weight, peer_id.to_bytes(), m.relay)
                          for m, peer_id in zip(members, group.peer_ids)],
            my_index, group.group_id, secret, credentials, self.compression, self.chunk_numel, deadline, links,
            loss_budget or 0.0, [m.bandwidth for m in members], self.aggregation, distrusted, scratch=self._scratch,
            relay=self._relay.connect if self._relay is not None else None, force_relay=self.transport == "libp2p",
            sampled_member=sampled, kept=self._kept)
        with self._lock_tensors:
            flat, write_back = flatten(tensors)
            result = dataplane.average(flat, self.error_feedback)
            write_back()
        self._upload.note(result.upload_bps)
        if self.aggregation == "clipped":
            self.suspects.record_round(peer_ids, result.evidence_by_index)
        self._nat.note_round(len(members) - 1, len(set(result.departed) | set(result.absent)))  # behind NAT: relay ok?
        result, facts = round_facts(result, peer_ids, members, my_index, sampled)
        self.flagged_peers.update(facts["flagged"])  # a Counter: adds
        log_round(group.group_id.hex()[:8], result, facts["flagged"], self.aggregation, facts["members_diverged"])
        return loss_budget, loss_phase, result, dict(facts, part_sizes=dataplane.part_sizes(flat.numel()) or [],
                                                     distrusted=[peer_ids[i] for i in distrusted], upload_paced_s=spread)
