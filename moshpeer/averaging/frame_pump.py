"""A run of frames at a time: the socket calls of a pipeline slice in one compiled call, the GIL released.

A part's chunks are encoded and decoded a slice at a time (part_sender.py, part_receiver.py); their frames were
written and read one at a time, each with its own Python calls and syscalls. On a CPU-bound host (4 peers on 2 cores)
that interpreter work per frame, and the GIL hand-offs around each syscall, were a large share of a compressed round
(docs/benchmarks.md). Here a slice's frames are written with one `sendmsg` (when the socket takes it), and a
connection's frames are read and checked until the batch is full, a phase ends, or the sender pauses, by the CPU
extension's `send_frames` / `recv_frames` (kernels/frames_cpu.cpp).

MACs: one implementation, `handshake.FrameAuth` (AES-256-GCM through `cryptography`), for both paths. The sender
tags a run's frames before the compiled call writes them; the reader verifies each frame the compiled call read, in
order, before any of its payload is used, and a frame that fails ends the run there (its own and later payloads are
never handed out). One Python call per frame remains, but a frame is a whole chunk (up to 1 MiB), and `cryptography`'s
bundled OpenSSL ran GMAC at 21 GB/s on the 2-core host, where the system's libcrypto 3.0 (which the pump called
before) ran it at 6.9: a 64 MB uncompressed round MACs 192 MB per peer (docs/benchmarks.md).

The wire format is the one `handshake.send_frame` / `FrameReader` speak, with the same checks and errors: either end
may use either path. Where the CPU extension cannot load, or `MOSHPEER_KERNELS=torch` forces the reference kernels,
the Python path runs instead, frame by frame.
"""

from __future__ import annotations

import functools
import os
import socket
from typing import List, Optional, Sequence, Tuple

import torch

from moshpeer.averaging import handshake, wire
from moshpeer.averaging.handshake import Frame, FrameAuth, FrameReader
from moshpeer.compression.kernels.loader import KernelUnavailable, forced_backend, load_backend
from moshpeer.errors import ProtocolError
from moshpeer.version import PROTOCOL_VERSION

# recv_frames' status codes (kernels/frames_cpu.cpp) and what FrameReader raises for each.
_PROTOCOL_ERRORS = {-1: "bad chunk header", -2: "chunk of another round", -3: "payload exceeds the frame limit",
                    -4: "end marker with a payload"}
_CLOSED = -6


@functools.lru_cache(maxsize=1)
def _compiled_ops():
    try:
        load_backend("cpp")
    except KernelUnavailable:
        return None
    ops = torch.ops.moshpeer_cpu
    return ops if hasattr(ops, "recv_frames") else None


def compiled() -> Optional[object]:
    """The compiled frame ops, or None (no CPU extension here, or the reference kernels forced)."""
    try:
        if forced_backend() == "torch":
            return None
    except KernelUnavailable:
        return None  # a bad MOSHPEER_KERNELS: the codecs say so where it matters
    return _compiled_ops()


def _as_bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def send_run(sock: socket.socket, auth: FrameAuth, headers: Sequence[bytes], data, spans: Sequence[Tuple[int, int]]
             ) -> None:
    """Frames k = 0.. : `headers[k]` with the payload `data[offset_k: offset_k + nbytes_k]` (`spans[k]`; `data` a
    writable bytes-like object). Raises OSError (incl. the socket's timeout) or ConnectionError if the connection
    broke; the frames before the one that failed have left."""
    ops = compiled()
    view = memoryview(data)
    if ops is None:
        for header, (offset, nbytes) in zip(headers, spans):
            handshake.send_frame(sock, auth, header, view[offset: offset + nbytes])
        return
    tags = b"".join(auth.tag(header, view[offset: offset + nbytes]) for header, (offset, nbytes) in zip(headers, spans))
    payloads = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    _, error = ops.send_frames(sock.fileno(), _as_bytes(b"".join(headers)), payloads, _as_bytes(tags),
                               [offset for offset, _ in spans], [nbytes for _, nbytes in spans])
    if error:
        raise _failure(error)


class RunReader:
    """Reads one connection's frames into a batch inbox (`staging.BatchInbox`) a run at a time: `read_run`.

    Compiled where `compiled()` says so and `batched` (every payload goes to the next row of the inbox), else
    through `frames.read()`, one frame per run. Frames and errors are those of `FrameReader.read`; an error after
    some frames of a run were read is raised by the next call, so that the caller takes in the valid frames first.
    """

    def __init__(self, frames: FrameReader, batched: bool = True):
        self.frames, self.inbox = frames, frames.inbox
        self._ops = compiled() if batched else None
        self._tag = _as_bytes(frames.tag)
        # Each frame's header and tag as read, for its MAC check: room for a full inbox and an end marker.
        room = self.inbox.capacity + 1 if self._ops is not None else 0
        self._headers = torch.empty(room * wire.HEADER.size, dtype=torch.uint8)
        self._tags = torch.empty(room * handshake.MAC_BYTES, dtype=torch.uint8)
        self._header_bytes, self._tag_bytes = memoryview(self._headers.numpy()), memoryview(self._tags.numpy())
        self._failure: Optional[BaseException] = None

    def read_run(self, phase: int = 0, idle_s: float = 0.0) -> List[Frame]:
        """At least one frame (waiting for the first as the socket's timeout allows), then more while they keep
        coming within `idle_s`, up to: the inbox full, an end marker, or a data frame of another phase than `phase`
        (0: the first frame's), each of which ends the run as its last frame."""
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        if self._ops is None:
            return [self.frames.read()]
        buffer, first_row, free = self.inbox.receive_into()
        result = self._ops.recv_frames(self.frames.sock.fileno(), self._tag, PROTOCOL_VERSION, buffer,
                                       self.inbox.stride, first_row, free, self.frames.max_payload, phase,
                                       max(0, int(idle_s * 1000)), self._headers, self._tags)
        status, count = result[0], result[1]
        failure = _failure(status) if status else None
        rows, frames = memoryview(buffer.numpy()), []
        for k in range(count):
            phase_k, part, chunk, nbytes = result[2 + 4 * k: 6 + 4 * k]
            end = phase_k in (wire.PHASE_END_REDUCE, wire.PHASE_END_GATHER)
            # Data frames fill rows first_row.. in order; an end marker is always a run's last frame.
            payload = b"" if end else rows[(first_row + k) * self.inbox.stride:][:nbytes]
            try:
                self.frames.auth.check(self._header_bytes[k * wire.HEADER.size:][:wire.HEADER.size], payload,
                                       self._tag_bytes[k * handshake.MAC_BYTES:][:handshake.MAC_BYTES])
            except ProtocolError as e:
                failure = e  # this frame and any after it are never handed out
                break
            frames.append(Frame(phase_k, part, chunk, nbytes, None if end else self.inbox.payload(nbytes)))
        if failure is not None:
            if not frames:
                raise failure
            self._failure = failure
        return frames


def _failure(status: int) -> BaseException:
    if status in _PROTOCOL_ERRORS:
        return ProtocolError(_PROTOCOL_ERRORS[status])
    if status == _CLOSED:
        return ConnectionError("connection closed in the middle of a frame or before the next one")
    return OSError(status, os.strerror(status))
