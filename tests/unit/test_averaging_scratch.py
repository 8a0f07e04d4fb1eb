"""Working buffers lent across all-reduces (scratch.py): reuse, and rounds on reused (stale) buffers stay exact."""

import pytest
import torch

from local_group import run_group
from moshpeer.averaging.scratch import ScratchPool

pytestmark = pytest.mark.timeout(90)


def test_pool_lends_the_smallest_fitting_buffer_once_and_keeps_the_largest():
    pool = ScratchPool(keep=2)
    small, large = pool.take(10, torch.device("cpu")), pool.take(100, torch.device("cpu"))
    pool.give_back(small)
    pool.give_back(large)
    assert pool.take(5, torch.device("cpu")) is small  # smallest that fits
    assert pool.take(5, torch.device("cpu")) is large
    fresh = pool.take(5, torch.device("cpu"))  # nothing free: new memory
    assert fresh is not small and fresh is not large and fresh.numel() == 5
    for buffer in (pool.take(1, "cpu"), pool.take(2, "cpu"), pool.take(3, "cpu")):
        pool.give_back(buffer)
    assert pool.take(200, torch.device("cpu")).numel() == 200  # too large for what was kept: new
    assert {pool.take(1, "cpu").numel(), pool.take(1, "cpu").numel()} == {3, 2}  # the 2 largest were kept


@pytest.mark.parametrize("aggregation", ["mean", "clipped"])
def test_rounds_on_reused_buffers_are_exact(aggregation):
    """Each member keeps one pool over three rounds with different inputs: a round never sees the last one's sums."""
    pools = [ScratchPool() for _ in range(3)]
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        originals = [torch.randn(3000, generator=g) * 0.01 + seed for _ in range(3)]
        tensors = [x.clone() for x in originals]
        results = run_group(tensors, chunk_numel=256, deadline_s=20.0, aggregation=aggregation,
                            member_kwargs=lambda k: {"scratch": pools[k]})
        assert all(r is not None and not r.reduce.chunks_lost for r in results)
        exact = sum(originals) / 3
        for t in tensors:  # (CenteredClip clips none of these close values: it is their mean too)
            assert torch.allclose(t, exact, atol=1e-5), seed
    for pool in pools:  # the buffers went back after the last round: the next one gets them again
        allocated = pool.allocated
        assert pool.take(1000, torch.device("cpu")).numel() >= 1000 and pool.allocated == allocated


def test_a_rounds_slices_and_inboxes_are_lent_again_to_the_next_round():
    """int8: the owner's sums, the senders' encoded slices and the receivers' inboxes come from the pool; from the
    second round on no member allocates any of them (fresh memory costs a page fault per 4 KiB)."""
    pools = [ScratchPool(keep=2 + 3 * 3) for _ in range(3)]
    allocated = []
    for seed in range(3):
        tensors = [torch.randn(6000, generator=torch.Generator().manual_seed(seed + k)) for k in range(3)]
        results = run_group(tensors, chunk_numel=256, deadline_s=20.0, compression="int8",
                            member_kwargs=lambda k: {"scratch": pools[k]})
        assert all(r is not None and not r.reduce.chunks_lost and not r.gather.chunks_lost for r in results)
        allocated.append([pool.allocated for pool in pools])
    assert all(n >= 1 + 2 * 2 for n in allocated[0]), allocated  # the sums; per other member a slice and an inbox
    assert allocated[2] == allocated[1] == allocated[0], allocated
