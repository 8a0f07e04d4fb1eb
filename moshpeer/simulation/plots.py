"""PNG plots of `moshpeer simulate` (`--plot DIR`): distance vs round, loss vs simulated time, goodput vs
failure rate. matplotlib is imported here only (Agg backend: no display needed).

Every function raises UserError when DIR cannot be created or written (one line from the CLI, exit 2).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, List, Sequence

if TYPE_CHECKING:
    from moshpeer.simulation.averaging import CellResult
    from moshpeer.simulation.training_result import TrainingResult

from moshpeer.errors import UserError


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def prepare_directory(directory: str) -> None:
    """Create `directory` if needed; UserError if it cannot be created or written."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise UserError(f"--plot {directory}: {e.strerror}") from None
    if not os.access(directory, os.W_OK):
        raise UserError(f"--plot {directory}: not writable")


def _save(fig, path: str) -> None:
    try:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None


def plot_distance(directory: str, cell: "CellResult") -> List[str]:
    """distance-vs-round.png: the mean error per round of an averaging cell (log scale). -> paths written."""
    prepare_directory(directory)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    errors = [max(e, 1e-300) for e in cell.mean_error]
    ax.semilogy(range(len(errors)), errors, marker="o", ms=3)
    ax.set_xlabel("round")
    ax.set_ylabel("mean squared distance to the exact mean")
    ax.set_title(f"{cell.config.peers} peers, g = {cell.config.group_size}, p = {cell.config.failure_rate:g}")
    ax.grid(True, which="both", alpha=0.3)
    path = os.path.join(directory, "distance-vs-round.png")
    _save(fig, path)
    plt.close(fig)
    return [path]


def plot_training(directory: str, results: Sequence["TrainingResult"], sweep: Sequence[dict]) -> List[str]:
    """loss-vs-time.png for the runs; goodput-vs-failure-rate.png when a sweep was run. -> paths written."""
    prepare_directory(directory)
    plt = _pyplot()
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.semilogy([t / 3600 for t, _ in r.curve], [max(loss - r.loss_floor, 1e-12) for _, loss in r.curve],
                    label=f"{r.system} (goodput {r.goodput:.2f})")
    ax.set_xlabel("simulated hours")
    ax.set_ylabel("loss above the optimum")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    paths.append(os.path.join(directory, "loss-vs-time.png"))
    _save(fig, paths[-1])
    plt.close(fig)
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        rates = [row["failures_per_hour"] for row in sweep]
        ax.plot(rates, [row["moshpit"] for row in sweep], marker="o", label="Moshpit groups")
        ax.plot(rates, [row["sync"] for row in sweep], marker="s", label="synchronous data parallel")
        ax.set_xlabel("failures per peer per hour")
        ax.set_ylabel("goodput")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
        ax.legend()
        paths.append(os.path.join(directory, "goodput-vs-failure-rate.png"))
        _save(fig, paths[-1])
        plt.close(fig)
    return paths
