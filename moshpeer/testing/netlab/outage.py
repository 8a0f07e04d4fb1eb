"""A peer's network gone for a while (wifi lost, a cable pulled), then back: its lab link down, then up; or its
address changed under it (`readdress`)."""

from __future__ import annotations

import dataclasses
import ipaddress
from contextlib import contextmanager
from typing import Iterator

from moshpeer.testing.netlab.commands import in_netns, run
from moshpeer.testing.netlab.lab import IFNAME, Netlab


@contextmanager
def outage(lab: Netlab, index: int, *, connections_survive: bool = True) -> Iterator[None]:
    """Peer `index`'s link is down inside the block. Leaving it, the link comes back with its routes, which the
    kernel drops with a link that goes down (on a real machine, DHCP or the network manager puts them back).

    Established TCP connections outlive a short outage (between idle DHT nodes libp2p ended them ~38 s after the
    link went down, measured here; sooner with traffic in flight); with `connections_survive=False` the peer's end
    of each is killed first, as a long outage, a new address or a restarted NAT would end them. The other ends learn
    it from the reset their next packet gets."""
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


def readdress(lab: Netlab, index: int) -> str:
    """Peer `index` (a public one) gets a new address in the lab's subnet, as a roaming laptop or a new DHCP lease
    would, and its established connections end (a new address breaks them all); returns the new address. The old
    one is gone, with its route from the router; `lab.addresses` says the new one. Every lab peer routes the whole
    subnet, so they reach it."""
    node = lab.nodes[index]
    old = ipaddress.ip_address(node.address)
    taken = {ipaddress.ip_address(address) for address in lab.addresses}
    new = next(old + step for step in (100, -100, 50, -50) if (old + step) not in taken
               and (old + step).packed[:3] == old.packed[:3] and (old + step).packed[3] not in (0, 1, 255))
    link = f"p{index}"  # the router's end of the peer's veth (lab.py `_wire`)
    run(["ip", "-n", node.netns, "addr", "add", f"{new}/32", "dev", IFNAME])
    run(["ip", "-n", lab.router, "route", "add", f"{new}/32", "dev", link])
    run(["ip", "-n", node.netns, "addr", "del", f"{old}/32", "dev", IFNAME])
    run(["ip", "-n", lab.router, "route", "del", f"{old}/32", "dev", link])
    run(in_netns(node.netns, ["ss", "-K", "-t", "state", "established"]))
    lab.nodes[index] = dataclasses.replace(node, address=str(new))
    return str(new)
