"""`moshpeer status`: list the live peers of a run, as a table or as JSON; `--watch` keeps it live.

It starts a short-lived client-mode DHT node (it stores nothing and accepts no connections),
reads the run's membership dictionary, and prints what passes validation: each peer (role, epoch,
samples/s, the health of its recent rounds) and the swarm (epoch, throughput, progress toward the
epoch's target batch and the time to reach it, when the trainers publish their target). With
`--watch` it reads again every `--interval` seconds until Ctrl-C (exit 0) or `--count` refreshes.
With a private run's `--swarm-key` / `--allow-peers`, only the records of the run's members are shown.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List

from moshpeer.cli.common import (
    add_initial_peers_argument,
    add_private_run_arguments,
    add_run_id_argument,
    admission_from_args,
    configure_logging,
    exit_now,
    positive_float,
)
from moshpeer.dht.maddrs import DEFAULT_HOST_MADDRS
from moshpeer.errors import UserError

if TYPE_CHECKING:
    from moshpeer.dht.records import PeerRecord
    from moshpeer.peer.optimizer.progress import ProgressSnapshot

# hivemind (and with it torch) loads only once the command runs, not while its flags are parsed.

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
    parser.add_argument("--watch", action="store_true", help="keep the view live until Ctrl-C")
    parser.add_argument("--interval", type=positive_float, default=2.0, metavar="SECONDS",
                        help="with --watch: seconds between refreshes (default: 2)")
    parser.add_argument("--count", type=int, metavar="N",
                        help="with --watch: stop after N refreshes (with --json: N lines, one per refresh)")
    add_private_run_arguments(parser)  # with them, only the run's members are shown
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.verbose)
    if args.count is not None and (args.count < 1 or not args.watch):
        raise UserError("--count needs --watch and a positive number of refreshes")
    from moshpeer.dht.node import start_dht

    admission = admission_from_args(args, member=False)  # before the DHT starts: a bad key file is one line, exit 2
    dht = start_dht(
        initial_peers=args.initial_peers,
        # Same listen addresses as a peer: libp2p reuses its listening ports to dial out, so a
        # loopback-only node could depend on fallbacks to reach peers on other machines.
        host_maddrs=DEFAULT_HOST_MADDRS,
        client_mode=True,
        run_ids=[args.run_id],
        connect_timeout=args.timeout,
        admission=admission,
    )
    try:
        if args.watch:
            # Ctrl-C ends --watch, a normal way out. It only sets a flag: a KeyboardInterrupt raised inside a
            # DHT read could leave the DHT client mid-call and its shutdown below waiting on it.
            leave = threading.Event()
            signal.signal(signal.SIGINT, lambda *_: leave.set())
            watch(dht, args, leave)
        else:
            show_once(dht, args)
    except KeyboardInterrupt:
        pass  # Ctrl-C during a one-shot read (the DHT process ignores SIGINT; it is stopped below)
    finally:
        dht.stop()
    exit_now(0)


def show_once(dht: Any, args: argparse.Namespace) -> None:
    """One snapshot; UserError if nobody answers or the run has no live peers."""
    from hivemind.utils import get_dht_time

    from moshpeer.dht.membership import list_peers

    try:
        peers = list_peers(dht, args.run_id, timeout=args.timeout)
        retry_until = time.monotonic() + _EMPTY_RETRY_SECONDS
        while not peers and time.monotonic() < retry_until:
            time.sleep(0.5)
            peers = list_peers(dht, args.run_id, timeout=args.timeout)
    except TimeoutError as e:
        raise UserError(str(e)) from None
    if not peers:
        raise UserError(f"no live peers in run {args.run_id!r}: check the run id, or start peers with 'moshpeer join'")
    now = get_dht_time()
    if args.json:
        print(json.dumps(status_as_json(args.run_id, peers, now), indent=2))
    else:
        _console().print(build_table(args.run_id, peers, now))


def watch(dht: Any, args: argparse.Namespace, leave: threading.Event) -> None:
    """Refresh every `args.interval` seconds until `leave` is set (Ctrl-C) or `args.count` refreshes. A read that
    times out shows the last view with a note, and the next refresh tries again."""
    from contextlib import nullcontext

    from hivemind.utils import get_dht_time

    from moshpeer.dht.membership import list_peers

    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    console = _console()
    # On a terminal the view redraws in place; elsewhere (a pipe, a file) each refresh is printed in turn.
    live = Live(console=console, auto_refresh=False) if console.is_terminal and not args.json else nullcontext()
    peers: List[PeerRecord] = []
    refreshes = 0
    with live:
        while True:
            note = ""
            try:
                peers = list_peers(dht, args.run_id, timeout=args.timeout)
            except TimeoutError as e:
                note = f"no answer from the swarm ({e}); showing the last view"
            now = get_dht_time()
            if args.json:
                print(json.dumps({**status_as_json(args.run_id, peers, now), "note": note or None},
                                 separators=(",", ":")), flush=True)
            else:
                view = Group(build_table(args.run_id, peers, now),
                             Text(note or f"refreshing every {args.interval:g} s; Ctrl-C to leave", style="dim"))
                if isinstance(live, Live):
                    live.update(view, refresh=True)
                else:
                    console.print(view)
            refreshes += 1
            if args.count is not None and refreshes >= args.count:
                return
            if leave.wait(args.interval):
                return


def swarm_view(peers: List[PeerRecord], now: float) -> ProgressSnapshot:
    """The swarm as the peers describe it (epoch, progress, throughput); the target batch is the one the
    trainers publish (0: unknown)."""
    from moshpeer.peer.optimizer.progress import summarize

    target = max((peer.target_batch_size for peer in peers if peer.role == "trainer"), default=0)
    return summarize(tuple(peers), own=None, target_batch_size=target, now=now)


def status_as_json(run_id: str, peers: List[PeerRecord], now: float) -> Dict[str, Any]:
    swarm = swarm_view(peers, now)
    eta = swarm.eta_s if swarm.target_batch_size else None
    return {"run_id": run_id, "time": round(now, 3),
            "swarm": {**swarm.to_json(), "eta_s": None if eta is None or math.isinf(eta) else round(eta, 2)},
            "peers": [peer_as_json(peer, now) for peer in peers]}


def short_peer_id(peer_id: str) -> str:
    """The last 8 characters: distinct in practice (the first ones are the same for every RSA peer)."""
    return "…" + peer_id[-8:]


def peer_as_json(peer: PeerRecord, now: float) -> Dict[str, Any]:
    # Binary fields (a private run's membership tag, the witnessed peers' tags) as hex: JSON has no bytes.
    wire = {key: _hex(value) for key, value in peer.to_wire().items()}
    return {**wire, "last_seen_s": round(max(0.0, now - peer.updated_at), 3)}


def _hex(value: Any) -> Any:
    """`value` with bytes, also inside a list, as hex strings."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_hex(item) for item in value]
    return value


