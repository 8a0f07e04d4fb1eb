"""A peer killed in the middle of an averaging round: the survivors go on, and their logs stay clean."""

from __future__ import annotations

import pytest

from swarm import FORBIDDEN_STDERR
from training_swarm import events, start_trainers, wait_event

pytestmark = [pytest.mark.timeout(240), pytest.mark.swarm]


def test_survivors_of_a_peer_killed_mid_round_log_no_traceback(swarm):
    run = "killed"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    common = ("--group-size", "3", "--min-peers", "3", "--max-epochs", "400", "--eval-every", "50",
              "--chunk-bytes", "4096")
    survivors = start_trainers(swarm, 2, run, boot.maddrs, *common)
    # The victim sends each 4 KiB chunk 50 ms late, so its rounds last long enough to be killed inside one.
    (victim,) = start_trainers(swarm, 1, run, boot.maddrs, *common, "--faults", "delay=0.05")
    for peer in (*survivors, victim):
        wait_event(peer, "epoch", timeout=120, predicate=lambda e: e["epoch"] >= 2)

    # Killed as soon as it has a group: its data plane has seconds of delayed chunks still to send.
    victim.wait_for_line(lambda line: "group of 3 assembled" in line, timeout=60, stream="stderr")
    victim.kill()

    # The survivors notice (a lost round, a missing member) and train on for several epochs.
    for peer in survivors:
        now = events(peer, "epoch")[-1]["epoch"]
        wait_event(peer, "epoch", timeout=120, predicate=lambda e: e["epoch"] >= now + 3)
    for peer in survivors:
        assert peer.terminate(timeout=10) == 0, peer.describe(40)
        for marker in FORBIDDEN_STDERR:
            assert marker not in peer.stderr, peer.describe(60)
