"""Who is on the other end of a data-plane connection, and a MAC on everything it carries.

Per round, each member signs a fresh X25519 key with its libp2p identity (`RoundCredentials`: one
RSA signature per round, over the group, the member's index and that key). A connection, sender ->
receiver (one per ordered pair of members per all-reduce), then runs:

    sender   -> receiver HELLO:   "MSHH" | version u8 | tag 8 | sender u16 | receiver u16 | c_s 32 |
                                  x25519_s 32 | key_len u16 | sig_len u16 | public key | signature
    receiver -> sender   REPLY:   "MSHR" | version u8 | c_r 32 | x25519_r 32 | key_len u16 | sig_len u16 |
                                  public key | signature | MAC_r 16
    sender   -> receiver CONFIRM: "MSHK" | version u8 | MAC_s 16

Each side checks that the other's public key hashes to the libp2p peer id that matchmaking gave for
that member index, and that the key signed the other's X25519 key for this group and index. The
connection key is BLAKE2b keyed with the group secret over the X25519 shared secret and the whole
transcript (version, tag, indices, peer ids, both challenges, both X25519 keys); MAC_r and MAC_s
(under distinct labels) prove both sides derived it. So:

- a member cannot pose as another: it has the other's signed X25519 key (it got it in a REPLY) but
  not its private half, so it cannot derive the key or produce MAC_s;
- a replayed or reflected message fails: the other side's challenge and X25519 key are fresh;
- an on-path proxy, even one that knows the group secret, cannot derive the connection key (it would
  have to replace an X25519 key, which the signature covers).

A connection that ended cleanly (both phases' end markers sent and read) may carry the next all-reduce between
the same two peers (kept_links.py): the sender rebinds it instead of opening a new one, in one round trip,
with no signature and no key exchange:

    sender   -> receiver REBIND:  "MSHB" | version u8 | tag 8 | sender u16 | receiver u16 | c_s 32 | MAC 16
    receiver -> sender   ACK:     "MSHA" | version u8 | c_r 32 | MAC_r 16

MAC is the next frame MAC of the old connection (only its sender holds that key); the receiver checks that the
new round's matchmaking names the same peer as member `sender`, and itself as `receiver`. The new key is BLAKE2b
keyed with the new group's secret over the old key and the new transcript (tag, indices, peer ids, c_s, c_r);
MAC_r (label "rebind") proves the receiver derived it. Frames then start over under the new key.

After the handshake every frame (chunk header + payload, end markers) carries a 16-byte tag:
AES-256-GCM under the connection key with the frame's sequence number as nonce, the header as the
(encrypted, then discarded) message and the payload as associated data, i.e. a GMAC over both. A
connection carries frames one way only, so a (key, nonce) pair is never used twice. The payload is
authenticated, not encrypted (see docs/security.md). A frame that fails its MAC ends the connection
(`ProtocolError`). `send_frame` writes a frame; `FrameReader` reads one and checks its MAC before
anything reads its payload. GCM rather than ChaCha20-Poly1305: with AES-NI and carry-less multiply (every
x86-64 and ARMv8 server CPU) its GHASH runs at about twice Poly1305's speed, and on a loopback round,
which is all memory traffic, the MAC is a tenth of the CPU (docs/benchmarks.md, bench_trust).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Tuple

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from moshpeer.averaging import wire
from moshpeer.dht.identity import Identity, load_public_key, peer_id_bytes_from_public_key
from moshpeer.errors import ProtocolError
from moshpeer.version import PROTOCOL_VERSION

HELLO = struct.Struct("!4sB8sHH32s32sHH")
REPLY = struct.Struct("!4sB32s32sHH")
CONFIRM = struct.Struct("!4sB16s")
REBIND = struct.Struct("!4sB8sHH32s")  # then the MAC of the old connection's next frame over these bytes
REBIND_ACK = struct.Struct("!4sB32s16s")
HELLO_MAGIC, REPLY_MAGIC, CONFIRM_MAGIC = b"MSHH", b"MSHR", b"MSHK"
REBIND_MAGIC, REBIND_ACK_MAGIC = b"MSHB", b"MSHA"
MAC_BYTES = 16
# An OpenSSH RSA public key is ~380 bytes at 2048 bits, ~720 at 4096; a signature is base64 (344 / 684):
# anything larger is not a key we would spend time verifying.
MAX_PUBLIC_KEY_BYTES = 1024
MAX_SIGNATURE_BYTES = 1024
_CERT_LABEL = b"moshpeer-round-key|"


def _x25519_public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _certificate(group_prefix: bytes, index: int, x25519_public: bytes) -> bytes:
    """What a member's identity signs once per round."""
    return b"".join((_CERT_LABEL, struct.pack("!B", PROTOCOL_VERSION), group_prefix, struct.pack("!H", index),
                     x25519_public))


