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
    # decoded, and the averaged part decoded by each other member, each a few batches ("pipeline slices").
    assert many == few, f"16 chunks: {few_by_name}; 64 chunks: {many_by_name}"
    assert many <= 32, many_by_name
    print(f"backend calls per part ({spec}, {device}): {few} at 16 chunks, {many} at 64: {many_by_name}")
