"""A swarm of 4 `moshpeer join` peers where one is preempted (SIGTERM) and rejoins with its checkpoint
directory: the others never stall past a round deadline, and the rejoined peer, whose checkpoint is
now too stale, downloads fresher state and catches up to the swarm's epoch.
"""

from __future__ import annotations

import signal
import time

import pytest

from training_swarm import FAST_TRAINING, events, start_trainers, wait_event
from swarm import LOOPBACK

pytestmark = [pytest.mark.timeout(300), pytest.mark.swarm]

GRACE = 20.0
STARTUP = 150.0
# Longest a survivor may go between two epochs: matchmaking twice, the round's deadline (both from
# FAST_TRAINING), the optimizer's 5 s margin, and a little compute. A peer that waited on a
# departed group member until its round gave up would still fit; one that hung would not.
MATCHMAKING_S, ROUND_TIMEOUT_S = 1.0, 10.0
ROUND_DEADLINE_S = 2 * MATCHMAKING_S + ROUND_TIMEOUT_S + 5.0
assert FAST_TRAINING[FAST_TRAINING.index("--round-timeout") + 1] == str(int(ROUND_TIMEOUT_S))


def latest_epoch(peer) -> int:
    epochs = events(peer, "epoch")
    return epochs[-1]["epoch"] if epochs else 0


def epoch_gaps(peer) -> list:
    """Seconds between consecutive epoch events of a peer (from the times it printed)."""
    times = [e["time"] for e in events(peer, "epoch")]
    return [b - a for a, b in zip(times, times[1:])]


def test_preempted_peer_rejoins_and_catches_up_without_stalling_the_others(swarm, tmp_path):
    run = "preempt4"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    common = ("--group-size", "4", "--min-peers", "4", "--eval-every", "50", "--max-seconds", "240")
    survivors = start_trainers(swarm, 3, run, boot.maddrs, *common)
    victim_args = ("join", "--initial-peers", *boot.maddrs, "--run-id", run, "--host-maddrs", LOOPBACK,
                   *FAST_TRAINING, *common, "--checkpoint-dir", str(tmp_path / "victim"),
                   "--grace-period", str(GRACE))
    victim = swarm.spawn(*victim_args, name="victim")

    wait_event(victim, "epoch", timeout=STARTUP, predicate=lambda e: e["epoch"] >= 3)
    sent = time.monotonic()
    victim.send_signal(signal.SIGTERM)
    assert victim.wait_exit(GRACE + 15) == 0, victim.describe(40)
    assert time.monotonic() - sent < GRACE
    final = [e for e in events(victim, "checkpoint") if e["kind"] == "final"]
    assert len(final) == 1, victim.describe(40)
    saved_epoch = final[0]["epoch"]

    # The swarm goes on without it, past the staleness limit (1 epoch by default).
    for peer in survivors:
        wait_event(peer, "epoch", timeout=90, predicate=lambda e: e["epoch"] >= saved_epoch + 3)

    rejoined = swarm.spawn(*victim_args, name="rejoined")
    resumed = wait_event(rejoined, "resumed", timeout=STARTUP)
    assert resumed["file"] == final[0]["file"] and resumed["epoch"] == saved_epoch
    stale = wait_event(rejoined, "checkpoint_stale", timeout=60)
    assert stale["checkpoint_epoch"] == saved_epoch and stale["swarm_epoch"] > saved_epoch + 1
    loaded = wait_event(rejoined, "state_loaded", timeout=90)
    assert loaded["epoch"] >= stale["swarm_epoch"] - 1
    # Caught up: it trains in step with the swarm's epoch.
    swarm_epoch = max(latest_epoch(peer) for peer in survivors)
    wait_event(rejoined, "epoch", timeout=90, predicate=lambda e: e["epoch"] >= swarm_epoch)
    time_of_catch_up = max(latest_epoch(peer) for peer in survivors)
    assert latest_epoch(rejoined) >= time_of_catch_up - 1

    for peer in survivors:
        gaps = epoch_gaps(peer)
        print(f"{peer.name}: {len(gaps)} epoch gaps, longest {max(gaps):.2f} s (limit {ROUND_DEADLINE_S:g} s)")
        assert len(gaps) >= 6 and max(gaps) < ROUND_DEADLINE_S, (max(gaps), gaps, peer.describe())
    for peer in [*survivors, rejoined]:
        assert peer.terminate(timeout=30) == 0, peer.describe(40)
        assert "Traceback" not in peer.stderr, peer.describe(60)
