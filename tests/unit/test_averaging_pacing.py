"""Upload pacing (moshpeer/averaging/pacing.py): a round's sends spread over a span instead of a burst, within the
round's deadline, agreed by the group, and asked for by an overlapped DiLoCo peer."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
from local_group import run_group

from moshpeer.averaging.deadline import MAX_PACED_SHARE, RoundDeadline
from moshpeer.averaging.links import PLAIN_LINKS, StreamSpec
from moshpeer.averaging.member_info import pack_member_info, parse_member_info
from moshpeer.averaging.pacing import (BURST_S, DEADLINE_MARGIN_S, PacedLinks, PacedStream, UploadPacer,
                                       planned_upload_bytes)
from moshpeer.averaging.report import PhaseStats
from moshpeer.compression import get_compression
from moshpeer.errors import ProtocolError, UserError
from moshpeer.peer.optimizer.round_timing import PACE_SHARE, RoundTiming
from moshpeer.peer.strategies.diloco import DiLoCoStrategy

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    """The stream below the pacer: when (fake clock) each send reached it."""

    def __init__(self, clock):
        self.clock, self.sent, self.stats = clock, [], PhaseStats()

    def send(self, header, data) -> None:
        self.sent.append((self.clock(), len(header) + len(data)))

    def end(self, marker) -> None:
        pass

    def closing(self) -> bool:
        return False


def test_a_pacer_lets_bytes_out_at_its_rate_after_a_short_burst():
    clock = FakeClock()
    pacer = UploadPacer(1000.0, clock=clock)
    clock.now += 10.0  # idle for long: the credit is one burst, not ten seconds' worth
    starts = [pacer.reserve(100) for _ in range(5)]
    first = starts[0]
    assert first == clock.now
    assert starts == pytest.approx([first + k * 0.1 - BURST_S if k else first for k in range(5)])


def test_a_paced_stream_spreads_its_sends_and_never_waits_past_its_deadline():
    clock = FakeClock()
    below = Recorder(clock)
    stream = PacedStream(below, UploadPacer.spreading(10_000, 2.0, clock=clock), deadline=clock.now + 3.0,
                         sleep=clock.sleep)
    for _ in range(10):
        stream.send(b"h" * 10, b"x" * 990)
    times = [t - 100.0 for t, _ in below.sent]
    assert times[-1] == pytest.approx(1.8, abs=1e-6)  # 10 x 1000 bytes at 5000 bytes/s (never idle: no burst)
    assert all(b >= a for a, b in zip(times, times[1:]))
    late = PacedStream(Recorder(clock), UploadPacer(1.0, clock=clock), deadline=clock.now + 1.0, sleep=clock.sleep)
    before = clock.now
    for _ in range(3):  # 1 byte/s: each send would wait ~1000 s
        late.send(b"", b"x" * 1000)
    assert clock.now - before <= 1.0 - DEADLINE_MARGIN_S + 1e-6


def test_planned_bytes_follow_the_codecs_and_the_group():
    none, int8 = get_compression("none"), get_compression("int8")
    assert planned_upload_bytes(4096, 4, none, 1024) == 2 * 4096 * 3 // 4 * 4  # fp32 both ways, (g-1)/g each
    assert planned_upload_bytes(4096, 1, none, 1024) == 0
    assert planned_upload_bytes(4096, 4, int8, 1024) < planned_upload_bytes(4096, 4, none, 1024) / 3


def test_the_spread_is_part_of_the_round_deadline_within_the_cap():
    plain = RoundDeadline.starting_now(1.0, 1.0, round_timeout=10.0, data_s=2.0)
    paced = RoundDeadline.starting_now(1.0, 1.0, round_timeout=10.0, data_s=2.0, spread_s=3.0)
    assert (plain.data_s, plain.paced_s) == (2.0, 0.0)
    assert (paced.data_s, paced.paced_s) == (5.0, 3.0)
    long = RoundDeadline.starting_now(1.0, 1.0, round_timeout=10.0, data_s=8.0, spread_s=30.0)
    assert long.paced_s == MAX_PACED_SHARE * 10.0 and long.data_s == 10.0


def test_members_announce_their_spread_and_a_bad_one_is_refused():
    info = pack_member_info("127.0.0.1", 4000, 1.0, b"n" * 16, pace_s=2.5)
    assert parse_member_info(info).pace_s == 2.5
    assert parse_member_info(pack_member_info("127.0.0.1", 4000, 1.0, b"n" * 16)).pace_s == 0.0
    bad = msgpack.unpackb(info)
    for value in (float("nan"), -1.0, 1e9, "2"):
        with pytest.raises(ProtocolError, match="pace"):
            parse_member_info(msgpack.packb({**bad, "pace": value}))


def test_a_paced_group_round_spreads_its_upload_and_averages_exactly():
    """Three members, each sending 2 x 2/3 of 96 KB: paced over 1.5 s the round lasts about that long (unpaced it
    takes milliseconds on loopback), and the average is the same."""
    numel, spread = 3 * 8192, 1.5
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(numel, generator=g) + k for k in range(3)]
    exact = sum(tensors) / 3
    planned = planned_upload_bytes(numel, 3, get_compression("none"), 1024)

    def paced(k: int) -> dict:
        return {"links": PacedLinks(PLAIN_LINKS, UploadPacer.spreading(planned, spread))}

    started = time.monotonic()
    results = run_group(tensors, chunk_numel=1024, deadline_s=20.0, member_kwargs=paced)
    took = time.monotonic() - started
    assert all(r is not None and not r.departed and r.reduce.chunks_lost == r.gather.chunks_lost == 0
               for r in results)
    assert spread - 2 * BURST_S - 0.1 <= took <= spread + 5.0, took
    for t in tensors:
        assert torch.allclose(t, exact, rtol=0, atol=1e-5)


def test_paced_links_keep_the_wrapped_links_decisions():
    class Halved(type(PLAIN_LINKS)):
        def declared_weight(self, weight):
            return weight / 2

    links = PacedLinks(Halved(), UploadPacer(1e9))
    assert links.declared_weight(4.0) == 2.0 and links.for_allreduce().pacer is links.pacer
    spec = StreamSpec(round_seed=1, sender=0, receiver=1, phase="reduce", deadline=time.monotonic() + 5)
    assert isinstance(links.stream(Recorder(time.monotonic), spec), PacedStream)


def test_an_overlapped_diloco_peer_paces_by_its_last_epoch_and_pacing_needs_overlap():
    with pytest.raises(UserError, match="overlap"):
        DiLoCoStrategy(inner_steps=10, pace=True)
    assert DiLoCoStrategy(inner_steps=10, overlap=True, pace=True).paces_uploads
    assert not DiLoCoStrategy(inner_steps=10, overlap=True).paces_uploads
    clock = FakeClock()
    timing = RoundTiming(1.0, None, 4, clock=clock)
    timing.begin_epoch()
    clock.now += 4.0
    timing.end_compute()
    assert timing.upload_spread() == pytest.approx(PACE_SHARE * 4.0)