def build_table(run_id: str, peers: List[PeerRecord], now: float):
    """A rich table of the peers, titled with the swarm's epoch, throughput and progress."""
    from rich.table import Table

    counts = {role: sum(peer.role == role for peer in peers) for role in ("trainer", "aux", "bootstrap")}
    summary = ", ".join(f"{n} {role}{'s' if n != 1 else ''}" for role, n in counts.items() if n) or "none"
    table = Table(title=f"run {run_id}: {len(peers)} live peers ({summary})\n{_describe_swarm(swarm_view(peers, now))}",
                  title_justify="left")
    table.add_column("peer")
    table.add_column("role")
    table.add_column("address", overflow="fold")
    table.add_column("epoch/step", justify="right")
    table.add_column("samples/s", justify="right")
    table.add_column("recent rounds", justify="right")  # averaged / rounds, share of chunks lost, seconds
    table.add_column("path")  # how its chunks reached its group: direct TCP, or a share over the relay
    table.add_column("last seen", justify="right")
    # How many other peers' robust aggregation clipped it: each record counts once, whatever count it claims
    # (a single record claiming 2^62 flags about an honest peer shows as 1 reporter, not 2^62).
    table.add_column("flagged by", justify="right")
    flagged = flagged_by(peers)
    for peer in peers:
        table.add_row(
            short_peer_id(peer.peer_id),
            peer.role,
            _display_address(peer),
            # A trainer back from an outage: its epochs since `apart_since` were trained alone (trained_apart.py).
            f"{peer.epoch}/{peer.step}" + ("" if peer.apart_since is None else f", apart since {peer.apart_since}"),
            f"{peer.samples_per_second:.1f}",
            _describe_health(peer),
            _describe_path(peer),
            f"{max(0.0, now - peer.updated_at):.1f} s ago",
            str(flagged.get(peer.peer_id, 0)),
        )
    return table


def flagged_by(peers: List[PeerRecord]) -> Dict[str, int]:
    """Per peer id: how many other live peers' records flag it (claims about oneself are ignored)."""
    reporters: Dict[str, int] = {}
    for peer in peers:
        for other, count in peer.flagged.items():
            if other != peer.peer_id and count > 0:
                reporters[other] = reporters.get(other, 0) + 1
    return reporters


def _describe_swarm(swarm: ProgressSnapshot) -> str:
    line = f"swarm epoch {swarm.global_epoch}, {swarm.samples_per_second:.1f} samples/s"
    if swarm.target_batch_size:
        eta = swarm.eta_s
        line += (f", {swarm.samples_accumulated}/{swarm.target_batch_size} samples of this epoch"
                 f" ({'next epoch in ' + format(eta, '.1f') + ' s' if math.isfinite(eta) else 'nobody computing'})")
    return line


def _describe_health(peer: PeerRecord) -> str:
    health = peer.round_health
    if health is None or not health.rounds:
        return "-"
    return f"{health.averaged}/{health.rounds} ok, {100 * health.lost_fraction:.1f}% lost, {health.seconds:.2f} s"


def _describe_path(peer: PeerRecord) -> str:
    health = peer.round_health
    if health is None or not health.averaged:
        return "-"
    if health.relayed_fraction == 0:
        return "direct"
    return f"{100 * health.relayed_fraction:.0f}% relayed"


def _console():
    from rich.console import Console

    # Not a terminal (a pipe, a file, a test): keep lines long enough that addresses stay whole.
    return Console(width=None if sys.stdout.isatty() else 180)


def _display_address(peer: PeerRecord) -> str:
    """The first address without its /p2p/ suffix (the peer id column already says who it is)."""
    if not peer.addresses:
        return "-"
    return peer.addresses[0].split("/p2p/")[0]
