"""A trainer whose process is paused for a while and then resumes (a suspended VM, a laptop whose lid was closed: here
SIGSTOP and SIGCONT of its process group). It wakes up with its view of the swarm from before the pause. Before the
fix (progress.py's `current`, epoch_credit.py's gap), it took itself for a peer in step with a swarm 60 epochs ahead
and averaged its stale gradients with it for several seconds (in a 30 s pause, for 12 s, and the pair's loss rose
10x); now its first epoch end reads the swarm again and takes a donor's state instead.

The same when only its p2pd stalls (a wedged libp2p daemon: SIGSTOP of p2pd alone): the trainer runs on, but every read
of the swarm's progress fails. Before the fix (a view that reads have not renewed for long is stale), it averaged the
gradients of epochs 10-15 with a swarm at epoch 26 for 1.4 s after the stall ended. And in 2 runs of 17 it never read
the swarm again: its heartbeat waited, without a deadline, for an answer the DHT process had lost in the stall (it let
the request's task be garbage-collected), so it never rejoined (node.py's `SwarmDHT._run_coroutine`)."""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest

from moshpeer.peer.optimizer.epoch_loop import CAUGHT_UP, MISSED_CAUGHT_UP, REJOINED
from training_swarm import start_trainers, timed_events, wait_event

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

# The pause: at least this long (a pause is a duration: the stimulus itself), and until the pair is this far ahead.
# A stalled p2pd must outlast 3 of the progress cadence's longest intervals (5 s) for the view to count as stale.
MIN_PAUSE_S = {"process": 15.0, "p2pd": 20.0}
EPOCHS_AHEAD = 30
# How its catch-up epoch says it took the swarm's state: "caught up" when its first fresh read shows the swarm ahead;
# "back from an outage; ..." when its DHT lost every neighbour in the stall and it rejoined (it trained alone since);
# "missed round; caught up" when it was stopped while it waited for a round's result: that round failed, and it took
# the swarm's state instead (a CI rehearsal's run stopped it there, session 48).
CATCH_UPS = (CAUGHT_UP, REJOINED, MISSED_CAUGHT_UP)


def newest_epoch(proc, before: float = float("inf")) -> int:
    return max((e["round_epoch"] for arrived, e in timed_events(proc, "epoch") if arrived < before), default=0)


@pytest.mark.parametrize("stopped", ["process", "p2pd"])
def test_a_trainer_paused_for_a_while_takes_the_swarms_state_before_it_averages_again(swarm, stopped):
    run = f"paused-{stopped}"
    boot = swarm.bootstrap(run)
    trainers = start_trainers(swarm, 3, run, boot.maddrs, "--min-peers", "3")
    for trainer in trainers:
        trainer.wait_ready()
    pair, paused = trainers[:2], trainers[2]
    # Epoch 20, not earlier: there two honest donors one epoch apart can still fail the download's cross-check
    # (a training step moves the parameters too much), as in test_outage.
    started = wait_event(paused, "epoch", timeout=120,
                         predicate=lambda e: e.get("group_size") == 3 and e["round_epoch"] >= 20)
    if stopped == "p2pd":
        (p2pd,) = paused.p2pd_processes()
        send = functools.partial(os.kill, p2pd.pid)
    else:
        send = functools.partial(os.killpg, paused.pid)
    send(signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        wait_event(pair[0], "epoch", timeout=120,
                   predicate=lambda e: e["round_epoch"] >= started["round_epoch"] + EPOCHS_AHEAD)
        time.sleep(max(0.0, stopped_at + MIN_PAUSE_S[stopped] - time.monotonic()))
    finally:
        send(signal.SIGCONT)
    resumed_at = time.monotonic()
    at_pause = newest_epoch(paused, before=resumed_at)  # every line it printed before the stop has arrived by now
    swarm_epoch = max(newest_epoch(mate, before=resumed_at) for mate in pair)

    caught = paused.wait_for_line(lambda line: "caught up: epoch" in line, timeout=60, stream="stderr")
    assert int(caught.split("caught up: epoch ")[1].split()[0]) >= swarm_epoch - 2  # the swarm's state, not an old one
    # Between the pause and that state, no round of its own averaged with a group: the one in flight when it was
    # stopped (epoch at_pause + 1) may have ended either way, a later one must not have mixed in stale work.
    wait_event(paused, "epoch", timeout=30, predicate=lambda e: e.get("error") in CATCH_UPS)
    after = [e for arrived, e in timed_events(paused, "epoch") if arrived >= resumed_at]
    until_caught_up = after[:next(k for k, e in enumerate(after) if e.get("error") in CATCH_UPS)]
    stale = [e["round_epoch"] for e in until_caught_up
             if e.get("ok") and e.get("group_size", 1) > 1 and e["round_epoch"] > at_pause + 1]
    assert not stale, f"averaged the work of epochs {stale} with a swarm at {swarm_epoch} after the pause"
    # ... and it averages with the pair again.
    wait_event(paused, "epoch", timeout=60,
               predicate=lambda e: e.get("group_size") == 3 and e["round_epoch"] > swarm_epoch)
    for proc in (*trainers, boot):
        assert proc.terminate() == 0, proc.describe()
