"""`moshpeer dht`: run a bootstrap / relay node that other peers join through.

It takes part in the DHT like any peer (stores records, relays), publishes a `bootstrap` record
in its run, prints its multiaddrs and a ready-to-paste `moshpeer join ...` line, and runs until
SIGINT or SIGTERM. In a private run it carries the run's proof in its record; the run owner's node
(`--identity` of the owner, `--run-owner`, `--revoked FILE`) passes the owner's revocation list on.
"""

from __future__ import annotations

import argparse
import functools

from moshpeer.cli.common import (
    add_initial_peers_argument,
    add_membership_arguments,
    add_metrics_argument,
    add_network_arguments,
    add_private_run_arguments,
    add_run_id_argument,
    announce_ready,
    check_flags,
    configure_logging,
    exit_now,
    make_daemon,
    metrics_from_args,
)

DEFAULT_RUN_ID = "demo"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dht",
        help="run a bootstrap / relay node for a swarm",
        description="Run a bootstrap / relay node. Prints its multiaddrs and the command that joins the swarm; "
        "runs until SIGINT or SIGTERM.",
    )
    add_run_id_argument(parser, required=False, default=DEFAULT_RUN_ID)
    add_initial_peers_argument(parser)
    add_network_arguments(parser)
    add_membership_arguments(parser)
    add_private_run_arguments(parser)
    add_metrics_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.verbose)
    check_flags(args)
    metrics = metrics_from_args(args, "dht")
    daemon = make_daemon(args, role="bootstrap")
    ready = functools.partial(announce_ready, command="dht", metrics=metrics, metrics_port=args.metrics_port)
    exit_now(daemon.run(on_ready=ready))
