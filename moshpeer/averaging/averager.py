"""`MoshpitAverager`: Moshpit rounds (grid groups via hivemind's matchmaking) over moshpeer's own data plane.

Control plane: the averager owns a hivemind `Matchmaking` (and through it a `GroupKeyManager`,
whose group bits are Moshpit's grid coordinates) and serves its `rpc_join_group` on a P2P replica
of the DHT's daemon. Both run on a private asyncio loop in a background thread. Each member's
`data_for_gather` (msgpack: protocol version, data-plane address, weight, random nonce, loss budget) travels
inside matchmaking over libp2p's encrypted channel; the group secret is a hash of the group id and
all nonces.

Data plane: `GroupAllReduce` (direct TCP, see allreduce.py; libp2p streams through `StreamRelay`
for members without a direct path), run in the thread that calls `step()`. After every assembled
group the key manager shifts an index drawn from an RNG seeded by the group id into the group bits,
so the next round's group mixes different peers.

Matchmaking deadline. hivemind's follower commits to a leader (ACCEPTED) and then waits for the
leader's BEGIN_ALLREDUCE, which the leader sends when its group fills or at its declared expiration,
at most the follower's own request expiration, itself capped at the follower's search end. If the
follower stops waiting exactly at its search end (what `look_for_group` does when the step's timeout
equals its deadline), a group assembled in the last moments before that deadline counts a follower
that has already left: the leader's view and the follower's disagree. So a step gives hivemind its
search end as `deadline` but waits for the group `request_timeout` + ASSEMBLY_GRACE_S longer (hivemind's
own bound on a leader's answer), and only while it is committed (accepted by a leader, leading
followers, or a join request in flight); an uncommitted peer stops at the search end. Should
matchmaking still disagree (an event loop stalled past the grace), the data plane makes it fast and
visible: the left-out peer refuses the group's connections at once (strict `DataPlane`), its mates
report it in `RoundResult.absent`, and the left-out peer's result says it gave up while committed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import msgpack
import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.dht import DHT
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import cancel_and_wait

from moshpeer.averaging import wire
from moshpeer.averaging.aggregation import check_aggregation
from moshpeer.averaging.allreduce import AllReduceResult, GroupAllReduce, GroupMember
from moshpeer.averaging.dataplane import DataPlane
from moshpeer.averaging.adaptive_deadlines import RoundDeadlines
from moshpeer.averaging.deadline import RoundDeadline, RoundFuture
from moshpeer.averaging.handshake import RoundCredentials
from moshpeer.averaging.links import PLAIN_LINKS, Links
from moshpeer.averaging.loss_budget import LossBudget, group_budget, parse_loss_budget
from moshpeer.averaging.partition import bandwidth_part_sizes
from moshpeer.averaging.private import admits_follower, dataplane_check, filter_leaders, outsider_in_group
from moshpeer.averaging.relay import StreamRelay
from moshpeer.averaging.report import PhaseStats, RoundResult
from moshpeer.averaging.scratch import ScratchPool
from moshpeer.averaging.suspects import SuspectTracker
from moshpeer.compression.codec import get_compression
from moshpeer.compression.ef21m import EF21M
from moshpeer.dht import admission as private_runs
from moshpeer.dht.keys import averaging_prefix, validate_run_id
from moshpeer.errors import ProtocolError, UserError
from moshpeer.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

MAX_GATHERED_BYTES = 1024  # one member's matchmaking metadata; anything larger is rejected
NONCE_BYTES = 16
# Past its search end, how much longer than request_timeout a committed peer waits for its group
# (event-loop and network latency of the leader's BEGIN_ALLREDUCE; see the module docstring).
ASSEMBLY_GRACE_S = 1.0
# A data plane that took this much of its budget ran into its deadline (the owners stop waiting at 60 %).
DEADLINE_HIT_FRACTION = 0.9
COMMITMENT_POLL_S = 0.02
# A join request we could only accept after this fraction of request_timeout is refused (see rpc_join_group):
# the asker's own wait started earlier and the answer still has to travel back.
LATE_ACCEPTANCE_FRACTION = 0.5
TRANSPORTS = ("auto", "libp2p")
ROUND_DEVICE_TYPES = ("cpu", "cuda")  # where a round's vector may live (averaging/staging.py); else on the CPU
PARTITIONS = ("equal", "bandwidth")
MAX_BANDWIDTH = 1e12  # bytes/s; a member announcing more is rejected
# Weight of the newest measurement in this peer's upload estimate (exponential average over rounds).
UPLOAD_ESTIMATE_ALPHA = 0.5


@dataclass
class _StepRequest:
    """What hivemind's Matchmaking reads from a step (a light stand-in for its multiprocess StepControl)."""

    data_for_gather: bytes
    scheduled_time: float
    deadline: float  # search end (DHT time): no new declarations or join requests after it
    weight: float
    schema_hash: bytes  # of this round's tensors: peers group only with peers averaging the same schema
    target_group_size: int = 4
    matchmaking_time: float = 3.0
    grace: float = 0.0  # how long past `deadline` a committed peer may still wait for its group

    def get_timeout(self) -> float:
        return max(0.0, self.deadline + self.grace - get_dht_time())


