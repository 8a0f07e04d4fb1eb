"""Opening this peer's authenticated connection to one group member: `MemberConnector`.

Direct TCP to the member's announced address, retried CONNECT_RETRIES times; when the member announced no
address or the direct connection cannot be opened: a circuit through the relay that holds the member's slot
(a member behind NAT announces it, see tcp_relay/), then a libp2p stream to its peer id (bridged into a local
socket pair, see relay.py; the only path when the peer sends over libp2p only, `force_relay`). On whichever
opens, the sender's side of the handshake (handshake.py) proves both ends' identities and keys the frames'
MACs, end to end through any relay. The result says which path was taken. Which paths to try is a pure
decision (`connection_paths`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Tuple

from moshpeer.averaging import frame_pump, handshake, wire
from moshpeer.averaging.dataplane import _close
from moshpeer.averaging.handshake import FrameAuth, PeerNotAuthentic, PeerRefused, RoundCredentials
from moshpeer.averaging.tcp_relay.reservation import open_circuit
from moshpeer.errors import ProtocolError

if TYPE_CHECKING:
    from moshpeer.averaging.kept_links import KeptLinks

logger = logging.getLogger(__name__)

CONNECT_RETRIES = 3
RELAY_ATTEMPTS = 2  # libp2p streams tried per member when the first one closes after our hello
CONNECT_TIMEOUT = 2.0  # per direct connection attempt; an unreachable (NAT'ed) address then falls back to libp2p
# While a kept connection is rebound: how long its REBIND may stay unacknowledged by the other end's TCP before the
# kernel gives the connection up (TCP_USER_TIMEOUT). A middlebox that dropped an idle connection's state answers
# nothing, and the ACK would otherwise be awaited until the round's deadline; a live peer's TCP acknowledges within a
# round trip, however long its round takes to start.
REBIND_UNACKED_S = 3.0
DIRECT, RELAY, LIBP2P = "direct", "relay", "libp2p"


@dataclass(frozen=True)
class GroupMember:
    """A member as the data plane sees it: where to connect, its averaging weight and libp2p peer id.

    port 0 (or an empty host) = no direct address: reach this member through its relay or over libp2p.
    """

    host: str
    port: int
    weight: float
    peer_id: bytes = b""
    relay: Optional[Tuple[str, int]] = None  # the relay holding this member's slot (it is behind NAT)

    @property
    def has_direct_address(self) -> bool:
        return bool(self.host) and self.port > 0


# (peer id, absolute time.monotonic() deadline) -> a connected socket carrying a libp2p stream to that peer
RelayConnect = Callable[[bytes, float], socket.socket]


@dataclass
class OutboundLink:
    """Our authenticated connection to one member: the socket, the MACs of our frames on it, the path it took
    (DIRECT, RELAY or LIBP2P), and whether it was kept from an earlier all-reduce."""

    sock: socket.socket
    auth: FrameAuth
    path: str = DIRECT
    rebound: bool = False  # a connection kept from an earlier all-reduce (kept_links.py), not a new one
    # The last frame sent was an END_GATHER marker: nothing of the all-reduce follows, the connection may be kept.
    # Read off the wire, not from the streams: a wrapper (faults.py) may withhold a marker.
    ended: bool = False

    @property
    def relayed(self) -> bool:
        return self.path != DIRECT

    def send(self, header: bytes, payload=b"") -> None:
        """One frame; raises OSError / ConnectionError if the connection broke."""
        self.ended = False
        handshake.send_frame(self.sock, self.auth, header, payload)
        self.ended = wire.header_phase(header) == wire.PHASE_END_GATHER

    def send_run(self, headers: Sequence[bytes], data, spans: Sequence[Tuple[int, int]]) -> None:
        """Frames (headers[k], data[offset_k: offset_k + nbytes_k]) in one go (frame_pump.py); raises as `send`."""
        self.ended = False
        frame_pump.send_run(self.sock, self.auth, headers, data, spans)


def connection_paths(member: GroupMember, *, has_relay: bool, force_relay: bool) -> Tuple[str, ...]:
    """The paths to try, in order: direct first when the member has an address and we may use it, then its
    relay when it announced one, then libp2p when we have it (`has_relay`). () = it cannot be reached at all."""
    paths = []
    if member.has_direct_address and not force_relay:
        paths.append(DIRECT)
    if member.relay is not None and not force_relay:
        paths.append(RELAY)
    if has_relay:
        paths.append(LIBP2P)
    return tuple(paths)


class MemberConnector:
    """Opens this peer's connections to the members of one all-reduce, each bounded by `deadline`.

    :param tag, secret, credentials: the all-reduce's tag, group secret and this member's signed round key
    :param relay: opens a libp2p stream to a member (see `RelayConnect`); None = direct TCP only
    :param force_relay: send to every member over `relay`, never directly (ValueError without a relay)
    :param closing: True once the all-reduce is tearing down: stop retrying
    :param on_unauthentic: (why, who) when a member answered but could not prove its identity (`reach`)
    :param kept: direct connections kept from earlier all-reduces, and where this one's are kept (kept_links.py);
        None: every connection is new and closed at the end
    """

    def __init__(self, members: Sequence[GroupMember], *, tag: bytes, secret: bytes, credentials: RoundCredentials,
                 deadline: float, relay: Optional[RelayConnect] = None, force_relay: bool = False,
                 closing: Callable[[], bool] = lambda: False,
                 on_unauthentic: Callable[[str, str], None] = lambda why, who: None,
                 kept: Optional["KeptLinks"] = None):
        if force_relay and relay is None:
            raise ValueError("force_relay needs a relay")
        self.members, self.tag, self.secret, self.credentials = list(members), tag, secret, credentials
        self.deadline, self.relay, self.force_relay, self.closing = deadline, relay, force_relay, closing
        self.on_unauthentic, self.kept = on_unauthentic, kept

    def keep(self, j: int, link: OutboundLink) -> None:
        """`link` to member j ended cleanly: keep it for our next all-reduce with j if it is direct and connections
        are kept, else close it."""
        member = self.members[j]
        if self.kept is None or link.path != DIRECT:
            _close(link.sock)
            return
        self.kept.put(member.peer_id, (member.host, member.port), link)

    def reach(self, j: int) -> Optional[OutboundLink]:
        """`connect(j)`, with its failures logged instead of raised: None = member j is not in this round for
        us (unreachable, refused our hello, could not prove its identity, or its handshake failed)."""
        try:
            return self.connect(j)
        except (PeerRefused, PeerNotAuthentic, socket.timeout) as e:
            if isinstance(e, PeerNotAuthentic):
                self.on_unauthentic(str(e), f"member {j}")
            logger.warning(f"group member {j} is not in this round: {e}")
        except (OSError, ProtocolError) as e:
            logger.warning(f"handshake with group member {j} failed: {type(e).__name__}: {e}")
        return None

    def connect(self, j: int) -> Optional[OutboundLink]:
        """An authenticated connection to member j: direct TCP if possible, else a circuit through its relay,
        else a libp2p stream; None if none opens. Raises PeerRefused / PeerNotAuthentic when j answers but is
        not in this round, and socket.timeout / OSError / ProtocolError when its handshake fails."""
        member = self.members[j]
        paths = connection_paths(member, has_relay=self.relay is not None, force_relay=self.force_relay)
        if DIRECT in paths:
            link = self._rebind_kept(j)
            if link is not None:
                return link
            link, error, stopped = self._connect_direct(j)
            if link is not None or stopped or len(paths) == 1:
                return link
            logger.info(f"no direct connection to member {j} at {member.host}:{member.port} ({error}); "
                        f"trying {paths[1]}")
        if RELAY in paths:
            try:
                return self._handshake(open_circuit(member.relay, member.peer_id, self.deadline), j, RELAY)
            except (OSError, ProtocolError) as e:  # PeerRefused is a ConnectionError: the member is not in it
                if isinstance(e, (PeerRefused, PeerNotAuthentic)) or LIBP2P not in paths:
                    raise
                logger.info(f"no circuit to member {j} through relay {member.relay[0]}:{member.relay[1]} "
                            f"({type(e).__name__}: {e}); sending over libp2p")
        if LIBP2P not in paths:
            logger.warning(f"member {j} has no direct address or relay, and this peer has no libp2p stream")
            return None
        for attempt in range(RELAY_ATTEMPTS):
            try:
                sock = self.relay(member.peer_id, self.deadline)
            except Exception as e:  # the libp2p stream did not open (peer gone, unreachable, timeout)
                logger.warning(f"could not open a libp2p stream to member {j}: {type(e).__name__}: {e}")
                return None
            try:
                return self._handshake(sock, j, LIBP2P)
            except PeerRefused:
                # A stream that dies before its first byte arrives looks like a refusal; between two peers behind
                # NATs relayed connections are reset within a fraction of a second (cause not found yet:
                # docs/benchmarks.md, session 19), so a fresh stream is worth one more try.
                if attempt + 1 == RELAY_ATTEMPTS or time.monotonic() >= self.deadline or self.closing():
                    raise
                logger.info(f"libp2p stream to member {j} closed after our hello; opening another")

    def _rebind_kept(self, j: int) -> Optional[OutboundLink]:
        """The connection kept for member j's peer at its address, rebound to this all-reduce; None if none is kept
        or the rebind fails (it is closed: a fresh connection is opened instead)."""
        member = self.members[j]
        kept = self.kept.take(member.peer_id, (member.host, member.port)) if self.kept is not None else None
        if kept is None:
            return None
        try:
            with unacked_limit(kept.sock, REBIND_UNACKED_S):
                auth = handshake.rebind(kept.sock, kept.auth, self.deadline, tag=self.tag,
                                        sender=self.credentials.index, receiver=j,
                                        sender_peer=self.credentials.peer_id, group_secret=self.secret)
            wire.block_until(kept.sock, self.deadline)
            return OutboundLink(kept.sock, auth, DIRECT, rebound=True)
        except (OSError, ProtocolError) as e:  # incl. PeerRefused: it timed the connection out, or is not in this round
            _close(kept.sock)
            log = logger.warning if isinstance(e, ProtocolError) else logger.debug
            log(f"kept connection to member {j} not rebound ({type(e).__name__}: {e}); opening a new one")
            return None

    def _connect_direct(self, j: int) -> Tuple[Optional[OutboundLink], Optional[BaseException], bool]:
        """-> (the link or None, the last connection error, stopped: the deadline passed or the all-reduce is
        closing, so no other path is worth trying)."""
        member = self.members[j]
        last_error: Optional[BaseException] = None
        for attempt in range(CONNECT_RETRIES):
            remaining = self.deadline - time.monotonic()
            if remaining <= 0 or self.closing():
                return None, last_error, True
            try:
                sock = socket.create_connection((member.host, member.port), timeout=min(remaining, CONNECT_TIMEOUT))
            except OSError as e:
                last_error = e
                logger.debug(f"connect to member {j} failed ({e}); attempt {attempt + 1}")
                time.sleep(min(0.05 * (attempt + 1), max(self.deadline - time.monotonic(), 0)))
                continue
            return self._handshake(sock, j, DIRECT), None, False
        return None, last_error, False

    def _handshake(self, sock: socket.socket, j: int, path: str) -> OutboundLink:
        """Run the sender's side of the authenticated handshake (handshake.py) on a fresh connection to member j;
        the socket is closed if it fails."""
        try:
            wire.tune_socket(sock)
            # The receiver may wait a little for its session to be registered: allow up to the deadline.
            auth = handshake.connect(sock, self.deadline, credentials=self.credentials, tag=self.tag, receiver=j,
                                     receiver_peer=self.members[j].peer_id, group_secret=self.secret)
            wire.block_until(sock, self.deadline)
            return OutboundLink(sock, auth, path)
        except BaseException:
            _close(sock)
            raise


@contextlib.contextmanager
def unacked_limit(sock: socket.socket, seconds: float) -> Iterator[None]:
    """Within it, the kernel ends `sock` (the next call fails with ETIMEDOUT) once data sent on it stays
    unacknowledged for `seconds` (TCP_USER_TIMEOUT; not on local socket pairs, nor where the system has no such
    option); the kernel's default (many minutes) after it."""
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if option is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        yield
        return
    sock.setsockopt(socket.IPPROTO_TCP, option, int(seconds * 1000))
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # the connection is gone: nothing to restore
            sock.setsockopt(socket.IPPROTO_TCP, option, 0)


def peer_closed(sock: socket.socket) -> bool:
    """True if the other end closed or reset `sock` (checked without blocking or consuming data; no select(),
    which fails on descriptors >= 1024)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True
