"""A group's id and member order, fixed by a rule every member checks: `canonical_group`.

A group's order decides who owns which part of the vector (`partition.py`), and its id and order decide where
every member goes next: hivemind's key manager draws each member's next grid bits from `random.Random(group_id)`
and the member's index. hivemind's leader picks both at random, and nobody can tell a random pick from a chosen
one, so a hostile leader could hand its colluders chosen parts and steer each follower's next group key, round
after round (issue 26: "a hostile matchmaking leader chooses who is in it").

Here both follow from what the members contributed: the group id hashes the group key, the leader's peer id and,
per follower in peer-id order, its peer id and the fresh random nonce of its gathered metadata
(member_info.py); members are ordered by a hash of the group id and their peer id. Each follower recomputes both
and leaves a group whose leader sent anything else, or altered the follower's own metadata
(matchmaking_adapter.py). The leader's own nonce is left out on purpose: it sees every follower's nonce before
the group begins, and a nonce of its own would let it try orders until one suits it.

What remains: the leader still picks which of the peers asking it join (first come, in hivemind), and a leader
colluding with a follower could tell it the others' nonces before that follower asks last, which lets the pair
try nonces (a commit-reveal of nonces would close that; not built). A leader that sends different followers
different metadata only breaks its own round: the members' group ids then disagree, and so do their round keys
(the data plane's handshake binds the group id).
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Sequence, Tuple

from moshpeer.averaging.member_info import parse_member_info
from moshpeer.errors import ProtocolError

_PERSON = b"moshpeer-group"


def canonical_group(group_key: str, leader: bytes, gathered: Dict[bytes, bytes]) -> Tuple[bytes, List[bytes]]:
    """-> (group id, member peer ids in order) for the members in `gathered` (peer id bytes -> that member's
    gathered metadata, the leader's included), assembled under `group_key` by `leader`. A follower whose metadata
    does not parse counts with an empty nonce (the averager refuses its metadata later, like any other's)."""
    h = hashlib.blake2b(digest_size=32, person=_PERSON)
    h.update(len(group_key.encode()).to_bytes(4, "big") + group_key.encode())
    h.update(len(leader).to_bytes(4, "big") + leader)
    for peer in sorted(gathered):
        if peer != leader:
            h.update(len(peer).to_bytes(4, "big") + peer + _nonce(gathered[peer]))
    group_id = h.digest()
    return group_id, sorted(gathered, key=lambda peer: _rank(group_id, peer))


def is_canonical(group_key: str, leader: bytes, group_id: bytes, ordered: Sequence[bytes],
                 gathered: Sequence[bytes]) -> bool:
    """Did a leader follow the rule? (`ordered[i]` gathered `gathered[i]`; False also for duplicates or mismatched
    lengths.)"""
    if len(ordered) != len(gathered) or len(set(ordered)) != len(ordered) or leader not in ordered:
        return False
    expected_id, expected_order = canonical_group(group_key, leader, dict(zip(ordered, gathered)))
    return expected_id == group_id and expected_order == list(ordered)


def _nonce(gathered: bytes) -> bytes:
    try:
        return parse_member_info(gathered).nonce
    except ProtocolError:
        return b""


def _rank(group_id: bytes, peer: bytes) -> bytes:
    return hashlib.blake2b(group_id + peer, digest_size=16, person=_PERSON).digest()
