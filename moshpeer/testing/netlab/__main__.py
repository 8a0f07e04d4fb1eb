"""`python -m moshpeer.testing.netlab up | down | cleanup | status | run`: labs from the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional, Sequence

from moshpeer.testing.netlab import cpu
from moshpeer.testing.netlab.commands import NetlabError
from moshpeer.testing.netlab.lab import (MAX_PEERS, PREFIX, SUBNET_CANDIDATES, Netlab, _NETNS_RE, cleanup,
                                         list_netns, unavailable)
from moshpeer.testing.netlab.spec import SITE_KINDS, parse_rates


def describe(lab: Netlab) -> dict:
    return {"lab": lab.lab_id, "router": lab.router, "ifname": "nl0",
            "nodes": [{"index": n.index, "netns": n.netns, "address": n.address, "upload_mbit": n.upload_mbit,
                       "download_mbit": n.download_mbit, "rtt_ms": n.rtt_ms, "jitter_ms": n.jitter_ms,
                       "site": n.site, "site_address": n.site_address, "cpu_share": n.cpu_share}
                      for n in lab.nodes]}


def _run_everywhere(lab: Netlab, argv: List[str], timeout: Optional[float]) -> int:
    """Start argv in every namespace ({index}, {address}, {addresses}, {netns}, {peers} substituted); wait."""
    fields = {"addresses": ",".join(lab.addresses), "peers": str(len(lab.nodes))}
    procs = []
    for node in lab.nodes:
        values = {**fields, "index": str(node.index), "address": node.address, "netns": node.netns}
        procs.append(lab.popen(node.index, [arg.format(**values) for arg in argv]))
    deadline = None if timeout is None else time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic())))
        except Exception:
            print(f"netlab: command still running after {timeout:g} s; stopping the lab", file=sys.stderr)
            return 124
    return max(codes, default=0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moshpeer.testing.netlab",
                                     description="machines on the internet, in network namespaces")
    sub = parser.add_subparsers(dest="cmd", required=True)

    def lab_args(p):
        p.add_argument("--peers", type=int, default=2, help="number of peers (default: 2)")
        p.add_argument("--rate", default="100mbit", help="upload per peer: one rate or a comma-separated list "
                       "(100, 100mbit, 1gbit, none; default: 100mbit)")
        p.add_argument("--download", default=None, help="download rate(s), same form (default: unshaped)")
        p.add_argument("--rtt", default=None, help="round-trip time each peer adds, one or one per peer "
                       "(100ms, 0.2s; default: none)")
        p.add_argument("--jitter", default=None, help="how much the round trip varies, same form (default: none)")
        p.add_argument("--sites", default=None, help="per peer, comma-separated: - (public) or a site label, "
                       f"{' / '.join(SITE_KINDS)}, optionally named (cone-a): peers with one label share a router")
        p.add_argument("--cpu", default=None, help="CPU budget per peer in cores (0.3, 30%%), one or one per peer")
        p.add_argument("--subnet", default=None, help="private /24 to use (default: a free one of "
                       f"{', '.join(SUBNET_CANDIDATES)})")
        p.add_argument("--tcp", default=None, help="TCP congestion control every peer runs, e.g. cubic (stock "
                       "Linux's; default: this kernel's). `up` leaves it on the host's allowed list")

    lab_args(sub.add_parser("up", help="build a lab that stays until `down`; prints it as JSON"))
    sub.add_parser("down", help="delete the labs made by `up`")
    clean = sub.add_parser("cleanup", help="delete labs (namespaces, links, cgroups) whose owning process is gone")
    clean.add_argument("--all", action="store_true", help="delete every lab, running owners included")
    sub.add_parser("status", help="list lab namespaces and cgroups on this machine")
    run = sub.add_parser("run", help="build a lab, run a command in every namespace, tear the lab down",
                         description="{index} {address} {addresses} {netns} {peers} in the command are "
                         "substituted per namespace.")
    lab_args(run)
    run.add_argument("--timeout", type=float, default=None, help="stop after this many seconds")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    try:
        if args.cmd in ("up", "run"):
            if not 1 <= args.peers <= MAX_PEERS:
                raise NetlabError(f"--peers must be within 1..{MAX_PEERS}")
            lab = Netlab(parse_rates(args.rate, args.peers), downloads=args.download, rtt=args.rtt,
                         jitter=args.jitter, sites=args.sites, cpu_shares=args.cpu, subnet=args.subnet,
                         persistent=args.cmd == "up", tcp_congestion=args.tcp)
            if args.cmd == "up":
                print(json.dumps(describe(lab.up())))
                return 0
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                raise NetlabError("netlab run: give a command after --")
            with lab:
                print(json.dumps(describe(lab)), file=sys.stderr)
                return _run_everywhere(lab, command, args.timeout)
        if args.cmd == "status":
            for name in list_netns():
                if _NETNS_RE.match(name):
                    print(f"netns  {name}")
            for group in cpu.leftovers(f"{PREFIX}-"):
                print(f"cgroup {group.name}")
            return 0
        reason = unavailable()
        if reason is not None:
            raise NetlabError(reason)
        removed = cleanup(persistent=True) if args.cmd == "down" else cleanup(everything=args.all)
        print(f"netlab: removed {len(removed)} namespaces and cgroups", file=sys.stderr)
        return 0
    except NetlabError as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
