"""The data-plane server: one listening TCP socket per averager, shared by all of its rounds.

Every incoming connection runs the mutual handshake of `handshake.py`: the connecting member proves
that it is the libp2p peer matchmaking named for its index, this server proves the same of itself,
and both derive the connection key that MACs every frame. The server hands an authenticated
connection to the all-reduce session it names (by tag); anything else (wrong magic or version,
unknown tag, a wrong identity, bad MAC, impossible indices, silence past the handshake deadline,
a second connection from the same member) is closed and counted in `rejected_connections`.
Connections relayed over libp2p streams (see `relay.py`) arrive as local socket pairs through
`accept_socket` and go through exactly the same handshake, as do circuits through a relay (tcp_relay/).
Another protocol can share the port (`serve_protocol`: a relay's): a connection that opens with its
4-byte magic is handed to its handler instead of the handshake.

Resources are bounded: at most MAX_HANDSHAKES connections handshake at once and at most
MAX_PER_ADDRESS are open from one address; more are closed at once (counted). Each handshake has one
deadline for all its reads. Rejections are logged at most a few per interval (`RateLimitedLog`).

In strict mode (the averager's) a connection for a group this peer is not in is refused at once,
unless the peer is still matchmaking (it may be about to learn the group): a member that matchmaking
left out of a group its mates assembled (hivemind's matchmaking can disagree at a deadline) thus
makes its mates fail fast, not wait for the handshake timeout.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, Optional, Tuple

from moshpeer.averaging import handshake, wire
from moshpeer.errors import ProtocolError
from moshpeer.ratelimited_log import RateLimitedLog

logger = logging.getLogger(__name__)

# How long a connecting member may take to say hello, and how long the server waits for the
# session it names to be registered (members finish matchmaking a few milliseconds apart).
HANDSHAKE_TIMEOUT = 10.0
MAX_HANDSHAKES = 64
MAX_PER_ADDRESS = 32


class DataPlane:
    """Listens on (host, port); `register(tag, session)` makes a session reachable for its round.

    :param admit: raises ProtocolError unless a hello's public key may connect (a private run); None: anyone
    :param strict: refuse at once a connection for a group that is not open (`open_group`) while no
        matchmaking is in progress (`matchmaking()`); if False (standalone use), an unknown tag waits up to
        HANDSHAKE_TIMEOUT for its session to be registered
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, strict: bool = False,
                 admit: Optional[Callable[[bytes], None]] = None):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(256)
        self.address: Tuple[str, int] = (host, self._listener.getsockname()[1])
        self._sessions: Dict[bytes, object] = {}
        self.strict = strict
        self._admit = admit  # a private run's check of a hello's public key (averaging/private.py)
        self._open_groups: Dict[bytes, int] = {}  # wire.tag_group(tag) -> how many holders
        self._matchmaking = 0
        self._cond = threading.Condition()
        self._lock = threading.Lock()
        self.rejected_connections = 0
        self._rejection_log = RateLimitedLog(logger)
        self._handshaking = 0
        self._per_address: Dict[str, int] = {}
        self._closed = False
        self._protocols: Dict[bytes, Callable[[socket.socket, object], None]] = {}
        self._thread = threading.Thread(target=self._accept_loop, name="moshpeer-dataplane-accept", daemon=True)
        self._thread.start()

    # -- sessions --

    def register(self, tag: bytes, session) -> None:
        with self._cond:
            self._sessions[tag] = session
            self._cond.notify_all()

    def unregister(self, tag: bytes) -> None:
        with self._cond:
            self._sessions.pop(tag, None)

    def open_group(self, group_prefix: bytes) -> None:
        """This peer is in the group whose tags start with `group_prefix` (`wire.group_tag_prefix`)."""
        with self._cond:
            self._open_groups[group_prefix] = self._open_groups.get(group_prefix, 0) + 1
            self._cond.notify_all()

    def close_group(self, group_prefix: bytes) -> None:
        with self._cond:
            left = self._open_groups.get(group_prefix, 0) - 1
            if left > 0:
                self._open_groups[group_prefix] = left
            else:
                self._open_groups.pop(group_prefix, None)
            self._cond.notify_all()

    @contextmanager
    def matchmaking(self) -> Iterator[None]:
        """While open, connections for unknown groups wait (bounded): this peer may be about to join them."""
        with self._cond:
            self._matchmaking += 1
        try:
            yield
        finally:
            with self._cond:
                self._matchmaking -= 1
                self._cond.notify_all()

    def _may_still_come(self, tag: bytes) -> bool:
        """With _cond held: may a session for `tag` still be registered here?"""
        return not self.strict or self._matchmaking > 0 or wire.tag_group(tag) in self._open_groups

    def count_rejected(self, why: str, peer=None) -> None:
        with self._lock:
            self.rejected_connections += 1
        self._rejection_log.warning(f"data plane: rejected connection from {peer}: {why}")

    def serve_protocol(self, magic: bytes, handler: Callable[[socket.socket, object], None]) -> None:
        """Hand connections that open with the 4-byte `magic` to `handler(conn, peer)` (on the connection's own
        thread; it owns and closes `conn`), instead of the handshake."""
        assert len(magic) == 4 and magic != handshake.HELLO_MAGIC
        self._protocols[magic] = handler

    # -- serving --

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)
                continue
            self.accept_socket(conn, peer)

    def accept_socket(self, conn: socket.socket, peer) -> None:
        """Serve a connection on its own thread: one from the listener, or one that arrived another way
        (a libp2p stream relayed into a local socket pair). Over the caps it is closed at once."""
        if self._closed:
            _close(conn)
            return
        address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        with self._lock:
            over = ("too many handshakes in progress" if self._handshaking >= MAX_HANDSHAKES else
                    "too many connections from this address" if self._per_address.get(address, 0) >= MAX_PER_ADDRESS
                    else None)
            if over is None:
                self._handshaking += 1
                self._per_address[address] = self._per_address.get(address, 0) + 1
        if over is not None:
            _close(conn)
            self.count_rejected(over, peer)
            return
        threading.Thread(target=self._handle, args=(conn, peer, address), name="moshpeer-dataplane-conn",
                         daemon=True).start()

    def _handle(self, conn: socket.socket, peer, address: str) -> None:
        handshaking = True
        other_protocol = None
        try:
            wire.tune_socket(conn)
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT  # one deadline for the whole handshake
            try:
                if self._protocols:
                    other_protocol = self._protocols.get(wire.peek_exactly(conn, 4, deadline))
                if other_protocol is None:
                    session, sender, auth = handshake.accept(
                        conn, deadline, lambda tag: self._wait_for_session(tag, deadline), admit=self._admit)
                    session.admit_inbound(sender)  # raises ProtocolError on a second connection from the member
            except (ProtocolError, ConnectionError, socket.timeout, OSError) as e:
                self.count_rejected(str(e) or type(e).__name__, peer)
                _close(conn)
                return
            with self._lock:
                self._handshaking -= 1
                handshaking = False
            if other_protocol is None:
                session.serve_inbound(sender, conn, auth)  # returns when the round is over; the session closes conn
        finally:
            with self._lock:
                self._handshaking -= handshaking
                left = self._per_address.get(address, 1) - 1
                if left > 0:
                    self._per_address[address] = left
                else:
                    self._per_address.pop(address, None)
        if other_protocol is not None:  # it bounds its own connections (the relay's slots and circuits)
            other_protocol(conn, peer)

    def _wait_for_session(self, tag: bytes, deadline: float):
        with self._cond:
            while tag not in self._sessions:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed or not self._may_still_come(tag):
                    return None
                self._cond.wait(remaining)
            return self._sessions[tag]

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=2.0)


def _close(sock: Optional[socket.socket]) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
