"""The send side of a group all-reduce, as a seam that wrappers plug into.

`GroupAllReduce` puts every phase of its traffic to one member (its contribution to the member's part, or
its averaged part) through a `ChunkStream`: `send(header, data)` per chunk, then `end(marker)`. It asks the
`Links` it was given for that stream, for the codec its contributions are encoded with, and for the weight
it declares in matchmaking. The plain `Links` hands back the real stream, the real codec and the real weight
unchanged: that is the production path, and it costs nothing.

Wrappers subclass `Links`: `moshpeer.averaging.faults.FaultyLinks` drops, delays and resends chunks, silences
the peer, or makes it hostile. The all-reduce and the averager hold no fault logic of their own; what a test
or `moshpeer join --faults` injects is a `Links` built outside and passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, Tuple

from moshpeer.averaging.handshake import MAC_BYTES
from moshpeer.averaging.report import PhaseStats


@dataclass(frozen=True)
class StreamSpec:
    """Which stream a `ChunkStream` carries, as a wrapper needs to know it.

    :param round_seed: derived from the all-reduce's tag: the same on every member of the group
    :param sender: our index in the group; receiver: the member the stream goes to
    :param phase: "reduce" (our contributions to the receiver's part) or "gather" (our averaged part)
    :param deadline: absolute `time.monotonic()` by which the phase ends; nothing is sent after it
    :param droppable: chunks of this stream the sender may leave lost (its share of the receiver's DBLP loss
        allowance; 0 without a loss budget)
    :param selective: a loss budget > 0 is in force: a late chunk does not hold back the ones behind it
    """

    round_seed: int
    sender: int
    receiver: int
    phase: str
    deadline: float
    droppable: int = 0
    selective: bool = False


class ChunkStream(Protocol):
    """One phase of frames to one member. `send` and `end` raise OSError when the connection breaks."""

    stats: PhaseStats  # what went on the wire (and, for wrappers, what they withheld)

    def send(self, header: bytes, data) -> None:
        """Put one chunk (its wire header and payload bytes) on the connection."""

    def end(self, marker: bytes) -> None:
        """Send the end-of-phase marker: nothing more of this phase follows."""

    # Optional: `send_run(headers, data, spans)`, the chunks (headers[k], data[offset_k: offset_k + nbytes_k]) in one
    # go; a stream without it gets them one `send` at a time (`send_run` below).

    def closing(self) -> bool:
        """True once the all-reduce is tearing down (a wrapper stops waiting)."""


class FrameLink(Protocol):
    """An authenticated connection that sends frames (`member_connector.OutboundLink`)."""

    def send(self, header: bytes, payload=b"") -> None: ...

    def send_run(self, headers: Sequence[bytes], data, spans: Sequence[Tuple[int, int]]) -> None: ...


@dataclass
class WireStream:
    """The real `ChunkStream` of one phase on our connection to a member: frames, counted in `stats`."""

    link: FrameLink
    stats: PhaseStats
    closing: Callable[[], bool]

    def send(self, header: bytes, data) -> None:
        self.link.send(header, data)
        self.stats.chunks_sent += 1
        self.stats.bytes_sent += len(header) + len(data) + MAC_BYTES

    def send_run(self, headers: Sequence[bytes], data, spans: Sequence[Tuple[int, int]]) -> None:
        self.link.send_run(headers, data, spans)
        self.stats.chunks_sent += len(headers)
        self.stats.bytes_sent += sum(len(header) + nbytes + MAC_BYTES for header, (_, nbytes) in zip(headers, spans))

    def end(self, marker: bytes) -> None:
        self.link.send(marker)


def send_run(stream: ChunkStream, headers: Sequence[bytes], data, spans: Sequence[Tuple[int, int]]) -> None:
    """Chunks (headers[k], data[offset_k: offset_k + nbytes_k]) on `stream`: in one go where it can (the real
    stream: frame_pump.py), else a `send` each (a wrapper that drops, delays or paces chunk by chunk)."""
    run = getattr(stream, "send_run", None)
    if run is not None:
        run(headers, data, spans)
        return
    view = memoryview(data)
    for header, (offset, nbytes) in zip(headers, spans):
        stream.send(header, view[offset: offset + nbytes])


class Links:
    """The real transport, unchanged. Subclass to wrap it; every hook is called for every round."""

    def declared_weight(self, weight: float) -> float:
        """The averaging weight this peer announces in matchmaking."""
        return weight

    def contribution_codec(self, codec):
        """The codec this peer's reduce-phase contributions are encoded with (the owner's side is untouched)."""
        return codec

    def for_allreduce(self) -> "Links":
        """The links of one all-reduce (a wrapper may keep per-round state, e.g. chunks sent so far)."""
        return self

    def stream(self, inner: ChunkStream, spec: StreamSpec) -> ChunkStream:
        """The stream the all-reduce sends `spec`'s chunks through; `inner` is the real one."""
        return inner


PLAIN_LINKS = Links()
