"""State download: a newcomer (or a peer that fell behind) fetches the training state from a donor.

Donors run a small TCP `StateServer` and advertise it in the DHT under `state_offers_key(run_id)`:
one signed entry per donor (subkey = its owner marker) holding its address and epoch. A peer that
needs state lists the offers, tries the most advanced donor first, and falls back to the next one
if a donor is unreachable, dies mid-transfer, sends more than it announced, or sends bytes whose
SHA-256 does not match its header ("lies").

Wire protocol (version 1), every message framed as a 4-byte big-endian length + body:
  client -> server  msgpack {"op": "get_state", "protocol": 1, "run_id": str}
  server -> client  msgpack {"ok": true, "epoch": int, "total_bytes": int, "sha256": hex, "chunk_bytes": int}
                    then raw chunks, each framed, each at most chunk_bytes, summing to total_bytes
The state itself is `torch.save` of a dict of tensors and plain values, read back with
`torch.load(weights_only=True)`, so a malicious donor cannot run code here; sizes are checked
against `max_bytes` before anything is allocated.

Why TCP and not a libp2p stream: the transfer is bulk, one-shot and pull-based; a plain socket is
simpler to bound in time and to throttle for tests. Peers behind NAT cannot donate (they do not
advertise), but they can still download.
"""

from __future__ import annotations

import hashlib
import io
import logging
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import msgpack
import torch
from hivemind.utils import get_dht_time

from moshpeer.dht import SwarmDHT
from moshpeer.dht.identity import peer_id_from_owner_key
from moshpeer.errors import ProtocolError

logger = logging.getLogger(__name__)

STATE_PROTOCOL = 1
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_STATE_BYTES = 8 << 30
MAX_HEADER_BYTES = 4096
_LEN = struct.Struct(">I")

StateSource = Callable[[], Tuple[int, bytes]]  # -> (epoch, serialized state)


def state_offers_key(run_id: str) -> str:
    """DHT key of the run's state offers: one signed entry per donor (subkey = owner marker)."""
    return f"{run_id}_state_offers"


def serialize_state(state: Dict[str, Any]) -> bytes:
    """Bytes of a state dict (tensors, numbers, strings, lists, dicts) for `deserialize_state`."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def deserialize_state(data: bytes) -> Dict[str, Any]:
    """Inverse of `serialize_state`; refuses anything but tensors and plain values (weights_only)."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ProtocolError(f"state does not decode: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict):
        raise ProtocolError(f"state must be a dict, got {type(state).__name__}")
    return state


# ---- framing ------------------------------------------------------------------------------------


def _send_frame(sock: socket.socket, body: bytes) -> None:
    if len(body) < 65536:  # small frames: one send, no extra packet
        sock.sendall(_LEN.pack(len(body)) + body)
    else:  # large chunks: no copy of the body
        sock.sendall(_LEN.pack(len(body)))
        sock.sendall(body)


def _recv_exact(sock: socket.socket, size: int, into: Optional[memoryview] = None) -> bytes:
    buffer = bytearray(size) if into is None else None
    view = memoryview(buffer) if into is None else into
    received = 0
    while received < size:
        n = sock.recv_into(view[received:], size - received)
        if n == 0:
            raise ConnectionError(f"connection closed after {received} of {size} bytes")
        received += n
    return bytes(buffer) if buffer is not None else b""


def _recv_frame_length(sock: socket.socket, limit: int) -> int:
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {limit}")
    return length


def _recv_msgpack(sock: socket.socket) -> Dict[str, Any]:
    body = _recv_exact(sock, _recv_frame_length(sock, MAX_HEADER_BYTES))
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:
        raise ProtocolError(f"bad message: {e}") from None
    if not isinstance(message, dict):
        raise ProtocolError("message is not a map")
    return message


# ---- serving ------------------------------------------------------------------------------------


