"""Bytes on the data plane: group secret and tags, the fixed chunk header, socket helpers.

A connection (one per ordered pair of group members per all-reduce, sender -> owner / receiver)
starts with the authenticated handshake of `handshake.py`. The sender then streams frames: a fixed
header, `payload_len` bytes, and a 16-byte MAC (`handshake.FrameAuth`):

    magic "MSHP" | version u8 | phase u8 | part u16 | chunk u32 | payload_len u32 | group tag 8 bytes

The tag is 6 bytes of a hash of the group id followed by the all-reduce's sequence number in the
round (u16), so a data plane can tell which group an unknown tag belongs to. The group secret (a
hash of the group id and every member's random nonce, all delivered inside matchmaking over
libp2p's encrypted channel) keys the connection-key derivation, so a stranger who only sees the data
port learns nothing.

Phases: REDUCE (a member's contribution to the owner's part), GATHER (the owner's averaged chunk),
and the END_* markers (payload_len 0) that say "I sent everything I will send in this phase".
"""

from __future__ import annotations

import functools
import hashlib
import select
import socket
import struct
import time
from typing import Callable, Optional, Sequence, Tuple

from moshpeer.errors import ProtocolError
from moshpeer.version import PROTOCOL_VERSION

HEADER = struct.Struct("!4sBBHII8s")
CHUNK_MAGIC = b"MSHP"
TAG_GROUP_BYTES = 6  # the tag's first bytes name the group; the last two are the all-reduce sequence

PHASE_REDUCE, PHASE_GATHER, PHASE_END_REDUCE, PHASE_END_GATHER = 1, 2, 3, 4
PHASE_NAMES = {PHASE_REDUCE: "reduce", PHASE_GATHER: "gather", PHASE_END_REDUCE: "end-reduce",
               PHASE_END_GATHER: "end-gather"}

# fp32 bytes of one chunk, before compression: MoshpitAverager's default `chunk_bytes` (the unit of loss and of the
# loss budget; Partition.pipelined may cut it smaller so that each part has a few).
DEFAULT_CHUNK_BYTES = 1 << 20
SOCKET_BUFFER_BYTES = 4 << 20


def group_secret(group_id: bytes, nonces: Sequence[bytes]) -> bytes:
    """Per-group secret: hash of the group id and every member's nonce, in group order."""
    h = hashlib.blake2b(digest_size=32, person=b"moshpeer-secret")
    h.update(group_id)
    for nonce in nonces:
        h.update(len(nonce).to_bytes(2, "big") + nonce)
    return h.digest()


def group_tag_prefix(group_id: bytes) -> bytes:
    """The first TAG_GROUP_BYTES of every all-reduce tag of this group."""
    return hashlib.blake2b(group_id, digest_size=TAG_GROUP_BYTES, person=b"moshpeer-tag").digest()


def allreduce_tag(group_id: bytes, sequence: int) -> bytes:
    """8-byte tag of the `sequence`-th all-reduce of a group (ARC-Top-K runs several per group)."""
    if not 0 <= sequence < 1 << 16:
        raise ValueError(f"all-reduce sequence {sequence} out of range")
    return group_tag_prefix(group_id) + sequence.to_bytes(2, "big")


def tag_group(tag: bytes) -> bytes:
    """The group part of a tag (see `group_tag_prefix`)."""
    return bytes(tag[:TAG_GROUP_BYTES])


def chunk_seed(tag: bytes, sender: int, part: int, chunk: int) -> int:
    """The codec seed of `sender`'s encoding of (part, chunk) in the all-reduce `tag`. The sender's index is in
    the seed: members sharing rounding noise would not average it out."""
    return int.from_bytes(tag[:4], "big") ^ (sender << 40) ^ (part << 20) ^ chunk


def pack_header(phase: int, part: int, chunk: int, payload_len: int, tag: bytes) -> bytes:
    return HEADER.pack(CHUNK_MAGIC, PROTOCOL_VERSION, phase, part, chunk, payload_len, tag)


def header_phase(header) -> int:
    """The phase of a header `pack_header` made (unchecked: for what we send, not what we receive)."""
    return header[5]  # after the magic (4 bytes) and the version (1)


def parse_header(data) -> tuple:
    """-> (phase, part, chunk, payload_len, tag); raises ProtocolError on bad magic/version/phase."""
    magic, version, phase, part, chunk, payload_len, tag = HEADER.unpack(data)
    if magic != CHUNK_MAGIC or version != PROTOCOL_VERSION or phase not in PHASE_NAMES:
        raise ProtocolError(f"bad chunk header (magic {magic!r}, version {version}, phase {phase})")
    return phase, part, chunk, payload_len, tag


