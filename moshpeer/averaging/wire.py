"""Bytes on the data plane: connection handshake (HMAC challenge) and the fixed chunk header.

Connection (one per ordered pair of group members per all-reduce, sender -> owner / receiver):

    receiver -> sender   CHALLENGE: magic "MSHC", version (u8), 32 random bytes
    sender   -> receiver HELLO: magic "MSHH", version (u8), group tag (8 bytes), sender index (u16),
                         receiver index (u16), HMAC-SHA256(secret, challenge | tag | indices) (32 bytes)

The secret is derived from the group id and every member's random nonce, all delivered inside
matchmaking over libp2p's encrypted channel: a stranger who only sees the data port cannot compute
the HMAC and is rejected. After the hello, the sender streams chunks, each a fixed header followed
by `payload_len` bytes:

    magic "MSHP" | version u8 | phase u8 | part u16 | chunk u32 | payload_len u32 | group tag 8 bytes

Phases: REDUCE (a member's contribution to the owner's part), GATHER (the owner's averaged chunk),
and the END_* markers (payload_len 0) that say "I sent everything I will send in this phase".
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from typing import Sequence

from moshpeer.errors import ProtocolError
from moshpeer.version import PROTOCOL_VERSION

CHALLENGE = struct.Struct("!4sB32s")
HELLO = struct.Struct("!4sB8sHH32s")
HEADER = struct.Struct("!4sBBHII8s")
CHALLENGE_MAGIC, HELLO_MAGIC, CHUNK_MAGIC = b"MSHC", b"MSHH", b"MSHP"

PHASE_REDUCE, PHASE_GATHER, PHASE_END_REDUCE, PHASE_END_GATHER = 1, 2, 3, 4
PHASE_NAMES = {PHASE_REDUCE: "reduce", PHASE_GATHER: "gather", PHASE_END_REDUCE: "end-reduce",
               PHASE_END_GATHER: "end-gather"}

SOCKET_BUFFER_BYTES = 4 << 20


def group_secret(group_id: bytes, nonces: Sequence[bytes]) -> bytes:
    """Per-group secret: hash of the group id and every member's nonce, in group order."""
    h = hashlib.blake2b(digest_size=32, person=b"moshpeer-secret")
    h.update(group_id)
    for nonce in nonces:
        h.update(len(nonce).to_bytes(2, "big") + nonce)
    return h.digest()


def allreduce_tag(group_id: bytes, sequence: int) -> bytes:
    """8-byte tag of the `sequence`-th all-reduce of a group (ARC-Top-K runs several per group)."""
    return hashlib.blake2b(group_id + sequence.to_bytes(4, "big"), digest_size=8, person=b"moshpeer-tag").digest()


def hello_mac(secret: bytes, challenge: bytes, tag: bytes, sender: int, receiver: int) -> bytes:
    return hmac.new(secret, challenge + tag + struct.pack("!HH", sender, receiver), hashlib.sha256).digest()


def new_challenge() -> bytes:
    return CHALLENGE.pack(CHALLENGE_MAGIC, PROTOCOL_VERSION, os.urandom(32))


def parse_challenge(data: bytes) -> bytes:
    magic, version, challenge = CHALLENGE.unpack(data)
    if magic != CHALLENGE_MAGIC or version != PROTOCOL_VERSION:
        raise ProtocolError(f"bad challenge (magic {magic!r}, version {version})")
    return challenge


def pack_hello(secret: bytes, challenge: bytes, tag: bytes, sender: int, receiver: int) -> bytes:
    return HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, tag, sender, receiver,
                      hello_mac(secret, challenge, tag, sender, receiver))


def parse_hello(data: bytes):
    """-> (tag, sender, receiver, mac); checks magic and version only (the MAC needs the session)."""
    magic, version, tag, sender, receiver, mac = HELLO.unpack(data)
    if magic != HELLO_MAGIC or version != PROTOCOL_VERSION:
        raise ProtocolError(f"bad hello (magic {magic!r}, version {version})")
    return tag, sender, receiver, mac


def pack_header(phase: int, part: int, chunk: int, payload_len: int, tag: bytes) -> bytes:
    return HEADER.pack(CHUNK_MAGIC, PROTOCOL_VERSION, phase, part, chunk, payload_len, tag)


def parse_header(data) -> tuple:
    """-> (phase, part, chunk, payload_len, tag); raises ProtocolError on bad magic/version/phase."""
    magic, version, phase, part, chunk, payload_len, tag = HEADER.unpack(data)
    if magic != CHUNK_MAGIC or version != PROTOCOL_VERSION or phase not in PHASE_NAMES:
        raise ProtocolError(f"bad chunk header (magic {magic!r}, version {version}, phase {phase})")
    return phase, part, chunk, payload_len, tag


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`; raises ConnectionError on EOF (and socket.timeout / OSError from the socket).

    On a blocking socket (see `block_until`) MSG_WAITALL lets the kernel fill the whole buffer in one
    call: one GIL release per chunk instead of one per arriving TCP segment.
    """
    got, size = 0, len(view)
    flags = socket.MSG_WAITALL if sock.gettimeout() is None else 0
    while got < size:
        n = sock.recv_into(view[got:], size - got, flags)
        if n == 0:
            raise ConnectionError("connection closed")
        got += n


def send_parts(sock: socket.socket, header: bytes, payload) -> None:
    """Send header + payload with one syscall where possible (no Python-level copy of the payload)."""
    total = len(header) + len(payload)
    sent = sock.sendmsg([header, payload])
    if sent < total:
        if sent < len(header):
            sock.sendall(header[sent:])
            sock.sendall(payload)
        else:
            sock.sendall(memoryview(payload)[sent - len(header):])


def tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


def block_until(sock: socket.socket, deadline: float) -> None:
    """Make `sock` blocking, with kernel send/receive timeouts that expire at `deadline` (time.monotonic()).

    Blocking calls let the kernel move a whole chunk per syscall; the kernel timeouts keep every call
    bounded by the round's deadline (a call that runs into it fails with OSError / returns short).
    """
    import time

    remaining = max(deadline - time.monotonic(), 0.001)
    timeval = struct.pack("ll", int(remaining), int((remaining % 1) * 1e6))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
