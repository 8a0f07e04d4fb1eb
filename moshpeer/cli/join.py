"""`moshpeer join`: run a peer of a training run until SIGINT or SIGTERM.

With `--initial-peers` it joins their swarm; without, it starts a new swarm and prints how others
join. Either way it prints one JSON readiness line on stdout once it is in the swarm.
"""

from __future__ import annotations

import argparse

from moshpeer.cli.common import (
    add_initial_peers_argument,
    add_membership_arguments,
    add_network_arguments,
    add_run_id_argument,
    announce_ready,
    configure_logging,
    make_daemon,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "join",
        help="join (or start) a training run as a peer",
        description="Join the swarm of a training run (or start a new one without --initial-peers). "
        "Runs until SIGINT or SIGTERM, then withdraws from the swarm and exits.",
    )
    add_initial_peers_argument(parser)
    add_run_id_argument(parser)
    parser.add_argument(
        "--role",
        choices=("trainer", "aux"),
        default="trainer",
        help="trainer: computes and averages; aux: only helps average (default: trainer)",
    )
    parser.add_argument(
        "--client-mode",
        action="store_true",
        help="do not accept incoming connections (for peers behind NAT or firewalls; needs --initial-peers)",
    )
    add_network_arguments(parser)
    add_membership_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.verbose)
    daemon = make_daemon(args, role=args.role, client_mode=args.client_mode)
    return daemon.run(on_ready=lambda d: announce_ready(d, "join"))
