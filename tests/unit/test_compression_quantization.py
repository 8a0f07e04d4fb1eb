"""Blockwise quantization codecs: documented error bounds, unbiased stochastic rounding, payload validation."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from moshpeer.compression import get_compression
from moshpeer.compression.quantization import HEADER_NBYTES, BlockQuantizer
from moshpeer.errors import ProtocolError, UserError

pytestmark = pytest.mark.timeout(120)


def heavy_tailed(numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(numel, generator=g) / torch.rand(numel, generator=g).clamp_min(1e-3).sqrt()
    return (t * torch.exp(torch.randn(numel, generator=g) * 2.0)).float()


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """absmax of each value's block, repeated per value."""
    nb = math.ceil(x.numel() / block)
    padded = torch.nn.functional.pad(x.abs(), (0, nb * block - x.numel())).view(nb, block)
    return padded.amax(dim=1).repeat_interleave(block)[: x.numel()]


# --- error bounds (docs/compression.md) -------------------------------------------------------------------


@pytest.mark.parametrize("bits,qmax", [(8, 127), (4, 7)])
@pytest.mark.parametrize("block", [64, 128, 1024])
@pytest.mark.parametrize("stochastic", [False, True])
def test_error_within_documented_bound(bits, qmax, block, stochastic):
    """Nearest: |x - x'| <= absmax_b / (2 qmax); stochastic: < absmax_b / qmax (float32 slack 1e-6 relative)."""
    x = heavy_tailed(50_001, seed=bits + block)
    codec = BlockQuantizer(bits, block, stochastic)
    decoded = codec.decode(codec.encode(x, seed=9), x.numel())
    bound = block_absmax(x, block) / qmax * (1.0 if stochastic else 0.5) * (1 + 1e-6)
    err = (x - decoded).abs()
    assert bool((err <= bound).all()), f"worst ratio {(err / bound).max().item()}"
    # and the bound is not vacuous: the error gets within a factor 2 of it somewhere
    assert (err / bound).max() > 0.5


def test_relative_l2_errors_on_gaussian_data_match_the_documented_figures():
    """Figures quoted in docs/compression.md for Gaussian data, block 128 (kept honest by this test)."""
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0))
    rel = {}
    for spec in ("int8", "int4"):
        codec = get_compression(spec).reduce_codec
        rel[spec] = ((codec.decode(codec.encode(x), x.numel()) - x).norm() / x.norm()).item()
    assert 0.005 < rel["int8"] < 0.01
    assert 0.09 < rel["int4"] < 0.15


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased(bits):
    """Mean over K seeds of decode(encode(x)) converges to x at the rate the Bernoulli variance allows.

    Each decoded value is low or low + scale with P(up) = frac, so its std is <= scale / 2 and the mean of K
    independent draws is within z * scale / (2 sqrt(K)) of x. With z = 5.5 and 4096 values the chance of a false
    failure is below 4096 * 2 * Phi(-5.5) < 2e-4. Nearest rounding fails the same test (checked below).
    """
    qmax = 7 if bits == 4 else 127
    n, seeds = 4096, 400
    x = torch.rand(n, generator=torch.Generator().manual_seed(1)) * 2 - 1
    x[::128] = 1.0  # pin every block's absmax so that scale = 1 / qmax exactly
    scale = 1.0 / qmax
    bound = 5.5 * scale / (2 * math.sqrt(seeds))
    for stochastic, should_pass in ((True, True), (False, False)):
        codec = BlockQuantizer(bits, 128, stochastic)
        mean = torch.zeros(n)
        for seed in range(seeds):
            codec.decode_accumulate(codec.encode(x, seed=seed), mean, 1.0 / seeds)
        worst = (mean - x).abs().max().item()
        assert (worst <= bound) == should_pass, (stochastic, worst, bound)


def test_stochastic_rounding_depends_on_seed_only():
    codec = BlockQuantizer(4, 128, stochastic=True)
    x = torch.randn(1000)
    assert torch.equal(codec.encode(x, seed=5), codec.encode(x, seed=5))
    assert not torch.equal(codec.encode(x, seed=5), codec.encode(x, seed=6))
    assert torch.equal(codec.encode(x, seed=-1), codec.encode(x, seed=2**64 - 1))  # seeds are taken mod 2^64


# --- registry and sizes -----------------------------------------------------------------------------------


def test_registry_specs():
    c = get_compression("int4-int8")
    assert (c.reduce_codec.bits, c.gather_codec.bits) == (4, 8)
    assert c.reduce_codec.block == c.gather_codec.block == 128
    c = get_compression("int8:256:sr")
    assert c.name == "int8:256:sr" and c.reduce_codec.block == 256 and c.reduce_codec.stochastic
    assert get_compression("int4:sr:64").reduce_codec.block == 64
    for bad in ("int8:32", "int8:2048", "int8:100", "int4:fast", "int4-int8:sr:x"):
        with pytest.raises(UserError):
            get_compression(bad)


