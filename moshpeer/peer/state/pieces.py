"""The piece-wise half of the state protocol (version 3): a signed manifest of per-piece hashes, and ranges of
pieces checked against it. This is what lets a newcomer pull one state from several donors at once
(swarm.py); `StateServer` (sync.py) answers both requests. Framing and signatures: framing.py.

  client -> server  the signed request of framing.py with op "get_manifest"
  server -> client  msgpack {"ok": true, "epoch", "total_bytes", "sha256", "piece_bytes", "public_key",
                             "signature": over the challenge, those fields and the SHA-256 of the hash list}
                    then one frame: the pieces' SHA-256 digests, 32 bytes each, in order
  client -> server  the signed request with op "get_pieces", "sha256": the state's digest, "first", "count"
  server -> client  msgpack {"ok": true} then one frame per piece; or {"ok": false, "error": ...} when the
                    donor no longer holds that state (it moved on to a newer epoch)

Pieces need no signature of their own: each is checked against a manifest whose donor signed it over the
client's challenge. The manifest is computed once per served state, and the donor keeps serving pieces of
the last states it sent manifests of (PINNED_SNAPSHOTS, for PIN_S) after it moved on to a newer epoch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import msgpack

from moshpeer.dht.identity import Identity
from moshpeer.errors import ProtocolError
from moshpeer.averaging.wire import recv_exactly_by
from moshpeer.peer.state.framing import (StateOffer, check_donor, parse_header, recv_frame_length,
                                         recv_msgpack, remaining, send_frame, signed_request)

if TYPE_CHECKING:  # the server calls into this module; this module only uses the server it is handed
    from moshpeer.peer.state.sync import StateServer

logger = logging.getLogger(__name__)

MIN_PIECE_BYTES = 1024  # a smaller piece is refused (its hash list would outweigh the state)
SMALLEST_SERVED_PIECE = 16 << 10
TARGET_PIECES = 64  # enough pieces for several donors to share a small state
PINNED_SNAPSHOTS = 2  # states a donor keeps serving pieces of after it moved on
PIN_S = 120.0  # ... as long as one of their manifests or pieces was asked this recently
_DIGEST = 32


class CorruptPiece(ProtocolError):
    """A piece whose SHA-256 does not match the manifest: the donor that sent it is not to be asked again."""


class DonorMovedOn(ConnectionError):
    """The donor no longer holds the state the manifest describes (it adopted a newer epoch)."""


@dataclass(frozen=True)
class Manifest:
    """One state's layout: `piece_hashes[i]` is the SHA-256 of bytes [i * piece_bytes, (i + 1) * piece_bytes)."""

    epoch: int
    total_bytes: int
    sha256: str
    piece_bytes: int
    piece_hashes: Tuple[bytes, ...]

    @property
    def key(self) -> Tuple[str, int, Tuple[bytes, ...]]:
        """Equal for two donors that serve byte-identical states cut the same way."""
        return self.sha256, self.piece_bytes, self.piece_hashes

    def piece_range(self, first: int, count: int) -> Tuple[int, int]:
        """Byte offsets [start, end) of pieces first .. first + count - 1."""
        return first * self.piece_bytes, min(self.total_bytes, (first + count) * self.piece_bytes)


