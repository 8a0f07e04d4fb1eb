"""`moshpeer checkpoint inspect DIR`: what a checkpoint directory holds, and whether it is usable.

One row per checkpoint-like file: file, epoch, step, size, created, and "valid" or the reason it
is not (truncated, checksum mismatch, leftover temp file, unknown format version, ...). Valid
rows are verified end to end (payload checksum) unless --quick, which checks headers and sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, List

if TYPE_CHECKING:
    from moshpeer.peer.checkpoint import CheckpointInfo


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "checkpoint",
        help="inspect checkpoint directories",
        description="Work with the checkpoints a peer writes (--checkpoint-dir).",
    )
    actions = parser.add_subparsers(dest="checkpoint_action", metavar="ACTION", required=True)
    inspect = actions.add_parser(
        "inspect",
        help="list the checkpoints in a directory and check that each is intact",
        description="List the checkpoints in DIR (oldest first) with epoch, step, size, creation time, and "
        "whether each is valid (checksum verified) or why not.",
    )
    inspect.add_argument("directory", metavar="DIR", help="checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    inspect.add_argument(
        "--quick", action="store_true", help="check headers and file sizes only, not the payload checksums"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from moshpeer.peer.checkpoint import list_checkpoints  # torch: loaded once the flags are checked

    infos = list_checkpoints(args.directory, verify=not args.quick)
    if args.json:
        print(json.dumps([info.to_json() for info in infos], indent=2))
    else:
        print_table(args.directory, infos, verified=not args.quick)
    return 0


def _human_size(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"  # pragma: no cover


def print_table(directory: str, infos: List[CheckpointInfo], *, verified: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    valid = sum(info.valid for info in infos)
    title = f"{directory}: {valid} valid checkpoint{'s' if valid != 1 else ''}, {len(infos) - valid} other file(s)"
    if not verified:
        title += " (quick check: checksums not verified)"
    table = Table(title=title, title_justify="left")
    for column, justify in (("file", "left"), ("epoch", "right"), ("step", "right"), ("size", "right")):
        table.add_column(column, justify=justify)
    table.add_column("created")
    table.add_column("status", overflow="fold")
    for info in infos:
        meta = info.meta
        table.add_row(
            info.name,
            str(meta.epoch) if meta else "-",
            str(meta.step) if meta else "-",
            _human_size(info.size),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(meta.created)) if meta else "-",
            "valid" if info.valid else f"invalid: {info.reason}",
        )
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
