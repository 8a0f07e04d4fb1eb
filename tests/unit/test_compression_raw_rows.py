"""The data path's small kernels beside quantization: raw float32 payloads (the `none` codec), the owner's
estimate, and the scale check of quantized payload rows. The compiled CPU ones agree with the pure-torch
reference, refuse a bad row or chunk alone and leave its target untouched. Runs on the CPU; on a CUDA machine the
same checks run through the device's backend (which uses the reference for these)."""

from __future__ import annotations

import pytest
import torch

from moshpeer.compression.kernels import backend_for, load_backend, reference

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")])]
N = 1000
SKIP, INTO, ADD = reference.MODE_SKIP, reference.MODE_INTO, reference.MODE_ADD


def backends(device: str):
    """The reference, and the backend this device's data path uses (the C++ one on the CPU)."""
    return [load_backend("torch"), backend_for(torch.device(device))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight", [1.0, 0.37])
def test_take_float_rows_writes_only_finite_rows_by_their_mode(device, weight):
    g = torch.Generator().manual_seed(1)
    values = torch.randn(6, N + 24, generator=g)  # rows longer than the values they carry (a payload stride)
    values[2, 17] = float("nan")
    values[4, 3] = float("inf")
    modes = [INTO, ADD, ADD, SKIP, INTO, ADD]
    before = torch.randn(6 * N, generator=g)
    results = []
    for backend in backends(device):
        out = before.clone().to(device)
        refused = backend.take_float_rows(values.clone().to(device), out, modes, weight)
        assert list(refused) == [0, 0, 1, 0, 1, 0]
        results.append(out.cpu())
    expected = before.view(6, N).clone()
    rows = values[:, :N]
    expected[0] = rows[0] * weight
    expected[1] += rows[1] * weight
    expected[5] += rows[5] * weight
    for out in results:
        out = out.view(6, N)
        assert torch.equal(out[2:5], before.view(6, N)[2:5])  # refused (2, 4) and skipped (3) rows untouched
        assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)
    if weight == 1.0:
        assert torch.equal(results[0], results[1])  # a copy and an add: no rounding to differ in


@pytest.mark.parametrize("device", DEVICES)
def test_estimate_chunks_keeps_our_value_where_the_estimate_overflows(device):
    g = torch.Generator().manual_seed(2)
    own = torch.randn(3 * N + 10, generator=g)  # three full chunks and a short one
    total = torch.randn(3 * N + 10, generator=g)
    total[N + 5] = 3e38  # finite, but 3e38 * 2 overflows
    k1, k2 = 2.0, 0.5
    expected = total * k1 + own * k2
    results = []
    for backend in backends(device):
        mine, scratch = own.clone().to(device), total.clone().to(device)
        refused = backend.estimate_chunks(scratch, mine, N, k1, k2)
        assert list(refused) == [0, 1, 0, 0]
        results.append(mine.cpu())
    for mine in results:
        assert torch.equal(mine[N:2 * N], own[N:2 * N])  # the chunk whose estimate is not finite keeps our value
        keep = torch.ones_like(own, dtype=torch.bool)
        keep[N:2 * N] = False
        assert torch.allclose(mine[keep], expected[keep], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_scale_rows_refuses_a_row_with_any_scale_the_decoder_refuses(device):
    nb, limit = 8, 2.0 ** 120
    scales = torch.rand(6, nb)
    scales[1, 3] = float("nan")
    scales[2, 0] = -1.0
    scales[3, 7] = float("inf")
    scales[4, 5] = limit * 2
    scales[5, 2] = -0.0  # as the decoder: not negative
    rows = torch.zeros(6, 16 + 4 * nb + 12, dtype=torch.uint8)
    rows[:, 16:16 + 4 * nb] = scales.view(torch.uint8).view(6, 4 * nb)
    for backend in backends(device):
        assert list(backend.bad_scale_rows(rows.to(device), nb, limit)) == [0, 1, 1, 1, 1, 0]
