"""Every codec through the real group all-reduce (GroupAllReduce over the TCP data plane, members in threads):
result within the codec's documented bound of the exact weighted mean, and bit-identical on every member."""

from __future__ import annotations


import pytest
import torch
from compression_bounds import allreduce_error_bound, exact_mean
from local_group import run_group


pytestmark = pytest.mark.timeout(120)

CODECS = ["none", "fp16", "bf16", "int8", "int4", "int4-int8", "int8:sr", "int4-int8:64:sr"]


def group_allreduce(spec: str, inputs, weights, chunk_numel: int, part_sizes=None):
    """One all-reduce of `inputs` (one member per thread; parts of `part_sizes`); returns (results, reports)."""
    tensors = [x.clone() for x in inputs]
    reports = run_group(tensors, weights=weights, compression=spec, chunk_numel=chunk_numel, part_sizes=part_sizes)
    assert all(r is not None for r in reports), "a member did not finish"
    return tensors, reports


@pytest.mark.parametrize("spec", CODECS)
def test_group_allreduce_within_bound_and_identical_everywhere(spec):
    g = torch.Generator().manual_seed(3)
    numel, chunk_numel = 10_001, 1024  # odd: short last chunks and blocks
    inputs = [torch.randn(numel, generator=g) * (1 + k) + k for k in range(4)]
    inputs[2][5000:5100] *= 50.0  # a few loud blocks: the bound is per block
    weights = [1.0, 2.0, 0.5, 3.0]
    results, reports = group_allreduce(spec, inputs, weights, chunk_numel)
    for report in reports:
        assert report.reduce.chunks_lost == 0 and report.gather.chunks_lost == 0 and not report.departed
    mean = exact_mean(inputs, weights)
    bound = allreduce_error_bound(spec, inputs, weights, chunk_numel)
    for k, result in enumerate(results):
        error = (result.double() - mean).abs()
        worst = int(torch.argmax(error / bound))
        assert bool((error <= bound).all()), f"member {k}, value {worst}: error {error[worst]:.3g} > {bound[worst]:.3g}"
        # The owner of a part keeps the decoded all-gather payload, not its own fp32 average: same bits everywhere.
        assert torch.equal(result, results[0]), f"member {k} differs from member 0"
    if spec != "none":
        assert float((results[0].double() - mean).abs().max()) > 0  # lossy codecs do lose something
