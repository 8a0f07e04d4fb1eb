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

A connection that ended cleanly is kept for the sender's next all-reduce with this peer (kept_links.py): its
thread waits up to KEEP_INBOUND_S for a rebind (`handshake.accept_rebind`), which names the next round's session
the same way; at most MAX_KEPT_INBOUND are kept (past it the longest-waiting one is closed), and while kept they do
not count against MAX_PER_ADDRESS (peers behind one NAT would fill it).

Resources are bounded: at most MAX_HANDSHAKES connections handshake at once and at most
MAX_PER_ADDRESS are open from one address. A connection must send its first bytes within
FIRST_BYTES_TIMEOUT, and each handshake has one deadline for all its reads. At a cap, a new connection
takes the slot of the oldest handshake that has sent nothing yet (from its own address at the per-address
cap, else from the address holding the most such handshakes), which is closed; with no silent handshake to
evict (or MAX_EVICTING evicted ones still ending), the new one is closed (counted). So silent sockets hold no
slot against a member that speaks: an honest member behind the same NAT as an attacker, or a round's members
facing a flood from a few addresses, still get in. Rejections are logged at most a few per interval (`RateLimitedLog`).

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
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Tuple

from moshpeer.averaging import handshake, wire
from moshpeer.errors import ProtocolError
from moshpeer.ratelimited_log import RateLimitedLog

logger = logging.getLogger(__name__)

# How long a connecting member may take to say hello, and how long the server waits for the
# session it names to be registered (members finish matchmaking a few milliseconds apart).
HANDSHAKE_TIMEOUT = 10.0
# How long a new connection may stay silent: a member sends its hello as soon as it connects (one relay hop of a
# path 200 ms long takes well under a second); a silent socket only holds a slot.
FIRST_BYTES_TIMEOUT = 3.0
MAX_HANDSHAKES = 64
MAX_PER_ADDRESS = 32
# Evicted handshakes whose threads have not ended yet (each ends as soon as its socket is closed): past this many,
# a new connection over a cap is refused instead, so a flood never holds more than MAX_HANDSHAKES + this threads.
MAX_EVICTING = 16
# A kept connection's sender rebinds it at most kept_links.SENDER_KEEP_S after its last round: wait longer than that.
KEEP_INBOUND_S = 90.0
MAX_KEPT_INBOUND = 64


@dataclass(eq=False)
class _Handshaking:
    """A connection in its handshake (`DataPlane._pending`, oldest first)."""

    conn: socket.socket
    address: str
    spoke: bool = False  # its first bytes arrived: no longer evictable
    evicted: bool = False  # closed to make room; its slot was already given back
    counted: bool = True  # counts at its address (not while kept: MAX_KEPT_INBOUND bounds those)