@dataclass(frozen=True)
class _MemberInfo:
    host: str  # "" and port 0: no direct address (reach it over libp2p)
    port: int
    weight: float
    nonce: bytes
    # The loss budget P and phase this member would apply; the group applies the smallest (loss_budget.py).
    loss_budget: Optional[Tuple[float, str]] = None
    # Upload bytes/s for sizing parts (0: unknown or equal parts wanted; the group then splits equally).
    bandwidth: float = 0.0
    tag: bytes = b""  # a private run's membership tag (moshpeer/dht/admission.py); b"" in open runs


def _pack_member_info(host: str, port: int, weight: float, nonce: bytes,
                      loss_budget: Optional[Tuple[float, str]] = None, bandwidth: float = 0.0,
                      tag: bytes = b"") -> bytes:
    info = {"v": PROTOCOL_VERSION, "host": host, "port": port, "weight": weight, "nonce": nonce}
    if loss_budget is not None:
        info["budget"], info["phase"] = float(loss_budget[0]), str(loss_budget[1])
    if bandwidth > 0:
        info["bw"] = float(bandwidth)
    if tag:
        info["tag"] = tag
    return msgpack.packb(info)


def _parse_member_info(data: bytes) -> _MemberInfo:
    """Validate one member's gathered metadata (untrusted: it came from another peer)."""
    if not isinstance(data, bytes) or len(data) > MAX_GATHERED_BYTES:
        raise ProtocolError("gathered metadata missing or too large")
    try:
        info = msgpack.unpackb(data, raw=False, max_bin_len=MAX_GATHERED_BYTES, max_str_len=MAX_GATHERED_BYTES)
    except Exception as e:
        raise ProtocolError(f"undecodable gathered metadata: {e}") from None
    if not isinstance(info, dict) or info.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("gathered metadata of another protocol version")
    host, port, weight, nonce = info.get("host"), info.get("port"), info.get("weight"), info.get("nonce")
    if not isinstance(host, str) or not len(host) <= 255:
        raise ProtocolError("bad data-plane host")
    if not isinstance(port, int) or not 0 <= port < 65536 or (port == 0) != (host == ""):
        raise ProtocolError("bad data-plane port")
    if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise ProtocolError("bad weight")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ProtocolError("bad nonce")
    budget, phase = info.get("budget"), info.get("phase")
    declared = None
    if budget is not None:  # optional: a member without one leaves the decision to the others
        if not isinstance(budget, (int, float)) or not 0.0 <= budget < 1.0 or not isinstance(phase, str) \
                or len(phase) > 16:
            raise ProtocolError("bad loss budget")
        declared = (float(budget), phase)
    bandwidth = info.get("bw", 0.0)
    if not isinstance(bandwidth, (int, float)) or not 0 <= bandwidth <= MAX_BANDWIDTH:
        raise ProtocolError("bad bandwidth")
    tag = info.get("tag", b"")
    if not isinstance(tag, bytes) or len(tag) > private_runs.TAG_BYTES:
        raise ProtocolError("bad membership tag")
    return _MemberInfo(host, port, float(weight), nonce, declared, float(bandwidth), tag)


def _payload_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """fp32 bytes a round averages, before compression: what its deadline's history is keyed by."""
    return 4 * sum(t.numel() for t in tensors)


