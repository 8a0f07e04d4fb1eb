"""Which of this machine's addresses other peers reach it at, now.

A peer that listens on every interface (`moshpeer join`'s default, /ip4/0.0.0.0) announces one address for its
data plane, its relay service and its state server. Taken once at start, that address went stale when the
machine's address changed (a laptop roaming, a new DHCP lease): measured in netlab (session 37), the peer averaged
nothing for the rest of the run, every round it joined lost all its chunks and its mates' catch-ups from it failed
with "Network is unreachable". So the listeners bind to every interface too, and the address is asked again
whenever it is announced (`AnnouncedHost`): the source address the kernel picks for a packet to the swarm (a UDP
socket connected to an initial peer; connecting a UDP socket sends nothing), cached for a second.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from typing import Any, Callable, List, Optional, Sequence

ALL_INTERFACES = "0.0.0.0"
ANNOUNCE_TTL_S = 1.0  # a round, a relay offer and a state offer each ask; the route changes rarely
PROBE_PORT = 9  # any port: a connected UDP socket only picks its route and source address


def route_source(destination: str) -> Optional[str]:
    """The local IPv4 address the kernel would send from to `destination` (no packet is sent); None without a
    route (the network is down) or for a malformed address."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((destination, PROBE_PORT))
            return probe.getsockname()[0]
    except (OSError, ValueError):
        return None


def ipv4_hosts(maddrs: Sequence[str]) -> List[str]:
    """The IPv4 hosts of multiaddrs ("/ip4/H/tcp/P/..."), in order, without repeats."""
    hosts: List[str] = []
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if len(parts) > 2 and parts[1] == "ip4" and parts[2] not in hosts:
            hosts.append(parts[2])
    return hosts


def remote_hosts(maddrs: Sequence[Any]) -> List[str]:
    """`ipv4_hosts` of multiaddrs other machines could reach (not loopback, not 0.0.0.0)."""
    return [host for host in ipv4_hosts([str(m) for m in maddrs]) if not _unusable(host)]


def visible_host(maddrs: Sequence[Any]) -> str:
    """The IPv4 address others reach this peer at, from its DHT's visible multiaddrs: one beyond loopback if there
    is one (peers in other network namespaces or on other machines cannot reach 127.0.0.1), else the first one (a
    local swarm), else 127.0.0.1."""
    remote = remote_hosts(maddrs)
    local = [host for host in ipv4_hosts([str(m) for m in maddrs]) if host != ALL_INTERFACES]
    return remote[0] if remote else local[0] if local else "127.0.0.1"


def listens_on_all_interfaces(maddrs: Sequence[str]) -> bool:
    """Whether listen multiaddrs include every IPv4 interface (/ip4/0.0.0.0/...)."""
    return ALL_INTERFACES in ipv4_hosts(maddrs)


class AnnouncedHost:
    """The address to announce for a listener bound to every interface: this machine's source address towards the
    first of `towards` it has a route to (asked again after `ttl_s`), else `fallback`. Call it for the address.

    :param probe: `route_source` (a fake one in tests); clock: monotonic seconds
    """

    def __init__(self, towards: Sequence[str], fallback: str, ttl_s: float = ANNOUNCE_TTL_S,
                 probe: Callable[[str], Optional[str]] = route_source, clock: Callable[[], float] = time.monotonic):
        self.towards, self.fallback, self.ttl_s = list(towards), fallback, ttl_s
        self._probe, self._clock = probe, clock
        self._cached: Optional[str] = None
        self._asked_at = float("-inf")

    def __call__(self) -> str:
        now = self._clock()
        if self._cached is None or now - self._asked_at >= self.ttl_s:
            found = (self._probe(destination) for destination in self.towards)
            self._cached = next((host for host in found if host and not _unusable(host)), self.fallback)
            self._asked_at = now
        return self._cached


def _unusable(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # not an address at all
        return True
    return address.is_unspecified or address.is_loopback


def announced_host(host: str, dht: Any) -> Optional[AnnouncedHost]:
    """For listeners on `host`, next to `dht`: None when `host` is one address (announce it as it is), else (every
    interface) an `AnnouncedHost` towards the DHT's initial peers beyond loopback, falling back to `visible_host`."""
    if host != ALL_INTERFACES:
        return None
    return AnnouncedHost(remote_hosts(getattr(dht, "initial_peers", None) or ()),
                         fallback=visible_host(dht.get_visible_maddrs()))
