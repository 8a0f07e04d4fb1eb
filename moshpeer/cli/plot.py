"""`moshpeer plot EVENTS.jsonl ... [--out DIR]`: PNG plots of a run from the JSON lines `moshpeer join` prints.

Reads the `{"event": "epoch", ...}` lines of one or more peers (a file per peer: `join --events FILE`,
or its captured stdout; other lines are skipped) and writes three figures:

    loss.png     training loss against time and against epoch
    metric.png   the task's evaluation metric (e.g. accuracy) against time and against epoch
    rounds.png   seconds per round (matchmaking + averaging) and chunks lost per round, against epoch

Each file is one series, named after its peer id (from the "training" line) or the file name.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import List, Optional

from moshpeer.cli.common import check_directory_flag
from moshpeer.errors import UserError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="plot loss, metric and round health from the event lines of 'moshpeer join'",
        description="Write loss.png, metric.png and rounds.png from the JSON event lines of one or more peers "
        "('moshpeer join --events FILE', or its stdout).",
    )
    parser.add_argument("events", nargs="+", metavar="EVENTS.jsonl", help="event lines of one peer per file")
    parser.add_argument("--out", default="moshpeer-plots", metavar="DIR",
                        help="directory for the PNG files (default: moshpeer-plots)")
    parser.set_defaults(run=run)


@dataclass
class PeerSeries:
    """The epoch lines of one peer, in the order it printed them."""

    name: str
    metric_name: str = "metric"
    epochs: List[dict] = field(default_factory=list)

    def points(self, x: str, y: str) -> List[tuple]:
        """(x, y) for each epoch line where both are numbers."""
        return [(e[x], e[y]) for e in self.epochs
                if isinstance(e.get(x), (int, float)) and isinstance(e.get(y), (int, float))]


def read_events(path: str) -> PeerSeries:
    """The epoch lines of `path`; lines that are not JSON objects (log lines in a captured stdout) are skipped.

    :raises UserError: the file cannot be read, or holds no epoch line
    """
    series = PeerSeries(name=os.path.basename(path))
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                event = parse_event_line(line)
                if event is None:
                    continue
                if event.get("event") == "training" and isinstance(event.get("peer_id"), str):
                    series.name = f"…{event['peer_id'][-8:]}"
                elif event.get("event") == "epoch" and isinstance(event.get("epoch"), int):
                    series.epochs.append(event)
                    if isinstance(event.get("metric_name"), str):
                        series.metric_name = event["metric_name"]
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    if not series.epochs:
        raise UserError(f"{path} holds no epoch lines (expected the output of 'moshpeer join' or its --events file)")
    return series


def parse_event_line(line: str) -> Optional[dict]:
    """The JSON object of one `moshpeer join` event line, or None for any other line."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def write_plots(peers: List[PeerSeries], out: str) -> List[str]:
    """Write loss.png, metric.png and rounds.png into `out` (created if missing); their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    metric_name = peers[0].metric_name
    figures = {
        "loss.png": _two_panels(plt, peers, "loss", "training loss", log_y=True),
        "metric.png": _two_panels(plt, peers, "metric", metric_name),
        "rounds.png": _rounds(plt, peers),
    }
    paths = []
    for name, figure in figures.items():
        path = os.path.join(out, name)
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths


def _two_panels(plt, peers: List[PeerSeries], y: str, label: str, log_y: bool = False):
    """`y` against wall time (left) and against epoch (right), one line per peer."""
    figure, (by_time, by_epoch) = plt.subplots(1, 2, figsize=(12, 4.5))
    values = [v for peer in peers for _, v in peer.points("epoch", y)]
    # A log scale only where the values span more than a decade and a half (a loss from 2.3 to 0.01).
    log_y = log_y and bool(values) and min(values) > 0 and max(values) / min(values) > 30
    for peer in peers:
        for axis, x in ((by_time, "time"), (by_epoch, "epoch")):
            points = peer.points(x, y)
            if points:
                axis.plot(*zip(*points), marker="." if len(points) < 60 else None, linewidth=1.2, label=peer.name)
    for axis, xlabel in ((by_time, "seconds since the peer started"), (by_epoch, "collaborative epoch")):
        axis.set_xlabel(xlabel)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        if log_y:
            axis.set_yscale("log")
            axis.yaxis.set_major_formatter(_plain_numbers())
    _integer_ticks(by_epoch)
    by_time.set_title(f"{label} against time")
    by_epoch.set_title(f"{label} against epoch")
    if not values:
        for axis in (by_time, by_epoch):
            _note(axis, f"no {label} in these events")
    _legend(by_epoch, peers)
    figure.tight_layout()
    return figure


def _rounds(plt, peers: List[PeerSeries]):
    """Seconds per round (matchmaking + averaging) and chunks lost per round, against epoch; rounds that did
    not average with a group are marked x."""
    figure, (seconds, lost) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(peers), 1)
    any_lost = False
    for k, peer in enumerate(peers):
        rounds = [e for e in peer.epochs if isinstance(e.get("matchmaking_s"), (int, float))]
        epochs = [e["epoch"] for e in rounds]
        total = [e["matchmaking_s"] + (e.get("averaging_s") or 0.0) for e in rounds]
        line, = seconds.plot(epochs, total, marker="." if len(rounds) < 60 else None, linewidth=1.2,
                             label=f"{peer.name}: matchmaking + averaging")
        color = line.get_color()
        seconds.plot(epochs, [e.get("averaging_s") or 0.0 for e in rounds], linewidth=1.0, linestyle="--",
                     color=color, label=f"{peer.name}: averaging")
        alone = [(x, t) for x, t, e in zip(epochs, total, rounds) if e.get("ok") is False]
        if alone:
            seconds.plot(*zip(*alone), linestyle="none", marker="x", color=color, label=f"{peer.name}: no group")
        chunks = [e.get("chunks_lost") or 0 for e in rounds]
        any_lost = any_lost or any(chunks)
        lost.bar([x - 0.4 + width * (k + 0.5) for x in epochs], chunks, width=width, color=color, label=peer.name)
    seconds.set_title("seconds per round")
    seconds.set_ylabel("seconds")
    seconds.set_ylim(bottom=0)
    seconds.legend(fontsize="small")
    lost.set_title("chunks lost per round")
    lost.set_ylabel("chunks lost")
    lost.set_ylim(bottom=0)
    if not any_lost:
        lost.set_ylim(0, 1)
        _note(lost, "no chunk was lost")
    for axis in (seconds, lost):
        axis.set_xlabel("collaborative epoch")
        axis.grid(alpha=0.3)
        _integer_ticks(axis)
    _legend(lost, peers)
    figure.tight_layout()
    return figure


def _integer_ticks(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))


def _plain_numbers():
    """Tick labels like 0.5 and 2 instead of 5x10^-1 on a log axis."""
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda value, _: f"{value:g}")


def _note(axis, text: str) -> None:
    axis.text(0.5, 0.5, text, transform=axis.transAxes, ha="center", va="center", color="gray")


def _legend(axis, peers: List[PeerSeries]) -> None:
    if len(peers) > 1:
        axis.legend(fontsize="small")


def run(args: argparse.Namespace) -> int:
    check_directory_flag("--out", args.out)
    peers = [read_events(path) for path in args.events]
    for path in write_plots(peers, args.out):
        print(path)
    return 0
