"""A run of frames at a time: the MACs and socket calls of a pipeline slice in one compiled call, the GIL released.

A part's chunks are encoded and decoded a slice at a time (part_sender.py, part_receiver.py); their frames were
written and read one at a time, each with its own Python calls, MAC call and syscalls. On a CPU-bound host (4
peers on 2 cores) that interpreter work per frame, and the GIL hand-offs around each syscall, were a large share of
a compressed round (docs/benchmarks.md). Here a slice's frames are tagged and written with one `sendmsg` (when the
socket takes it), and a connection's frames are read and checked until the batch is full, a phase ends, or the
sender pauses, by the CPU extension's `send_frames` / `recv_frames` (kernels/frames_cpu.cpp).

The wire format is the one `handshake.send_frame` / `FrameReader` speak, with the same checks, errors and MACs (the
compiled MAC is OpenSSL's AES-256-GCM, like `cryptography`'s): either end may use either path. Where the CPU
extension or libcrypto cannot load, or `MOSHPEER_KERNELS=torch` forces the reference kernels, the Python path
runs instead, frame by frame.
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
                    -4: "end marker with a payload", -5: "frame MAC mismatch (altered or forged on the way)"}
_CLOSED, _NO_CRYPTO = -6, -7


@functools.lru_cache(maxsize=1)
def _compiled_ops():
    try:
        load_backend("cpp")
    except KernelUnavailable:
        return None
    ops = torch.ops.moshpeer_cpu
    return ops if hasattr(ops, "recv_frames") and ops.frame_mac_available() else None


def compiled() -> Optional[object]:
    """The compiled frame ops, or None (no CPU extension or libcrypto here, or the reference kernels forced)."""
    try:
        if forced_backend() == "torch":
            return None
    except KernelUnavailable:
        return None  # a bad MOSHPEER_KERNELS: the codecs say so where it matters
    return _compiled_ops()


def _key(auth: FrameAuth) -> torch.Tensor:
    return torch.frombuffer(bytearray(auth.frame_key), dtype=torch.uint8)


def send_run(sock: socket.socket, auth: FrameAuth, headers: Sequence[bytes], data, spans: Sequence[Tuple[int, int]]
             ) -> None:
    """Frames k = 0.. : `headers[k]` with the payload `data[offset_k: offset_k + nbytes_k]` (`spans[k]`; `data` a
    writable bytes-like object). Raises OSError (incl. the socket's timeout) or ConnectionError if the connection
    broke; the frames before the one that failed have left."""
    ops = compiled()
    if ops is None:
        view = memoryview(data)
        for header, (offset, nbytes) in zip(headers, spans):
            handshake.send_frame(sock, auth, header, view[offset: offset + nbytes])
        return
    packed = torch.frombuffer(bytearray(b"".join(headers)), dtype=torch.uint8)
    payloads = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    sequence = auth.take(len(headers))
    _, error = ops.send_frames(sock.fileno(), _key(auth), sequence, packed, payloads,
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
        self._tag = torch.frombuffer(bytearray(frames.tag), dtype=torch.uint8)
        self._key = _key(frames.auth)
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
        auth = self.frames.auth
        result = self._ops.recv_frames(self.frames.sock.fileno(), self._key, auth.sequence, self._tag,
                                       PROTOCOL_VERSION, buffer, self.inbox.stride, first_row, free,
                                       self.frames.max_payload, phase, max(0, int(idle_s * 1000)))
        status, count = result[0], result[1]
        auth.take(count)
        frames = []
        for k in range(count):
            phase_k, part, chunk, nbytes = result[2 + 4 * k: 6 + 4 * k]
            end = phase_k in (wire.PHASE_END_REDUCE, wire.PHASE_END_GATHER)
            frames.append(Frame(phase_k, part, chunk, nbytes, None if end else self.inbox.payload(nbytes)))
        if status:
            failure = _failure(status)
            if not frames:
                raise failure
            self._failure = failure
        return frames


def _failure(status: int) -> BaseException:
    if status in _PROTOCOL_ERRORS:
        return ProtocolError(_PROTOCOL_ERRORS[status])
    if status == _CLOSED:
        return ConnectionError("connection closed in the middle of a frame or before the next one")
    if status == _NO_CRYPTO:
        return RuntimeError("the compiled frame MAC failed (libcrypto)")
    return OSError(status, os.strerror(status))