def piece_bytes_for(total: int, chunk_bytes: int) -> int:
    """The piece size a donor uses for a state of `total` bytes: about TARGET_PIECES pieces, at least 16 KiB,
    at most the server's frame size."""
    return max(MIN_PIECE_BYTES, min(chunk_bytes, max(SMALLEST_SERVED_PIECE, -(-total // TARGET_PIECES))))


def _manifest_fields(run_id: str, challenge: bytes, manifest: Manifest) -> bytes:
    hashes = hashlib.sha256(b"".join(manifest.piece_hashes)).hexdigest()
    return b"|".join((b"moshpeer-state-manifest", run_id.encode(), challenge, str(manifest.epoch).encode(),
                      str(manifest.total_bytes).encode(), manifest.sha256.encode(),
                      str(manifest.piece_bytes).encode(), hashes.encode()))


# ---- serving ------------------------------------------------------------------------------------


def _manifest_of(server: "StateServer", epoch: int, data: bytes) -> Manifest:
    """The manifest of `data`, computed once per state the server's source hands out, and pinned: the donor
    keeps serving pieces of it after it moved on (a download may outlast several epochs), for the last
    PINNED_SNAPSHOTS manifests asked within PIN_S seconds (bounded memory on the donor)."""
    with server.manifest_lock:
        pinned: Dict[str, list] = server.manifest_cache
        now = time.monotonic()
        for digest in [d for d, entry in pinned.items() if now - entry[2] > PIN_S]:
            del pinned[digest]
        for entry in pinned.values():
            if entry[0] is data:
                entry[2] = now
                return entry[1]
        piece = piece_bytes_for(len(data), server.chunk_bytes)
        view = memoryview(data)
        hashes = tuple(hashlib.sha256(view[i : i + piece]).digest() for i in range(0, len(data), piece))
        manifest = Manifest(int(epoch), len(data), hashlib.sha256(data).hexdigest(), piece, hashes)
        pinned[manifest.sha256] = [data, manifest, now]
        while len(pinned) > PINNED_SNAPSHOTS:
            del pinned[min(pinned, key=lambda d: pinned[d][2])]
        return manifest


def _pinned(server: "StateServer", digest: Any) -> Optional[Tuple[bytes, Manifest]]:
    """(bytes, manifest) of a pinned state, None if the donor no longer holds it."""
    with server.manifest_lock:
        entry = server.manifest_cache.get(digest) if isinstance(digest, str) else None
        if entry is None:
            return None
        entry[2] = time.monotonic()
        return entry[0], entry[1]


def serve_piece_request(server: "StateServer", sock: socket.socket, request: Dict[str, Any], challenge: bytes,
                        epoch: int, data: bytes) -> None:
    """Answer an admitted "get_manifest" or "get_pieces" request (see the module docstring).

    Raises ProtocolError on a malformed range, OSError when the client goes away (the server logs both)."""
    if request["op"] == "get_manifest":
        manifest = _manifest_of(server, epoch, data)
        header = {"ok": True, "epoch": manifest.epoch, "total_bytes": manifest.total_bytes,
                  "sha256": manifest.sha256, "piece_bytes": manifest.piece_bytes,
                  "public_key": server.identity.public_key.to_bytes(),
                  "signature": server.identity.private_key.sign(_manifest_fields(server.run_id, challenge, manifest))}
        send_frame(sock, msgpack.packb(header))
        send_frame(sock, b"".join(manifest.piece_hashes))
        server.count_served(manifest.epoch, manifest.sha256, manifest.total_bytes)
        return
    pinned = _pinned(server, request.get("sha256"))
    if pinned is None:
        send_frame(sock, msgpack.packb({"ok": False, "error": f"serving epoch {epoch} now"}))
        return
    data, manifest = pinned
    first, count = request.get("first"), request.get("count")
    if not (isinstance(first, int) and isinstance(count, int) and 0 <= first and 0 < count
            and first + count <= len(manifest.piece_hashes)):
        raise ProtocolError(f"bad piece range {first!r}+{count!r}")
    send_frame(sock, msgpack.packb({"ok": True}))
    start, end = manifest.piece_range(first, count)
    logger.info(f"serving state of epoch {manifest.epoch}: pieces {first}..{first + count - 1} ({end - start} bytes) "
                f"to {sock.getpeername()[0]}")
    server.send_range(sock, data, start, end, frame_bytes=manifest.piece_bytes)


# ---- fetching -----------------------------------------------------------------------------------


def fetch_manifest(offer: StateOffer, run_id: str, *, deadline: float, max_bytes: int,
                   identity: Optional[Identity] = None, tag: bytes = b"") -> Manifest:
    """A donor's signed manifest, by `deadline` (time.monotonic()).

    Raises ProtocolError when the donor cannot prove it is the offer's peer, announces more than `max_bytes`,
    or sends a malformed header or hash list; TimeoutError past the deadline; OSError / ConnectionError
    when the connection fails."""
    challenge = os.urandom(32)
    with socket.create_connection((offer.host, offer.port), timeout=min(remaining(deadline), 5.0)) as sock:
        request = signed_request("get_manifest", run_id, challenge, identity, tag)
        send_frame(sock, msgpack.packb(request))
        header = recv_msgpack(sock, deadline)
        epoch, total, digest, piece = parse_header(header, max_bytes, "piece_bytes")
        if piece < MIN_PIECE_BYTES:
            raise ProtocolError(f"pieces of {piece} bytes are below the minimum of {MIN_PIECE_BYTES}")
        count = -(-total // piece)
        raw = recv_exactly_by(sock, recv_frame_length(sock, count * _DIGEST, deadline), deadline)
        if len(raw) != count * _DIGEST:
            raise ProtocolError(f"manifest lists {len(raw) // _DIGEST} pieces, the state has {count}")
        manifest = Manifest(epoch, total, digest, piece, tuple(raw[i : i + _DIGEST] for i in range(0, len(raw), _DIGEST)))
        check_donor(header, offer.peer_id, _manifest_fields(run_id, challenge, manifest))
        return manifest


def fetch_pieces(offer: StateOffer, run_id: str, manifest: Manifest, first: int, count: int, *, deadline: float,
                 identity: Optional[Identity] = None, tag: bytes = b"",
                 on_bytes: Optional[Callable[[int], None]] = None) -> List[bytes]:
    """Pieces first .. first + count - 1 of `manifest`'s state from one donor, each checked against its hash.

    Raises CorruptPiece on a hash mismatch, DonorMovedOn when the donor no longer holds that state,
    ProtocolError on a malformed answer, TimeoutError past `deadline`, OSError / ConnectionError when the
    donor goes away. `on_bytes(n)` is called as each verified piece arrives."""
    challenge = os.urandom(32)
    pieces: List[bytes] = []
    with socket.create_connection((offer.host, offer.port), timeout=min(remaining(deadline), 5.0)) as sock:
        request = signed_request("get_pieces", run_id, challenge, identity, tag, sha256=manifest.sha256,
                                             first=first, count=count)
        send_frame(sock, msgpack.packb(request))
        answer = recv_msgpack(sock, deadline)
        if answer.get("ok") is not True:
            raise DonorMovedOn(f"donor no longer serves that state ({str(answer.get('error'))[:100]})")
        for index in range(first, first + count):
            start, end = manifest.piece_range(index, 1)
            length = recv_frame_length(sock, manifest.piece_bytes, deadline)
            if length != end - start:
                raise ProtocolError(f"piece {index} has {length} bytes, the manifest says {end - start}")
            piece = recv_exactly_by(sock, length, deadline)
            if hashlib.sha256(piece).digest() != manifest.piece_hashes[index]:
                raise CorruptPiece(f"piece {index} does not match the manifest")
            pieces.append(piece)
            if on_bytes is not None:
                on_bytes(length)
    return pieces