@dataclass(frozen=True)
class RoundCredentials:
    """This member's identity for one group: a fresh X25519 key signed by its libp2p key."""

    group_prefix: bytes  # wire.group_tag_prefix(group id)
    index: int
    peer_id: bytes  # binary libp2p peer id of `public_key`
    public_key: bytes  # OpenSSH RSA public key
    signature: bytes
    x25519: X25519PrivateKey
    x25519_public: bytes

    @classmethod
    def create(cls, identity: Identity, group_prefix: bytes, index: int) -> "RoundCredentials":
        """Sign a fresh X25519 key for member `index` of the group (one RSA signature)."""
        key = X25519PrivateKey.generate()
        public = _x25519_public_bytes(key)
        signature = identity.private_key.sign(_certificate(group_prefix, index, public))
        return cls(group_prefix, index, identity.peer_id_bytes, identity.public_key_bytes, signature, key,
                   public)


def _check_certificate(public_key: bytes, signature: bytes, expected_peer: bytes, group_prefix: bytes, index: int,
                       x25519_public: bytes) -> None:
    """Raise ProtocolError unless `public_key` is member `index`'s (peer id from matchmaking) and signed its key."""
    key = load_public_key(public_key)
    if not expected_peer or not hmac.compare_digest(peer_id_bytes_from_public_key(key), expected_peer):
        raise ProtocolError(f"identity is not member {index}'s peer id")
    if not key.verify(_certificate(group_prefix, index, x25519_public), signature):
        raise ProtocolError(f"bad signature on member {index}'s round key")


def _transcript(tag: bytes, sender: int, receiver: int, sender_peer: bytes, receiver_peer: bytes, c_s: bytes,
                x_s: bytes, c_r: bytes, x_r: bytes) -> bytes:
    return b"".join((
        struct.pack("!B", PROTOCOL_VERSION), tag, struct.pack("!HH", sender, receiver),
        struct.pack("!H", len(sender_peer)), sender_peer, struct.pack("!H", len(receiver_peer)), receiver_peer,
        c_s, x_s, c_r, x_r,
    ))


def _connection_key(group_secret: bytes, own: X25519PrivateKey, their_public: bytes, transcript: bytes) -> bytes:
    try:
        shared = own.exchange(X25519PublicKey.from_public_bytes(their_public))
    except ValueError as e:  # a low-order point: no shared secret
        raise ProtocolError(f"bad X25519 key: {e}") from None
    return _derive(group_secret, b"moshpeer-conn", shared, transcript)


def _derive(group_secret: bytes, person: bytes, secret: bytes, transcript: bytes) -> bytes:
    h = hashlib.blake2b(key=hashlib.blake2b(group_secret, digest_size=32).digest(), digest_size=32, person=person)
    h.update(secret)
    h.update(transcript)
    return h.digest()


def _label_mac(key: bytes, label: bytes) -> bytes:
    return hashlib.blake2b(label, key=key, digest_size=MAC_BYTES, person=b"moshpeer-hs").digest()


class FrameAuth:
    """The MACs of one connection's frames, in order (each side keeps its own counter: TCP keeps order), and who
    is at its other end (`peer`: its libp2p peer id, `public_key`), which a rebind (`rebind`) carries over."""

    def __init__(self, connection_key: bytes, peer: bytes = b"", public_key: bytes = b""):
        self.key, self.peer, self.public_key = connection_key, peer, public_key
        self._aead = AESGCM(hashlib.blake2b(b"frames", key=connection_key, digest_size=32).digest())
        self.sequence = 0  # the next frame's (its nonce)

    def tag(self, header: bytes, payload=b"") -> bytes:
        """The MAC of the next frame (a header and its payload, any bytes-like object)."""
        nonce = self.sequence.to_bytes(12, "little")
        self.sequence += 1
        return self._aead.encrypt(nonce, bytes(header), payload if len(payload) else None)[-MAC_BYTES:]

    def check(self, header: bytes, payload, mac: bytes) -> None:
        """Raise ProtocolError unless `mac` is the next frame's MAC."""
        if not hmac.compare_digest(self.tag(header, payload), bytes(mac)):
            raise ProtocolError("frame MAC mismatch (altered or forged on the way)")



