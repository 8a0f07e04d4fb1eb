"""Upload pacing: one round's sends spread over a span of time instead of a burst at the link's rate.

An overlapped round (DiLoCo with `--diloco-overlap`) runs while the peer computes its next epoch, and
nothing needs it before that epoch ends. Sent at once, its bytes fill the uplink for a fraction of a second
and leave it idle for the rest of the epoch, so the peak rate a volunteer's link must carry is the link's
whole rate, and everything else on it (the DHT, other groups' rounds) queues behind the burst. Streaming
DiLoCo (Douillard et al., 2025) spreads a fragment's communication over the inner steps until it is
needed; a paced round does the same: every send of the round draws from one `UploadPacer`, a token bucket
whose rate is the round's planned upload (`planned_upload_bytes`) over the spread, so the round's upload
takes about the spread.

The spread is part of the round's deadline, set once when the round is asked for (`RoundDeadline.paced_s`,
at most half the `round_timeout` cap): the data plane's budget is the learned one plus the spread, within the
cap. The deadline learner sees paced rounds' durations as they are (spread included), so a paced round's
budget errs on the patient side rather than shrinking round after round. A send never waits past its
stream's deadline less `DEADLINE_MARGIN_S`: pacing yields to the deadline, so a planned-bytes estimate that
is too low (it is the codecs' largest encoding, so it should not be) costs a burst at the end, never a lost
chunk.

`PacedLinks` is a `Links` wrapper (links.py): it wraps whatever links the averager uses (the real ones, or
a test's faulty ones) and changes nothing but when a chunk is handed to the stream below.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence, Tuple

from moshpeer.averaging.links import ChunkStream, Links, StreamSpec
from moshpeer.averaging.report import PhaseStats

# Idle time earns at most this much sending credit: a paced round starts with a short burst, no more.
BURST_S = 0.05
# A paced send waits at most until this long before its stream's deadline.
DEADLINE_MARGIN_S = 0.5
# Waits are sliced so that a round that is torn down stops waiting soon.
WAIT_SLICE_S = 0.05


def planned_upload_bytes(numel: int, group_size: int, compression, chunk_numel: int) -> int:
    """What this member sends in one all-reduce of `numel` values in a group of `group_size`: its
    contributions to the others' parts ((g-1)/g of the values, encoded with the reduce codec) and its averaged
    part to each of the others ((g-1) x 1/g of them, gather codec), at the codecs' largest encoding (an upper
    bound: a paced round finishes no later than planned)."""
    if group_size <= 1 or numel <= 0:
        return 0
    chunk = max(1, min(chunk_numel, numel))
    per_value = (compression.reduce_codec.max_encoded_nbytes(chunk)
                 + compression.gather_codec.max_encoded_nbytes(chunk)) / chunk
    return int(numel * (group_size - 1) / group_size * per_value)


class UploadPacer:
    """A token bucket shared by one round's sending threads: bytes leave at `rate_bps` on average, with at
    most `burst_s` of credit earned while idle. Thread-safe."""

    def __init__(self, rate_bps: float, burst_s: float = BURST_S, clock: Callable[[], float] = time.monotonic):
        if not rate_bps > 0:
            raise ValueError(f"rate_bps must be positive, got {rate_bps}")
        self.rate_bps, self.burst_s, self.clock = rate_bps, burst_s, clock
        self._lock = threading.Lock()
        self._paid_until = clock()  # when every byte reserved so far has left, at rate_bps

    @classmethod
    def spreading(cls, nbytes: int, spread_s: float, **kwargs) -> "UploadPacer":
        """A pacer that sends `nbytes` in about `spread_s` seconds."""
        return cls(max(nbytes, 1) / spread_s, **kwargs)

    def reserve(self, nbytes: int) -> float:
        """Reserve the rate for a send of `nbytes`; -> when (clock time) that send may start."""
        with self._lock:
            now = self.clock()
            start = max(self._paid_until, now - self.burst_s)
            self._paid_until = start + nbytes / self.rate_bps
            return max(start, now)


class PacedStream:
    """A `ChunkStream` whose sends wait for the round's pacer (never past the stream's deadline less a margin)."""

    def __init__(self, inner: ChunkStream, pacer: UploadPacer, deadline: float,
                 sleep: Callable[[float], None] = time.sleep):
        self.inner, self.pacer, self.sleep = inner, pacer, sleep
        self.latest_start = deadline - DEADLINE_MARGIN_S

    @property
    def stats(self) -> PhaseStats:
        return self.inner.stats

    def send(self, header: bytes, data) -> None:
        start = min(self.pacer.reserve(len(header) + len(data)), self.latest_start)
        while not self.inner.closing():
            left = start - self.pacer.clock()
            if left <= 0:
                break
            self.sleep(min(left, WAIT_SLICE_S))
        self.inner.send(header, data)

    def end(self, marker: bytes) -> None:
        self.inner.end(marker)

    def closing(self) -> bool:
        return self.inner.closing()


class PacedLinks(Links):
    """`inner` (the averager's links), with every stream of the round paced by one `pacer`."""

    def __init__(self, inner: Links, pacer: UploadPacer):
        self.inner, self.pacer = inner, pacer

    def declared_weight(self, weight: float) -> float:
        return self.inner.declared_weight(weight)

    def contribution_codec(self, codec):
        return self.inner.contribution_codec(codec)

    def for_allreduce(self) -> "PacedLinks":
        # One pacer per round: a round's all-reduces (ARC-Top-K runs two) share the uplink one after the other.
        return PacedLinks(self.inner.for_allreduce(), self.pacer)

    def stream(self, inner: ChunkStream, spec: StreamSpec) -> ChunkStream:
        return PacedStream(self.inner.stream(inner, spec), self.pacer, spec.deadline)


def group_links(links: Links, paces: Sequence[float], numel: int, compression, chunk_numel: int) -> Tuple[Links, float]:
    """The links of a round of `numel` values with members that announced the upload spreads `paces` (seconds,
    `MemberInfo.pace_s`): `links` paced over the smallest spread (every member's budget has room for its own),
    or `links` as they are if any member does not pace; and the spread applied (0: none)."""
    spread = min(paces, default=0.0)
    if spread <= 0:
        return links, 0.0
    planned = planned_upload_bytes(numel, len(paces), compression, chunk_numel)
    return PacedLinks(links, UploadPacer.spreading(planned, spread)), spread
