"""Bytes on the data plane: the mutual connection handshake and the fixed chunk header.

Connection (one per ordered pair of group members per all-reduce, sender -> owner / receiver):

    receiver -> sender   CHALLENGE: magic "MSHC", version (u8), 32 random bytes (c_r)
    sender   -> receiver HELLO: magic "MSHH", version (u8), group tag (8 bytes), sender index (u16),
                         receiver index (u16), 32 random bytes (c_s), MAC_hello (32 bytes)
    receiver -> sender   WELCOME: magic "MSHW", version (u8), MAC_welcome (32 bytes)

Both MACs are HMAC-SHA256 under the group secret over the same transcript: protocol version, both
challenges, the tag (group id + all-reduce sequence), both indices and both members' libp2p peer ids;
each MAC starts with its own direction label. So both ends prove they know the secret of this group,
for this round, between these two peers: a replayed hello or welcome fails (the other side's
challenge is fresh), a reflected one fails (the labels differ), one meant for another member fails
(indices and peer ids). The sender streams chunks only after a valid WELCOME; a receiver that is not
in the round (matchmaking disagreed) or fails to prove the secret closes or is dropped at once.

The secret is derived from the group id and every member's random nonce, all delivered inside
matchmaking over libp2p's encrypted channel: a stranger who only sees the data port cannot compute
either MAC. After the handshake the sender streams chunks, each a fixed header followed by
`payload_len` bytes:

    magic "MSHP" | version u8 | phase u8 | part u16 | chunk u32 | payload_len u32 | group tag 8 bytes

The tag is 6 bytes of a hash of the group id followed by the all-reduce's sequence number in the
round (u16), so a data plane can tell which group an unknown tag belongs to.

Phases: REDUCE (a member's contribution to the owner's part), GATHER (the owner's averaged chunk),
and the END_* markers (payload_len 0) that say "I sent everything I will send in this phase".
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from typing import Optional, Sequence

from moshpeer.errors import ProtocolError
from moshpeer.version import PROTOCOL_VERSION

CHALLENGE = struct.Struct("!4sB32s")
HELLO = struct.Struct("!4sB8sHH32s32s")
WELCOME = struct.Struct("!4sB32s")
HEADER = struct.Struct("!4sBBHII8s")
CHALLENGE_MAGIC, HELLO_MAGIC, WELCOME_MAGIC, CHUNK_MAGIC = b"MSHC", b"MSHH", b"MSHW", b"MSHP"
TAG_GROUP_BYTES = 6  # the tag's first bytes name the group; the last two are the all-reduce sequence

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


def _transcript(challenge_r: bytes, challenge_s: bytes, tag: bytes, sender: int, receiver: int,
                sender_peer: bytes, receiver_peer: bytes) -> bytes:
    return b"".join((
        struct.pack("!B", PROTOCOL_VERSION), challenge_r, challenge_s, tag, struct.pack("!HH", sender, receiver),
        struct.pack("!H", len(sender_peer)), sender_peer, struct.pack("!H", len(receiver_peer)), receiver_peer,
    ))


def _mac(label: bytes, secret: bytes, *transcript) -> bytes:
    return hmac.new(secret, label + _transcript(*transcript), hashlib.sha256).digest()


def hello_mac(secret: bytes, challenge_r: bytes, challenge_s: bytes, tag: bytes, sender: int, receiver: int,
              sender_peer: bytes = b"", receiver_peer: bytes = b"") -> bytes:
    """The sender's proof (see the module docstring)."""
    return _mac(b"moshpeer-hello|", secret, challenge_r, challenge_s, tag, sender, receiver, sender_peer, receiver_peer)


def welcome_mac(secret: bytes, challenge_r: bytes, challenge_s: bytes, tag: bytes, sender: int, receiver: int,
                sender_peer: bytes = b"", receiver_peer: bytes = b"") -> bytes:
    """The receiver's proof: the same transcript under another label, so a reflected hello is no welcome."""
    return _mac(b"moshpeer-welcome|", secret, challenge_r, challenge_s, tag, sender, receiver, sender_peer,
                receiver_peer)


def new_challenge() -> bytes:
    return CHALLENGE.pack(CHALLENGE_MAGIC, PROTOCOL_VERSION, os.urandom(32))


def parse_challenge(data: bytes) -> bytes:
    magic, version, challenge = CHALLENGE.unpack(data)
    if magic != CHALLENGE_MAGIC or version != PROTOCOL_VERSION:
        raise ProtocolError(f"bad challenge (magic {magic!r}, version {version})")
    return challenge


def pack_hello(secret: bytes, challenge_r: bytes, tag: bytes, sender: int, receiver: int,
               sender_peer: bytes = b"", receiver_peer: bytes = b"", challenge_s: Optional[bytes] = None) -> bytes:
    """The sender's HELLO; `challenge_s` (default: fresh random bytes) is what the WELCOME must answer."""
    challenge_s = os.urandom(32) if challenge_s is None else challenge_s
    mac = hello_mac(secret, challenge_r, challenge_s, tag, sender, receiver, sender_peer, receiver_peer)
    return HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, tag, sender, receiver, challenge_s, mac)


def parse_hello(data: bytes):
    """-> (tag, sender, receiver, challenge_s, mac); checks magic and version only (the MAC needs the session)."""
    magic, version, tag, sender, receiver, challenge_s, mac = HELLO.unpack(data)
    if magic != HELLO_MAGIC or version != PROTOCOL_VERSION:
        raise ProtocolError(f"bad hello (magic {magic!r}, version {version})")
    return tag, sender, receiver, challenge_s, mac


def hello_challenge(hello: bytes) -> bytes:
    """The sender's challenge inside a packed HELLO."""
    return parse_hello(hello)[3]


def pack_welcome(mac: bytes) -> bytes:
    return WELCOME.pack(WELCOME_MAGIC, PROTOCOL_VERSION, mac)


def parse_welcome(data: bytes) -> bytes:
    """-> the receiver's MAC; raises ProtocolError on bad magic / version."""
    magic, version, mac = WELCOME.unpack(data)
    if magic != WELCOME_MAGIC or version != PROTOCOL_VERSION:
        raise ProtocolError(f"bad welcome (magic {magic!r}, version {version})")
    return mac


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
    if sock.family in (socket.AF_INET, socket.AF_INET6):  # relayed connections are local socket pairs
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
    remaining = max(deadline - time.monotonic(), 0.001)
    timeval = struct.pack("ll", int(remaining), int((remaining % 1) * 1e6))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