def _read_identity(sock: socket.socket, key_len: int, sig_len: int, deadline: float) -> Tuple[bytes, bytes]:
    if not 0 < key_len <= MAX_PUBLIC_KEY_BYTES or not 0 < sig_len <= MAX_SIGNATURE_BYTES:
        raise ProtocolError(f"identity of impossible size (key {key_len}, signature {sig_len} bytes)")
    blob = wire.recv_exactly_by(sock, key_len + sig_len, deadline)
    return blob[:key_len], blob[key_len:]


def _check_magic(magic: bytes, version: int, expected: bytes, what: str) -> None:
    if magic != expected or version != PROTOCOL_VERSION:
        raise ProtocolError(f"bad {what} (magic {magic!r}, version {version})")


# What the data plane needs of the all-reduce a connection names (see GroupAllReduce).
SessionLookup = Callable[[bytes], Optional[object]]


def _session_for(find_session: SessionLookup, tag: bytes, sender: int, receiver: int):
    """The session of the all-reduce `tag` in which we are member `receiver` and `sender` another member; raises
    ProtocolError if there is none."""
    session = find_session(tag)
    if session is None:
        raise ProtocolError("unknown or finished round (not in this group)")
    if receiver != session.credentials.index or not 0 <= sender < session.group_size or sender == receiver:
        raise ProtocolError(f"impossible member indices {sender} -> {receiver}")
    return session


def accept(sock: socket.socket, deadline: float, find_session: SessionLookup,
           admit: Optional[Callable[[bytes], None]] = None) -> Tuple[object, int, FrameAuth]:
    """Receiver side: -> (session, sender index, the MACs of its frames). Raises ProtocolError (bad or
    unauthentic hello, no such round, a public key that `admit` refuses), ConnectionError or socket.timeout;
    the caller closes `sock`."""
    magic, version, tag, sender, receiver, c_s, x_s, key_len, sig_len = HELLO.unpack(
        wire.recv_exactly_by(sock, HELLO.size, deadline))
    _check_magic(magic, version, HELLO_MAGIC, "hello")
    public_key, signature = _read_identity(sock, key_len, sig_len, deadline)
    if admit is not None:
        admit(public_key)  # before any session is looked up: an outsider learns nothing about our rounds
    session = _session_for(find_session, tag, sender, receiver)
    creds: RoundCredentials = session.credentials
    sender_peer = session.peer_id_of(sender)
    _check_certificate(public_key, signature, sender_peer, creds.group_prefix, sender, x_s)
    c_r = os.urandom(32)
    transcript = _transcript(tag, sender, receiver, sender_peer, creds.peer_id, c_s, x_s, c_r, creds.x25519_public)
    key = _connection_key(session.secret, creds.x25519, x_s, transcript)
    sock.sendall(REPLY.pack(REPLY_MAGIC, PROTOCOL_VERSION, c_r, creds.x25519_public, len(creds.public_key),
                            len(creds.signature)) + creds.public_key + creds.signature + _label_mac(key, b"reply"))
    magic, version, mac = CONFIRM.unpack(wire.recv_exactly_by(sock, CONFIRM.size, deadline))
    _check_magic(magic, version, CONFIRM_MAGIC, "confirmation")
    if not hmac.compare_digest(mac, _label_mac(key, b"confirm")):
        raise ProtocolError(f"member {sender} did not prove its round key (impersonation or a stale hello)")
    return session, sender, FrameAuth(key, sender_peer, public_key)


def pack_hello(credentials: RoundCredentials, tag: bytes, receiver: int, challenge: bytes) -> bytes:
    """The HELLO of member `credentials.index` to member `receiver` for the all-reduce `tag`."""
    me = credentials
    return HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, tag, me.index, receiver, challenge, me.x25519_public,
                      len(me.public_key), len(me.signature)) + me.public_key + me.signature