def recv_exactly(sock: socket.socket, view: memoryview, deadline: Optional[float] = None) -> None:
    """Fill `view` (exactly len(view) bytes) from `sock`: the one "read exactly N bytes" of the data plane.

    deadline=None: the socket's own timeouts bound every call (see `block_until`); on a blocking socket
    MSG_WAITALL lets the kernel fill the whole buffer in one call: one GIL release per chunk instead of one
    per arriving TCP segment. With `deadline` (time.monotonic()): one deadline for all of it, however
    slowly the bytes trickle in; every recv waits at most the time left (this sets the socket's timeout).

    Raises ConnectionError on EOF, socket.timeout (TimeoutError) once `deadline` passed, and OSError (incl.
    socket.timeout) from the socket; `view` is then partly filled.
    """
    got, size = 0, len(view)
    flags = socket.MSG_WAITALL if deadline is None and sock.gettimeout() is None else 0
    while got < size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout(f"deadline passed after {got} of {size} bytes")
            sock.settimeout(remaining)
        n = sock.recv_into(view[got:], size - got, flags)
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {size} bytes")
        got += n


def recv_exactly_by(sock: socket.socket, size: int, deadline: float) -> bytes:
    """Exactly `size` bytes from `sock` by `deadline` (time.monotonic()); see `recv_exactly` for the errors."""
    data = bytearray(size)
    recv_exactly(sock, memoryview(data), deadline)
    return bytes(data)


def peek_exactly(sock: socket.socket, size: int, deadline: float) -> bytes:
    """The first `size` bytes waiting on `sock`, left there for the next read, by `deadline` (time.monotonic()).
    Raises ConnectionError on EOF and socket.timeout past the deadline."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout(f"fewer than {size} bytes arrived by the deadline")
        sock.settimeout(remaining)
        data = sock.recv(size, socket.MSG_PEEK | socket.MSG_WAITALL)
        if not data:
            raise ConnectionError("connection closed before its first bytes")
        if len(data) == size:
            return data
        time.sleep(0.005)  # a local socket pair may return fewer: wait for the rest


def readable_within(sock: socket.socket, seconds: float) -> bool:
    """Do bytes wait on `sock` (or its end come) within `seconds`? (`poll`, not `select`: a peer with many files
    open has descriptors past select's limit of 1024.) A socket another thread closed (the round ended) counts
    as ended: True, and the caller's next read fails with the OSError it handles."""
    fd = sock.fileno()
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(max(0, int(seconds * 1000))))


def send_parts(sock: socket.socket, parts: Sequence) -> None:
    """Send the bytes-like `parts` back to back, with one syscall where possible (no Python-level copy)."""
    sent = sock.sendmsg(parts)
    for part in parts:
        size = len(part)
        if sent < size:
            sock.sendall(memoryview(part).cast("B")[sent:])
        sent = max(sent - size, 0)


def buffer_options(read_ceiling: Callable[[str], int]) -> Tuple[int, ...]:
    """The socket buffers worth setting to SOCKET_BUFFER_BYTES: those whose kernel ceiling (`read_ceiling` of
    "wmem_max" / "rmem_max") grants that much. Setting a buffer turns off the kernel's autotuning for it, and
    the kernel caps the request at the ceiling, 212992 bytes on a stock Linux: there a set buffer would hold a
    connection to ~416 KB in flight (about 33 Mbit/s at 100 ms RTT), while autotuning grows it to MBs."""
    return tuple(option for option, ceiling in ((socket.SO_SNDBUF, "wmem_max"), (socket.SO_RCVBUF, "rmem_max"))
                 if read_ceiling(ceiling) >= SOCKET_BUFFER_BYTES)


def _kernel_ceiling(name: str) -> int:
    try:
        with open(f"/proc/sys/net/core/{name}") as f:
            return int(f.read())
    except (OSError, ValueError):  # not Linux, or no /proc: leave the buffers to the kernel
        return 0


@functools.lru_cache(maxsize=1)
def _buffers_to_set() -> Tuple[int, ...]:
    return buffer_options(_kernel_ceiling)


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay on TCP, and large buffers where the kernel grants them (`buffer_options`)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):  # relayed connections are local socket pairs
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in _buffers_to_set():
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


def block_until(sock: socket.socket, deadline: float) -> None:
    """Make `sock` blocking, with kernel send/receive timeouts that expire at `deadline` (time.monotonic()).

    Blocking calls let the kernel move a whole chunk per syscall; the kernel timeouts keep every call
    bounded by the round's deadline (a call that runs into it fails with OSError / returns short).
    """
    remaining = max(deadline - time.monotonic(), 0.001)
    timeval = struct.pack("ll", int(remaining), int((remaining % 1) * 1e6))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