class StateServer:
    """Serves this peer's state to downloaders over TCP and advertises it in the DHT.

    :param source: returns (epoch, serialized state); called once per request (cache inside it)
    :param bytes_per_second: throttle each transfer (tests use it to kill a donor mid-download)
    """

    def __init__(
        self,
        source: StateSource,
        *,
        run_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        bytes_per_second: Optional[float] = None,
        on_served: Optional[Callable[[Dict[str, Any]], None]] = None,
    ):
        self.source, self.run_id = source, run_id
        # A throttled transfer sends small chunks (about 20 per second), so the rate holds within a second.
        self.chunk_bytes = chunk_bytes if not bytes_per_second else min(chunk_bytes, max(4096, int(bytes_per_second / 20)))
        self.bytes_per_second = bytes_per_second
        self.on_served = on_served
        self.served = 0
        server_self = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server_self._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="moshpeer-state-server", daemon=True)
        self._thread.start()

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(30.0)
        try:
            request = _recv_msgpack(sock)
            if request.get("op") != "get_state" or request.get("protocol") != STATE_PROTOCOL:
                raise ProtocolError(f"unsupported request {request!r:.200}")
            if request.get("run_id") != self.run_id:
                raise ProtocolError("request for another run")
            epoch, data = self.source()
            digest = hashlib.sha256(data).hexdigest()
            logger.info(f"serving state of epoch {epoch} ({len(data)} bytes) to {sock.getpeername()[0]}")
            header = {"ok": True, "epoch": int(epoch), "total_bytes": len(data), "sha256": digest,
                      "chunk_bytes": self.chunk_bytes}
            _send_frame(sock, msgpack.packb(header))
            view = memoryview(data)
            started = time.monotonic()
            for offset in range(0, len(data), self.chunk_bytes):
                chunk = view[offset : offset + self.chunk_bytes]
                if self.bytes_per_second:
                    # Throttle: never run ahead of the configured rate.
                    ahead = offset / self.bytes_per_second - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
                _send_frame(sock, bytes(chunk))
            self.served += 1
            if self.on_served is not None:
                self.on_served({"epoch": int(epoch), "sha256": digest, "bytes": len(data)})
        except (OSError, ProtocolError, ConnectionError) as e:
            logger.info(f"state request not served: {e}")
        except Exception:
            logger.exception("state server failed on a request")

    def advertise(self, dht: SwarmDHT, epoch: int, *, expiration: float = 15.0) -> bool:
        """Publish (or refresh) this donor's offer in the DHT; re-call at least every `expiration`/2."""
        offer = {"peer_id": dht.identity.peer_id, "host": self.host, "port": int(self.port), "epoch": int(epoch),
                 "protocol": STATE_PROTOCOL}
        try:
            return bool(dht.store(state_offers_key(self.run_id), offer, expiration_time=get_dht_time() + expiration,
                                  subkey=dht.owner_subkey, return_future=True).result(timeout=2.0))
        except Exception as e:
            logger.debug(f"could not advertise state: {e}")
            return False

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# ---- downloading --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateOffer:
    peer_id: str
    host: str
    port: int
    epoch: int


@dataclass
class DownloadedState:
    """A verified state from `donor` at `epoch`."""

    epoch: int
    state: Dict[str, Any]
    donor: str
    sha256: str
    nbytes: int
    seconds: float
    failed_donors: List[Tuple[str, str]]  # (peer id, why) of donors tried before this one


class StateDownloadFailed(Exception):
    """No donor delivered a verified state in time."""


def list_state_offers(dht: SwarmDHT, run_id: str, *, timeout: float = 5.0) -> List[StateOffer]:
    """Valid offers of the run, most advanced first. Malformed or misattributed entries are dropped."""
    found = dht.get(state_offers_key(run_id), latest=True, return_future=True).result(timeout=timeout)
    if found is None or not isinstance(found.value, dict):
        return []
    offers = []
    for subkey, entry in found.value.items():
        value = entry.value
        try:
            if not isinstance(value, dict) or value.get("protocol") != STATE_PROTOCOL:
                raise ValueError("bad shape or protocol")
            peer_id, host, port, epoch = value["peer_id"], value["host"], value["port"], value["epoch"]
            if not (isinstance(host, str) and len(host) < 256 and isinstance(port, int) and 0 < port < 65536
                    and isinstance(epoch, int) and epoch >= 0 and isinstance(peer_id, str)):
                raise ValueError("bad field types")
            owner = subkey if isinstance(subkey, bytes) else str(subkey).encode()
            if peer_id_from_owner_key(owner) != peer_id:
                raise ValueError("offer names another peer")
        except Exception as e:  # untrusted input: drop it, never crash
            logger.debug(f"ignoring a state offer: {e}")
            continue
        offers.append(StateOffer(peer_id, host, port, epoch))
    offers.sort(key=lambda offer: (-offer.epoch, offer.peer_id))
    return offers