class PeerRefused(ConnectionError):
    """The receiver closed the connection after our hello: it is not in this round (or refused our identity)."""


class PeerNotAuthentic(ProtocolError):
    """The receiver answered without proving that it is the member matchmaking named."""


def connect(sock: socket.socket, deadline: float, *, credentials: RoundCredentials, tag: bytes, receiver: int,
            receiver_peer: bytes, group_secret: bytes) -> FrameAuth:
    """Sender side, on a fresh connection to member `receiver`: -> the MACs of our frames. Raises PeerRefused,
    PeerNotAuthentic, ProtocolError, socket.timeout or OSError; the caller closes `sock`."""
    c_s = os.urandom(32)
    me = credentials
    sock.sendall(pack_hello(me, tag, receiver, c_s))
    try:
        magic, version, c_r, x_r, key_len, sig_len = REPLY.unpack(wire.recv_exactly_by(sock, REPLY.size, deadline))
    except ConnectionError:
        raise PeerRefused(f"member {receiver} closed the connection after our hello") from None
    _check_magic(magic, version, REPLY_MAGIC, "reply")
    public_key, signature = _read_identity(sock, key_len, sig_len, deadline)
    mac = wire.recv_exactly_by(sock, MAC_BYTES, deadline)
    try:
        _check_certificate(public_key, signature, receiver_peer, me.group_prefix, receiver, x_r)
    except ProtocolError as e:
        raise PeerNotAuthentic(str(e)) from None
    transcript = _transcript(tag, me.index, receiver, me.peer_id, receiver_peer, c_s, me.x25519_public, c_r, x_r)
    key = _connection_key(group_secret, me.x25519, x_r, transcript)
    if not hmac.compare_digest(mac, _label_mac(key, b"reply")):
        raise PeerNotAuthentic(f"member {receiver} did not prove its round key")
    sock.sendall(CONFIRM.pack(CONFIRM_MAGIC, PROTOCOL_VERSION, _label_mac(key, b"confirm")))
    return FrameAuth(key, receiver_peer, public_key)


def rebind(sock: socket.socket, old: FrameAuth, deadline: float, *, tag: bytes, sender: int, receiver: int,
           sender_peer: bytes, group_secret: bytes) -> FrameAuth:
    """Sender side, on a kept connection whose frames `old` MACs, to the same peer (`old.peer`), now member
    `receiver` of the all-reduce `tag`: -> the MACs of our frames in it. Raises PeerRefused (the receiver closed
    it: it timed the connection out, or it is not in this round), PeerNotAuthentic, ProtocolError, socket.timeout
    or OSError; the caller closes `sock`, and may open a fresh connection instead."""
    c_s = os.urandom(32)
    sock.settimeout(max(deadline - time.monotonic(), 0.001))  # the sendall too; the caller sets the round's after
    message = REBIND.pack(REBIND_MAGIC, PROTOCOL_VERSION, tag, sender, receiver, c_s)
    try:
        sock.sendall(message + old.tag(message))
        magic, version, c_r, mac = REBIND_ACK.unpack(wire.recv_exactly_by(sock, REBIND_ACK.size, deadline))
    except ConnectionError:
        raise PeerRefused(f"member {receiver} closed our kept connection") from None
    _check_magic(magic, version, REBIND_ACK_MAGIC, "rebind acknowledgement")
    key = _rebound_key(group_secret, old.key, tag, sender, receiver, sender_peer, old.peer, c_s, c_r)
    if not hmac.compare_digest(mac, _label_mac(key, b"rebind")):
        raise PeerNotAuthentic(f"member {receiver} did not prove the key of our kept connection")
    return FrameAuth(key, old.peer, old.public_key)