class DataPlane:
    """Listens on (host, port); `register(tag, session)` makes a session reachable for its round.

    :param admit: raises ProtocolError unless a hello's public key may connect (a private run); None: anyone
    :param announce_host: asked for the host peers reach this listener at (`reachable_address`), when it listens on
        every interface and the machine's address may change (moshpeer/dht/local_address.py); None: `host`
    :param strict: refuse at once a connection for a group that is not open (`open_group`) while no
        matchmaking is in progress (`matchmaking()`); if False (standalone use), an unknown tag waits up to
        HANDSHAKE_TIMEOUT for its session to be registered
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, strict: bool = False,
                 admit: Optional[Callable[[bytes], None]] = None,
                 announce_host: Optional[Callable[[], str]] = None):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(256)
        self.address: Tuple[str, int] = (host, self._listener.getsockname()[1])
        self._announce_host = announce_host
        self._sessions: Dict[bytes, object] = {}
        self.strict = strict
        self._admit = admit  # a private run's check of a hello's public key (averaging/private.py)
        self._open_groups: Dict[bytes, int] = {}  # wire.tag_group(tag) -> how many holders
        self._matchmaking = 0
        self._cond = threading.Condition()
        self._lock = threading.Lock()
        self.rejected_connections = 0
        self._rejection_log = RateLimitedLog(logger)
        self._pending: Dict[_Handshaking, None] = {}  # connections in their handshake, oldest first
        self._evicting = 0  # evicted handshakes whose threads are still ending
        self._per_address: Dict[str, int] = {}  # open connections (handshaking or serving) per address
        self._kept: Dict[socket.socket, None] = {}  # kept connections waiting for a rebind, longest-waiting first
        self._closed = False
        self._protocols: Dict[bytes, Callable[[socket.socket, object], None]] = {}
        self._thread = threading.Thread(target=self._accept_loop, name="moshpeer-dataplane-accept", daemon=True)
        self._thread.start()

    def reachable_address(self) -> Tuple[str, int]:
        """Where peers reach this listener now: `address`, with the host `announce_host` gives when there is one."""
        return (self._announce_host() if self._announce_host else self.address[0]), self.address[1]

    @property
    def kept_connections(self) -> int:
        """Inbound connections kept now, waiting for their senders' next rebind (kept_links.py)."""
        with self._lock:
            return len(self._kept)

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
        (a libp2p stream relayed into a local socket pair). Over a cap it takes a silent handshake's slot, or
        is closed at once (module docstring)."""
        if self._closed:
            _close(conn)
            return
        address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        victim = None
        with self._lock:
            over = ("too many handshakes in progress" if len(self._pending) >= MAX_HANDSHAKES else
                    "too many connections from this address" if self._per_address.get(address, 0) >= MAX_PER_ADDRESS
                    else None)
            if over is not None:
                at_address_cap = self._per_address.get(address, 0) >= MAX_PER_ADDRESS
                if self._evicting < MAX_EVICTING:
                    victim = self._silent_victim(address if at_address_cap else None)
                if victim is not None:
                    self._release(victim)
                    victim.evicted = True
                    self._evicting += 1
            if over is None or victim is not None:
                entry = _Handshaking(conn, address)
                self._pending[entry] = None
                self._per_address[address] = self._per_address.get(address, 0) + 1
        if victim is not None:
            _close(victim.conn)
            self.count_rejected(f"silent while the handshake slots were full ({over}): evicted", victim.address)
        elif over is not None:
            _close(conn)
            self.count_rejected(over, peer)
            return
        threading.Thread(target=self._handle, args=(entry, peer), name="moshpeer-dataplane-conn",
                         daemon=True).start()

    def _silent_victim(self, address: Optional[str]) -> Optional[_Handshaking]:
        """With _lock held: the oldest handshake that has sent nothing, from `address`, or (None) from the address
        holding the most of them; None if there is none."""
        silent = [entry for entry in self._pending if not entry.spoke]
        if address is None and silent:
            counts: Dict[str, int] = {}
            for entry in silent:
                counts[entry.address] = counts.get(entry.address, 0) + 1
            address = max(counts, key=counts.get)
        return next((entry for entry in silent if entry.address == address), None)

    def _release(self, entry: _Handshaking) -> None:
        """With _lock held: `entry`'s connection no longer counts at its address, nor as a handshake."""
        self._pending.pop(entry, None)
        if not entry.counted:
            return
        entry.counted = False
        left = self._per_address.get(entry.address, 1) - 1
        if left > 0:
            self._per_address[entry.address] = left
        else:
            self._per_address.pop(entry.address, None)

    def _handle(self, entry: _Handshaking, peer) -> None:
        conn = entry.conn
        other_protocol = None
        try:
            started = time.monotonic()
            deadline = started + HANDSHAKE_TIMEOUT  # one deadline for the whole handshake
            try:
                wire.tune_socket(conn)
                first = wire.peek_exactly(conn, 4, min(deadline, started + FIRST_BYTES_TIMEOUT))
                with self._lock:
                    if entry.evicted:
                        return
                    entry.spoke = True
                other_protocol = self._protocols.get(first)
                if other_protocol is None:
                    # A list that `_serve` empties: no variable here holds the session while the connection is kept.
                    accepted = list(handshake.accept(
                        conn, deadline, lambda tag: self._wait_for_session(tag, deadline), admit=self._admit))
                    accepted[0].admit_inbound(accepted[1])  # raises ProtocolError on a second connection from it
            except (ProtocolError, ConnectionError, socket.timeout, OSError) as e:
                with self._lock:  # failed on its own, or evicted (closed and counted by the evicting thread)
                    evicted = entry.evicted
                    self._pending.pop(entry, None)  # no longer evictable
                if not evicted:
                    self.count_rejected(str(e) or type(e).__name__, peer)
                    _close(conn)
                return
            with self._lock:
                self._pending.pop(entry, None)  # handshake over: the slot is free, the address still counts
            if other_protocol is None:
                self._serve(entry, peer, accepted)
        finally:
            with self._lock:
                if entry.evicted:
                    self._evicting -= 1
                else:
                    self._release(entry)
        if other_protocol is not None:  # it bounds its own connections (the relay's slots and circuits)
            other_protocol(conn, peer)

    def _serve(self, entry: _Handshaking, peer, accepted: list) -> None:
        """Serve an authenticated connection (`accepted`: its session, sender index and MACs, taken out of the list)
        for its round, then for each round its sender rebinds it to while it is kept; closed here when a rebind
        fails or does not come in time, or by the session that held it last."""
        conn = entry.conn
        session, sender, auth = accepted
        accepted.clear()
        while True:
            auth = session.serve_inbound(sender, conn, auth)  # returns when its round is over
            session = None  # a kept connection must not hold its last round's buffers (or the caller's tensors)
            if auth is None:  # the session closes conn
                return
            if not self._keep(entry):
                _close(conn)
                return
            try:
                wire.peek_exactly(conn, len(handshake.REBIND_MAGIC), time.monotonic() + KEEP_INBOUND_S)
                deadline = time.monotonic() + HANDSHAKE_TIMEOUT
                session, sender, auth = handshake.accept_rebind(
                    conn, auth, deadline, lambda tag: self._wait_for_session(tag, deadline), admit=self._admit)
                session.admit_inbound(sender)  # raises ProtocolError on a second connection from the member
                with self._lock:  # serving again: it counts at its address (a kept one may push it past the cap)
                    self._per_address[entry.address] = self._per_address.get(entry.address, 0) + 1
                    entry.counted = True
            except ProtocolError as e:
                self.count_rejected(f"rebind of a kept connection: {e}", peer)
                _close(conn)
                return
            except OSError:  # its sender closed it, or no rebind came in time
                _close(conn)
                return
            finally:
                with self._lock:
                    self._kept.pop(conn, None)

    def _keep(self, entry: _Handshaking) -> bool:
        """Register `entry`'s connection as kept, no longer counted at its address (False once the plane closed);
        past MAX_KEPT_INBOUND, close the longest-waiting."""
        conn = entry.conn
        with self._lock:
            if self._closed:
                return False
            self._release(entry)
            self._kept[conn] = None
            oldest = next(iter(self._kept)) if len(self._kept) > MAX_KEPT_INBOUND else None
        if oldest is not None:
            _close(oldest)  # its thread's wait fails and ends it
        return True

    def _wait_for_session(self, tag: bytes, deadline: float):
        with self._cond:
            while tag not in self._sessions:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed or not self._may_still_come(tag):
                    return None
                self._cond.wait(remaining)
            return self._sessions[tag]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            kept = list(self._kept)
        for conn in kept:
            _close(conn)
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
