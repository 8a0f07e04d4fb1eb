"""A peer's network gone for a while (wifi lost, a cable pulled), then back: its lab link down, then up."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from moshpeer.testing.netlab.commands import in_netns, run
from moshpeer.testing.netlab.lab import IFNAME, Netlab


@contextmanager
def outage(lab: Netlab, index: int, *, connections_survive: bool = True) -> Iterator[None]:
    """Peer `index`'s link is down inside the block. Leaving it, the link comes back with its routes, which the
    kernel drops with a link that goes down (on a real machine, DHCP or the network manager puts them back).

    Established TCP connections outlive a short outage (between idle DHT nodes libp2p ended them ~38 s after the
    link went down, measured here; sooner with traffic in flight); with `connections_survive=False` the peer's end of each is killed first, as a long outage, a new
    address or a restarted NAT would end them. The other ends learn it from the reset their next packet gets."""
    netns = lab.nodes[index].netns
    routes = [line.split() for line in run(["ip", "-n", netns, "route"]).stdout.splitlines() if line.strip()]
    run(["ip", "-n", netns, "link", "set", IFNAME, "down"])
    try:
        yield
    finally:
        if not connections_survive:
            run(in_netns(netns, ["ss", "-K", "-t", "state", "established"]))
        run(["ip", "-n", netns, "link", "set", IFNAME, "up"])
        for route in routes:
            run(["ip", "-n", netns, "route", "replace", *route])
