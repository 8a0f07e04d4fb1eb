"""`moshpeer` command line: parses arguments, dispatches to one module per subcommand.

Each subcommand module exposes `add_parser(subparsers)` and `run(args) -> int`. Errors the user
can fix arrive as `UserError` and are printed as one line; they never show a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Optional, Sequence

from moshpeer.errors import UserError
from moshpeer.version import __version__

# Subcommand modules under moshpeer.cli, in the order `moshpeer --help` lists them.
COMMANDS = ("dht", "join", "status", "checkpoint", "member", "demo", "plot", "simulate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moshpeer",
        description="Decentralized training on volunteer and preemptible machines.",
    )
    parser.add_argument("--version", action="version", version=f"moshpeer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"moshpeer.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.run(args) or 0)
    except UserError as e:
        print(f"moshpeer {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
