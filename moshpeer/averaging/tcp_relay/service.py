"""A public peer's relay for peers behind NAT: `RelayService` holds their slots and splices circuits.

It runs on the data plane's port (`DataPlane.serve_protocol(MAGIC, service.handle)`), one thread per
connection, like the data plane. What it accepts is bounded: MAX_RESERVATIONS slots, MAX_CIRCUITS_PER_PEER
circuits to one peer and MAX_CIRCUITS in all; over a limit the request is refused with a reason. A slot
belongs to whoever proves the key of its peer id; a newer proof replaces an older slot (a peer that
reconnects after a network change). A circuit copies bytes it cannot read or forge (protocol.py), and ends
when either side closes or stays silent for IDLE_TIMEOUT.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field as dataclass_field
from typing import Callable, Dict, Optional

from moshpeer.averaging import wire
from moshpeer.averaging.tcp_relay import protocol
from moshpeer.averaging.dataplane import _close
from moshpeer.averaging.tcp_relay.protocol import field, recv_message, send_message
from moshpeer.dht.identity import load_public_key, peer_id_bytes_from_public_key
from moshpeer.errors import ProtocolError

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT = 10.0  # a client's opening and request; a dialled peer's accept
CONTROL_TIMEOUT = 45.0  # a slot whose holder sent nothing (its pings come every RelayReservation.PING_S) is dropped
IDLE_TIMEOUT = 300.0  # a circuit silent this long both ways is closed
MAX_RESERVATIONS = 64
MAX_CIRCUITS_PER_PEER = 32
MAX_CIRCUITS = 256
COPY_BYTES = 1 << 18


@dataclass
class _Slot:
    control: socket.socket
    send_lock: threading.Lock = dataclass_field(default_factory=threading.Lock)
    circuits: int = 0


@dataclass
class _Pending:
    target: bytes
    accepted: threading.Event = dataclass_field(default_factory=threading.Event)
    sock: Optional[socket.socket] = None


class RelayService:
    """Slots for peers behind NAT, and circuits to them (see the module docstring).

    :param admit: raises ProtocolError unless a public key may hold a slot (a private run); None: anyone
    """

    def __init__(self, admit: Optional[Callable[[bytes], None]] = None):
        self._admit = admit
        self._lock = threading.Lock()
        self._slots: Dict[bytes, _Slot] = {}
        self._pending: Dict[bytes, _Pending] = {}
        self._circuits = 0
        self.bytes_relayed = 0
        self.circuits_opened = 0
        self.refused = 0

    @property
    def reservations(self) -> int:
        with self._lock:
            return len(self._slots)

    def handle(self, conn: socket.socket, peer) -> None:
        """Serve one connection that opened with protocol.MAGIC (blocks until it is over; closes `conn`)."""
        try:
            deadline = time.monotonic() + REQUEST_TIMEOUT
            opening = wire.recv_exactly_by(conn, len(protocol.opening()), deadline)
            if opening != protocol.opening():
                raise ProtocolError(f"relay protocol version {opening[-1]} (we speak {protocol.VERSION})")
            challenge = protocol.new_id()
            send_message(conn, op="challenge", challenge=challenge)
            request = recv_message(conn, deadline)
            op = request.get("op")
            if op == "reserve":
                self._hold_slot(conn, request, challenge, peer)
            elif op == "connect":
                self._connect(conn, field(request, "peer", bytes, 64))
            elif op == "accept":
                self._accept(conn, field(request, "sid", bytes, protocol.SID_BYTES))
                return  # the circuit's sender thread owns the socket now
            else:
                raise ProtocolError(f"unknown relay request {op!r}")
        except (ProtocolError, OSError) as e:
            logger.debug(f"relay: connection from {peer} ended: {type(e).__name__}: {e}")
        _close(conn)

    # -- slots --

    def _hold_slot(self, conn: socket.socket, request: dict, challenge: bytes, peer) -> None:
        key_bytes, signature = field(request, "key", bytes, 1024), field(request, "sig", bytes, 1024)
        key = load_public_key(key_bytes)
        if not key.verify(protocol.reservation_statement(challenge), signature):
            raise ProtocolError("bad signature on a relay reservation")
        if self._admit is not None:
            self._admit(key_bytes)
        peer_id = peer_id_bytes_from_public_key(key)
        slot = _Slot(conn)
        with self._lock:
            full = len(self._slots) >= MAX_RESERVATIONS and peer_id not in self._slots
            replaced = None if full else self._slots.get(peer_id)
            if not full:
                self._slots[peer_id] = slot
        if full:
            self._refuse(conn, "this relay holds as many slots as it serves")
            return
        _close(replaced.control if replaced else None)
        send_message(conn, op="reserved", ok=True)
        logger.info(f"relay: holding a slot for {peer_id.hex()[-12:]} ({peer})")
        try:
            self._serve_control(conn, slot)
        finally:
            with self._lock:
                if self._slots.get(peer_id) is slot:
                    del self._slots[peer_id]
            logger.info(f"relay: slot of {peer_id.hex()[-12:]} closed")

    def _serve_control(self, conn: socket.socket, slot: _Slot) -> None:
        """Answer the holder's pings until it goes silent or closes (our dials go out from other threads)."""
        while True:
            message = recv_message(conn, time.monotonic() + CONTROL_TIMEOUT)
            if message.get("op") == "ping":
                with slot.send_lock:
                    send_message(conn, op="pong")

    # -- circuits --

    def _connect(self, conn: socket.socket, target: bytes) -> None:
        sid, pending = protocol.new_id(), _Pending(target)
        with self._lock:
            slot = self._slots.get(target)
            why = ("no slot for that peer" if slot is None else
                   "too many circuits to that peer" if slot.circuits >= MAX_CIRCUITS_PER_PEER else
                   "too many circuits" if self._circuits >= MAX_CIRCUITS else None)
            if why is None:
                slot.circuits += 1
                self._circuits += 1
                self._pending[sid] = pending
        if why is not None:
            self._refuse(conn, why)
            return
        spliced = False
        try:
            try:
                with slot.send_lock:
                    send_message(slot.control, op="dial", sid=sid)
            except OSError:
                self._refuse(conn, "the peer's slot just closed")
                return
            if not pending.accepted.wait(REQUEST_TIMEOUT):
                self._refuse(conn, "the peer did not accept in time")
                return
            send_message(conn, op="connected", ok=True)
            self.circuits_opened += 1
            spliced = True
            self._splice(conn, pending.sock)
        finally:
            with self._lock:  # after this, no accept can attach a socket to the circuit
                self._pending.pop(sid, None)
                slot.circuits -= 1
                self._circuits -= 1
            if not spliced:
                _close(pending.sock)  # an accept that came too late, or a sender that left

    def _accept(self, conn: socket.socket, sid: bytes) -> None:
        with self._lock:
            pending = self._pending.get(sid)
            if pending is not None and pending.sock is None:
                pending.sock = conn
        if pending is None or pending.sock is not conn:
            raise ProtocolError("accept for no pending circuit")
        pending.accepted.set()

    def _splice(self, sender: socket.socket, target: socket.socket) -> None:
        """Copy both ways until one side ends (its copy on a thread of its own); then close both."""
        try:
            for sock in (sender, target):
                sock.settimeout(IDLE_TIMEOUT)
                wire.tune_socket(sock)
            back = threading.Thread(target=self._copy, args=(target, sender), name="moshpeer-relay-copy",
                                    daemon=True)
            back.start()
            self._copy(sender, target)
            back.join(IDLE_TIMEOUT)
        finally:
            _close(target)  # the sender's socket is closed by `handle`

    def _copy(self, source: socket.socket, sink: socket.socket) -> None:
        buffer = bytearray(COPY_BYTES)
        view = memoryview(buffer)
        try:
            while True:
                n = source.recv_into(buffer)
                if n == 0:
                    break
                sink.sendall(view[:n])
                self.bytes_relayed += n  # one counter per direction would race; an approximate total is enough
        except OSError:
            pass
        finally:  # the data plane never half-closes: one side's end ends the circuit
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self.refused += 1
        try:
            send_message(conn, op="refused", ok=False, why=why)
        except OSError:
            pass

    def close(self) -> None:
        """Close every slot's control connection (their holders look for another relay)."""
        with self._lock:
            slots = list(self._slots.values())
        for slot in slots:
            _close(slot.control)

