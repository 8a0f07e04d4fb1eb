"""Authenticated groups for in-process all-reduce tests: every member a real libp2p identity.

RSA keys are slow to generate, so one pool of identities serves a whole test process.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, List, Optional, Sequence

import torch

from moshpeer.averaging import AllReduceResult, DataPlane, GroupAllReduce, GroupMember, wire
from moshpeer.compression import get_compression
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


def run_group(tensors: Sequence[torch.Tensor], *, weights: Optional[Sequence[float]] = None,
              group_id: Optional[bytes] = None, compression: str = "none", deadline_s: float = 30.0,
              member_kwargs: Callable[[int], dict] = lambda k: {}, planes: Optional[Sequence[DataPlane]] = None,
              reshape: Callable[[List[GroupMember]], List[GroupMember]] = lambda group: group,
              **kwargs) -> List[Optional[AllReduceResult]]:
    """One `GroupAllReduce` of `tensors` (averaged in place), member k in a thread on a DataPlane of its own.

    `kwargs` go to every member's GroupAllReduce (chunk_numel is required), `member_kwargs(k)` to member k's
    only. A fixed `group_id` replays the same fault decisions (their RNG is seeded by the tag). `planes`: the
    members' data planes (default: new ones); `reshape` changes the members as announced (e.g. a relay).
    Returns each member's result; None for a member that did not finish within the deadline plus 30 s.
    The planes are closed afterwards.
    """
    planes = list(planes) if planes is not None else [DataPlane() for _ in tensors]
    group = reshape(members([plane.address for plane in planes], weights))
    tag = wire.allreduce_tag(group_id or os.urandom(20), 0)
    results: List[Optional[AllReduceResult]] = [None] * len(tensors)

    def member(k: int) -> None:
        results[k] = GroupAllReduce(
            planes[k], tensors[k], members=group, my_index=k, tag=tag, secret=b"s" * 32,
            credentials=credentials(tag, k), compression=get_compression(compression),
            deadline=time.monotonic() + deadline_s, **kwargs, **member_kwargs(k)).run()

    threads = [threading.Thread(target=member, args=(k,), daemon=True) for k in range(len(tensors))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(deadline_s + 30.0)
    finally:
        for plane in planes:
            plane.close()
    return results
