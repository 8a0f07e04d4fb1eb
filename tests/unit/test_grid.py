"""moshpeer.averaging.grid against hivemind's real GroupKeyManager, and the grouping rule's invariants.

The equivalence test is what makes the simulator's key decisions the production code's: the peer rotates its
key through hivemind's `GroupKeyManager.update_key_on_group_assembled`, the simulator through `grid`.
"""

from __future__ import annotations

import asyncio
import random
import types

import numpy as np
import pytest
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.p2p import PeerID

from moshpeer.averaging import grid


def hivemind_rotation(bits: str, group_id: bytes, peer_ids, me: int, target_group_size) -> str:
    """What hivemind's key manager does for member `me`. Its constructor only reads `dht.peer_id`, so a stand-in
    object with that one attribute is the whole DHT it needs (no network, nothing started)."""
    dht = types.SimpleNamespace(peer_id=peer_ids[me])
    manager = GroupKeyManager(dht, prefix="sim", initial_group_bits=bits, target_group_size=target_group_size)
    info = GroupInfo(group_id=group_id, peer_ids=tuple(peer_ids), gathered=tuple(b"" for _ in peer_ids))
    asyncio.run(manager.update_key_on_group_assembled(info))
    return manager.group_bits


def test_rotation_matches_hivemind_on_random_groups():
    rnd = random.Random(2023)
    checked = 0
    for trial in range(300):
        target = rnd.choice([None, 2, 3, 4, 5, 8, 16, 32])
        size = rnd.randint(1, target if target is not None else 20)
        key_bits = rnd.choice([0, 1, 2, 3, 5, 7, 10, 12])
        group_id = rnd.randbytes(rnd.choice([8, 20, 32]))
        peer_ids = [PeerID(rnd.randbytes(34)) for _ in range(size)]
        for me in range(size):
            bits = "".join(rnd.choice("01") for _ in range(key_bits))
            expected = hivemind_rotation(bits, group_id, peer_ids, me, target)
            assert grid.rotated_group_bits(bits, group_id, me, size, target) == expected, (trial, me)
            # The integer form the simulator uses gives the same key.
            buckets = target if target is not None else grid._num_buckets(size, None)
            index = grid.group_indices(group_id, size, target)[me]
            as_int = grid.rotate_key(int(bits, 2) if bits else 0, key_bits, index, buckets)
            assert grid.key_to_bits(as_int, key_bits) == expected
            vec = grid.rotate_keys(np.array([int(bits, 2) if bits else 0]), key_bits, np.array([index]),
                                   np.array([buckets]))
            assert grid.key_to_bits(int(vec[0]), key_bits) == expected
            checked += 1
    assert checked > 1000


def test_group_indices_distinct_and_in_range():
    for size in range(1, 17):
        idx = grid.group_indices(bytes([size]) * 20, size, 16)
        assert sorted(set(idx)) == sorted(idx) and all(0 <= i < 16 for i in idx)
    with pytest.raises(ValueError):
        grid.group_indices(b"x", 5, 4)  # a group larger than its target: hivemind's rng.sample raises too


def test_full_grid_rotation_makes_columns():
    """g=4, 16 peers, 2-bit keys: after one round each new key holds exactly one member of every old group."""
    rng = np.random.default_rng(0)
    keys = np.repeat(np.arange(4), 4)
    g = grid.assemble_groups(np.arange(16), keys, 4, 2, rng)
    assert g.num_groups == 4 and (g.sizes == 4).all() and g.alone.size == 0
    new = grid.rotate_grouped_keys(keys, 2, g, 4, [bytes([j]) * 20 for j in range(4)])
    for k in range(4):
        holders = np.flatnonzero(new == k)
        assert sorted(keys[holders].tolist()) == [0, 1, 2, 3]


def test_assemble_groups_rule():
    rng = np.random.default_rng(1)
    keys = np.array([0] * 11 + [1] * 3 + [2] * 1 + [3] * 5)
    peers = np.arange(keys.size) + 100
    g = grid.assemble_groups(peers, keys, 4, 2, rng)
    # key 0: 4 + 4 + 3; key 1: 3; key 2: alone; key 3: 4 + 1 (alone)
    assert sorted(g.sizes.tolist()) == [3, 3, 4, 4, 4]
    alone = sorted(g.alone.tolist())
    assert len(alone) == 2 and alone[0] == 114 and 115 <= alone[1] <= 119
    assert sorted(np.r_[g.members, g.alone].tolist()) == peers.tolist()
    for j in range(g.num_groups):
        members = g.members[g.starts[j]:g.starts[j] + g.sizes[j]]
        assert len(set(keys[members - 100].tolist())) == 1
    # Seeded: the same rng seed gives the same groups.
    again = grid.assemble_groups(peers, keys, 4, 2, np.random.default_rng(1))
    assert again.members.tolist() == g.members.tolist()
    with pytest.raises(ValueError):
        grid.assemble_groups(peers, keys, 2, 3, rng)


def test_default_key_bits():
    assert grid.default_key_bits(512, 32) == 0  # 512 / 2^5 = 16 peers per key < 4 * 32
    assert grid.default_key_bits(10_000, 4) == 8  # 39 per key >= 16; 10 bits would leave 9.8
    assert grid.default_key_bits(10_000, 16) == 4
    assert grid.default_key_bits(3, 4) == 0
    assert grid.bits_per_axis(32) == 5 and grid.bits_per_axis(5) == 3 and grid.bits_per_axis(2) == 1
