"""A trainer whose process is paused for a while and then resumes (a suspended VM, a laptop whose lid was closed: here
SIGSTOP and SIGCONT of its process group). It wakes up with its view of the swarm from before the pause. Before the
fix (progress.py's `current`, epoch_credit.py's gap), it took itself for a peer in step with a swarm 60 epochs ahead
and averaged its stale gradients with it for several seconds (in a 30 s pause, for 12 s, and the pair's loss rose
10x); now its first epoch end reads the swarm again and takes a donor's state instead."""

from __future__ import annotations

import os
import signal
import time

import pytest

from training_swarm import start_trainers, timed_events, wait_event

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

# The pause: at least this long (a pause is a duration: the stimulus itself), and until the pair is this far ahead.
MIN_PAUSE_S = 15.0
EPOCHS_AHEAD = 30


def newest_epoch(proc, before: float = float("inf")) -> int:
    return max((e["round_epoch"] for arrived, e in timed_events(proc, "epoch") if arrived < before), default=0)


def test_a_trainer_paused_for_a_while_takes_the_swarms_state_before_it_averages_again(swarm):
    run = "paused"
    boot = swarm.bootstrap(run)
    trainers = start_trainers(swarm, 3, run, boot.maddrs, "--min-peers", "3")
    for trainer in trainers:
        trainer.wait_ready()
    pair, paused = trainers[:2], trainers[2]
    # Epoch 20, not earlier: there two honest donors one epoch apart can still fail the download's cross-check
    # (a training step moves the parameters too much), as in test_outage.
    started = wait_event(paused, "epoch", timeout=120,
                         predicate=lambda e: e.get("group_size") == 3 and e["round_epoch"] >= 20)
    os.killpg(paused.pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        wait_event(pair[0], "epoch", timeout=120,
                   predicate=lambda e: e["round_epoch"] >= started["round_epoch"] + EPOCHS_AHEAD)
        time.sleep(max(0.0, stopped_at + MIN_PAUSE_S - time.monotonic()))
    finally:
        os.killpg(paused.pid, signal.SIGCONT)
    resumed_at = time.monotonic()
    at_pause = newest_epoch(paused, before=resumed_at)  # every line it printed before the stop has arrived by now
    swarm_epoch = max(newest_epoch(mate, before=resumed_at) for mate in pair)

    caught = paused.wait_for_line(lambda line: "caught up: epoch" in line, timeout=60, stream="stderr")
    assert int(caught.split("caught up: epoch ")[1].split()[0]) >= swarm_epoch - 2  # the swarm's state, not an old one
    # Between the pause and that state, no round of its own averaged with a group: the one in flight when it was
    # stopped (epoch at_pause + 1) may have ended either way, a later one must not have mixed in stale work.
    wait_event(paused, "epoch", timeout=30, predicate=lambda e: e.get("error") == "caught up")
    after = [e for arrived, e in timed_events(paused, "epoch") if arrived >= resumed_at]
    until_caught_up = after[:next(k for k, e in enumerate(after) if e.get("error") == "caught up")]
    stale = [e["round_epoch"] for e in until_caught_up
             if e.get("ok") and e.get("group_size", 1) > 1 and e["round_epoch"] > at_pause + 1]
    assert not stale, f"averaged the work of epochs {stale} with a swarm at {swarm_epoch} after the pause"
    # ... and it averages with the pair again.
    wait_event(paused, "epoch", timeout=60,
               predicate=lambda e: e.get("group_size") == 3 and e["round_epoch"] > swarm_epoch)
    for proc in (*trainers, boot):
        assert proc.terminate() == 0, proc.describe()
