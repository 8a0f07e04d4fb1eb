"""The one place that talks to hivemind's `Matchmaking`: `MatchmakingAdapter`.

The averager owns a hivemind `Matchmaking` (and through it a `GroupKeyManager`, whose group bits are
Moshpit's grid coordinates) and serves its `rpc_join_group`. hivemind reads its settings from plain
attributes on every join request and keeps its state (current leader, followers, the assembled group) in
attributes too, with no public API for either; this module is the only one that reads or sets them, so a
hivemind upgrade that renames them breaks here and nowhere else. Everything here runs on the averager's
asyncio loop.

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

Groups too small to average. In a robust mode ("clipped", "trimmed") a part that fewer than
MIN_ROBUST_CONTRIBUTIONS members reach keeps its owner's value (aggregation.py), so a group of two averages
nothing. hivemind's leader alone decides when its group begins: a hostile leader that starts as soon as one
follower joined keeps that follower out of the honest peers' group every time it leads (issue 26,
`leader_pair`; a digits run lost 4 points of accuracy that way). A robust follower therefore leaves a group
smaller than that, unless the round's target is smaller still, and asks the next leader, like after any
refusal; a robust leader does not start one at its timeout either. It then skips that leader's group-key
entries for AVOID_LEADER_S (an honest robust leader never starts such a group): from its next round on it does
not even ask it, and the hostile peer can only join honest groups as a follower.

Withdrawals. hivemind awaits the DHT store that withdraws a peer's group-key entry between assembling its group and
returning it; the adapter runs it beside the round instead (`_withdraw_in_background`, docs/averaging.md).

Group id and order. A leader assembles with the id and order that `group_order.canonical_group` derives from the
group key and the members' metadata, not hivemind's random ones, and a follower leaves (and avoids, as above) a
leader whose group says anything else: a hostile leader cannot pick who owns which part or steer its followers'
next group keys.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import cancel_and_wait

from moshpeer.averaging.aggregation import MIN_ROBUST_CONTRIBUTIONS
from moshpeer.averaging.deadline import RoundDeadline
from moshpeer.averaging.group_order import canonical_group, is_canonical
from moshpeer.averaging.member_info import parse_member_info
from moshpeer.averaging.private import admits_follower, excluded_leader
from moshpeer.bounded_memory import remember
from moshpeer.errors import ProtocolError, UserError
from moshpeer.ratelimited_log import RateLimitedLog
from moshpeer.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

# Past its search end, how much longer than request_timeout a committed peer waits for its group
# (event-loop and network latency of the leader's BEGIN_ALLREDUCE; see the module docstring).
ASSEMBLY_GRACE_S = 1.0
COMMITMENT_POLL_S = 0.02
# A join request we could only accept after this fraction of request_timeout is refused (see `join_group`):
# the asker's own wait started earlier and the answer still has to travel back.
LATE_ACCEPTANCE_FRACTION = 0.5
# How long a leader keeps a join request's stream open after its last answer, for the asker to read it and close
# the stream (see `join_group`): an asker that vanished without closing it holds a task that long at most.
ANSWERED_STREAM_HOLD_S = 10.0
# How long a robust follower skips a leader that started a group too small to average (module docstring), and
# how many such leaders it remembers (the oldest forgotten first: identities are cheap).
AVOID_LEADER_S = 600.0
MAX_AVOIDED_LEADERS = 1024
# Askers refused for another schema, and how many times in a row (bounded the same way).
MAX_REFUSED_ASKERS = 1024
# A peer a phase apart is refused for a round or two and then groups again: gradients mode sends the parameters too
# every --params-every epochs, and a peer back from an outage at another epoch does that in other rounds (measured:
# the warning below, false, within 2 s of such a peer's return). A peer of another model or codec is refused in
# every round. So an asker is named once refused this many times in a row, never accepted in between.
SCHEMA_REFUSALS_TO_NAME = 5


def schema_hash(tensors: Sequence[torch.Tensor], compression: str, chunk_numel: int) -> bytes:
    """Peers only group with peers that average the same shapes with the same codec and chunking."""
    h = hashlib.blake2b(digest_size=20, person=b"moshpeer-schema")
    h.update(f"v{PROTOCOL_VERSION}|{compression}|{chunk_numel}".encode())
    for t in tensors:
        h.update(f"|{tuple(t.shape)}:{t.dtype}".encode())
    return h.digest()


def initial_group_bits(grid_bits: Union[int, str, None]) -> str:
    """A peer's first group bits (its grid coordinates): "" for None, the given '0'/'1' string, or that many
    random bits for an int. UserError for anything else."""
    if grid_bits is None:
        return ""
    if isinstance(grid_bits, str):
        if any(bit not in "01" for bit in grid_bits):
            raise UserError(f"grid_bits must be a string of 0/1, got {grid_bits!r}")
        return grid_bits
    if grid_bits < 0:
        raise UserError("grid_bits must be non-negative")
    return "".join(str(b) for b in torch.randint(0, 2, (grid_bits,)).tolist())


@dataclass
class StepRequest:
    """What hivemind's Matchmaking reads from a step (a light stand-in for its multiprocess StepControl)."""

    data_for_gather: bytes
    scheduled_time: float
    deadline: float  # search end (DHT time): no new declarations or join requests after it
    weight: float
    schema_hash: bytes  # of this round's tensors: peers group only with peers averaging the same schema
    target_group_size: int = 4
    matchmaking_time: float = 3.0
    grace: float = 0.0  # how long past `deadline` a committed peer may still wait for its group

    @classmethod
    def for_round(cls, deadline: RoundDeadline, data_for_gather: bytes, weight: float, window: float,
                  target_group_size: int, schema: bytes) -> "StepRequest":
        """The request of a round with these deadlines: declare for `window` seconds (never past the search end),
        and, committed to a group, wait for it until the assembly end."""
        search_end = deadline.dht_time(deadline.search_end)
        return cls(data_for_gather, scheduled_time=min(get_dht_time() + window, search_end), deadline=search_end,
                   weight=weight, schema_hash=schema, target_group_size=target_group_size, matchmaking_time=window,
                   grace=deadline.assembly_end - deadline.search_end)

    def get_timeout(self) -> float:
        """What hivemind's look_for_group waits for (DHT time): until the search end plus the grace."""
        return max(0.0, self.deadline + self.grace - get_dht_time())


