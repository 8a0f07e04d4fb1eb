"""The send-side seam of the data plane (moshpeer/averaging/links.py): every chunk a round sends goes through
the `Links` the all-reduce was handed, and fault injection is such a wrapper, built outside and passed in."""

from __future__ import annotations

import inspect
import threading
import time

import pytest
import torch
from local_group import run_group

from moshpeer.averaging import allreduce, averager, dataplane
from moshpeer.averaging.faults import FaultConfig, FaultyLinks
from moshpeer.averaging.links import PLAIN_LINKS, Links
from moshpeer.averaging.report import PhaseStats

pytestmark = pytest.mark.timeout(60)

N, PART, CHUNK = 3, 256, 64  # 4 chunks per member's part


class _PassThrough:
    """A `ChunkStream` wrapper that passes everything on to the real stream; subclasses override what they change."""

    def __init__(self, inner):
        self.inner = inner
        self.stats: PhaseStats = inner.stats

    def closing(self) -> bool:
        return self.inner.closing()

    def send(self, header: bytes, data) -> None:
        self.inner.send(header, data)

    def end(self, marker: bytes) -> None:
        self.inner.end(marker)


class _Counted(_PassThrough):
    """Passes everything on to the real stream, counting what it was asked to send."""

    def __init__(self, inner, counts: dict, phase: str):
        super().__init__(inner)
        self.counts, self.phase = counts, phase

    def send(self, header: bytes, data) -> None:
        self.counts[self.phase] += 1
        super().send(header, data)

    def end(self, marker: bytes) -> None:
        self.counts["markers"] += 1
        super().end(marker)


class _Tap(Links):
    def __init__(self):
        self.counts = {"reduce": 0, "gather": 0, "markers": 0}

    def stream(self, inner, spec):
        return _Counted(inner, self.counts, spec.phase)


def _inputs():
    g = torch.Generator().manual_seed(11)
    return [torch.randn(N * PART, generator=g) + k for k in range(N)]


def test_every_chunk_and_marker_goes_through_the_links_given():
    tensors = _inputs()
    exact = sum(tensors) / N
    taps = [_Tap() for _ in range(N)]
    results = run_group(tensors, chunk_numel=CHUNK, deadline_s=20.0, member_kwargs=lambda k: {"links": taps[k]})
    for tap, result in zip(taps, results):
        assert result is not None and not result.departed
        assert tap.counts == {"reduce": result.reduce.chunks_sent, "gather": result.gather.chunks_sent,
                              "markers": 2 * (N - 1)}
        assert result.reduce.chunks_sent == result.gather.chunks_sent == (PART // CHUNK) * (N - 1)
    for t in tensors:
        assert torch.allclose(t, exact, rtol=0, atol=1e-6)


def test_a_silenced_peer_is_a_wrapper_the_others_survive():
    """Member 2's links swallow everything (stop after 0 chunks: no chunks, no end markers), like a peer that
    hangs. The others count it as departed, average their own parts between themselves, keep their own values
    for its part, and the round ends by its deadline."""
    tensors = _inputs()
    originals = [t.clone() for t in tensors]
    silent = FaultyLinks(FaultConfig(stop_after_chunks=0))
    results = run_group(tensors, chunk_numel=CHUNK, deadline_s=3.0,
                        member_kwargs=lambda k: {"links": silent if k == 2 else PLAIN_LINKS})
    assert all(r is not None for r in results)
    assert results[2].reduce.chunks_sent == results[2].gather.chunks_sent == 0
    pair_mean = (originals[0] + originals[1]) / 2
    for k in (0, 1):
        assert results[k].departed == [2]
        assert results[k].gather.chunks_lost == PART // CHUNK  # member 2's averaged part never came
        assert torch.allclose(tensors[k][: 2 * PART], pair_mean[: 2 * PART], rtol=0, atol=1e-6)
        assert torch.equal(tensors[k][2 * PART:], originals[k][2 * PART:])


def test_the_round_code_holds_no_fault_logic():
    """Faults are injected from outside: the all-reduce, the averager and the data plane never import them."""
    for module in (allreduce, averager, dataplane):
        imports = [line for line in inspect.getsource(module).splitlines() if line.lstrip().startswith(("from ", "import "))]
        assert not [line for line in imports if "faults" in line or "Fault" in line], module.__name__


class _EndMarkerBreaks(_PassThrough):
    """Our gather stream to a member whose end marker meets a closed connection (the member finished and closed
    its end first); `broke` is set once it has."""

    def __init__(self, inner, broke):
        super().__init__(inner)
        self.broke = broke

    def end(self, marker: bytes) -> None:
        self.broke.set()
        raise BrokenPipeError("the member closed its end of our connection")


class _HeldWhileOpen(_PassThrough):
    """Member 2's gather stream to member 0: its chunks leave once member 0's end marker to it has failed and
    member 0's all-reduce has then either ended (what the race did) or kept waiting for 2 s (what it must do)."""

    def __init__(self, inner, race):
        super().__init__(inner)
        self.race = race

    def send(self, header: bytes, data) -> None:
        self.race.broke.wait(10.0)
        patience = time.monotonic() + 2.0
        while not self.race.first_closing() and time.monotonic() < patience:
            time.sleep(0.01)
        super().send(header, data)


class _Race(Links):
    """Member 0's gather end marker to member 2 fails; member 2's gather chunks to member 0 leave after that."""

    def __init__(self):
        self.broke = threading.Event()
        self.breaking = None  # member 0's stream to member 2

    def first_closing(self) -> bool:
        return self.breaking is not None and self.breaking.closing()

    def stream(self, inner, spec):
        if spec.phase == "gather" and (spec.sender, spec.receiver) == (0, 2):
            self.breaking = _EndMarkerBreaks(inner, self.broke)
            return self.breaking
        if spec.phase == "gather" and (spec.sender, spec.receiver) == (2, 0):
            return _HeldWhileOpen(inner, self)
        return inner


def test_a_connection_that_breaks_does_not_end_what_arrives_on_the_other():
    """A member that has all it needs closes its connections; the last frame another member sends it (an end
    marker) then fails. That says nothing of the member's own data to us, which comes over its connection to us
    and may still be on its way (seen on a relayed path under load: a round that lost the tail of a part, every
    member alive). Member 0 keeps receiving member 2's averaged part, and every member ends with the exact mean."""
    tensors = _inputs()
    exact = sum(tensors) / N
    race = _Race()
    results = run_group(tensors, chunk_numel=CHUNK, deadline_s=20.0, member_kwargs=lambda k: {"links": race})
    assert race.broke.is_set()
    for k, result in enumerate(results):
        assert result is not None and not result.departed and not result.missing_chunks, (k, result)
    for t in tensors:
        assert torch.allclose(t, exact, rtol=0, atol=1e-6)
