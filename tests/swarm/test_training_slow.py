"""Longer collaborative-training runs through the real CLI (marked slow: `pytest -m slow`)."""

from __future__ import annotations

import statistics

import pytest

from test_training import TARGET_BATCH, single_process_accuracy
from training_swarm import events, start_trainers, wait_event

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_four_peers_gradient_mode_within_one_point_of_single_process(swarm):
    epochs = 60
    run = "grad4"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    peers = start_trainers(swarm, 4, run, boot.maddrs, "--group-size", "4", "--min-peers", "4",
                           "--max-epochs", str(epochs), "--eval-every", "10")
    done = [wait_event(peer, "done", timeout=500) for peer in peers]
    for peer in peers:
        assert peer.wait_exit(30) == 0, peer.describe()
    for peer in peers:
        # Every epoch is this peer's share of the global batch, except the few where it fell behind
        # (a round it missed on a loaded machine) and caught up by downloading state instead.
        odd = [e for e in events(peer, "epoch") if e["samples"] != TARGET_BATCH // 4]
        assert all(e["error"] == "caught up" for e in odd) and len(odd) <= epochs // 10, odd
    reference = single_process_accuracy(epochs)
    for summary in done:
        assert summary["epochs"] == epochs
        assert abs(summary["metrics"]["accuracy"] - reference) <= 0.01, (summary["metrics"], reference)


def test_parameter_averaging_converges(swarm):
    run = "params4"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    peers = start_trainers(swarm, 4, run, boot.maddrs, "--averaging", "parameters", "--group-size", "2",
                           "--min-peers", "4", "--max-epochs", "30", "--eval-every", "10")
    done = [wait_event(peer, "done", timeout=500) for peer in peers]
    accuracies = [summary["metrics"]["accuracy"] for summary in done]
    assert min(accuracies) > 0.93, accuracies
    # Groups of 2 in a swarm of 4: parameters spread between groups, and Moshpit rounds pull them together.
    spreads = [e["param_spread"] for peer in peers for e in events(peer, "epoch")[10:] if e["param_spread"] is not None]
    assert spreads and statistics.median(spreads) < 0.05, spreads[:20]


def test_one_of_four_killed_others_finish_well(swarm):
    run = "kill4"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    peers = start_trainers(swarm, 4, run, boot.maddrs, "--group-size", "4", "--min-peers", "4",
                           "--max-epochs", "45", "--eval-every", "15")
    wait_event(peers[0], "epoch", timeout=120, predicate=lambda e: e["epoch"] >= 8)
    victim, survivors = peers[3], peers[:3]
    victim.kill()
    killed_at_epoch = max(e["epoch"] for e in events(peers[0], "epoch"))
    done = [wait_event(peer, "done", timeout=400) for peer in survivors]
    for summary, peer in zip(done, survivors):
        assert summary["epochs"] == 45 and summary["metrics"]["accuracy"] > 0.93, summary
        after = [e for e in events(peer, "epoch") if e["epoch"] > killed_at_epoch + 5]
        # Once the dead peer's record expired, the survivors average among themselves.
        assert after and all(e["num_trainers"] == 3 for e in after)
        assert sum(e["ok"] and e["group_size"] == 3 for e in after) >= len(after) // 2


def test_dropcompute_budget_bounds_steps_with_a_heavy_tailed_straggler(swarm):
    run = "straggler"
    budget, mean_delay = 0.5, 1.0
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    common = ("--group-size", "2", "--min-peers", "2", "--max-epochs", "30", "--eval-every", "10",
              "--compute-budget", str(budget))
    (fast,) = start_trainers(swarm, 1, run, boot.maddrs, *common)
    (slow,) = start_trainers(swarm, 1, run, boot.maddrs, *common,
                             "--straggler", f"lognormal:mean_s={mean_delay},sigma=1.0,seed=1")
    done = [wait_event(peer, "done", timeout=500) for peer in (fast, slow)]
    slow_epochs = events(slow, "epoch")
    # The straggler stops at the budget instead of computing its whole share (4 micro-batches, ~4 s).
    assert sum(e["stopped_by_budget"] for e in slow_epochs) >= len(slow_epochs) * 0.7
    assert statistics.mean(e["samples"] for e in slow_epochs) < TARGET_BATCH // 2
    durations = [b["time"] - a["time"] for a, b in zip(slow_epochs, slow_epochs[1:])]
    no_budget_step_s = (TARGET_BATCH // 2 // 32) * mean_delay
    assert statistics.median(durations) < 0.6 * no_budget_step_s, durations
    # The fast peer does not wait for the straggler past the budget either (the matchmaking window ends
    # at the budget deadline): its epochs take about the budget, not the straggler's ~4 s.
    fast_epochs = events(fast, "epoch")
    fast_durations = [b["time"] - a["time"] for a, b in zip(fast_epochs, fast_epochs[1:])]
    assert statistics.median(fast_durations) < 0.4 * no_budget_step_s, fast_durations
    for summary in done:
        assert summary["metrics"]["accuracy"] > 0.9, summary
