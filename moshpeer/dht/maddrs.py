"""Checking multiaddrs from the command line before anything is started.

A malformed address, an initial peer without its peer id, or a listen port that another process
holds would otherwise surface as a p2pd error deep inside hivemind's DHT process. We check them
up front and raise `UserError` with the offending address in the message.
"""

from __future__ import annotations

import errno
import socket
from typing import TYPE_CHECKING, Iterable, List, Sequence

from moshpeer.errors import UserError

if TYPE_CHECKING:
    from hivemind.utils.multiaddr import Multiaddr

# Imported by the CLI's argument parser: this module imports hivemind only where a multiaddr is parsed, so
# that a bad flag is reported before hivemind and torch are loaded.
DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
_TRANSPORTS = ("tcp", "udp")


def parse_maddr(text: str, what: str = "multiaddr") -> Multiaddr:
    """Parse one multiaddr, raising `UserError` that names `what` (e.g. "initial peer") if it is malformed."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        return Multiaddr(text)
    except Exception as e:  # the multiaddr parser raises several ValueError subclasses and TypeError
        raise UserError(f"malformed {what} {text!r}: {e}") from None


def _protocol_names(maddr: Multiaddr) -> List[str]:
    return [protocol.name for protocol in maddr.protocols()]


def parse_initial_peers(texts: Iterable[str]) -> List[str]:
    """Validate initial peers: each must be a well-formed multiaddr that ends in /p2p/<peer id>."""
    peers = []
    for text in texts:
        maddr = parse_maddr(text, "initial peer multiaddr")
        names = _protocol_names(maddr)
        if "p2p" not in names:
            raise UserError(f"initial peer {text!r} has no /p2p/<peer id> part (copy the full address it printed)")
        if not any(transport in names for transport in _TRANSPORTS):
            raise UserError(f"initial peer {text!r} has no /tcp/ or /udp/ port")
        peers.append(str(maddr))
    return peers


def parse_listen_maddrs(texts: Iterable[str], *, announce: bool = False) -> List[str]:
    """Validate host (listen) or announce multiaddrs: an IP or DNS host and a TCP or UDP port."""
    what = "announce multiaddr" if announce else "host multiaddr"
    maddrs = []
    for text in texts:
        maddr = parse_maddr(text, what)
        names = _protocol_names(maddr)
        if not any(transport in names for transport in _TRANSPORTS):
            raise UserError(f"{what} {text!r} has no /tcp/ or /udp/ port")
        ports = [maddr.value_for_protocol(transport) for transport in _TRANSPORTS if transport in names]
        if announce and "0" in ports:
            raise UserError(f"{what} {text!r} must name an explicit port, not 0")
        maddrs.append(str(maddr))
    return maddrs


def maddrs_for_port(port: int, host: str = "0.0.0.0") -> List[str]:
    """Listen multiaddrs for `--port`: TCP on `host` (all IPv4 interfaces by default)."""
    if not 0 <= port <= 65535:
        raise UserError(f"port {port} is out of range 0..65535")
    return [f"/ip4/{host}/tcp/{port}"]


def check_ports_free(host_maddrs: Sequence[str]) -> None:
    """Raise `UserError` if a fixed TCP listen port in `host_maddrs` is already taken.

    p2pd binds with SO_REUSEPORT, so a second p2pd on the same port would start and silently share
    it with the first. We probe with a plain bind instead, with SO_REUSEADDR so connections of a
    previous run left in TIME_WAIT do not count as "in use". Port 0 (any free port) is not probed.
    """
    from hivemind.utils.multiaddr import Multiaddr

    for text in host_maddrs:
        maddr = Multiaddr(text)
        names = _protocol_names(maddr)
        if "tcp" not in names:
            continue
        port = int(maddr.value_for_protocol("tcp"))
        if port == 0:
            continue
        if "ip4" in names:
            family, host = socket.AF_INET, maddr.value_for_protocol("ip4")
        elif "ip6" in names:
            family, host = socket.AF_INET6, maddr.value_for_protocol("ip6")
        else:
            continue  # dns hosts: nothing to probe locally
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise UserError(f"port {port} on {host} is already in use (host multiaddr {text})") from None
                if e.errno == errno.EADDRNOTAVAIL:
                    raise UserError(f"cannot listen on {host}: no local interface has this address ({text})") from None
                raise UserError(f"cannot listen on {text}: {e.strerror}") from None
