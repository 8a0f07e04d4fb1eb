"""`moshpeer status`: list the live peers of a run, as a table or as JSON.

It starts a short-lived client-mode DHT node (it stores nothing and accepts no connections),
reads the run's membership dictionary, and prints what passes validation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List

from hivemind.utils import get_dht_time

from moshpeer.cli.common import (
    add_initial_peers_argument,
    add_run_id_argument,
    configure_logging,
    exit_now,
    positive_float,
)
from moshpeer.dht import DEFAULT_HOST_MADDRS, PeerRecord, list_peers, start_dht
from moshpeer.errors import UserError

# An empty answer right after joining can mean "not found yet": ask again within this time.
_EMPTY_RETRY_SECONDS = 2.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the live peers of a run",
        description="Show the live peers of a run: peer id, role, address, epoch/step, samples/s, last seen.",
    )
    add_initial_peers_argument(parser, required=True)
    add_run_id_argument(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=15.0,
        metavar="SECONDS",
        help="give up if no initial peer answers within this time (default: 15)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.verbose)
    dht = start_dht(
        initial_peers=args.initial_peers,
        # Same listen addresses as a peer: libp2p reuses its listening ports to dial out, so a
        # loopback-only node could depend on fallbacks to reach peers on other machines.
        host_maddrs=DEFAULT_HOST_MADDRS,
        client_mode=True,
        run_ids=[args.run_id],
        connect_timeout=args.timeout,
    )
    try:
        peers = list_peers(dht, args.run_id, timeout=args.timeout)
        retry_until = time.monotonic() + _EMPTY_RETRY_SECONDS
        while not peers and time.monotonic() < retry_until:
            time.sleep(0.5)
            peers = list_peers(dht, args.run_id, timeout=args.timeout)
    except TimeoutError as e:
        raise UserError(str(e)) from None
    finally:
        dht.stop()
    if not peers:
        raise UserError(f"no live peers in run {args.run_id!r}: check the run id, or start peers with 'moshpeer join'")
    now = get_dht_time()
    if args.json:
        print(json.dumps({"run_id": args.run_id, "peers": [peer_as_json(peer, now) for peer in peers]}, indent=2))
    else:
        print_table(args.run_id, peers, now)
    exit_now(0)


def short_peer_id(peer_id: str) -> str:
    """The last 8 characters: distinct in practice (the first ones are the same for every RSA peer)."""
    return "…" + peer_id[-8:]


def peer_as_json(peer: PeerRecord, now: float) -> Dict[str, Any]:
    return {**peer.to_wire(), "last_seen_s": round(max(0.0, now - peer.updated_at), 3)}


def print_table(run_id: str, peers: List[PeerRecord], now: float) -> None:
    from rich.console import Console
    from rich.table import Table

    counts = {role: sum(peer.role == role for peer in peers) for role in ("trainer", "aux", "bootstrap")}
    summary = ", ".join(f"{n} {role}{'s' if n != 1 else ''}" for role, n in counts.items() if n)
    table = Table(title=f"run {run_id}: {len(peers)} live peers ({summary})", title_justify="left")
    table.add_column("peer")
    table.add_column("role")
    table.add_column("address", overflow="fold")
    table.add_column("epoch/step", justify="right")
    table.add_column("samples/s", justify="right")
    table.add_column("last seen", justify="right")
    table.add_column("flagged", justify="right")  # chunks in which other peers' robust aggregation clipped it
    flagged: Dict[str, int] = {}
    for peer in peers:
        for other, n in peer.flagged.items():
            flagged[other] = flagged.get(other, 0) + n
    for peer in peers:
        table.add_row(
            short_peer_id(peer.peer_id),
            peer.role,
            _display_address(peer),
            f"{peer.epoch}/{peer.step}",
            f"{peer.samples_per_second:.1f}",
            f"{max(0.0, now - peer.updated_at):.1f} s ago",
            str(flagged.get(peer.peer_id, 0)),
        )
    # Not a terminal (a pipe, a file, a test): keep lines long enough that addresses stay whole.
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)


def _display_address(peer: PeerRecord) -> str:
    """The first address without its /p2p/ suffix (the peer id column already says who it is)."""
    if not peer.addresses:
        return "-"
    return peer.addresses[0].split("/p2p/")[0]
