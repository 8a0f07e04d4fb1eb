"""Issue 26, "groups a single peer cannot shape": a group's id and order follow from its members' metadata
(group_order.py), the leader assembles that way, and a follower leaves a leader whose group says otherwise.

Before this rule a hostile leader picked the id and the order at will (hivemind's random ones, indistinguishable
from chosen ones): who owns which part, and each follower's next group key. The adapter tests drive
`MatchmakingAdapter`'s own assembly code against hivemind's real `GroupKeyManager`, with the rest of hivemind's
`Matchmaking` replaced by the few attributes those methods read."""

from __future__ import annotations

import asyncio
import os
import random
import types

from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from moshpeer.averaging.group_order import canonical_group, is_canonical
from moshpeer.averaging.matchmaking_adapter import AVOID_LEADER_S, MatchmakingAdapter
from moshpeer.averaging.member_info import NONCE_BYTES, pack_member_info

KEY = "run_averaging.0b0110"


def gather(nonce: bytes = b"") -> bytes:
    return pack_member_info("127.0.0.1", 4000, 1.0, nonce or os.urandom(NONCE_BYTES))


def members(count: int, seed: int = 0):
    rnd = random.Random(seed)
    return {rnd.randbytes(34): gather(rnd.randbytes(NONCE_BYTES)) for _ in range(count)}


def test_the_id_and_order_are_fixed_by_the_members_and_checkable_by_each():
    gathered = members(4)
    leader = next(iter(gathered))
    group_id, order = canonical_group(KEY, leader, gathered)
    assert sorted(order) == sorted(gathered)
    assert canonical_group(KEY, leader, dict(reversed(list(gathered.items())))) == (group_id, order)
    assert is_canonical(KEY, leader, group_id, order, [gathered[p] for p in order])
    # Anything a leader would choose on its own is refused: another order, another id, a member listed twice.
    assert not is_canonical(KEY, leader, group_id, order[1:] + order[:1], [gathered[p] for p in order[1:] + order[:1]])
    assert not is_canonical(KEY, leader, os.urandom(32), order, [gathered[p] for p in order])
    assert not is_canonical(KEY, leader, group_id, order + order[:1], [gathered[p] for p in order + order[:1]])
    # The leader's own nonce does not enter (it sees the others' before the group begins); a follower's does.
    with_other_leader_nonce = dict(gathered)
    with_other_leader_nonce[leader] = gather()
    assert canonical_group(KEY, leader, with_other_leader_nonce) == (group_id, order)
    follower = order[0] if order[0] != leader else order[1]
    with_other_follower_nonce = dict(gathered)
    with_other_follower_nonce[follower] = gather()
    assert canonical_group(KEY, leader, with_other_follower_nonce)[0] != group_id
    assert canonical_group("run_averaging.0b0111", leader, gathered)[0] != group_id


def test_orders_are_spread_over_positions():
    """Fresh nonces every round: each member lands in each position about equally often (the Moshpit grid's
    rotation draws next bits from the id and position, as with hivemind's random ones)."""
    gathered = members(4, seed=1)
    leader = next(iter(gathered))
    first_positions = {peer: 0 for peer in gathered}
    for _ in range(800):
        fresh = {peer: gather() for peer in gathered}
        first_positions[canonical_group(KEY, leader, fresh)[1][0]] += 1
    assert all(120 < count < 280 for count in first_positions.values()), first_positions


def fake_matchmaking(me: bytes, my_gather: bytes, followers=None) -> types.SimpleNamespace:
    """What the adapter's assembly methods read of hivemind's Matchmaking, with hivemind's real key manager."""
    key_manager = GroupKeyManager(types.SimpleNamespace(peer_id=PeerID(me)), prefix="run_averaging",
                                  initial_group_bits="0110", target_group_size=4)
    return types.SimpleNamespace(peer_id=PeerID(me), group_key_manager=key_manager,
                                 step_control=types.SimpleNamespace(data_for_gather=my_gather),
                                 current_followers={PeerID(p): types.SimpleNamespace(gather=g)
                                                    for p, g in (followers or {}).items()},
                                 assembled_group=None, target_group_size=4)


def adapter_over(mm) -> MatchmakingAdapter:
    adapter = MatchmakingAdapter.__new__(MatchmakingAdapter)  # the real methods; hivemind's parts faked above
    adapter._mm, adapter._avoided, adapter._min_useful = mm, {}, 3

    async def hivemind_follower_assembly(leader, message):
        return "assembled"
    adapter._follower_assemble_group = hivemind_follower_assembly
    return adapter


def test_a_follower_joins_the_group_its_leader_assembled_by_the_rule():
    gathered = members(4, seed=2)
    leader, *followers = list(gathered)
    leading = fake_matchmaking(leader, gathered[leader], {p: gathered[p] for p in followers})

    async def assemble():
        leading.assembled_group = asyncio.get_running_loop().create_future()
        return await adapter_over(leading)._assemble_as_leader()
    group = asyncio.run(assemble())
    message = averaging_pb2.MessageFromLeader(code=averaging_pb2.BEGIN_ALLREDUCE, group_id=group.group_id,
                                              ordered_peer_ids=[p.to_bytes() for p in group.peer_ids],
                                              gathered=list(group.gathered))
    for follower in followers:
        adapter = adapter_over(fake_matchmaking(follower, gathered[follower]))
        assert asyncio.run(adapter._assemble_as_follower(PeerID(leader), message)) == "assembled"
        assert not adapter._avoided


def test_a_follower_leaves_a_leader_that_chose_the_order_or_altered_its_metadata():
    gathered = members(4, seed=3)
    leader, *followers = list(gathered)
    me = followers[0]
    group_id, order = canonical_group(KEY, leader, gathered)

    def message(group_id: bytes, order, metadata) -> averaging_pb2.MessageFromLeader:
        return averaging_pb2.MessageFromLeader(code=averaging_pb2.BEGIN_ALLREDUCE, group_id=group_id,
                                               ordered_peer_ids=order, gathered=[metadata[p] for p in order])

    chosen_order = sorted(order, key=lambda p: p != me)  # the follower put first, e.g. to own part 0
    altered = dict(gathered)
    altered[me] = gather()  # another nonce in our name
    for hostile in (message(group_id, chosen_order, gathered), message(os.urandom(32), order, gathered),
                    message(*canonical_group(KEY, leader, altered), altered)):
        adapter = adapter_over(fake_matchmaking(me, gathered[me]))
        assert asyncio.run(adapter._assemble_as_follower(PeerID(leader), hostile)) is None
        assert adapter._avoided[str(PeerID(leader))] > 0  # and skipped for AVOID_LEADER_S
    assert AVOID_LEADER_S >= 60
    honest = adapter_over(fake_matchmaking(me, gathered[me]))
    assert asyncio.run(honest._assemble_as_follower(PeerID(leader), message(group_id, order, gathered))) == "assembled"
