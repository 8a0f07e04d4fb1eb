"""The wire that both state protocols share (sync.py: one donor; pieces.py: many donors).

Every message is framed as a 4-byte big-endian length + body. A request is a msgpack map with the op, the
protocol version, the run id and a fresh 32-byte challenge, signed by the client's identity when it has one
(a private run's donors require it); a donor's header is a msgpack map signed over the challenge and what it
announces, by the key whose hash is the peer id of its offer. Offers live in the DHT under
`dht.keys.state_offers_key(run_id)` (entries `dht.offers.StateOfferRecord`); a state travels as `serialize_state`
bytes (`torch.save` of tensors and plain values, read back with `weights_only=True`, so a malicious donor cannot
run code here).

Failure: every receive has one deadline (time.monotonic()) for the whole exchange and raises TimeoutError once
it passed (`wire.recv_exactly_by`, the same reader as the data plane's); a closed connection raises
ConnectionError; a malformed, oversized or wrongly signed message raises ProtocolError. Nothing is allocated
from an announced size before it is checked against a limit.
"""

from __future__ import annotations

import io
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import msgpack
import torch
from hivemind.utils.crypto import RSAPublicKey

from moshpeer.averaging.wire import recv_exactly_by
from moshpeer.dht.identity import Identity, peer_id_from_public_key
from moshpeer.errors import ProtocolError

STATE_PROTOCOL = 3
MAX_HEADER_BYTES = 4096
OPS = ("get_state", "get_manifest", "get_pieces")  # the last two: pieces.py (multi-donor download)
_LEN = struct.Struct(">I")


@dataclass(frozen=True)
class StateOffer:
    """A donor's offer as found in the DHT (checked: its entry is signed by `peer_id`)."""

    peer_id: str
    host: str
    port: int
    epoch: int


def serialize_state(state: Dict[str, Any]) -> bytes:
    """Bytes of a state dict (tensors, numbers, strings, lists, dicts) for `deserialize_state`."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def deserialize_state(data: bytes) -> Dict[str, Any]:
    """Inverse of `serialize_state`; refuses anything but tensors and plain values (weights_only): ProtocolError."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ProtocolError(f"state does not decode: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict):
        raise ProtocolError(f"state must be a dict, got {type(state).__name__}")
    return state


# ---- frames -------------------------------------------------------------------------------------

def send_frame(sock: socket.socket, body: bytes) -> None:
    """Send one frame (length + body); OSError when the connection fails."""
    if len(body) < 65536:  # small frames: one send, no extra packet
        sock.sendall(_LEN.pack(len(body)) + body)
    else:  # large chunks: no copy of the body
        sock.sendall(_LEN.pack(len(body)))
        sock.sendall(body)


def remaining(deadline: float) -> float:
    """Seconds left until `deadline`; TimeoutError once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("state transfer deadline passed")
    return left


def recv_frame_length(sock: socket.socket, limit: int, deadline: float) -> int:
    """The next frame's length; ProtocolError if it is over `limit`."""
    (length,) = _LEN.unpack(recv_exactly_by(sock, _LEN.size, deadline))
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {limit}")
    return length


def recv_msgpack(sock: socket.socket, deadline: float) -> Dict[str, Any]:
    """The next frame as a msgpack map of at most MAX_HEADER_BYTES; ProtocolError if it is anything else."""
    body = recv_exactly_by(sock, recv_frame_length(sock, MAX_HEADER_BYTES, deadline), deadline)
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:
        raise ProtocolError(f"bad message: {e}") from None
    if not isinstance(message, dict):
        raise ProtocolError("message is not a map")
    return message


# ---- signatures ---------------------------------------------------------------------------------

STATE_KIND = b"moshpeer-state"  # what a signed header announces: a state (other ops sign their own kind)


def signed_fields(run_id: str, challenge: bytes, epoch: int, total: int, digest: str,
                  kind: bytes = STATE_KIND) -> bytes:
    """What a single-donor header's signature covers."""
    return b"|".join((kind, run_id.encode(), challenge, str(epoch).encode(), str(total).encode(), digest.encode()))


def request_fields(run_id: str, challenge: bytes) -> bytes:
    """What a client's request signature covers."""
    return b"|".join((b"moshpeer-state-request", run_id.encode(), challenge))


def signed_request(op: str, run_id: str, challenge: bytes, identity: Optional[Identity], tag: bytes,
                   **fields: Any) -> Dict[str, Any]:
    """A request for `op`; with `identity`, signed by it and carrying `tag` (what a private run's donors need)."""
    request = {"op": op, "protocol": STATE_PROTOCOL, "run_id": run_id, "challenge": challenge, **fields}
    if identity is not None:
        request.update(public_key=identity.public_key.to_bytes(), tag=tag,
                       signature=identity.private_key.sign(request_fields(run_id, challenge)))
    return request


def parse_header(header: Dict[str, Any], max_bytes: int, unit_field: str) -> Tuple[int, int, str, int]:
    """(epoch, total_bytes, sha256, header[unit_field]) of a donor's header; ProtocolError if malformed or the
    announced size is over `max_bytes`."""
    total, digest, epoch, unit = (header.get("total_bytes"), header.get("sha256"), header.get("epoch"),
                                  header.get(unit_field))
    if not (header.get("ok") is True and isinstance(total, int) and 0 < total
            and isinstance(digest, str) and len(digest) == 64 and isinstance(epoch, int) and epoch >= 0
            and isinstance(unit, int) and 0 < unit <= 64 << 20):
        raise ProtocolError(f"bad state header {header!r:.200}")
    if total > max_bytes:
        raise ProtocolError(f"donor announced {total} bytes, over this peer's limit of {max_bytes}")
    return epoch, total, digest, unit


def client_peer(request: Dict[str, Any], run_id: str, challenge: bytes) -> Optional[str]:
    """The peer id that signed a state request, None if it is unsigned or the signature does not verify."""
    public_key, signature = request.get("public_key"), request.get("signature")
    if not isinstance(public_key, bytes) or not isinstance(signature, bytes):
        return None
    try:
        key = RSAPublicKey.from_bytes(public_key)
        return peer_id_from_public_key(key) if key.verify(request_fields(run_id, challenge), signature) else None
    except Exception:  # a malformed key
        return None


def check_donor(header: Dict[str, Any], expected_peer: str, fields: bytes) -> None:
    """Raise ProtocolError unless the header's signature over `fields` (which hold our challenge) is by the key
    of `expected_peer`."""
    public_key, signature = header.get("public_key"), header.get("signature")
    if not isinstance(public_key, bytes) or not isinstance(signature, bytes):
        raise ProtocolError("donor did not sign its state")
    try:
        key = RSAPublicKey.from_bytes(public_key)
    except Exception:
        raise ProtocolError("donor's public key does not parse") from None
    if peer_id_from_public_key(key) != expected_peer:
        raise ProtocolError("donor is not the peer that offered the state")
    if not key.verify(fields, signature):
        raise ProtocolError("bad signature on the state header")
