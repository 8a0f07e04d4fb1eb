"""Rounds on the parameters' device: the group all-reduce encodes, decodes and accumulates where the vector
lives and stages only encoded bytes through host memory (averaging/staging.py).

On the CPU (default suite): staging is a pass-through that copies nothing, and the senders' one-chunk lookahead
(what a device uses to overlap its copies with the sends) gives the same bits, faults included.
Device tests run on every device present (the CPU always: their twin), the CUDA ones under the `cuda` marker: the
codecs' kernels on the data path match the pure-torch reference, ARC-Top-K
sketches and selects on the GPU, and a round on CUDA tensors stages exactly its encoded bytes.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from local_group import run_group

from moshpeer.averaging import handshake, wire
from moshpeer.averaging.faults import FaultConfig, FaultyLinks
from moshpeer.averaging.links import PLAIN_LINKS
from moshpeer.averaging.staging import HostStaging
from moshpeer.compression import get_compression
from moshpeer.compression.arc_topk import ArcTopK, projection, select, sketch, to_rows
from moshpeer.compression.kernels import ENV_BACKEND

pytestmark = pytest.mark.timeout(120)

CUDA = torch.cuda.is_available()
# Every device test runs on the CPU too (its twin), so that a mistake in the shared code fails without a GPU.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")])]
CODECS = ["none", "fp16", "int8", "int4", "int4-int8"]


def two_member_allreduce(spec: str, inputs, *, staging=None, faults=PLAIN_LINKS, chunk_numel: int = 1000):
    """One all-reduce of two members (threads, real TCP data plane); returns (results, reports)."""
    tensors = [x.clone() for x in inputs]
    # A fixed group id: fault injection draws its drops from it.
    reports = run_group(tensors, weights=[1.0 + k for k in range(len(inputs))], group_id=bytes(20), compression=spec,
                        chunk_numel=chunk_numel, links=faults,
                        member_kwargs=lambda k: {"staging": staging() if staging else None})
    assert all(r is not None for r in reports), "a member did not finish"
    return tensors, reports


def inputs_on(device, numel: int = 9_999):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(numel, generator=g) * (1 + k) + k).to(device) for k in range(2)]


@pytest.mark.parametrize("spec", CODECS)
def test_lookahead_staging_gives_the_same_bits_and_copies_nothing_on_cpu(spec):
    plain, plain_reports = two_member_allreduce(spec, inputs_on("cpu"))
    ahead, ahead_reports = two_member_allreduce(spec, inputs_on("cpu"), staging=lambda: HostStaging(lookahead=True))
    for a, b in zip(plain, ahead):
        assert torch.equal(a, b)  # two members: one contribution per chunk, so the bits are deterministic
    assert all(r.staged_bytes == 0 for r in plain_reports + ahead_reports)


def test_lookahead_staging_with_dropped_chunks():
    """A chunk encoded ahead and then dropped by faults is discarded; the next one still goes out right."""
    faults = FaultyLinks(FaultConfig(drop_prob=0.3, seed=5))
    plain, plain_reports = two_member_allreduce("int8", inputs_on("cpu"), faults=faults)
    ahead, _ = two_member_allreduce("int8", inputs_on("cpu"), faults=faults,
                                    staging=lambda: HostStaging(lookahead=True))
    assert sum(r.reduce.chunks_dropped_by_faults + r.gather.chunks_dropped_by_faults for r in plain_reports) > 0
    for a, b in zip(plain, ahead):
        assert torch.equal(a, b)


# ---- CUDA ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", CODECS)
def test_round_on_device_stages_only_encoded_bytes(device, spec):
    results, reports = two_member_allreduce(spec, inputs_on(device))
    reference, _ = two_member_allreduce(spec, inputs_on("cpu"), staging=lambda: HostStaging(lookahead=True))
    for result, expected in zip(results, reference):
        assert result.device.type == device
        torch.testing.assert_close(result.cpu(), expected, rtol=1e-6, atol=1e-6)
    header = wire.HEADER.size
    for r in reports:
        sent = (r.reduce.bytes_sent + r.gather.bytes_sent
                - (header + handshake.MAC_BYTES) * (r.reduce.chunks_sent + r.gather.chunks_sent))
        received = (r.reduce.bytes_received + r.gather.bytes_received
                    - header * (r.reduce.chunks_received + r.gather.chunks_received))
        assert sent + received > 0
        if device == "cpu":
            assert r.staged_bytes == 0  # pass-through: the sockets read and write the vector's own memory
            continue
        # A batch is staged in one copy of its rows: the payloads, plus the rows' padding (a short last chunk, an
        # int4 reduce payload in a row sized for int8 gather payloads).
        assert sent + received <= r.staged_bytes <= 2 * (sent + received)
        if spec.startswith("int"):
            assert r.staged_bytes < 0.3 * 4 * 2 * 9_999  # not the fp32 vector: its codes and scales



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", ["int8", "int4", "int4-int8", "int8:sr", "int4:64:sr"])
def test_codec_kernels_on_the_data_path_match_the_reference(monkeypatch, device, spec):
    compression = get_compression(spec)
    x = torch.randn(70_001, generator=torch.Generator().manual_seed(3)) * 3
    for codec in {compression.reduce_codec, compression.gather_codec}:
        monkeypatch.setenv(ENV_BACKEND, "torch")
        expected = codec.encode(x, seed=11)
        decoded = torch.empty(x.numel())
        codec.decode_into(expected, decoded, 0.5)
        monkeypatch.delenv(ENV_BACKEND)
        payload = codec.encode(x.to(device), seed=11)  # the compiled kernels, chosen by the tensor's device
        assert payload.device.type == device and torch.equal(payload.cpu(), expected)
        out = torch.full((x.numel(),), float("nan"), device=device)
        codec.decode_into(payload, out, 0.5)
        assert torch.equal(out.cpu().view(torch.int32), decoded.view(torch.int32))
        # The batched data path (a part's chunks in O(1) backend calls) gives the same payloads and values.
        chunk = 4096
        rows = -(-x.numel() // chunk)
        seeds = [11 + r for r in range(rows)]
        batch = codec.encode_chunks(x.to(device), chunk, seeds)
        assert all(e is None for e in batch.errors)
        out = torch.full((x.numel(),), float("nan"), device=device)
        assert codec.decode_chunks(batch.buffer, batch.nbytes, out, chunk, ["into"] * rows, 0.5) == [None] * rows
        monkeypatch.setenv(ENV_BACKEND, "torch")
        for r in range(rows):
            piece = x[r * chunk:(r + 1) * chunk]
            expected = codec.encode(piece, seed=seeds[r])
            assert torch.equal(batch.payload(r).cpu(), expected), f"chunk {r}"
            decoded = torch.empty(piece.numel())
            codec.decode_into(expected, decoded, 0.5)
            assert torch.equal(out[r * chunk:(r + 1) * chunk].cpu().view(torch.int32), decoded.view(torch.int32))
        monkeypatch.delenv(ENV_BACKEND)



@pytest.mark.parametrize("device", DEVICES)
def test_arc_topk_sketches_and_selects_on_the_device(device):
    assert torch.equal(projection(256, 4, 99, device=torch.device(device)).cpu(), projection(256, 4, 99))
    flat = torch.randn(256 * 300 + 17, generator=torch.Generator().manual_seed(1))
    rows_cpu = to_rows(flat, 256)
    on_device = sketch(rows_cpu.to(device), 99, 4)
    assert on_device.device.type == device
    # Selection from one averaged sketch is the same on every device (float64 norms, stable sort).
    averaged = sketch(rows_cpu, 99, 4)
    assert torch.equal(select(averaged.to(device), 30).cpu(), select(averaged, 30))

    async def alone(t: torch.Tensor) -> torch.Tensor:  # a group of one: the mean is the vector itself
        assert t.device.type == device
        return t

    sparse = ArcTopK(0.1)
    moved = flat.to(device).clone()
    result = asyncio.run(sparse.allreduce_inplace(moved, 99, alone))
    assert result.rows.device.type == device and torch.equal(moved.cpu(), flat)
