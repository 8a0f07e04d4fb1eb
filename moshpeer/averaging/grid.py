"""Moshpit group-key decisions as pure functions: no DHT, no asyncio, no clock.

A peer's group key is `{prefix}.0b{bits}`. Peers whose bits are equal look for a group together; after a
group assembles, every member shifts a few new bits into its key (hivemind's
`GroupKeyManager.update_key_on_group_assembled`), so the next round's groups mix members of different
groups. With g = target_group_size and bits of (M - 1) * log2(g), a full grid of g^M peers holds the exact
mean after M rounds.

Both the peer (through hivemind's `GroupKeyManager`) and the simulator (`moshpeer.simulation`) take these
decisions. `tests/unit/test_grid.py` checks `rotated_group_bits` against hivemind's real `GroupKeyManager`
on many random groups, so the simulator's keys are the ones a real peer would move to.

Integer form: the simulator keeps bits as integers (`int(bits, 2)`, a fixed length L); `rotate_key` is the
same rule as `rotated_group_bits` on that form: `(bits + new)[-L:]` is `((key << nbits) | index) mod 2^L`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np


def bits_per_axis(target_group_size: int) -> int:
    """Bits one rotation shifts in: ceil(log2(target_group_size)), at least 1 (the averager's `_bits_per_axis`).

    :raises ValueError: target_group_size < 1
    """
    if target_group_size < 1:
        raise ValueError(f"target_group_size must be >= 1, got {target_group_size}")
    return max(1, (target_group_size - 1).bit_length())


def _num_buckets(group_size: int, target_group_size: Optional[int]) -> int:
    # hivemind: target_group_size, or the next power of two above the group size when the target is unset.
    if target_group_size is not None:
        return target_group_size
    return 1 if group_size == 0 else 2 ** (group_size - 1).bit_length()


def _index_bits(num_buckets: int) -> int:
    # Bits the rotation shifts in. hivemind writes bin(index)[2:].rjust(ceil(log2(num_buckets)), "0"): that is
    # (num_buckets - 1).bit_length() characters, but never fewer than one ("0" for a single bucket).
    return max(1, (num_buckets - 1).bit_length())


def group_indices(group_id: bytes, group_size: int, target_group_size: Optional[int]) -> List[int]:
    """Generalized index of each member (in the group's peer order): distinct values in range(num_buckets), drawn
    from an RNG seeded by the group id, so that every member computes the same list.

    :raises ValueError: group_size > num_buckets (hivemind's `rng.sample` raises the same; matchmaking never
        assembles a group larger than its target)
    """
    num_buckets = _num_buckets(group_size, target_group_size)
    return random.Random(group_id).sample(range(num_buckets), group_size)


def rotated_group_bits(bits: str, group_id: bytes, index: int, group_size: int,
                       target_group_size: Optional[int]) -> str:
    """The bits a member at position `index` of an assembled group moves to: hivemind's
    `update_key_on_group_assembled`, on strings. Empty bits stay empty (one key for everybody).

    :raises ValueError: index outside the group, or group_size > num_buckets
    """
    if not 0 <= index < group_size:
        raise ValueError(f"index {index} outside a group of {group_size}")
    num_buckets = _num_buckets(group_size, target_group_size)
    new_index = group_indices(group_id, group_size, target_group_size)[index]
    nbits = _index_bits(num_buckets)
    new_bits = bin(new_index)[2:].rjust(nbits, "0")
    return (bits + new_bits)[-len(bits):] if bits else ""


def rotate_key(key: int, key_bits: int, group_index: int, num_buckets: int) -> int:
    """Integer form of the rotation: `key` holds `key_bits` bits; shift in `group_index` (from `group_indices`)
    as ceil(log2(num_buckets)) bits and keep the low `key_bits` bits."""
    if key_bits == 0:
        return 0
    nbits = _index_bits(num_buckets)
    return ((key << nbits) | group_index) & ((1 << key_bits) - 1)


def rotate_keys(keys: np.ndarray, key_bits: int, group_indices_: np.ndarray, num_buckets: np.ndarray) -> np.ndarray:
    """`rotate_key` over arrays (one entry per member; num_buckets may differ per group when the target is unset).
    Returns a new int64 array; key_bits must be <= 62 so that the shift cannot overflow."""
    if key_bits == 0:
        return np.zeros_like(keys)
    if key_bits > 62:
        raise ValueError("key_bits > 62 does not fit the integer form")
    nbits = np.asarray([_index_bits(int(b)) for b in np.atleast_1d(num_buckets)], dtype=np.int64)
    if nbits.size == 1:
        nbits = np.full(keys.shape, nbits[0], dtype=np.int64)
    mask = np.int64((1 << key_bits) - 1)
    # (key << nbits) may exceed 63 bits only for the bits that the mask drops; do it on the masked key.
    keep = np.int64(key_bits) - nbits  # how many of the old low bits survive (<= 0: none)
    old = np.where(keep > 0, keys.astype(np.int64) & ((np.int64(1) << np.maximum(keep, 0)) - 1), 0)
    return ((old << np.minimum(nbits, key_bits)) | (group_indices_.astype(np.int64) & mask)) & mask


def initial_group_bits(key_bits: int, rng: np.random.Generator) -> str:
    """Uniformly random initial bits, as the averager draws them when given a number of grid bits.

    :raises ValueError: key_bits < 0
    """
    if key_bits < 0:
        raise ValueError("key_bits must be non-negative")
    return "".join("1" if b else "0" for b in rng.integers(0, 2, key_bits))


def initial_group_keys(num_peers: int, key_bits: int, rng: np.random.Generator) -> np.ndarray:
    """Integer keys for `num_peers` peers, each uniform over 2^key_bits (= `initial_group_bits` read as int)."""
    if key_bits < 0 or key_bits > 62:
        raise ValueError("key_bits must be in [0, 62]")
    return rng.integers(0, 1 << key_bits, num_peers, dtype=np.int64) if key_bits else np.zeros(num_peers, np.int64)


def key_to_bits(key: int, key_bits: int) -> str:
    """The bit string of an integer key (leading zeros kept)."""
    return bin(key)[2:].rjust(key_bits, "0") if key_bits else ""


def default_key_bits(num_peers: int, target_group_size: int) -> int:
    """Key length for a swarm of `num_peers`: whole axes of log2(g) bits, as many as keep each key's expected
    occupancy N / 2^bits at or above 4 g; 0 (one key for everybody) for small swarms.

    Why whole axes: a peer shifts log2(g) bits per round, so the key is (M - 1) grid coordinates. Why 4 g: with
    random initial bits a key's occupancy is Poisson; measured in the simulator (docs/simulation.md), rounds to
    1e-4 are flat in the key length down to an occupancy of a few g and grow fast below it (N = 10,000, g = 4:
    7.0 rounds at 8 bits, 8.0 at 10, 10.4 at 12). Longer keys spread DHT load, which the simulator does not
    model; a real swarm may want them."""
    k = bits_per_axis(target_group_size)
    axes = 0
    while num_peers / 2 ** (k * (axes + 1)) >= 4 * target_group_size:
        axes += 1
    return k * axes


@dataclass
class Grouping:
    """Groups of one round: `members[starts[j]:starts[j] + sizes[j]]` is group j in its peer order (position in
    that order = the member's index for `group_indices`). `alone` are peers that found no group of at least
    min_group_size: they keep their value and their key."""

    members: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    alone: np.ndarray

    @property
    def num_groups(self) -> int:
        return int(self.sizes.size)

    def group_of_member(self) -> np.ndarray:
        """Group number of each entry of `members`."""
        return np.repeat(np.arange(self.sizes.size), self.sizes)


def assemble_groups(peers: np.ndarray, keys: np.ndarray, target_group_size: int, min_group_size: int,
                    rng: np.random.Generator) -> Grouping:
    """Matchmaking's grouping rule as the simulator models it: the peers (ids in `peers`, keys aligned) sharing a
    key are put in a seeded random order and cut into groups of `target_group_size` (the last one holds the
    rest); a group smaller than `min_group_size` does not assemble and its peers average alone.

    hivemind's matchmaking is leader-based over the DHT: a leader gathers followers until its group reaches
    the target or its time runs out, in an order set by DHT timings. The random order stands for those
    timings; the greedy cut (full groups first) for "a leader begins as soon as it has the target".

    :raises ValueError: min_group_size < 1 or target_group_size < min_group_size
    """
    if min_group_size < 1 or target_group_size < min_group_size:
        raise ValueError(f"need 1 <= min_group_size <= target_group_size, got {min_group_size}, {target_group_size}")
    peers = np.asarray(peers, dtype=np.int64)
    keys = np.asarray(keys, dtype=np.int64)
    if peers.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Grouping(empty, empty, empty, empty)
    shuffle = rng.permutation(peers.size)
    # Stable sort by key after the shuffle: within a key, peers stay in the random order.
    order = shuffle[np.argsort(keys[shuffle], kind="stable")]
    sorted_keys = keys[order]
    run_start = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    run_len = np.diff(np.r_[run_start, sorted_keys.size])
    position = np.arange(sorted_keys.size) - np.repeat(run_start, run_len)
    # Group label: (run, position // target) -> consecutive in `order`, so groups are contiguous slices.
    chunk = position // target_group_size
    new_group = np.r_[True, (chunk[1:] != chunk[:-1]) | (np.diff(np.repeat(np.arange(run_start.size), run_len)) != 0)]
    starts = np.flatnonzero(new_group)
    sizes = np.diff(np.r_[starts, sorted_keys.size])
    ok = sizes >= min_group_size
    ordered_peers = peers[order]
    in_ok_group = np.repeat(ok, sizes)
    members = ordered_peers[in_ok_group]
    kept_sizes = sizes[ok]
    kept_starts = np.r_[0, np.cumsum(kept_sizes)[:-1]] if kept_sizes.size else np.zeros(0, dtype=np.int64)
    return Grouping(members=members, starts=kept_starts.astype(np.int64), sizes=kept_sizes.astype(np.int64),
                    alone=ordered_peers[~in_ok_group])


def rotate_grouped_keys(keys: np.ndarray, key_bits: int, grouping: Grouping, target_group_size: Optional[int],
                        group_ids: Sequence[bytes]) -> np.ndarray:
    """New keys for every peer (indexed by peer id) after the groups of `grouping` assembled with `group_ids`;
    peers not in a group keep their key. One `group_indices` call per group (the RNG seeded by the group id)."""
    new_keys = keys.copy()
    if grouping.num_groups == 0 or key_bits == 0:
        if key_bits == 0:
            new_keys[grouping.members] = 0
        return new_keys
    indices = np.empty(grouping.members.size, dtype=np.int64)
    buckets = np.empty(grouping.members.size, dtype=np.int64)
    for j, (start, size) in enumerate(zip(grouping.starts.tolist(), grouping.sizes.tolist())):
        indices[start:start + size] = group_indices(group_ids[j], size, target_group_size)
        buckets[start:start + size] = _num_buckets(size, target_group_size)
    if target_group_size is not None:
        buckets = np.array([target_group_size])
    new_keys[grouping.members] = rotate_keys(keys[grouping.members], key_bits, indices, buckets)
    return new_keys