def schema_hash(tensors: Sequence[torch.Tensor], compression: str, chunk_numel: int) -> bytes:
    """Peers only group with peers that average the same shapes with the same codec and chunking."""
    h = hashlib.blake2b(digest_size=20, person=b"moshpeer-schema")
    h.update(f"v{PROTOCOL_VERSION}|{compression}|{chunk_numel}".encode())
    for t in tensors:
        h.update(f"|{tuple(t.shape)}:{t.dtype}".encode())
    return h.digest()


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
    :param host: address of the data-plane listener, announced to group mates
    :param client_mode: never lead matchmaking (peers that cannot accept libp2p connections)
    :param start: start the background loop now (else call `start()`)
    :param loss_budget: DBLP loss budget: a `LossBudget` (phase-aware; call `averager.loss_budget.on_window(
        norm)` at the end of each signal window) or a fixed fraction; None/0 = wait for everything until the
        deadline. A group applies the smallest budget its members declared in matchmaking.
    :param error_feedback: sparsifying codecs (arc-topk) only. None (default): a round replaces only the
        selected rows by their group average and keeps the other values (safe for parameters). An `EF21M`
        state (gradients): a round folds the tensors into it and writes back its compressed estimate e_bar.
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
        chunk_bytes: int = 1 << 20,
        matchmaking_time: float = 3.0,
        request_timeout: Optional[float] = None,
        round_timeout: float = 30.0,
        min_matchmaking_time: Optional[float] = None,
        min_round_timeout: Optional[float] = None,
        links: Links = PLAIN_LINKS,
        host: str = "127.0.0.1",
        client_mode: bool = False,
        start: bool = True,
        loss_budget: Union[LossBudget, float, None] = None,
        transport: str = "auto",
        error_feedback: Optional[EF21M] = None,
        partition: str = "equal",
        upload_bandwidth: Optional[float] = None,
        aggregation: str = "mean",
        swarm_key: Optional[bytes] = None,
        allow_peers: Optional[Sequence[str]] = None,
    ):
        validate_run_id(run_id)
        if not tensors:
            raise UserError("MoshpitAverager needs at least one tensor")
        if any(not t.is_floating_point() for t in tensors):
            raise UserError("MoshpitAverager averages floating-point tensors only")
        if target_group_size < 2 or min_group_size < 2 or min_group_size > target_group_size:
            raise UserError("need 2 <= min_group_size <= target_group_size")
        if chunk_bytes < 64 or matchmaking_time <= 0 or round_timeout <= 0:
            raise UserError("chunk_bytes >= 64, matchmaking_time > 0 and round_timeout > 0 are required")
        self.identity = getattr(dht, "identity", None)
        if self.identity is None:
            raise UserError("MoshpitAverager needs a DHT started by moshpeer.dht.start_dht (its identity signs "
                            "the data plane)")
        if swarm_key is not None or allow_peers is not None:
            private_runs.install(dht, private_runs.Admission(swarm_key, allow_peers))
        self.admission: private_runs.Admission = dht.admission
        self.aggregation = check_aggregation(aggregation)
        # Per peer id (base58): chunks in which this peer's robust aggregation clipped or trimmed that peer.
        self.flagged_peers: Dict[str, int] = {}
        self.suspects = SuspectTracker()  # "clipped": peers flagged round after round, weighed at zero
        self.tensors: List[torch.Tensor] = list(tensors)
        self.dht, self.run_id = dht, run_id
        self.target_group_size, self.min_group_size = target_group_size, min_group_size
        self.compression_spec = compression
        self.compression = get_compression(compression)
        self.chunk_numel = max(chunk_bytes // 4, 16)
        self.matchmaking_time, self.round_timeout = matchmaking_time, round_timeout
        try:
            self.deadlines = RoundDeadlines(
                matchmaking_floor=min_matchmaking_time or matchmaking_time, matchmaking_cap=matchmaking_time,
                round_floor=min_round_timeout or round_timeout, round_cap=round_timeout)
        except ValueError:
            raise UserError(f"need 0 < min_matchmaking_time <= matchmaking_time ({matchmaking_time:g}) and "
                            f"0 < min_round_timeout <= round_timeout ({round_timeout:g})") from None
        self.request_timeout = request_timeout if request_timeout is not None else matchmaking_time / 2
        self.links = links
        self.client_mode = client_mode
        if transport not in TRANSPORTS:
            raise UserError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        self.transport = transport
        if partition not in PARTITIONS:
            raise UserError(f"partition must be one of {', '.join(PARTITIONS)}, got {partition!r}")
        if upload_bandwidth is not None and not 0 < upload_bandwidth <= MAX_BANDWIDTH:
            raise UserError(f"upload bandwidth must be positive bytes/s, got {upload_bandwidth}")
        self.partition = partition
        self.declared_upload = upload_bandwidth
        self.measured_upload: Optional[float] = None  # bytes/s, from the rounds so far
        self.loss_budget: LossBudget = parse_loss_budget(loss_budget)
        self.prefix = averaging_prefix(run_id)
        self._bits_per_axis = max(1, (target_group_size - 1).bit_length())
        self._initial_bits = self._initial_group_bits(grid_bits)
        self._schema_hash = schema_hash(self.tensors, compression, self.chunk_numel)
        self._numel = sum(t.numel() for t in self.tensors)
        if error_feedback is not None and (self.compression.sparsifier is None or error_feedback.numel != self._numel):
            raise UserError("error_feedback needs a sparsifying codec (arc-topk) and one value per averaged value")
        self.error_feedback = error_feedback

        self._plane = DataPlane(host, strict=True, admit=dataplane_check(self.admission))
        self._scratch = ScratchPool()  # the owner's working buffers, reused round after round
        self._relay: Optional[StreamRelay] = None
        self._lock_tensors = threading.RLock()
        # Rounds run here, one at a time (step() queues them; see RoundFuture).
        self._rounds = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="moshpeer-round")
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._startup_error: Optional[BaseException] = None
        self._matchmaking: Optional[Matchmaking] = None
        self._p2p = None
        self.peer_id = None
        self.rounds_done = 0
        if start:
            self.start()

    # ---- lifecycle ----------------------------------------------------------------------------

    def _initial_group_bits(self, grid_bits: Union[int, str, None]) -> str:
        if grid_bits is None:
            return ""
        if isinstance(grid_bits, str):
            if any(bit not in "01" for bit in grid_bits):
                raise UserError(f"grid_bits must be a string of 0/1, got {grid_bits!r}")
            return grid_bits
        if grid_bits < 0:
            raise UserError("grid_bits must be non-negative")
        return "".join(str(b) for b in torch.randint(0, 2, (grid_bits,)).tolist())

    def start(self, timeout: float = 60.0) -> None:
        """Start the background matchmaking loop and wait until it serves requests."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run_loop, name="moshpeer-averager-loop", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise UserError(f"averager did not start within {timeout:g} s")
        if self._startup_error is not None:
            raise self._startup_error

    def _run_loop(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._setup())
        except BaseException as e:
            self._startup_error = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._teardown())
        _finish_pending_tasks(loop)
        loop.close()

    async def _setup(self) -> None:
        # A replica of our own: dht.replicate_p2p() hands every caller in a process the same cached replica,
        # bound to the event loop of its first user, so a second averager's streams would be served by the
        # first one's loop (late, or never once that loop stopped).
        self._p2p = await P2P.replicate(self.dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr))
        self.peer_id = self._p2p.peer_id
        if self.peer_id.to_bytes() != self.identity.peer_id_bytes:
            raise UserError("the DHT's libp2p daemon does not run under the DHT's identity")
        if not self.client_mode:
            await self.add_p2p_handlers(self._p2p, namespace=self.prefix)
        self._relay = StreamRelay(self._p2p, asyncio.get_running_loop(), self._plane, f"{self.prefix}.dataplane")
        await self._relay.start()
        self._matchmaking = Matchmaking(
            self._p2p,
            self._schema_hash,
            self.dht,
            servicer_type=MoshpitAverager,
            prefix=self.prefix,
            target_group_size=self.target_group_size,
            min_group_size=self.min_group_size,
            min_matchmaking_time=self.matchmaking_time,
            request_timeout=self.request_timeout,
            client_mode=self.client_mode,
            initial_group_bits=self._initial_bits,
        )
        filter_leaders(self._matchmaking.group_key_manager, self.admission)

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
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5.0)
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
        return self._matchmaking.group_key_manager.group_bits

    @property
    def coordinates(self) -> Tuple[int, ...]:
        """Grid coordinates: the group bits read as base-g digits (log2(g) bits per axis)."""
        bits, k = self.group_bits, self._bits_per_axis
        return tuple(int(bits[i : i + k], 2) for i in range(0, len(bits) - len(bits) % k, k))

    @property
    def data_address(self) -> Tuple[str, int]:
        """The data-plane listener's address; announced to group mates unless transport is "libp2p"."""
        return self._plane.address

    @property
    def upload_bandwidth(self) -> Optional[float]:
        """This peer's upload in bytes/s: the declared one, else the measured one; None while unknown."""
        return self.declared_upload if self.declared_upload is not None else self.measured_upload

    def _note_upload(self, measured: Optional[float]) -> None:
        if measured is None:
            return
        old = self.measured_upload
        self.measured_upload = measured if old is None else old + UPLOAD_ESTIMATE_ALPHA * (measured - old)

    def _announced_address(self) -> Tuple[str, int]:
        return ("", 0) if self.transport == "libp2p" else self._plane.address

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[List[torch.Tensor]]:
        """Hold the averaged tensors (no round writes to them while the context is open)."""
        with self._lock_tensors:
            yield self.tensors

    # ---- matchmaking RPC ----------------------------------------------------------------------

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """Another peer asks us to lead its group: hivemind's matchmaking decides, except for a late acceptance.

        hivemind's leader accepts under its `lock_request_join_group`, which it also holds while its own join
        request to another leader waits (up to request_timeout); the asker meanwhile waits request_timeout for
        the answer and then gives up. An acceptance given after most of that wait would count a peer that
        has left (the leader's group and the asker's view disagree), so it is withdrawn: the asker is told
        NOT_LOOKING_FOR_GROUP (if it still listens, it tries the next leader), and closing hivemind's handler
        drops it from our followers."""
        arrived = time.monotonic()
        try:
            tag = _parse_member_info(request.gather).tag
        except ProtocolError:
            tag = None
        if not admits_follower(self.admission, str(context.remote_id), tag):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        responses = self._matchmaking.rpc_join_group(request, context)
        try:
            async for response in responses:
                waited = time.monotonic() - arrived
                if (response.code == averaging_pb2.ACCEPTED
                        and waited > LATE_ACCEPTANCE_FRACTION * self._matchmaking.request_timeout):
                    logger.debug(f"withdrawing a late acceptance ({waited:.2f} s after the request)")
                    yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
                    return
                yield response
        finally:
            await responses.aclose()

    # ---- one round ----------------------------------------------------------------------------

    def step(self, weight: float = 1.0, timeout: Optional[float] = None, *,
             target_group_size: Optional[int] = None, matchmaking_time: Optional[float] = None,
             tensors: Optional[Sequence[torch.Tensor]] = None, averaged: Sequence[str] = (),
             wait: bool = True) -> Union[RoundResult, "RoundFuture"]:
        """Find a group and average `self.tensors` (or this round's `tensors`) with it in place.

        wait=True (default): block until the round is over and return its `RoundResult`. wait=False: return
        at once a `RoundFuture` of it, resolved by its `deadline`. Rounds run one at a time, in the order
        they were asked for, in the averager's round thread. The round's deadlines are computed here, once
        (`RoundDeadline`). Bad arguments raise UserError here; an error inside the round becomes the
        future's exception (raised by wait=True). A round that finds no group is a result with ok=False.

        :param weight: this peer's weight (e.g. samples contributed); >= 0
        :param timeout: how long to look for a group (default: 5 x matchmaking_time); a peer that a leader has
            accepted by then waits up to request_timeout + ASSEMBLY_GRACE_S longer for that group (see the
            module docstring); the data plane then has the deadline in force from the group's assembly (`round_timeout`, or
            the adaptive one between `min_round_timeout` and it)
        :param target_group_size: this round only: a group this large assembles at once (e.g. the number of
            live peers when the swarm is smaller than the configured group); default: the configured one
        :param matchmaking_time: this round only: how long to wait for the group to fill (e.g. up to a
            compute-budget deadline); default: the configured one
        :param tensors: this round only: average these instead of `self.tensors` (e.g. views of a part of
            them: a round that needs less sends less). Peers group only with peers whose round averages the
            same shapes (the schema hash covers them); UserError for non-float tensors
        :param averaged: what the tensors hold, e.g. ("gradients",); the result reports it
        """
        if not math.isfinite(weight) or weight < 0:
            raise UserError(f"weight must be finite and >= 0, got {weight}")
        if target_group_size is not None and not self.min_group_size <= target_group_size:
            raise UserError(f"target_group_size must be at least min_group_size ({self.min_group_size})")
        if matchmaking_time is not None and not matchmaking_time > 0:
            raise UserError(f"matchmaking_time must be positive, got {matchmaking_time}")
        if self._loop is None or not self._ready.is_set():
            raise UserError("averager is not started")
        tensors = self._round_tensors(tensors)
        target = target_group_size or self.target_group_size
        payload = _payload_bytes(tensors)
        # The deadlines in force: what this averager measured, between the floors and the caps; a caller's
        # window (e.g. up to a compute-budget deadline) is an upper bound on top.
        window = self.deadlines.matchmaking_window(target)
        if matchmaking_time is not None:
            window = min(window, matchmaking_time)
        search_s = max(timeout if timeout is not None else 5 * window, window)
        deadline = RoundDeadline.starting_now(search_s, self.request_timeout + ASSEMBLY_GRACE_S, self.round_timeout,
                                              data_s=self.deadlines.round_deadline(target, payload))
        future = RoundFuture(deadline)
        round_args = (deadline, float(weight), window, target, tensors, tuple(averaged))
        try:
            self._rounds.submit(self._run_round, future, *round_args)
        except RuntimeError:  # the executor is shut down
            raise UserError("averager is shut down") from None
        return future.result() if wait else future

    def _run_round(self, future: "RoundFuture", *round_args) -> None:
        if not future.set_running_or_notify_cancel():
            return  # cancelled before it started
        try:
            result = self._round(*round_args)
            _, _, _, target, tensors, _ = round_args
            self._learn_deadlines(result, target=target, payload=_payload_bytes(tensors))
            future.set_result(result)
        except BaseException as e:
            future.set_exception(e)

    def _learn_deadlines(self, result: RoundResult, *, target: int, payload: int) -> None:
        """Feed a finished round's assembly time (a full group only) and data-plane time (not when a member
        sent nothing at all: that says when the others gave up, not how long rounds take) to the adaptive
        deadlines."""
        if not result.group_id:
            return  # no group: the window ran out, which says nothing about how long assembly takes
        self.deadlines.observe_assembly(target, result.matchmaking_s, full=result.group_size >= target)
        if result.ok:
            self.deadlines.observe_round(
                result.group_size, payload, result.total_s,
                hit_deadline=result.total_s >= DEADLINE_HIT_FRACTION * result.data_deadline_s,
                member_died=bool(result.departed or result.absent))

    def _round(self, deadline: "RoundDeadline", weight: float, window: float, target_group_size: int,
               tensors: List[torch.Tensor], averaged: Tuple[str, ...]) -> RoundResult:
        started = time.monotonic()
        nonce = os.urandom(NONCE_BYTES)
        host, port = self._announced_address()
        search_end = deadline.dht_time(deadline.search_end)
        request = _StepRequest(
            data_for_gather=_pack_member_info(
                host, port, self.links.declared_weight(weight), nonce,
                (self.loss_budget.budget, self.loss_budget.phase),
                (self.upload_bandwidth or 0.0) if self.partition == "bandwidth" else 0.0,
                self.admission.tag(self.identity.peer_id)),
            scheduled_time=min(get_dht_time() + window, search_end),
            deadline=search_end,
            weight=weight,
            schema_hash=schema_hash(tensors, self.compression_spec, self.chunk_numel),
            target_group_size=target_group_size,
            matchmaking_time=window,
            grace=deadline.assembly_end - deadline.search_end,
        )
        bits_before = self.group_bits
        outcome: dict = {}
        with self._plane.matchmaking():  # connections for a group we may be about to learn of wait meanwhile
            search = asyncio.run_coroutine_threadsafe(self._look_for_group(request, outcome), self._loop)
            try:  # the search ends itself by assembly_end; the round's end bounds a stalled loop
                group = search.result(max(0.0, deadline.end - time.monotonic()))
            except Exception as e:
                search.cancel()
                logger.warning(f"matchmaking failed: {type(e).__name__}: {e}")
                group = None
            group_prefix = wire.group_tag_prefix(group.group_id) if group is not None else None
            if group_prefix is not None:
                self._plane.open_group(group_prefix)  # before leaving matchmaking: no refusal in between
        common = dict(averaged=averaged, weight=weight, matchmaking_s=time.monotonic() - started,
                      compression=self.compression_spec, matchmaking_window_s=window,
                      round_deadline_s=deadline.budget_s)
        if group is None:
            if "error" in outcome:
                logger.warning(f"matchmaking: {outcome['error']}")
            return RoundResult(ok=False, error=outcome.get("error", "no group found"), group_bits=bits_before,
                               coordinates=self.coordinates, **common)
        try:
            return self._round_with_group(group, tensors, deadline, bits_before, common)
        finally:
            self._plane.close_group(group_prefix)

    def _round_tensors(self, tensors: Optional[Sequence[torch.Tensor]]) -> List[torch.Tensor]:
        if tensors is None:
            return self.tensors
        tensors = list(tensors)
        if not tensors or any(not t.is_floating_point() for t in tensors):
            raise UserError("a round averages one or more floating-point tensors")
        if self.error_feedback is not None and sum(t.numel() for t in tensors) != self._numel:
            raise UserError("with error feedback every round averages all the averager's values")
        return tensors

    def _round_with_group(self, group: GroupInfo, tensors: List[torch.Tensor], deadline: "RoundDeadline",
                          bits_before: str, common: dict) -> RoundResult:
        group_id = group.group_id.hex()
        ids = dict(group_id=group_id, group_size=group.group_size, my_index=group.peer_ids.index(self.peer_id))
        try:
            members = [_parse_member_info(data) for data in group.gathered]
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
        # The data plane has the round's data budget from now, never past the round's end.
        assembled = time.monotonic()
        data_deadline = min(assembled + deadline.data_s, deadline.end)
        loss_budget, loss_phase, data, extra = self._average_with_group(group, members, ids["my_index"], tensors,
                                                                          data_deadline)
        self.rounds_done += 1
        return RoundResult(ok=True, group_bits=self.group_bits, coordinates=self.coordinates, loss_budget=loss_budget,
                           loss_phase=loss_phase, aggregation=self.aggregation, data_deadline_s=data_deadline - assembled,
                           **extra, **ids, **common,
                           **{f.name: getattr(data, f.name) for f in fields(data) if f.name not in ("flagged", "contributed")})

    def _committed(self) -> bool:
        """Is this peer part of a group in the making (see the module docstring)? Accepted by a leader, leading
        followers, a join request in flight, or a group already assembled whose result is still on its way
        to `look_for_group` (a leader's followers leave `current_followers` as soon as they are told)."""
        mm = self._matchmaking
        return (mm.current_leader is not None or bool(mm.current_followers) or mm.lock_request_join_group.locked()
                or mm.assembled_group.done())

    async def _look_for_group(self, request: _StepRequest, outcome: dict) -> Optional[GroupInfo]:
        """hivemind's look_for_group, stopped at the search end unless this peer is committed to a group."""
        task = asyncio.create_task(self._search(request))
        try:
            await asyncio.wait({task}, timeout=max(0.0, request.deadline - get_dht_time()))
            committed = False
            while not task.done() and self._committed():  # bounded: the search ends at deadline + grace
                committed = True
                await asyncio.wait({task}, timeout=COMMITMENT_POLL_S)
            if not task.done():
                await cancel_and_wait(task)
                return None
            group = task.result()
            if group is None and (committed or self._committed()):
                outcome["error"] = ("gave up waiting for the group of a leader that had accepted this peer "
                                    f"({request.grace:.1f} s past the search end): group assembly may disagree")
            return group
        except asyncio.CancelledError:
            await cancel_and_wait(task)
            raise

    async def _search(self, request: _StepRequest) -> Optional[GroupInfo]:
        # Per-round settings, set in the loop thread before this round's search starts. hivemind's
        # Matchmaking reads them on every join request; the group-key manager keeps the configured
        # size (it sets the grid, which must not change between rounds).
        self._matchmaking.schema_hash = request.schema_hash
        self._matchmaking.target_group_size = request.target_group_size
        self._matchmaking.min_matchmaking_time = request.matchmaking_time
        self._matchmaking.potential_leaders.target_group_size = request.target_group_size
        self._matchmaking.potential_leaders.min_matchmaking_time = request.matchmaking_time
        # hivemind: a request timeout above the matchmaking time can deadlock matchmaking; a short
        # per-round window (e.g. a compute-budget deadline) needs a shorter one.
        self._matchmaking.request_timeout = min(self.request_timeout, request.matchmaking_time / 2)
        return await self._matchmaking.look_for_group(request)

    def _average_with_group(self, group: GroupInfo, members: List[_MemberInfo], my_index: int,
                            tensors: List[torch.Tensor], deadline: float
                            ) -> Tuple[float, str, AllReduceResult, Dict[str, Any]]:
        """Average `tensors` with the group by `deadline`; returns the group's loss budget, phase, the data
        plane's counters (summed over the round's all-reduces) and more `RoundResult` fields: `flagged` (per
        member peer id, the chunks of our part robust aggregation clipped or trimmed), `distrusted` (members
        weighed at zero, suspects.py) and `part_sizes`."""
        peer_ids = [str(peer_id) for peer_id in group.peer_ids]
        distrusted = self.suspects.distrusted(peer_ids) if self.aggregation == "clipped" else []
        secret = self.admission.connection_secret(wire.group_secret(group.group_id, [m.nonce for m in members]))
        # One signature per round, shared by the round's all-reduces (ARC-Top-K runs two).
        credentials = RoundCredentials.create(self.identity, wire.group_tag_prefix(group.group_id), my_index)
        # One budget per group: every member computes the same one from the same gathered list.
        declared = [m.loss_budget for m in members if m.loss_budget is not None]
        loss_budget, loss_phase = group_budget(declared or [(self.loss_budget.budget, self.loss_budget.phase)])
        group_members = [GroupMember(m.host, m.port, m.weight, peer_id.to_bytes())
                         for m, peer_id in zip(members, group.peer_ids)]
        results: List[AllReduceResult] = []
        bandwidths = [m.bandwidth for m in members]
        by_bandwidth = all(b > 0 for b in bandwidths)  # else every member splits equally

        def dense_allreduce_blocking(flat: torch.Tensor) -> torch.Tensor:
            """Average one contiguous fp32 vector with this group (the `sequence`-th all-reduce of the round)."""
            allreduce = GroupAllReduce(
                self._plane,
                flat,
                members=group_members,
                my_index=my_index,
                tag=wire.allreduce_tag(group.group_id, len(results)),
                secret=secret,
                credentials=credentials,
                compression=self.compression,
                chunk_numel=self.chunk_numel,
                deadline=deadline,
                links=self.links,
                loss_budget=loss_budget or 0.0,
                relay=self._relay.connect if self._relay is not None else None,
                force_relay=self.transport == "libp2p",
                part_sizes=bandwidth_part_sizes(flat.numel(), bandwidths) if by_bandwidth else None,
                aggregation=self.aggregation,
                distrusted=distrusted,
                scratch=self._scratch,
            )
            results.append(allreduce.run())
            return flat

        with self._lock_tensors:
            flat, write_back = self._flatten(tensors)
            sparsifier = self.compression.sparsifier
            if sparsifier is None:
                dense_allreduce_blocking(flat)
            else:
                # ARC-Top-K runs two dense all-reduces (sketch, selected rows) within this group.
                async def dense_allreduce(t: torch.Tensor) -> torch.Tensor:
                    return dense_allreduce_blocking(t.detach().to(torch.float32).contiguous().clone())

                seed = int.from_bytes(group.group_id[:8], "big") & 0x7FFFFFFF
                if self.error_feedback is not None:  # gradients: the EF21M estimate is the update direction
                    flat.copy_(asyncio.run(self.error_feedback.step(flat, seed, dense_allreduce)))
                else:  # parameters: unselected rows keep their values (a zero there would destroy them)
                    asyncio.run(sparsifier.allreduce_inplace(flat, seed, dense_allreduce))
            write_back()
        result = _merge_results(results)
        self._note_upload(result.upload_bps)
        flagged = {peer_ids[i]: n for i, n in enumerate(result.flagged) if n}
        if self.aggregation == "clipped":
            for peer in self.suspects.record_round(peer_ids, result.flagged, result.contributed):
                logger.warning(f"peer {peer[-8:]} was clipped in {self.suspects.after_rounds} rounds in a row: "
                               f"its contributions to our parts count for nothing until a round where it is not")
        for peer, n in flagged.items():

            self.flagged_peers[peer] = self.flagged_peers.get(peer, 0) + n
        lost = result.reduce.chunks_lost + result.gather.chunks_lost
        tag = group.group_id.hex()[:8]
        if result.absent:
            logger.warning(
                f"round {tag}: members {result.absent} were not in this round (they refused or failed "
                f"our authenticated connection, or were unreachable: group assembly disagreed); averaged without them"
            )
        if flagged:
            logger.warning(f"round {tag}: {self.aggregation} aggregation flagged contributions of "
                           + ", ".join(f"{peer[-8:]} in {n} chunks" for peer, n in flagged.items()))
        if lost or result.departed or result.rejected_messages or result.rejected_connections:
            logger.warning(
                f"round {tag}: lost {result.reduce.chunks_lost}/{result.reduce.chunks_expected} "
                f"reduce and {result.gather.chunks_lost}/{result.gather.chunks_expected} gather chunks, "
                f"departed members {result.departed}, rejected {result.rejected_messages} messages and "
                f"{result.rejected_connections} connections"
            )
        part_sizes = bandwidth_part_sizes(flat.numel(), bandwidths) if by_bandwidth else []
        return loss_budget, loss_phase, result, dict(flagged=flagged, part_sizes=part_sizes,
                                                     distrusted=[peer_ids[i] for i in distrusted])

    def _flatten(self, tensors: List[torch.Tensor]):
        """A flat fp32 vector of `tensors` and a write-back. It lives on the first tensor's device, so a round
        encodes and decodes there and only encoded bytes cross PCIe (staging.py); zero-copy for one contiguous
        fp32 tensor (what `CollaborativeOptimizer` passes: its buffers are views of one such tensor)."""
        device = tensors[0].device
        if device.type not in ROUND_DEVICE_TYPES:  # the data plane stages CPU and CUDA memory only
            device = torch.device("cpu")
        if len(tensors) == 1 and tensors[0].dtype == torch.float32 and tensors[0].is_contiguous() \
                and tensors[0].device == device:
            return tensors[0].detach().view(-1), lambda: None
        flat = torch.cat([t.detach().reshape(-1).to(device=device, dtype=torch.float32) for t in tensors])

        def write_back() -> None:
            offset = 0
            for t in tensors:
                n = t.numel()
                t.data.copy_(flat[offset : offset + n].view_as(t))
                offset += n

        return flat, write_back