@pytest.mark.parametrize("spec,ratio", [("int8", (1 + 4 / 128) / 4), ("int4", (0.5 + 4 / 128) / 4),
                                        ("int8:1024", (1 + 4 / 1024) / 4)])
def test_wire_size(spec, ratio):
    codec = get_compression(spec).reduce_codec
    n = 1 << 20
    assert codec.max_encoded_nbytes(n) == HEADER_NBYTES + round(ratio * 4 * n)
    assert codec.encode(torch.randn(n)).numel() == codec.max_encoded_nbytes(n)


def test_encode_into_a_reused_buffer():
    codec = BlockQuantizer(4, 64, stochastic=True)
    x = torch.randn(777)
    buffer = torch.full((codec.max_encoded_nbytes(777) + 10,), 0xAB, dtype=torch.uint8)
    payload = codec.encode(x, seed=4, out=buffer)
    assert payload.data_ptr() == buffer.data_ptr()
    assert torch.equal(payload, codec.encode(x, seed=4))
    for bad in (buffer[:20], buffer[1:], torch.zeros(2000, dtype=torch.int8), buffer.view(1, -1)):
        with pytest.raises(ValueError):
            codec.encode(x, out=bad)


def test_decode_into_misaligned_payload_and_weight():
    """A payload sliced out of a receive buffer at an odd offset still decodes (scales copied when misaligned)."""
    codec = BlockQuantizer(8)
    x = torch.randn(999)
    payload = codec.encode(x)
    buffer = torch.zeros(payload.numel() + 3, dtype=torch.uint8)
    buffer[3:] = payload
    out = torch.ones(999)
    codec.decode_accumulate(buffer[3:], out, weight=-2.0)
    assert torch.allclose(out, 1 - 2 * codec.decode(payload, 999))


# --- malformed payloads --------------------------------------------------------------------------------------


def corrupt(payload: torch.Tensor, offset: int, data: bytes) -> torch.Tensor:
    payload = payload.clone()
    payload[offset:offset + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return payload


def float_bytes(value: float) -> bytes:
    return struct.pack("<f", value)


@pytest.mark.parametrize("bits", [8, 4])
def test_malformed_payloads_are_rejected_and_leave_out_untouched(bits):
    codec = BlockQuantizer(bits)
    n = 1001
    good = codec.encode(torch.randn(n))
    other_bits = BlockQuantizer(12 - bits)
    cases = {
        "truncated": good[:-1],
        "extended": torch.cat([good, good[:1]]),
        "header only": good[:HEADER_NBYTES],
        "empty": good[:0],
        "bad magic": corrupt(good, 0, b"XX"),
        "bad version": corrupt(good, 2, bytes([2])),
        "wrong bits": corrupt(good, 3, bytes([12 - bits])),
        "wrong block": corrupt(good, 4, struct.pack("<H", 256)),
        "unknown flag": corrupt(good, 6, bytes([2])),
        "reserved set": corrupt(good, 7, bytes([1])),
        "wrong numel": corrupt(good, 8, struct.pack("<Q", n - 1)),
        "NaN scale": corrupt(good, HEADER_NBYTES + 4, float_bytes(float("nan"))),
        "inf scale": corrupt(good, HEADER_NBYTES, float_bytes(float("inf"))),
        "negative scale": corrupt(good, HEADER_NBYTES + 8, float_bytes(-1.0)),
        "huge scale": corrupt(good, HEADER_NBYTES, float_bytes(3e38)),
        "other codec": other_bits.encode(torch.randn(n)),
        "float tensor": good[:256].view(torch.float32),
        "2-D": good.view(1, -1),
    }
    if bits == 4:
        cases["padding nibble"] = corrupt(good, good.numel() - 1, bytes([int(good[-1]) | 0x30]))
    out = torch.randn(n)
    before = out.clone()
    for name, payload in cases.items():
        with pytest.raises(ProtocolError):
            codec.decode_accumulate(payload, out)
        assert torch.equal(out, before), f"{name} modified out"
    codec.decode_accumulate(good, out)  # the good payload still decodes
    assert not torch.equal(out, before)


def test_out_and_weight_are_checked():
    codec = BlockQuantizer(8)
    payload = codec.encode(torch.randn(10))
    with pytest.raises(ValueError):
        codec.decode_accumulate(payload, torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError):
        codec.decode_accumulate(payload, torch.zeros(10), weight=float("nan"))
    with pytest.raises(ProtocolError):
        codec.decode_accumulate(payload, torch.zeros(11))
