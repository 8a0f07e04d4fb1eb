"""How a flat vector is split among a group: one contiguous part per member, each part in chunks.

Parts are equal by default. Given every member's upload bandwidth, `bandwidth_part_sizes` sizes them so
that the slowest uplink finishes no later than it must (see its docstring and docs/averaging.md).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


def bandwidth_part_sizes(numel: int, bandwidths: Sequence[float]) -> List[int]:
    """Part sizes (summing to `numel`) that minimize the round time of reduce-scatter + all-gather when
    member i uploads at `bandwidths[i]` (downloads unconstrained), no part above `max_share` of the vector.
    Raises ValueError on a non-positive bandwidth.

    Member i uploads S - s_i (its contribution to every other part) plus (n-1) s_i (its averaged part to
    every other member): U_i = S + (n-2) s_i, so the round takes T = max_i U_i / B_i. Equalizing U_i / B_i
    gives s_i = (T B_i - S) / (n-2) with T = 2(n-1) S / sum(B) -- parts grow with bandwidth -- as long as
    every s_i >= 0. A member too slow for that (B_i < S / T) owns nothing and still uploads S; a member that
    would own more than the cap owns the cap; the others share what is left as above, with T computed over
    them alone (water-filling). For two members U_i = S whatever the split; parts are then proportional to
    bandwidth, capped.
    """
    n = len(bandwidths)
    if any(not b > 0 for b in bandwidths):
        raise ValueError(f"bandwidths must be positive, got {list(bandwidths)}")
    cap = max_share(n)
    if n <= 2:  # any split costs a pair the same time: proportional to bandwidth, the larger part capped
        total = float(sum(bandwidths))
        shares = [b / total for b in bandwidths]
        if n == 2 and max(shares) > cap:
            shares = [cap if share > cap else 1.0 - cap for share in shares]
    else:
        active, capped = list(range(n)), []
        while True:
            left = 1.0 - cap * len(capped)  # of the vector, for the members not at the cap
            total = sum(bandwidths[i] for i in active)
            # With k owners sharing `left`: sum over them of (T B_i - S)/(n-2) = left S -> T below, in units of S.
            t = ((n - 2) * left + len(active)) / total if active else 0.0
            shares_active = {i: (t * bandwidths[i] - 1.0) / (n - 2) for i in active}
            negative = [i for i, share in shares_active.items() if share < 0]
            over = [i for i, share in shares_active.items() if share > cap]
            if negative:
                active = [i for i in active if i not in negative]
            elif over:  # capped: everyone else shares the rest again, slow members included
                capped += over
                active = [i for i in range(n) if i not in capped]
            else:
                break
        shares = [cap if i in capped else shares_active.get(i, 0.0) for i in range(n)]
    total_share = sum(shares)
    sizes = [int(numel * share / total_share) for share in shares]
    # Hand the rounding remainder to the largest parts, one value each.
    for i in sorted(range(n), key=lambda i: -shares[i])[: numel - sum(sizes)]:
        sizes[i] += 1
    return sizes


def max_share(group_size: int) -> float:
    """The largest fraction of the vector one member may own when parts follow bandwidth: 2/g (3/4 in a pair).

    The owner of a part sets the group's average of it, so a member that declares (or fakes) a huge uplink must
    not own the vector: a declared 1e12 B/s once made one member own 100% of it and set every honest member's
    values. Twice the equal share still lets a fast uplink take on a fair part of the work."""
    return 1.0 if group_size <= 1 else max(1.0 / group_size, min(2.0 / group_size, 0.75))


def reduce_allgather_seconds(numel_bytes: float, bandwidths: Sequence[float], sizes: Sequence[int]) -> float:
    """Time reduce-scatter + all-gather of `numel_bytes` takes with these part sizes if every member's upload
    is its only limit: max_i (S - s_i + (n-1) s_i) / B_i (see `bandwidth_part_sizes`)."""
    n, numel = len(sizes), sum(sizes)
    per_value = numel_bytes / numel if numel else 0.0
    return max((numel - s + (n - 1) * s) * per_value / b for s, b in zip(sizes, bandwidths))


# A round pipelines a part's chunks (an owner sends a chunk's average while later chunks are still arriving), which
# needs a few chunks per part: with one, a part's all-gather cannot start before its last contribution is in. On
# 8 peers with 20 Mbit/s uplinks averaging 8 MB (parts of 1 MB), 1 MB chunks took 1.45-1.60x the pipelined bound
# and 256 KB chunks 1.24-1.31x (docs/simulation.md). Below 64 KB a chunk's frame overhead starts to count.
MIN_CHUNKS_PER_PART = 4
MIN_PIPELINED_CHUNK_NUMEL = 16384


def pipelined_chunk_numel(chunk_numel: int, part_sizes: Sequence[int]) -> int:
    """The chunk size a round uses: `chunk_numel`, halved while the largest part would have fewer than
    MIN_CHUNKS_PER_PART chunks and the half is at least MIN_PIPELINED_CHUNK_NUMEL values. A pure function of
    what every member knows, so all members cut the same chunks."""
    largest = max(part_sizes, default=0)
    chunk = chunk_numel
    while chunk // 2 >= MIN_PIPELINED_CHUNK_NUMEL and -(-largest // chunk) < MIN_CHUNKS_PER_PART:
        chunk //= 2
    return chunk


class Partition:
    """Part j = [part_starts[j], part_starts[j+1]); chunk c of part j = `chunk_numel` values (the last shorter).

    Every member computes the same partition from (numel, group size, chunk_numel, part sizes), so nothing
    about it travels on the wire; receivers check chunk indices and sizes against it.

    :param sizes: values per part (must sum to numel; a part may be empty); default: equal parts
    """

    def __init__(self, numel: int, group_size: int, chunk_numel: int, sizes: Optional[Sequence[int]] = None):
        if numel < 0 or group_size < 1 or chunk_numel < 1:
            raise ValueError(f"bad partition numel={numel} group_size={group_size} chunk_numel={chunk_numel}")
        if sizes is None:
            base, extra = divmod(numel, group_size)
            sizes = [base + (1 if j < extra else 0) for j in range(group_size)]
        elif len(sizes) != group_size or sum(sizes) != numel or any(s < 0 for s in sizes):
            raise ValueError(f"bad part sizes {list(sizes)} for numel={numel} group_size={group_size}")
        self.numel, self.group_size, self.chunk_numel = numel, group_size, chunk_numel
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        self.part_starts: List[int] = starts

    def pipelined(self) -> "Partition":
        """The same parts, cut into chunks of `pipelined_chunk_numel` (self if that changes nothing)."""
        sizes = [b - a for a, b in zip(self.part_starts, self.part_starts[1:])]
        chunk = pipelined_chunk_numel(self.chunk_numel, sizes)
        return self if chunk == self.chunk_numel else Partition(self.numel, self.group_size, chunk, sizes)

    def part_range(self, part: int) -> Tuple[int, int]:
        return self.part_starts[part], self.part_starts[part + 1]

    def part_numel(self, part: int) -> int:
        return self.part_starts[part + 1] - self.part_starts[part]

    def num_chunks(self, part: int) -> int:
        return -(-self.part_numel(part) // self.chunk_numel)

    def chunk_range(self, part: int, chunk: int) -> Tuple[int, int]:
        """Absolute [start, end) of chunk `chunk` of part `part` in the flat vector."""
        start = self.part_starts[part] + chunk * self.chunk_numel
        return start, min(start + self.chunk_numel, self.part_starts[part + 1])
