"""The clients of a relay: `RelayReservation` (a peer behind NAT holding a slot) and `open_circuit` (a sender).

See protocol.py for the messages. A peer behind NAT keeps one slot at a time, on a relay it finds with
`find_relays` (the run's relay directory in the DHT); when the slot is lost (the relay left, went silent, or
refused) it looks for another, backing off from RETRY_S to MAX_RETRY_S while none takes it.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from moshpeer.averaging import wire
from moshpeer.averaging.dataplane import _close
from moshpeer.averaging.tcp_relay import protocol
from moshpeer.averaging.tcp_relay.protocol import RelayRefused, field, recv_message, send_message
from moshpeer.dht.identity import Identity
from moshpeer.errors import ProtocolError

logger = logging.getLogger(__name__)

Address = Tuple[str, int]
CONNECT_TIMEOUT = 5.0
REQUEST_TIMEOUT = 10.0
PING_S = 15.0  # well inside the relay's CONTROL_TIMEOUT (service.py)
SILENT_S = 45.0  # a relay that answered nothing this long is gone
RETRY_S, MAX_RETRY_S = 2.0, 30.0
AVOID_S = 600.0  # a relay we left for failing us (`move_on`) is tried again only after this, or if no other is left


def _open(relay: Address, deadline: float) -> Tuple[socket.socket, bytes]:
    """A new connection to `relay` past its opening: (the socket, the relay's challenge)."""
    sock = socket.create_connection(relay, timeout=max(min(CONNECT_TIMEOUT, deadline - time.monotonic()), 0.01))
    try:
        sock.sendall(protocol.opening())
        return sock, field(recv_message(sock, deadline), "challenge", bytes, protocol.CHALLENGE_BYTES)
    except BaseException:
        _close(sock)
        raise


def open_circuit(relay: Address, target: bytes, deadline: float) -> socket.socket:
    """A connection to peer `target` (binary peer id) through `relay`, by `deadline` (time.monotonic()).

    Raises RelayRefused if the relay answered but will not (no slot for `target`, over its limits, `target`
    did not accept), and OSError / socket.timeout / ProtocolError if the relay cannot be reached or misbehaves.
    """
    sock, _ = _open(relay, deadline)
    try:
        send_message(sock, op="connect", peer=target)
        answer = recv_message(sock, deadline)
        if answer.get("ok") is not True:
            raise RelayRefused(f"relay {relay[0]}:{relay[1]} refused: {str(answer.get('why', '?'))[:200]}")
        return sock
    except BaseException:
        _close(sock)
        raise


class RelayReservation:
    """Holds a slot on one relay at a time, so that peers reach this one (behind NAT) through it.

    :param identity: proves to the relay that the slot is this peer's
    :param find_relays: candidate relays, asked whenever a slot is needed; it may raise (then: none now)
    :param deliver: (socket, label) for each circuit a sender opened to us (`DataPlane.accept_socket`)
    """

    def __init__(self, identity: Identity, find_relays: Callable[[], List[Address]],
                 deliver: Callable[[socket.socket, str], None]):
        self._identity, self._find_relays, self._deliver = identity, find_relays, deliver
        self._stop = threading.Event()
        self._changed = threading.Condition()  # notified whenever `relay` changes
        self._relay: Optional[Address] = None
        self._control: Optional[socket.socket] = None
        self._avoid: Dict[Address, float] = {}  # relays we moved away from -> until when (time.monotonic())
        self._left: Optional[socket.socket] = None  # the control connection `move_on` closed last
        self.circuits_accepted = 0
        self._thread = threading.Thread(target=self._run, name="moshpeer-relay-slot", daemon=True)

    @property
    def relay(self) -> Optional[Address]:
        """The relay holding our slot now; None while we hold none."""
        return self._relay

    def start(self) -> None:
        self._thread.start()

    def wait_for_slot(self, timeout: float, on: Optional[Address] = None) -> bool:
        """True once a relay (`on`, if given) holds a slot for us; False if none did within `timeout` seconds."""
        with self._changed:
            return self._changed.wait_for(lambda: self._relay is not None and on in (None, self._relay), timeout)

    def _set_relay(self, relay: Optional[Address], control: Optional[socket.socket]) -> None:
        with self._changed:
            self._relay, self._control = relay, control
            self._changed.notify_all()

    def move_on(self, why: str) -> None:
        """Give up the slot we hold (if any) and take one on another relay: this one holds the slot but fails to
        carry circuits (`RelayWatch` decides). It is avoided for AVOID_S unless no other relay is offered."""
        with self._changed:
            relay, control = self._relay, self._control
            if relay is None:
                return
            self._avoid[relay] = time.monotonic() + AVOID_S
            self._left = control
        logger.warning(f"leaving relay {relay[0]}:{relay[1]}: {why}")
        _close(control)  # ends `_serve` with an OSError; `_run` then looks for another relay at once

    def stop(self) -> None:
        self._stop.set()
        _close(self._control)
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _candidates(self) -> List[Address]:
        try:
            relays = list(self._find_relays())
        except Exception as e:  # the DHT timed out or is stopping: no candidates this time
            logger.debug(f"no relay list: {type(e).__name__}: {e}")
            return []
        random.shuffle(relays)  # spread the peers behind NAT over the relays
        now = time.monotonic()
        self._avoid = {relay: until for relay, until in self._avoid.items() if until > now}
        trusted = [relay for relay in relays if relay not in self._avoid]
        return trusted or relays  # a relay that failed us before is better than none

    def _run(self) -> None:
        delay = RETRY_S
        while not self._stop.is_set():
            for relay in self._candidates():
                if self._stop.is_set():
                    return
                try:
                    control = self._reserve(relay)
                except (OSError, ProtocolError) as e:
                    logger.debug(f"relay {relay[0]}:{relay[1]} gave no slot: {type(e).__name__}: {e}")
                    continue
                held_since = time.monotonic()
                self._hold(relay, control)
                # A slot held a while was lost by a change (the relay left, or we moved on): look again at once. One
                # lost at once is a relay that takes slots and drops them: back off as if none took it.
                delay = 0.0 if time.monotonic() - held_since > MAX_RETRY_S or relay in self._avoid else delay
                break
            self._stop.wait(delay)
            delay = min(max(2 * delay, RETRY_S), MAX_RETRY_S)

    def _reserve(self, relay: Address) -> socket.socket:
        deadline = time.monotonic() + REQUEST_TIMEOUT
        control, challenge = _open(relay, deadline)
        try:
            send_message(control, op="reserve", key=self._identity.public_key.to_bytes(),
                         sig=self._identity.private_key.sign(protocol.reservation_statement(challenge)))
            answer = recv_message(control, deadline)
            if answer.get("ok") is not True:
                raise RelayRefused(str(answer.get("why", "refused"))[:200])
            return control
        except BaseException:
            _close(control)
            raise

    def _hold(self, relay: Address, control: socket.socket) -> None:
        """Serve the slot's control connection until it is lost or we stop."""
        self._set_relay(relay, control)
        logger.info(f"relay {relay[0]}:{relay[1]} holds a slot for this peer (behind NAT)")
        why = "stopped"
        try:
            self._serve(relay, control)
        except (OSError, ProtocolError) as e:
            why = f"{type(e).__name__}: {e}"
        finally:
            self._set_relay(None, None)
            _close(control)
        if not self._stop.is_set() and control is not self._left:  # `move_on` already said why we left
            logger.warning(f"lost the slot on relay {relay[0]}:{relay[1]} ({why}); looking for another")

    def _serve(self, relay: Address, control: socket.socket) -> None:
        heard = pinged = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now - heard > SILENT_S:
                raise TimeoutError(f"the relay was silent for {SILENT_S:.0f} s")
            if now - pinged >= PING_S:
                send_message(control, op="ping")
                pinged = now
            if not wire.readable_within(control, max(pinged + PING_S - now, 0.0)):
                continue
            message = recv_message(control, time.monotonic() + REQUEST_TIMEOUT)
            heard = time.monotonic()
            if message.get("op") == "dial":
                sid = field(message, "sid", bytes, protocol.SID_BYTES)
                threading.Thread(target=self._accept, args=(relay, sid), name="moshpeer-relay-accept",
                                 daemon=True).start()

    def _accept(self, relay: Address, sid: bytes) -> None:
        try:
            sock, _ = _open(relay, time.monotonic() + REQUEST_TIMEOUT)
            send_message(sock, op="accept", sid=sid)
        except (OSError, ProtocolError) as e:
            logger.debug(f"could not accept a circuit from relay {relay[0]}:{relay[1]}: {e}")
            return
        sock.settimeout(None)
        self.circuits_accepted += 1
        self._deliver(sock, f"relay {relay[0]}:{relay[1]}")