def accept_rebind(sock: socket.socket, old: FrameAuth, deadline: float, find_session: SessionLookup,
                  admit: Optional[Callable[[bytes], None]] = None) -> Tuple[object, int, FrameAuth]:
    """Receiver side of `rebind`, on a kept connection from the peer `old.peer` whose frames `old` MACs:
    -> (session, sender index, the MACs of its frames). Raises as `accept` does; the caller closes `sock`."""
    message = wire.recv_exactly_by(sock, REBIND.size, deadline)
    mac = wire.recv_exactly_by(sock, MAC_BYTES, deadline)
    magic, version, tag, sender, receiver, c_s = REBIND.unpack(message)
    _check_magic(magic, version, REBIND_MAGIC, "rebind")
    old.check(message, b"", mac)
    if admit is not None:
        admit(old.public_key)  # who may connect can change while a connection is kept
    session = _session_for(find_session, tag, sender, receiver)
    creds: RoundCredentials = session.credentials
    if not hmac.compare_digest(session.peer_id_of(sender), old.peer):
        raise ProtocolError(f"a kept connection's peer is not member {sender} of this round")
    c_r = os.urandom(32)
    key = _rebound_key(session.secret, old.key, tag, sender, receiver, old.peer, creds.peer_id, c_s, c_r)
    sock.sendall(REBIND_ACK.pack(REBIND_ACK_MAGIC, PROTOCOL_VERSION, c_r, _label_mac(key, b"rebind")))
    return session, sender, FrameAuth(key, old.peer, old.public_key)


def _rebound_key(group_secret: bytes, old_key: bytes, tag: bytes, sender: int, receiver: int, sender_peer: bytes,
                 receiver_peer: bytes, c_s: bytes, c_r: bytes) -> bytes:
    transcript = _transcript(tag, sender, receiver, sender_peer, receiver_peer, c_s, b"", c_r, b"")
    return _derive(group_secret, b"moshpeer-rebind", old_key, transcript)


def send_frame(sock: socket.socket, auth: FrameAuth, header: bytes, payload=b"") -> None:
    """Send header + payload + MAC with one syscall where possible (no Python-level copy of the payload)."""
    wire.send_parts(sock, [header, payload, auth.tag(header, payload)] if len(payload) else [header, auth.tag(header)])


class Frame(NamedTuple):  # a tuple: one is made per chunk on the hot path
    """One authenticated frame as read: its header fields and its payload (None for an END_* marker)."""

    phase: int
    part: int
    chunk: int
    payload_len: int
    payload: Optional[object] = None


class FrameReader:
    """Reads the frames of one authenticated connection (`send_frame`'s other end), checking each one.

    :param tag: the all-reduce's tag: a frame of another round is a protocol violation
    :param max_payload: bytes a frame's payload may have at most
    :param inbox: where payloads are received (`staging.Inbox`: `buffer(n)` to fill, then `payload(n)`)
    """

    def __init__(self, sock: socket.socket, auth: FrameAuth, *, tag: bytes, max_payload: int, inbox):
        self.sock, self.auth, self.tag, self.max_payload, self.inbox = sock, auth, tag, max_payload, inbox
        self._header = bytearray(wire.HEADER.size)
        self._header_view = memoryview(self._header)
        self._mac = bytearray(MAC_BYTES)
        self._mac_view = memoryview(self._mac)

    def read(self) -> Frame:
        """The next frame, its MAC checked before anything reads its payload. Raises ProtocolError (bad header,
        another round's tag, an oversized payload, a MAC mismatch: the stream cannot be trusted past it),
        ConnectionError on EOF, OSError when the socket's timeout (`wire.block_until`) expires."""
        sock, header = self.sock, self._header
        wire.recv_exactly(sock, self._header_view)
        # A bad header desynchronizes the stream: the connection is dropped (ProtocolError).
        phase, part, chunk, payload_len, tag = wire.parse_header(header)
        if tag != self.tag:
            raise ProtocolError("chunk of another round")
        if payload_len > self.max_payload:
            raise ProtocolError(f"payload of {payload_len} bytes exceeds the limit {self.max_payload}")
        if phase == wire.PHASE_END_REDUCE or phase == wire.PHASE_END_GATHER:
            if payload_len:
                raise ProtocolError("end marker with a payload")
            wire.recv_exactly(sock, self._mac_view)
            self.auth.check(header, b"", self._mac)
            return Frame(phase, part, chunk, 0)
        received = self.inbox.buffer(payload_len)
        wire.recv_exactly(sock, received)
        wire.recv_exactly(sock, self._mac_view)
        self.auth.check(header, received, self._mac)
        return Frame(phase, part, chunk, payload_len, self.inbox.payload(payload_len))
