"""Collaborative training through the real CLI: `moshpeer join` peers on the built-in digits task."""

from __future__ import annotations

import pytest

from moshpeer.peer.tasks import load_task, train_locally
from training_swarm import events, start_trainers, wait_event

pytestmark = [pytest.mark.timeout(240), pytest.mark.swarm]

EPOCHS = 24
TARGET_BATCH = 256


def single_process_accuracy(epochs: int) -> float:
    """One process, same global batch, same number of samples."""
    run = train_locally(load_task("digits"), num_samples=epochs * TARGET_BATCH, global_batch_size=TARGET_BATCH)
    return run.metrics["accuracy"]


def test_two_peers_gradient_averaging_matches_single_process(swarm):
    run = "grad2"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    peers = start_trainers(swarm, 2, run, boot.maddrs, "--group-size", "2", "--min-peers", "2",
                           "--max-epochs", str(EPOCHS), "--eval-every", "4", first_seed=0)
    done = [wait_event(peer, "done", timeout=200) for peer in peers]
    for peer in peers:
        assert peer.wait_exit(30) == 0, peer.describe()
        assert "Traceback" not in peer.stderr, peer.describe(40)

    epochs = [events(peer, "epoch") for peer in peers]
    for peer_epochs in epochs:
        assert [e["epoch"] for e in peer_epochs] == list(range(1, EPOCHS + 1))
        # Each peer computed its share of the global batch every epoch.
        off_share = [(e["epoch"], e["num_trainers"], e["samples"], e["swarm_samples"], e["error"])
                     for e in peer_epochs if e["samples"] != TARGET_BATCH // 2]
        assert not off_share, (off_share, [peer.describe(30) for peer in peers])
    # Rounds in a full group give both peers the same averaged gradient: identical parameters.
    both_ok = [a["ok"] and b["ok"] for a, b in zip(*epochs)]
    assert sum(both_ok) >= EPOCHS - 2, "\n".join(
        [f"epoch {a['epoch']}: {a['error']!r} (group {a['group_size']}) | {b['error']!r} (group {b['group_size']})"
         for a, b in zip(*epochs)] + [peer.describe(15) for peer in peers])
    assert done[0]["params_digest"] == done[1]["params_digest"] or not all(both_ok)
    assert all(e["group_size"] == 2 for e in epochs[0] if e["ok"])

    reference = single_process_accuracy(EPOCHS)
    for summary in done:
        assert summary["epochs"] == EPOCHS and summary["reason"] == "max_epochs"
        assert summary["metrics"]["accuracy"] >= reference - 0.015, (summary["metrics"], reference)
        assert summary["metrics"]["accuracy"] > 0.9
