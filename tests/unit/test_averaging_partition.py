"""Parts sized by upload bandwidth: the optimum of `bandwidth_part_sizes`, and exact averages with uneven or empty parts."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_compression_allreduce import group_allreduce

from moshpeer.averaging.partition import (MIN_CHUNKS_PER_PART, MIN_PIPELINED_CHUNK_NUMEL, Partition, bandwidth_part_sizes,
                                         max_share, pipelined_chunk_numel, reduce_allgather_seconds)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("bandwidths", [[1, 1, 1, 1], [100, 100, 100, 10], [1, 1, 1, 2], [3, 5, 7], [8, 1], [1, 2, 4, 8, 16]])
def test_bandwidth_parts_are_optimal_over_a_grid_of_splits(bandwidths):
    numel, n = 1200, len(bandwidths)
    sizes = bandwidth_part_sizes(numel, bandwidths)
    assert sum(sizes) == numel and all(s >= 0 for s in sizes)
    best = reduce_allgather_seconds(4 * numel, bandwidths, sizes)
    # No split on a grid of 1/12ths that keeps every part within the cap does better (up to the rounding of
    # sizes to whole values).
    step, cap = numel // 12, max_share(n) * numel
    assert max(sizes) <= cap + 1
    for cut in itertools.product(range(0, 13), repeat=n - 1):
        if sum(cut) <= 12:
            split = [c * step for c in cut] + [numel - step * sum(cut)]
            if max(split) > cap:
                continue
            assert reduce_allgather_seconds(4 * numel, bandwidths, split) >= best * (1 - 1e-3)


def test_uniform_bandwidth_gives_equal_parts_and_a_slow_member_owns_nothing():
    assert bandwidth_part_sizes(1000, [5.0] * 4) == [250] * 4
    sizes = bandwidth_part_sizes(9000, [100, 100, 100, 10])
    assert sizes == [3000, 3000, 3000, 0]
    # Its own upload then sets the pace: S / B_slow, the floor of any exact scheme.
    assert reduce_allgather_seconds(9000 * 4, [100, 100, 100, 10], sizes) == pytest.approx(9000 * 4 / 10)
    with pytest.raises(ValueError):
        bandwidth_part_sizes(10, [1.0, 0.0])


def test_group_allreduce_with_uneven_and_empty_parts_is_exact():
    g = torch.Generator().manual_seed(5)
    numel = 10_001
    inputs = [torch.randn(numel, generator=g) + k for k in range(4)]
    weights = [1.0, 2.0, 0.5, 3.0]
    results, reports = group_allreduce("none", inputs, weights, 1000, part_sizes=[6001, 0, 3000, 1000])
    mean = sum(w * x.double() for w, x in zip(weights, inputs)) / sum(weights)
    for result, report in zip(results, reports):
        assert report.reduce.chunks_lost == 0 and report.gather.chunks_lost == 0
        assert float((result.double() - mean).norm() / mean.norm()) <= 1e-6


def test_a_declared_huge_uplink_owns_at_most_twice_the_equal_share():
    """Issue 26: with --partition bandwidth, a member that declared 1e12 B/s owned 100% of the vector."""
    for n in (2, 3, 4, 8):
        sizes = bandwidth_part_sizes(100_000, [1e12] + [12.5e6] * (n - 1))
        assert sum(sizes) == 100_000
        assert sizes[0] <= max_share(n) * 100_000 + 1, (n, sizes)
    assert max_share(4) == 0.5 and max_share(2) == 0.75
    # Honest, moderately different uplinks are not affected by the cap.
    assert bandwidth_part_sizes(1000, [1.0, 1.0, 1.0, 1.0]) == [250, 250, 250, 250]


def test_chunks_shrink_until_parts_pipeline_but_not_below_the_floor():
    one_mb = 262_144  # values of fp32
    assert pipelined_chunk_numel(one_mb, [250_000] * 8) == one_mb // 4  # 8 MB over 8: 1 chunk per part -> 4
    assert pipelined_chunk_numel(one_mb, [4_194_304] * 4) == one_mb  # 16 parts of 1 MB already pipeline
    assert pipelined_chunk_numel(one_mb, [1000] * 4) == MIN_PIPELINED_CHUNK_NUMEL  # tiny parts: the floor
    assert pipelined_chunk_numel(4096, [100_000, 0]) == 4096  # a chunk set below the floor is kept
    assert pipelined_chunk_numel(one_mb, []) == MIN_PIPELINED_CHUNK_NUMEL
    for largest in (20_000, 70_000, 300_000, 1_000_000, 5_000_000):
        chunk = pipelined_chunk_numel(one_mb, [largest, largest // 3])
        assert MIN_PIPELINED_CHUNK_NUMEL <= chunk <= one_mb
        assert -(-largest // chunk) >= MIN_CHUNKS_PER_PART or chunk // 2 < MIN_PIPELINED_CHUNK_NUMEL
    partition = Partition(2_000_000, 8, one_mb)
    assert partition.pipelined().chunk_numel == one_mb // 4
    assert partition.pipelined().part_starts == partition.part_starts
    large = Partition(16 << 20, 4, one_mb)  # 64 MB over 4: 16 chunks per part, nothing to change
    assert large.pipelined() is large
