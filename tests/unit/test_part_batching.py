"""A part is the unit of work: the group all-reduce calls the codec backend O(1) times per part, not once per
chunk (issue 28). A counting wrapper around the backend `quantization.py` calls, a real in-process group
all-reduce (GroupAllReduce over the TCP data plane, members in threads), and the same counts for parts of 16 and
64 chunks. Runs on the CPU; on a CUDA machine the same test runs on the device too."""

from __future__ import annotations

import collections
import threading

import pytest
import torch

import moshpeer.compression.quantization as quantization
from local_group import run_group

pytestmark = pytest.mark.timeout(120)

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")])]
CHUNK = 1024


class CountingBackend:
    """Forwards to a real backend and counts each call by name (shared by every thread of the round)."""

    def __init__(self, inner, counts, lock):
        self._inner, self._counts, self._lock = inner, counts, lock

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            with self._lock:
                self._counts[name] += 1
            return attr(*args, **kwargs)

        return counted


def backend_calls_per_part(monkeypatch, device: str, chunks_per_part: int, spec: str = "int8", members: int = 2):
    counts, lock = collections.Counter(), threading.Lock()
    real = quantization.backend_for
    monkeypatch.setattr(quantization, "backend_for", lambda dev: CountingBackend(real(dev), counts, lock))
    g = torch.Generator().manual_seed(chunks_per_part)
    numel = members * chunks_per_part * CHUNK
    inputs = [torch.randn(numel, generator=g).to(device) for _ in range(members)]
    reports = run_group(inputs, weights=[1.0] * members, compression=spec, chunk_numel=CHUNK)
    assert all(r is not None and r.reduce.chunks_lost == 0 and r.gather.chunks_lost == 0 for r in reports)
    assert torch.equal(inputs[0], inputs[1])  # a real average: the same bits everywhere
    monkeypatch.setattr(quantization, "backend_for", real)
    return sum(counts.values()) / members, dict(counts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", ["int8", "int4-int8"])
def test_backend_calls_per_part_do_not_grow_with_its_chunks(monkeypatch, device, spec):
    few, few_by_name = backend_calls_per_part(monkeypatch, device, 16, spec)
    many, many_by_name = backend_calls_per_part(monkeypatch, device, 64, spec)
    # Per part: its contribution encoded (by each other member), received and decoded, its average encoded and
    # decoded, and the averaged part decoded by each other member, each a few batches ("pipeline slices"); a decoded
    # batch is two calls (its scales checked, then its rows decoded). A receiver also decodes what it holds when its
    # sender pauses (part_receiver.IDLE_FLUSH_S): on a loaded machine a descheduled sender adds a batch or two.
    # Chunk by chunk, 64 chunks would take over 128 calls (over 200 with the scale checks).
    assert many <= 1.5 * few, f"16 chunks: {few_by_name}; 64 chunks: {many_by_name}"
    assert many <= 48, many_by_name
    print(f"backend calls per part ({spec}, {device}): {few} at 16 chunks, {many} at 64: {many_by_name}")


@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_chunk_in_a_batch_is_refused_alone(device):
    """PartReducer.add_contributions with one corrupted payload among eight: that chunk is refused (and would be
    counted by the all-reduce), the other seven are taken in with the bits the chunk-by-chunk path gives."""
    from moshpeer.averaging.part_reducer import ACCEPTED, PartReducer
    from moshpeer.averaging.partition import Partition
    from moshpeer.compression import get_compression

    codec = get_compression("int8").reduce_codec
    chunks, members = 8, 2
    numel = members * chunks * CHUNK
    partition = Partition(numel, members, CHUNK)
    g = torch.Generator().manual_seed(1)
    ours, theirs = torch.randn(numel, generator=g).to(device), torch.randn(numel, generator=g).to(device)
    start, end = partition.part_range(0)
    encoded = codec.encode_chunks(theirs[start:end], CHUNK, list(range(chunks)))
    rows = encoded.buffer.clone()
    rows[5, 0] = 0  # bad magic in chunk 5

    def reducer():
        return PartReducer(ours.clone(), partition, 0, [1.0, 1.0], gather_codec=codec, chunk_seed=lambda p, c: c)

    batched = reducer()
    verdicts = batched.add_contributions(1, 0, 0, rows, encoded.nbytes, codec)
    assert [v is ACCEPTED for v in verdicts] == [c != 5 for c in range(chunks)]
    assert "bad magic" in verdicts[5].rejected
    single = reducer()
    for c in range(chunks):
        verdict = single.add_contribution(1, 0, c, rows[c, :encoded.nbytes[c]], codec)
        assert (verdict is ACCEPTED) == (c != 5)
    assert batched.arrived_from == single.arrived_from
    accepted = torch.cat([batched.others_sum[c * CHUNK:(c + 1) * CHUNK] for c in range(chunks) if c != 5])
    expected = torch.cat([single.others_sum[c * CHUNK:(c + 1) * CHUNK] for c in range(chunks) if c != 5])
    assert torch.equal(accepted, expected)
    batched.member_finished(1)
    single.member_finished(1)
    assert batched.finalize_ready() == single.finalize_ready() == list(range(chunks))
    assert torch.equal(batched.flat, single.flat)


def test_a_device_encodes_a_part_in_one_call_and_the_cpu_a_slice_at_a_time():
    """part_sender.encode_runs: on a device the host work of a call bounds the encode, so the part is one run; on the
    CPU each pipeline slice is encoded just before it is sent. Both cover every chunk once, in order."""
    from moshpeer.averaging.part_sender import MIN_SLICE_BYTES, PART_SLICES, encode_runs

    big = MIN_SLICE_BYTES // 64  # values per chunk: 1024 of them hold 64 x MIN_SLICE_BYTES of fp32 values
    assert encode_runs(1024, big, torch.device("cuda")) == [range(1024)]
    on_cpu = encode_runs(1024, big, torch.device("cpu"))
    assert len(on_cpu) == PART_SLICES and [c for run in on_cpu for c in run] == list(range(1024))
    # A part of less than MIN_SLICE_BYTES is one slice (a batch costs more than overlapping it hides).
    assert encode_runs(16, MIN_SLICE_BYTES // 64 - 1, torch.device("cpu")) == [range(16)]
    assert len(encode_runs(16, MIN_SLICE_BYTES // 16, torch.device("cpu"))) == PART_SLICES
    assert encode_runs(0, 256, torch.device("cuda")) == encode_runs(0, 256, torch.device("cpu")) == []
