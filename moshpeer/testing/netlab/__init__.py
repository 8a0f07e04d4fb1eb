"""netlab: machines on the internet, in a box (Linux network namespaces on one machine).

    with Netlab([100, 100, 100, 10], rtt="100ms", jitter="5ms",       # upload Mbit/s per peer
                sites=[None, "cone-a", "cone-a", "symmetric-b"], cpu_shares=0.3) as lab:
        proc = lab.popen(0, ["python", "-m", "moshpeer", "dht", "--host-maddrs",
                             f"/ip4/{lab.nodes[0].address}/tcp/0", ...])
        lab.tx_bytes(0)                                # bytes this peer has put on its link
        with outage(lab, 3): ...                       # peer 3's link down in the block (outage.py)
        readdress(lab, 2)                              # peer 2's address changes (a roaming laptop)
    # leaving the block: every process in the lab is killed, every namespace, link and cgroup is deleted

Topology: one namespace per peer, each with one interface (`IFNAME`) to a router namespace, directly (a
public peer, on a private /24 that no interface or route of this machine uses) or through a site router of
its own (nat.py: cone or symmetric NAT, or a firewall; private addresses behind it). There is no route out
of the lab: the peers reach each other and nothing else, and nothing outside reaches them.

- Bandwidth: each peer's upload is shaped with a `tbf` qdisc on its own side, so what a peer receives is
  limited by its senders' uploads; an optional download rate shapes the router's side of its link.
- Latency and jitter: a delay line of our own per peer (delay.py; this kernel has no netem).
- CPU: a cgroup quota per peer (cpu.py), so a peer that dies frees nothing for the others.

Teardown is guaranteed as far as a process can guarantee it: `down()` on leaving the `with` block,
an atexit hook and SIGTERM / SIGHUP handlers for labs still up, and names that carry the owning
process id, so `cleanup()` (also run before every new lab, and `python -m moshpeer.testing.netlab
cleanup`) deletes what a SIGKILLed owner left. Labs made by `... netlab up` belong to no process (owner 0)
and stay until `down` (or `cleanup --all`).

Where namespaces cannot be made (not root, no `ip` / `tc`, no CAP_SYS_ADMIN), `unavailable()` says
why in one line (`unavailable(delays=True, sites=True, cpu_budgets=True)` for the optional parts); tests
skip with it and `Netlab.up()` raises `NetlabError` with it.
"""

from moshpeer.testing.netlab.commands import NetlabError
from moshpeer.testing.netlab.lab import (IFNAME, MAX_INITIAL_WINDOW, MAX_PEERS, PUBLIC_CORE_SUBNET, SUBNET_CANDIDATES,
                                         Netlab, Node, cleanup, cpu_budget, pick_subnet, unavailable)
from moshpeer.testing.netlab.outage import outage, readdress
from moshpeer.testing.netlab.spec import SITE_KINDS, parse_ms, parse_rate, parse_rates, parse_share, parse_site

__all__ = ["IFNAME", "MAX_INITIAL_WINDOW", "MAX_PEERS", "PUBLIC_CORE_SUBNET", "SITE_KINDS", "SUBNET_CANDIDATES",
           "Netlab", "NetlabError", "Node", "cleanup", "cpu_budget", "outage", "parse_ms", "parse_rate", "parse_rates",
           "parse_share", "parse_site", "pick_subnet", "readdress", "unavailable"]