def fetch_state_from(
    offer: StateOffer,
    run_id: str,
    *,
    timeout: float,
    max_bytes: int = DEFAULT_MAX_STATE_BYTES,
    progress: Optional[Callable[[int, int], None]] = None,
) -> Tuple[int, bytes, str]:
    """Download and verify one donor's state; returns (epoch, bytes, sha256). Raises on any failure."""
    deadline = time.monotonic() + timeout
    with socket.create_connection((offer.host, offer.port), timeout=min(timeout, 5.0)) as sock:
        sock.settimeout(max(0.5, min(5.0, deadline - time.monotonic())))
        _send_frame(sock, msgpack.packb({"op": "get_state", "protocol": STATE_PROTOCOL, "run_id": run_id}))
        header = _recv_msgpack(sock)
        total, digest, epoch = header.get("total_bytes"), header.get("sha256"), header.get("epoch")
        chunk_limit = header.get("chunk_bytes")
        if not (header.get("ok") is True and isinstance(total, int) and 0 < total <= max_bytes
                and isinstance(digest, str) and len(digest) == 64 and isinstance(epoch, int) and epoch >= 0
                and isinstance(chunk_limit, int) and 0 < chunk_limit <= 64 << 20):
            raise ProtocolError(f"bad state header {header!r:.200}")
        buffer = bytearray(total)
        view = memoryview(buffer)
        received = 0
        while received < total:
            if time.monotonic() > deadline:
                raise TimeoutError(f"download took longer than {timeout:g} s ({received}/{total} bytes)")
            sock.settimeout(max(0.5, min(5.0, deadline - time.monotonic())))
            length = _recv_frame_length(sock, chunk_limit)
            if received + length > total:
                raise ProtocolError("donor sent more bytes than it announced")
            _recv_exact(sock, length, into=view[received : received + length])
            received += length
            if progress is not None:
                progress(received, total)
        if hashlib.sha256(buffer).hexdigest() != digest:
            raise ProtocolError("state checksum mismatch")
        return epoch, bytes(buffer), digest


def download_state(
    dht: SwarmDHT,
    run_id: str,
    *,
    exclude: Tuple[str, ...] = (),
    min_epoch: int = 0,
    timeout: float = 60.0,
    per_donor_timeout: float = 30.0,
    max_bytes: int = DEFAULT_MAX_STATE_BYTES,
    show_progress: bool = True,
    validate: Optional[Callable[[Dict[str, Any]], None]] = None,
) -> DownloadedState:
    """Download a verified state from the most advanced donor, trying the next one on failure.

    :param exclude: peer ids not to ask (this peer)
    :param min_epoch: ignore donors behind this epoch
    :param validate: raises if a decoded state does not fit this peer's model (then the next donor)
    :raises StateDownloadFailed: no donor delivered before `timeout`
    """
    deadline = time.monotonic() + timeout
    failed: List[Tuple[str, str]] = []
    tried: set = set()
    started = time.monotonic()
    while time.monotonic() < deadline:
        try:
            offers = [o for o in list_state_offers(dht, run_id, timeout=min(5.0, max(0.5, deadline - time.monotonic())))
                      if o.peer_id not in exclude and o.peer_id not in tried and o.epoch >= min_epoch]
        except Exception as e:
            logger.debug(f"listing state offers failed: {e}")
            offers = []
        if not offers:
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            continue
        offer = offers[0]
        tried.add(offer.peer_id)
        try:
            with _progress_bar(show_progress, offer) as update:
                epoch, data, digest = fetch_state_from(
                    offer, run_id, timeout=min(per_donor_timeout, max(0.5, deadline - time.monotonic())),
                    max_bytes=max_bytes, progress=update)
            state = deserialize_state(data)
            if validate is not None:
                validate(state)
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            logger.warning(f"state download from {offer.peer_id[-8:]} failed ({reason}); trying another donor")
            failed.append((offer.peer_id, reason))
            continue
        return DownloadedState(epoch=epoch, state=state, donor=offer.peer_id, sha256=digest, nbytes=len(data),
                               seconds=time.monotonic() - started, failed_donors=failed)
    raise StateDownloadFailed(f"no donor delivered the state within {timeout:g} s (failed: {failed})")


class _progress_bar:
    """A rich progress bar on stderr while a download runs (a no-op when disabled)."""

    def __init__(self, enabled: bool, offer: StateOffer):
        self.enabled, self.offer = enabled, offer
        self._progress = None
        self._task = None

    def __enter__(self) -> Callable[[int, int], None]:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            self._progress = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), console=Console(stderr=True), transient=True)
            self._progress.start()
            self._task = self._progress.add_task(f"state from {self.offer.peer_id[-8:]} (epoch {self.offer.epoch})",
                                                 total=None)
        return self._update

    def _update(self, received: int, total: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=received, total=total)

    def __exit__(self, *exc_info) -> None:
        if self._progress is not None:
            self._progress.stop()