def _merge_results(results: List[AllReduceResult]) -> AllReduceResult:
    """One round may run several all-reduces (ARC-Top-K): add their counters up."""
    if len(results) == 1:
        return results[0]

    def add(phases: List[PhaseStats]) -> PhaseStats:
        total = PhaseStats()
        for phase in phases:
            for name, value in vars(phase).items():
                setattr(total, name, getattr(total, name) + value)
        return total

    return AllReduceResult(
        reduce=add([r.reduce for r in results]),
        gather=add([r.gather for r in results]),
        departed=sorted({i for r in results for i in r.departed}),
        rejected_messages=sum(r.rejected_messages for r in results),
        rejected_connections=sum(r.rejected_connections for r in results),
        missing_chunks=[chunk for r in results for chunk in r.missing_chunks],
        absent=sorted({i for r in results for i in r.absent}),
        relayed=sorted({i for r in results for i in r.relayed}),
        staged_bytes=sum(r.staged_bytes for r in results),
        flagged=[sum(counts) for counts in zip(*(r.flagged for r in results))],
        contributed=[sum(counts) for counts in zip(*(r.contributed for r in results))],
        nonfinite_averages=sum(r.nonfinite_averages for r in results),
        reduce_scatter_s=sum(r.reduce_scatter_s for r in results),
        all_gather_s=sum(r.all_gather_s for r in results),
        total_s=sum(r.total_s for r in results),
        upload_bps=max((r.upload_bps for r in results if r.upload_bps is not None), default=None),
    )


def _finish_pending_tasks(loop: asyncio.AbstractEventLoop, timeout: float = 1.0) -> None:
    """Cancel the tasks still on `loop` (hivemind's matchmaking leaves waiters behind, our relay its copy
    tasks) and give them `timeout` to end, as asyncio.run does: a task garbage-collected while pending
    logs "Task was destroyed but it is pending!" """
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=timeout))
    loop.run_until_complete(loop.shutdown_asyncgens())
