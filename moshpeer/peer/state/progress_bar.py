"""A rich progress bar on stderr while a state download runs (`download_state(show_progress=True)`)."""

from __future__ import annotations

from typing import Callable

from moshpeer.peer.state.framing import StateOffer


class DownloadProgressBar:
    """A rich progress bar on stderr while a download runs (a no-op when disabled)."""

    def __init__(self, enabled: bool, offer: StateOffer, donors: int = 1):
        self.enabled, self.offer, self.donors = enabled, offer, donors
        self._progress, self._task = None, None

    def __enter__(self) -> Callable[[int, int], None]:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            self._progress = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), console=Console(stderr=True), transient=True)
            self._progress.start()
            self._task = self._progress.add_task(f"state of epoch {self.offer.epoch} from {self.donors} donor(s)",
                                                 total=None)
        return self._update

    def _update(self, received: int, total: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=received, total=total)

    def __exit__(self, *exc_info) -> None:
        if self._progress is not None:
            self._progress.stop()
