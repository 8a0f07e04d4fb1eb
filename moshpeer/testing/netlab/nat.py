"""Sites behind a router of their own: NAT of the common kinds, or a firewall, with iptables in the site's namespace.

- cone: MASQUERADE with the kernel's port preservation: one mapping per inside socket, whatever the
  destination (endpoint-independent mapping, as most home routers);
- symmetric: MASQUERADE --random-fully: a new outside port for every connection, so a port learned from one
  peer is useless to another (endpoint-dependent mapping, as carrier-grade and some corporate NATs);
- firewall: no translation (the site's addresses are routed), only the filter below.

Every kind drops unsolicited inbound traffic silently (a connection attempt from outside times out rather
than being refused), and lets in what belongs to connections opened from inside.
"""

from __future__ import annotations

from typing import List

from moshpeer.testing.netlab.commands import in_netns, run

UPLINK = "up0"


def rules(kind: str) -> List[List[str]]:
    """The iptables commands (argv after `iptables`) that make a site router of `kind`."""
    stateful = [["-A", chain, "-i", UPLINK, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
                for chain in ("FORWARD", "INPUT")]
    drop = [["-A", chain, "-i", UPLINK, "-j", "DROP"] for chain in ("FORWARD", "INPUT")]
    translate = {"cone": [["-t", "nat", "-A", "POSTROUTING", "-o", UPLINK, "-j", "MASQUERADE"]],
                 "symmetric": [["-t", "nat", "-A", "POSTROUTING", "-o", UPLINK, "-j", "MASQUERADE",
                                "--random-fully"]],
                 "firewall": []}[kind]
    return translate + stateful + drop


def apply(netns: str, kind: str) -> None:
    """Make the router in `netns` a site of `kind` (NetlabError, one line, if iptables is missing or refuses)."""
    for rule in rules(kind):
        run(in_netns(netns, ["iptables", "-w", "5", *rule]))
