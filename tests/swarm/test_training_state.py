"""State download through the real CLI: a late joiner adopts a donor's state; a dying donor is replaced."""

from __future__ import annotations

import time

import pytest

from training_swarm import events, start_trainers, wait_event

pytestmark = [pytest.mark.timeout(240), pytest.mark.swarm]


def test_late_joiner_downloads_state_and_survives_a_dying_donor(swarm):
    run = "late"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    # Two donors, throttled so that a download takes seconds and one can die in the middle of it.
    donors = start_trainers(swarm, 2, run, boot.maddrs, "--group-size", "2", "--min-peers", "2",
                            "--max-epochs", "400", "--eval-every", "50", "--state-rate", "60000")
    for donor in donors:
        donor.wait_ready()
        wait_event(donor, "epoch", timeout=120, predicate=lambda e: e["epoch"] >= 3)

    # Donors may already have served each other (a peer that fell behind catches up): count only
    # transfers that start after the newcomer does.
    serving = "serving state of epoch"
    served_before = [sum(serving in line for line in list(d.stderr_lines)) for d in donors]
    (newcomer,) = start_trainers(swarm, 1, run, boot.maddrs, "--group-size", "2", "--max-epochs", "400",
                                 "--eval-every", "50")
    # Whichever donor the newcomer asks first dies while it is sending.
    deadline = time.monotonic() + 90
    first = None
    while first is None:
        assert time.monotonic() < deadline, "the newcomer never asked a donor for state"
        for donor, before in zip(donors, served_before):
            if sum(serving in line for line in list(donor.stderr_lines)) > before:
                first = donor
                break
        time.sleep(0.02)
    first_id = first.peer_id
    first.kill()
    survivor = next(d for d in donors if d is not first)

    loaded = wait_event(newcomer, "state_loaded", timeout=90)
    assert loaded["donor"] == survivor.peer_id
    assert first_id in loaded["failed_donors"], loaded
    assert loaded["epoch"] >= 3

    # After the download, the newcomer's parameters are exactly the donor's at that epoch.
    donor_epoch = wait_event(survivor, "epoch", timeout=60, predicate=lambda e: e["epoch"] == loaded["epoch"])
    assert donor_epoch["params_digest"] == loaded["params_digest"]

    # And the newcomer trains on from there.
    later = wait_event(newcomer, "epoch", timeout=60, predicate=lambda e: e["epoch"] > loaded["epoch"])
    assert later["epoch"] == loaded["epoch"] + 1 or later["previous_epoch"] >= loaded["epoch"]
    for proc in (survivor, newcomer):
        assert proc.terminate(timeout=10) == 0, proc.describe()
        assert "Traceback" not in proc.stderr, proc.describe(40)
    assert events(newcomer, "state_loaded") == [loaded]
