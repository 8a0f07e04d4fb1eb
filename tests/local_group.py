"""Authenticated groups for in-process all-reduce tests: every member a real libp2p identity.

RSA keys are slow to generate, so one pool of identities serves a whole test process.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from moshpeer.averaging import GroupMember, wire
from moshpeer.averaging.handshake import RoundCredentials
from moshpeer.dht.identity import Identity

_POOL: List[Identity] = []


def identities(n: int) -> List[Identity]:
    """The first n identities of the process-wide pool."""
    while len(_POOL) < n:
        _POOL.append(Identity.generate())
    return _POOL[:n]


def members(addresses: Sequence, weights: Optional[Sequence[float]] = None) -> List[GroupMember]:
    """GroupMembers at `addresses` ((host, port) each), member k carrying identity k's peer id."""
    weights = weights or [1.0] * len(addresses)
    return [GroupMember(host, port, float(w), ident.peer_id_bytes)
            for (host, port), w, ident in zip(addresses, weights, identities(len(addresses)))]


def credentials(tag: bytes, k: int) -> RoundCredentials:
    """Member k's signed round key for the group of `tag`."""
    return RoundCredentials.create(identities(k + 1)[k], wire.tag_group(tag), k)
