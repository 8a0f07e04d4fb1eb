"""The relay protocol's messages: what a relay and its clients say to each other, and their checks.

A connection to a relay is a connection to its data-plane port that starts with MAGIC (the data plane
hands it to the relay instead of the handshake, see `DataPlane.serve_protocol`). The relay answers with
a fresh challenge, then the client sends one request:

    reserve {key, sig}  a peer behind NAT asks for a slot: `key` is its RSA public key, `sig` its signature
                        over RESERVE_LABEL + challenge (so the slot is held by whoever has the key, and a
                        recorded request cannot be replayed). The connection stays open as the slot's control
                        channel: the relay sends `dial {sid}` on it, the client sends `ping`, the relay `pong`.
    connect {peer}      a sender wants a circuit to the peer holding a slot: the relay sends that peer
                        `dial {sid}` and answers `{ok}` once the peer accepted, or `{ok: false, why}`.
    accept {sid}        the peer that was dialled opens a fresh connection for circuit `sid`.

After `{ok: true}` the relay copies bytes between the sender and the accepting peer, both ways, until one
side closes. It cannot read or forge what it copies: the data plane's own handshake (handshake.py) runs
end to end through the circuit and proves both ends' identities.

Every message is a 2-byte length and a msgpack map of at most MAX_MESSAGE_BYTES; anything else ends the
connection with ProtocolError.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any, Dict

import msgpack

from moshpeer.averaging import wire
from moshpeer.errors import ProtocolError

MAGIC = b"MPRY"  # 4 bytes, like the handshake's "MSHH": the data plane tells the two apart by them
VERSION = 1
MAX_MESSAGE_BYTES = 4096
CHALLENGE_BYTES = SID_BYTES = 16
RESERVE_LABEL = b"moshpeer-relay-reserve|"
_LENGTH = struct.Struct("!H")


def send_message(sock: socket.socket, **fields: Any) -> None:
    """Send one message; OSError if the connection broke."""
    body = msgpack.packb(fields)
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError("relay message too large")
    sock.sendall(_LENGTH.pack(len(body)) + body)


def recv_message(sock: socket.socket, deadline: float) -> Dict[str, Any]:
    """One message by `deadline` (time.monotonic()). Raises ProtocolError if it is not a well-formed message,
    ConnectionError on EOF, socket.timeout past the deadline."""
    (size,) = _LENGTH.unpack(wire.recv_exactly_by(sock, _LENGTH.size, deadline))
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"relay message of {size} bytes")
    try:
        message = msgpack.unpackb(wire.recv_exactly_by(sock, size, deadline), raw=False,
                                  max_bin_len=MAX_MESSAGE_BYTES, max_str_len=MAX_MESSAGE_BYTES)
    except Exception as e:
        raise ProtocolError(f"undecodable relay message: {e}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op", ""), str):
        raise ProtocolError("relay message is not a map")
    return message


def field(message: Dict[str, Any], name: str, kind: type, max_len: int = MAX_MESSAGE_BYTES) -> Any:
    """`message[name]` if it is a `kind` (of at most `max_len` items for bytes and str); else ProtocolError."""
    value = message.get(name)
    if not isinstance(value, kind) or (isinstance(value, (bytes, str)) and len(value) > max_len):
        raise ProtocolError(f"relay message without a valid {name!r}")
    return value


def opening() -> bytes:
    """What a client sends first on a new connection to a relay."""
    return MAGIC + bytes([VERSION])


def new_id() -> bytes:
    """A fresh challenge or circuit id."""
    return os.urandom(CHALLENGE_BYTES)


def reservation_statement(challenge: bytes) -> bytes:
    """What a peer asking for a slot signs."""
    return RESERVE_LABEL + challenge


class RelayRefused(ConnectionError):
    """The relay answered, but would not do what we asked (no slot for that peer, over its limits)."""
