"""Training under packet loss: `moshpeer join` peers on the built-in digits classifier, 10% of every
averaging round's chunks dropped in the real transport, reconstructed without bias.

Default: 2 peers with 10% random chunk loss against the lossless reference with the same global
batch and sample budget (one process: what a lossless gradient-averaging swarm computes, see
test_training.py). Slow: 4 peers, a lossless swarm and a lossy swarm with the same data seeds.
"""

from __future__ import annotations

import subprocess
import sys
from typing import List, Sequence, Tuple

import pytest

from moshpeer.peer.tasks import load_task, train_locally
from training_swarm import events, start_trainers, wait_event

pytestmark = pytest.mark.timeout(300)

TARGET_BATCH = 256
# 4 KiB chunks: the digits model's averaged buffer (gradients + parameters, 52k values) is cut into ~50
# chunks per peer and phase, so 10% chunk loss is 10% of the values, not all-or-nothing.
LOSSY = ("--chunk-bytes", "4096", "--faults", "drop_prob=0.1,seed=7", "--loss-budget", "phase")
TOLERANCE = 0.01  # 1 percentage point of accuracy


def lossless_reference(epochs: int, seeds: int = 3) -> float:
    """Mean accuracy of lossless large-batch training over a few data orders (a swarm's peers read
    their own shuffles, so the data order is not the reference's anyway)."""
    runs = [train_locally(load_task("digits"), num_samples=epochs * TARGET_BATCH, global_batch_size=TARGET_BATCH,
                          seed=seed) for seed in range(seeds)]
    return sum(run.metrics["accuracy"] for run in runs) / seeds


def train_swarm(swarm, run_id: str, peers: int, epochs: int, extra: Sequence[str] = ()) -> Tuple[List[dict], list]:
    """Run `peers` trainers (data seeds 0..peers-1) to `epochs` epochs; returns their "done" events and
    their "epoch" events (every peer must exit cleanly)."""
    boot = swarm.bootstrap(run_id, "--heartbeat", "1")
    procs = [proc for i in range(peers)
             for proc in start_trainers(swarm, 1, run_id, boot.maddrs, "--group-size", str(peers), "--min-peers",
                                        str(peers), "--max-epochs", str(epochs), "--eval-every", str(epochs),
                                        "--seed", str(i), *extra)]
    done = [wait_event(proc, "done", timeout=260) for proc in procs]
    for proc in procs:
        assert proc.wait_exit(30) == 0, proc.describe()
        assert "Traceback" not in proc.stderr, proc.describe(40)
    return done, [events(proc, "epoch") for proc in procs]


def assert_lossy_rounds(epoch_events: List[List[dict]]) -> None:
    """The rounds did lose chunks (about 10%), and every epoch line says which phase and budget applied."""
    rounds = [e for peer in epoch_events for e in peer if e["ok"]]
    assert len(rounds) >= 0.8 * sum(len(peer) for peer in epoch_events), "most rounds must average"
    lost = sum(e["lost_fraction"] for e in rounds) / len(rounds)
    phases = [e["loss_phase"] for e in rounds]
    print(f"mean lost fraction {lost:.3f}; rounds critical {phases.count('critical')}, normal {phases.count('normal')}")
    assert 0.05 < lost < 0.15, lost
    for e in rounds:
        assert e["loss_phase"] in ("critical", "normal") and e["loss_budget"] in (0.02, 0.42), e
        assert e["grad_norm"] is not None and e["grad_norm"] > 0
    assert rounds[0]["loss_phase"] == "critical"  # training starts in a critical phase


@pytest.mark.swarm
def test_ten_percent_chunk_loss_costs_at_most_one_point_of_accuracy(swarm):
    epochs = 30  # near convergence: 24 epochs left the lossy runs ~0.5 point behind, too close to the bound
    done, epoch_events = train_swarm(swarm, "lossy2", 2, epochs, LOSSY)
    assert_lossy_rounds(epoch_events)
    reference = lossless_reference(epochs)
    print(f"lossless reference {reference:.4f}; lossy peers {[d['metrics']['accuracy'] for d in done]}")
    for summary in done:
        assert summary["epochs"] == epochs and summary["reason"] == "max_epochs"
    # The swarm's accuracy: its peers' mean (a round that lost some averaged chunks leaves peers slightly apart).
    accuracy = sum(d["metrics"]["accuracy"] for d in done) / len(done)
    assert accuracy >= reference - TOLERANCE, (accuracy, reference)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_four_peers_lossy_swarm_matches_lossless_swarm(swarm):
    epochs = 30
    lossless, _ = train_swarm(swarm, "lossless4", 4, epochs)
    lossy, epoch_events = train_swarm(swarm, "lossy4", 4, epochs, LOSSY)
    assert_lossy_rounds(epoch_events)
    mean = lambda runs: sum(d["metrics"]["accuracy"] for d in runs) / len(runs)  # noqa: E731
    assert mean(lossy) >= mean(lossless) - TOLERANCE, (mean(lossy), mean(lossless))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags", [("--loss-budget", "0.5,0.1"), ("--faults", "drop_prob=2")])
def test_bad_loss_budget_flags_fail_with_one_line(flags):
    result = subprocess.run([sys.executable, "-m", "moshpeer", "join", "--run-id", "x", *flags],
                            capture_output=True, text=True, timeout=50)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