class MatchmakingAdapter:
    """hivemind's `Matchmaking` for one averager; build it on the averager's loop (`Matchmaking` binds to it).

    :param admission: a private run's policy (`moshpeer.dht.admission`): leaders it excludes are hidden
    :param request_timeout: the configured matchmaking request timeout (a round may use a shorter one)
    :param aggregation: the averager's; a robust one joins no group too small to average (module docstring)
    The other parameters are hivemind's.
    """

    def __init__(self, p2p, schema: bytes, dht, *, servicer_type: type, prefix: str, target_group_size: int,
                 min_group_size: int, matchmaking_time: float, request_timeout: float, client_mode: bool,
                 initial_group_bits: str, admission, aggregation: str = "mean"):
        self.request_timeout, self._admission = request_timeout, admission
        self._min_group_size = min_group_size
        self._min_useful = MIN_ROBUST_CONTRIBUTIONS if aggregation != "mean" else 2
        self._mm = Matchmaking(p2p, schema, dht, servicer_type=servicer_type, prefix=prefix,
                               target_group_size=target_group_size, min_group_size=min_group_size,
                               min_matchmaking_time=matchmaking_time, request_timeout=request_timeout,
                               client_mode=client_mode, initial_group_bits=initial_group_bits)
        self._avoided: Dict[str, float] = {}  # leader peer id -> time.monotonic() until which it is skipped
        self._schema_refusals: Dict[str, int] = {}  # asker -> refusals for another schema in a row (bounded)
        # A broken DHT fails every search at once, round after round: a few lines a minute say so.
        self._failures = RateLimitedLog(logger, interval_s=60.0, per_interval=3)
        self._hide_leaders(self._mm.group_key_manager)
        self._withdrawals: Set[asyncio.Task] = set()  # un-declarations still on their way to the DHT
        self._withdraw_in_background(self._mm.group_key_manager)
        self._follower_assemble_group = self._mm.follower_assemble_group
        self._mm.follower_assemble_group = self._assemble_as_follower
        self._mm.leader_assemble_group = self._assemble_as_leader

    def _smallest_useful_group(self) -> int:
        """The fewest members a group of this round may have for this peer to join it (module docstring)."""
        return min(self._min_useful, self._mm.target_group_size)

    async def _assemble_as_follower(self, leader, message: averaging_pb2.MessageFromLeader) -> Optional[GroupInfo]:
        """hivemind's `follower_assemble_group`, or None (hivemind then asks the next leader) for a group too
        small to average in a robust mode, or larger than this peer's configured group size (hivemind's key
        manager places a peer among that many buckets, and fails on a larger group)."""
        size = len(message.ordered_peer_ids)
        if size > self._mm.group_key_manager.target_group_size:
            logger.info(f"leaving the group of {size} that {str(leader)[-8:]} started: larger than this peer's "
                        f"group size {self._mm.group_key_manager.target_group_size}; asking the next leader")
            return None
        if size < self._smallest_useful_group():
            self._avoid(leader, f"leaving the group of {size} that {str(leader)[-8:]} started: a robust round "
                                f"needs {self._min_useful} members to average anything")
            return None
        if not self._follows_the_rule(leader, message):
            self._avoid(leader, f"leaving the group that {str(leader)[-8:]} started: its id or order is not the "
                                f"one its members' metadata gives (group_order.py), or it altered ours")
            return None
        return await self._follower_assemble_group(leader, message)

    def _follows_the_rule(self, leader, message: averaging_pb2.MessageFromLeader) -> bool:
        mm, me = self._mm, self._mm.peer_id.to_bytes()
        ordered, gathered = list(message.ordered_peer_ids), list(message.gathered)
        return (me in ordered and len(gathered) == len(ordered)
                and gathered[ordered.index(me)] == mm.step_control.data_for_gather
                and is_canonical(mm.group_key_manager.current_key, leader.to_bytes(), message.group_id, ordered,
                                 gathered))

    def _avoid(self, leader, why: str) -> None:
        """Skip this leader's group-key entries for AVOID_LEADER_S (the oldest of MAX_AVOIDED_LEADERS forgotten)."""
        remember(self._avoided, str(leader), time.monotonic() + AVOID_LEADER_S, limit=MAX_AVOIDED_LEADERS)
        logger.info(f"{why}; asking the next leader, and not this one for {AVOID_LEADER_S:g} s")

    async def _assemble_as_leader(self) -> GroupInfo:
        """hivemind's `leader_assemble_group`, with the group id and order that `canonical_group` gives instead of
        random ones (every follower checks them)."""
        mm = self._mm
        leader = mm.peer_id.to_bytes()
        gathered = {peer.to_bytes(): request.gather for peer, request in mm.current_followers.items()}
        gathered[leader] = mm.step_control.data_for_gather
        group_id, order = canonical_group(mm.group_key_manager.current_key, leader, gathered)
        group = GroupInfo(group_id, tuple(PeerID(peer) for peer in order), tuple(gathered[peer] for peer in order))
        await mm.group_key_manager.update_key_on_group_assembled(group)
        mm.assembled_group.set_result(group)
        return group

    def _hide_leaders(self, key_manager) -> None:
        """Make hivemind's key manager hide the group-key entries of the leaders this peer skips: those a private
        run excludes (private.py) and those whose pair it left (module docstring)."""
        get_averagers = key_manager.get_averagers

        async def leaders_to_ask(group_key, only_active: bool) -> List[Tuple[object, float]]:
            found = await get_averagers(group_key, only_active)
            now = time.monotonic()
            return [(peer, expiration) for peer, expiration in found
                    if self._avoided.get(str(peer), 0.0) <= now and not excluded_leader(self._admission, str(peer))]

        key_manager.get_averagers = leaders_to_ask

    def _withdraw_in_background(self, key_manager) -> None:
        """Make hivemind's un-declaration (the entry that says this peer no longer looks for a group, stored as its
        search ends) run beside the round instead of before it: hivemind awaits that DHT store (2 round trips) between
        assembling the group and returning it, which on peers 200 ms apart was 0.42 of matchmaking's 1.17 s. Nothing
        needs it first: a leader asked meanwhile refuses (its group is assembled), and the entry's expiration outranks
        only the declaration it withdraws (the next one is under a new group key, or expires later)."""
        declare = key_manager.declare_averager

        async def declare_or_withdraw(group_key, peer_id, expiration_time: float, looking_for_group: bool = True
                                      ) -> bool:
            if looking_for_group:
                return await declare(group_key, peer_id, expiration_time, looking_for_group)
            withdrawal = asyncio.create_task(declare(group_key, peer_id, expiration_time, looking_for_group))
            self._withdrawals.add(withdrawal)
            withdrawal.add_done_callback(self._withdrawn)
            return True

        key_manager.declare_averager = declare_or_withdraw

    def _withdrawn(self, withdrawal: asyncio.Task) -> None:
        self._withdrawals.discard(withdrawal)
        if not withdrawal.cancelled() and withdrawal.exception() is not None:  # the entry expires anyway
            logger.debug(f"withdrawing this peer's group-key entry failed: {withdrawal.exception()!r}")

    @property
    def group_bits(self) -> str:
        """The current group bits (updated by hivemind's key manager after every assembled group)."""
        return self._mm.group_key_manager.group_bits

    def committed(self) -> bool:
        """Is this peer part of a group in the making (see the module docstring)? Accepted by a leader, leading
        followers, a join request in flight, or a group already assembled whose result is still on its way
        to `look_for_group` (a leader's followers leave `current_followers` as soon as they are told)."""
        mm = self._mm
        return (mm.current_leader is not None or bool(mm.current_followers) or mm.lock_request_join_group.locked()
                or mm.assembled_group.done())

    def find_group(self, request: StepRequest, loop: asyncio.AbstractEventLoop, end: float
                   ) -> Tuple[Optional[GroupInfo], Optional[str]]:
        """From another thread: `look_for_group` on `loop` (the adapter's), waiting until `end` (time.monotonic())
        at most, which bounds a stalled loop (the search ends itself by the assembly end). -> (the group, None), or
        (None, why when it says: gave up while committed, or failed)."""
        errors: List[str] = []
        search = asyncio.run_coroutine_threadsafe(self.look_for_group(request, errors.append), loop)
        try:
            group = search.result(max(0.0, end - time.monotonic()))
        except TimeoutError:  # the search ends itself before `end`: its loop stalled, or this process was paused
            search.cancel()
            logger.warning(f"matchmaking did not end by the round's deadline ({time.monotonic() - end:.1f} s past "
                           f"it); no group this round")
            group = None
        except concurrent.futures.CancelledError:  # the averager is shutting down: its loop cancelled the search
            group = None
        except Exception as e:
            search.cancel()
            self._failures.warning(f"matchmaking failed: {type(e).__name__}: {e}")
            group = None
        return group, (errors[0] if errors else None)

    async def look_for_group(self, request: StepRequest, on_error: Callable[[str], None]) -> Optional[GroupInfo]:
        """hivemind's look_for_group, stopped at the search end unless this peer is committed to a group.
        None: no group; `on_error` is told why when the peer gave up while committed."""
        task = asyncio.create_task(self._search(request))
        try:
            await asyncio.wait({task}, timeout=max(0.0, request.deadline - get_dht_time()))
            committed = False
            while not task.done() and self.committed():  # bounded: the search ends at deadline + grace
                committed = True
                await asyncio.wait({task}, timeout=COMMITMENT_POLL_S)
            if not task.done():
                await cancel_and_wait(task)
                return None
            group = task.result()
            if group is None and (committed or self.committed()):
                on_error("gave up waiting for the group of a leader that had accepted this peer "
                         f"({request.grace:.1f} s past the search end): group assembly may disagree")
            return group
        except asyncio.CancelledError:
            await cancel_and_wait(task)
            raise

    async def _search(self, request: StepRequest) -> Optional[GroupInfo]:
        # Per-round settings, set in the loop thread before this round's search starts. hivemind's
        # Matchmaking reads them on every join request; the group-key manager keeps the configured
        # size (it sets the grid, which must not change between rounds).
        mm = self._mm
        mm.schema_hash = request.schema_hash
        mm.target_group_size = request.target_group_size
        mm.min_group_size = max(self._min_group_size, self._smallest_useful_group())  # a leader's timeout
        mm.min_matchmaking_time = request.matchmaking_time
        mm.potential_leaders.target_group_size = request.target_group_size
        mm.potential_leaders.min_matchmaking_time = request.matchmaking_time
        mm.request_timeout = self.answer_wait(request.matchmaking_time)
        return await mm.look_for_group(request)

    def answer_wait(self, window: float) -> float:
        """The request timeout of a round whose matchmaking window is `window`: how long this peer waits for a
        leader's first answer (it says so in its member info, see `join_group`). hivemind: a request timeout above
        the matchmaking time can deadlock matchmaking, so a short window (e.g. a compute-budget deadline) gets a
        shorter one than configured."""
        return min(self.request_timeout, window / 2)

    async def join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext, arrived: float
                         ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """Another peer asks us to lead its group: our answers (`_answers`), then the stream held open until the
        asker closes it (the p2p layer then cancels this handler), for ANSWERED_STREAM_HOLD_S at most.

        Why hold it: when a handler returns, hivemind closes our end of the stream, and the p2p daemon pipes
        that close on and may reset the stream before the asker's daemon has read our last messages (a
        reset discards what the receiving side has not read yet). The asker then sees the stream end with
        no answer while we count it in our group: a leader and a follower that disagree (seen on a loaded
        2-core machine: the leader waited for its follower's data, the follower missed the round). Once the
        asker has read everything, it closes the stream itself."""
        answers = self._answers(request, context, arrived)
        try:
            async for answer in answers:
                yield answer
        finally:
            await answers.aclose()
        await asyncio.sleep(ANSWERED_STREAM_HOLD_S)

    async def _answers(self, request: averaging_pb2.JoinRequest, context: P2PContext, arrived: float
                       ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """Our answers to a join request: refused if a private run does not admit the asker, or if its configured
        group size is below this round's target (it could not take part in a larger group); else hivemind's
        matchmaking decides, except for a late acceptance.

        hivemind's leader accepts under its `lock_request_join_group`, which it also holds while its own join
        request to another leader waits (up to request_timeout); the asker meanwhile waits request_timeout for
        the answer and then gives up. An acceptance given after most of that wait would count a peer that
        has left (the leader's group and the asker's view disagree), so it is withdrawn (the asker's wait is the one
        its member info states, when shorter than ours: peers' windows differ): the asker is told
        NOT_LOOKING_FOR_GROUP (if it still listens, it tries the next leader), and closing hivemind's handler
        drops it from our followers. `arrived`: when the request reached us (time.monotonic())."""
        try:
            info = parse_member_info(request.gather)
            tag, group_size, asker_wait = info.tag, info.group_size, info.answer_wait_s
        except ProtocolError:
            tag, group_size, asker_wait = None, 0, 0.0
        if not admits_follower(self._admission, str(context.remote_id), tag):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        if 0 < group_size < self._mm.target_group_size:
            # Its key manager could not place it in the group we aim for: it would leave it, absent, and its part
            # of the vector would go unaveraged (a peer configured with --group-size 2 among peers of 4).
            logger.debug(f"refusing a follower whose group size {group_size} is below this round's target "
                         f"{self._mm.target_group_size}")
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        # The asker's own wait, when it says it is shorter than ours (its window, hence its request timeout, may be
        # shorter: each peer learns its own), is the one an acceptance must fit in.
        wait = min(self._mm.request_timeout, asker_wait) if asker_wait > 0 else self._mm.request_timeout
        responses = self._mm.rpc_join_group(request, context)
        try:
            async for response in responses:
                if response.code in (averaging_pb2.BAD_SCHEMA_HASH, averaging_pb2.ACCEPTED):
                    self._note_schema(str(context.remote_id), refused=response.code == averaging_pb2.BAD_SCHEMA_HASH)
                waited = time.monotonic() - arrived
                if response.code == averaging_pb2.ACCEPTED and waited > LATE_ACCEPTANCE_FRACTION * wait:
                    logger.debug(f"withdrawing a late acceptance ({waited:.2f} s after the request)")
                    yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
                    return
                yield response
        finally:
            await responses.aclose()

    def _note_schema(self, asker: str, refused: bool) -> None:
        """hivemind refused (or accepted) `asker`: one of another schema (schema_hash) would never group with this
        peer, round after round, and the user would only see "no group found". Named once it was refused
        SCHEMA_REFUSALS_TO_NAME times in a row."""
        if not refused:
            self._schema_refusals.pop(asker, None)
            return
        refusals = self._schema_refusals.get(asker, 0) + 1
        remember(self._schema_refusals, asker, refusals, limit=MAX_REFUSED_ASKERS)
        if refusals == SCHEMA_REFUSALS_TO_NAME:
            logger.warning(f"peer {asker} averages other tensors than this peer (another model or --task-arg, "
                           "--compression, --chunk-bytes or moshpeer version): the two never average together "
                           f"({refusals} of its requests refused in a row)")
