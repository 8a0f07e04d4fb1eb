"""Multi-donor state download (issue 16) with real donor processes (tests/helpers/state_donor.py): pieces come from
several donors in parallel, a donor killed mid-download leaves its pieces to the others, and a donor that
serves a corrupt piece is dropped and named while the newcomer still ends with the exact state."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

import pytest
import torch

from moshpeer.peer.state import sync as state_sync
from moshpeer.peer.state.progress_bar import DownloadProgressBar
from moshpeer.peer.state.sync import download_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from state_donor import donor_state  # noqa: E402

pytestmark = [pytest.mark.timeout(150), pytest.mark.swarm]

RUN = "state-swarm"
FLOATS = 1 << 18  # a 1 MiB state
RATE = 256 << 10  # bytes per second and connection: about 4 s from one donor, 1.4 s from three
DONOR_SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "state_donor.py"


class Donor:
    """One tests/helpers/state_donor.py process (its own process group: the DHT and p2pd die with it)."""

    def __init__(self, maddr: str, tmp_path: Path, index: int, corrupt: bool = False):
        self.stderr_path = tmp_path / f"donor{index}.err"
        command = [sys.executable, str(DONOR_SCRIPT), "--initial-peer", maddr, "--run", RUN, "--seed", "1",
                   "--floats", str(FLOATS), "--rate", str(RATE)] + (["--corrupt"] if corrupt else [])
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=open(self.stderr_path, "wb"),
                                        text=True, start_new_session=True)
        self.peer_id = ""
        self.sha256 = ""

    def wait_ready(self, deadline: float) -> None:
        line = self.process.stdout.readline()  # the donor prints its ready line within its own 30 s, or exits
        assert line and time.monotonic() < deadline, f"donor did not start: {self.stderr_path.read_text()[-2000:]}"
        ready = json.loads(line)
        self.peer_id, self.sha256 = ready["peer_id"], ready["sha256"]

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)


@pytest.fixture
def donors(dht_node, tmp_path):
    """start(n, corrupt=()) -> (newcomer's DHT, [Donor]) once the newcomer sees all n offers."""
    started: List[Donor] = []

    def start(count: int, corrupt=()):
        boot = dht_node(run_ids=[RUN])
        maddr = str(boot.get_visible_maddrs()[0])
        started.extend(Donor(maddr, tmp_path, i, corrupt=i in corrupt) for i in range(count))
        deadline = time.monotonic() + 90
        for donor in started:
            donor.wait_ready(deadline)
        newcomer = dht_node(initial_peers=[maddr], run_ids=[RUN])
        while len(state_sync.list_state_offers(newcomer, RUN)) < count:
            assert time.monotonic() < deadline, "the newcomer did not see every donor's offer"
            time.sleep(0.3)
        return newcomer, started

    yield start
    for donor in started:
        donor.kill()
    for donor in started:
        assert "Traceback" not in donor.stderr_path.read_text(), donor.stderr_path.read_text()[-3000:]


def _assert_exact(downloaded, donor: "Donor") -> None:
    assert downloaded.sha256 == donor.sha256 and downloaded.epoch == 7
    assert torch.equal(downloaded.state["model"]["w"], donor_state(1, FLOATS)["model"]["w"])


def _once_a_third_arrived(monkeypatch, action) -> threading.Event:
    """Run `action` once, when a third of the state has arrived (the progress bar's hook sees every verified
    piece: the donor is hit while pieces are flowing); the event says it ran."""
    done = threading.Event()

    def hook(self, received: int, total: int) -> None:
        if received > total // 3 and not done.is_set():
            done.set()
            action()

    monkeypatch.setattr(DownloadProgressBar, "_update", hook)
    return done


def test_a_donor_killed_mid_download_leaves_its_pieces_to_the_others(donors, caplog, monkeypatch):
    newcomer, started = donors(3)
    victim = started[0]
    killed = _once_a_third_arrived(monkeypatch, victim.kill)
    with caplog.at_level(logging.WARNING):
        downloaded = download_state(newcomer, RUN, timeout=60, show_progress=False)
    assert killed.is_set()
    _assert_exact(downloaded, started[1])
    assert victim.peer_id in {peer for peer, _ in downloaded.failed_donors}
    assert len(downloaded.donors) >= 2  # pieces came from more than one donor
    departures = [r for r in caplog.records if victim.peer_id[-8:] in r.getMessage()]
    assert departures and all(r.exc_info is None for r in departures)  # log lines, not tracebacks


def test_a_corrupt_piece_is_refetched_and_its_donor_named(donors):
    newcomer, started = donors(3, corrupt=(1,))
    downloaded = download_state(newcomer, RUN, timeout=60, show_progress=False)
    _assert_exact(downloaded, started[0])
    liar = started[1].peer_id
    assert [why for peer, why in downloaded.failed_donors if peer == liar][0].startswith("CorruptPiece")
    assert liar not in downloaded.donors and set(downloaded.donors) <= {started[0].peer_id, started[2].peer_id}


def test_a_state_that_does_not_fit_names_every_donor_that_signed_it(donors):
    """A newcomer configured unlike the swarm (another --task-arg): every donor's state fails its validation. The
    failure names them as misfits, with why, so that the optimizer stops downloading from them (donors.py)."""
    newcomer, started = donors(2)

    def another_model(state) -> None:
        raise ValueError("state tensor w does not match the model")

    with pytest.raises(state_sync.StateDownloadFailed) as failed:
        download_state(newcomer, RUN, timeout=60, show_progress=False, validate=another_model)
    assert failed.value.misfits == {donor.peer_id: "ValueError: state tensor w does not match the model"
                                    for donor in started}


def test_a_stalled_donor_does_not_hold_the_download_to_its_deadline(donors, monkeypatch):
    """A donor frozen mid-download (SIGSTOP: its connections stay open and silent) keeps the range it holds:
    once the other donors have every other piece they fetch that range too (endgame), well before the deadline."""
    newcomer, started = donors(3)
    victim = started[0]
    stopped = _once_a_third_arrived(monkeypatch, lambda: os.killpg(victim.process.pid, signal.SIGSTOP))
    begun = time.monotonic()
    downloaded = download_state(newcomer, RUN, timeout=60, show_progress=False)
    assert stopped.is_set()
    assert time.monotonic() - begun < 20, "the download waited for the stalled donor"
    _assert_exact(downloaded, started[1])
