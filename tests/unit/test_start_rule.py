"""Production's start rule (`checkpoint.staleness.start_decision`: train on, resume from the checkpoint, or
download) and the simulator's rejoining peers, which call it on production's view of the swarm epoch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moshpeer.peer.checkpoint.staleness import Start, start_decision
from moshpeer.simulation.rejoin import downloads_on_rejoin, kept_checkpoints
from moshpeer.simulation.training import MoshpitTraining, TrainingConfig, Workload

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)


@pytest.mark.parametrize("swarm,local,from_checkpoint,limit,expected", [
    (5, 5, True, 1, Start.TRAIN_ON),
    (5, 7, False, 1, Start.TRAIN_ON),  # ahead of the swarm's view: nothing to fetch
    (0, 0, False, 1, Start.TRAIN_ON),  # the first peer of a run
    (5, 4, True, 1, Start.RESUME),
    (5, 2, True, 3, Start.RESUME),
    (5, 3, True, 1, Start.DOWNLOAD),  # the checkpoint is too stale
    (5, 4, True, 0, Start.DOWNLOAD),
    (5, 0, False, 1, Start.DOWNLOAD),  # a new peer, or one that lost its state
    (1, 0, False, 100, Start.DOWNLOAD),  # the limit is about checkpoints only
])
def test_start_decision(swarm, local, from_checkpoint, limit, expected):
    assert start_decision(swarm, local, from_checkpoint, limit) is expected


def test_rejoining_peers_read_the_swarm_epoch_as_the_upper_median_of_the_live_trainers():
    live = np.array([3, 10, 10, 11])  # a laggard and an outlier: the swarm is at 10
    epochs = np.array([9, 8, 9, 10])
    kept = np.array([True, True, False, False])
    assert downloads_on_rejoin(epochs, kept, live, max_staleness=1).tolist() == [False, True, True, True]
    # The last one is at the swarm's epoch but lost its state: a fresh model is at epoch 0.


def test_no_resume_fraction_draws_nothing_from_the_failure_stream():
    rng = np.random.default_rng(0)
    assert not kept_checkpoints(5, 0.0, rng).any()
    assert rng.random() == np.random.default_rng(0).random()
    assert kept_checkpoints(1000, 0.3, np.random.default_rng(1)).mean() == pytest.approx(0.3, abs=0.05)


def _failing_swarm(**overrides) -> MoshpitTraining:
    # Rounds of 50 x 32 / 16 = 100 s; a failed peer is away 60 s on average, so it often misses 0 or 1 round.
    config = TrainingConfig(peers=16, group_size=8, rounds=40, inner_steps=50, model_params=1_000_000,
                            workload=Workload(dim=16, lr=0.05, batch=32), failure_rate_per_hour=6.0, rejoin_s=60.0,
                            **overrides)
    sim = MoshpitTraining(config.check(), seed=2)
    sim.run()
    return sim


def test_simulated_peers_without_checkpoints_always_download():
    sim = _failing_swarm()
    result = sim.result()
    assert result.failures > 5
    assert result.checkpoint_resumes == 0 and result.state_downloads > 0
    # A DiLoCo state is θ_outer and its momentum in fp32; the figure is per peer of the swarm.
    assert result.state_bytes_per_peer == pytest.approx(result.state_downloads * 2 * 1_000_000 * 4 / 16)


def test_simulated_peers_with_checkpoints_resume_when_the_swarm_is_close_and_download_when_it_is_not():
    close = _failing_swarm(resume_fraction=1.0, max_staleness=1).result()
    assert close.checkpoint_resumes > 0 and close.state_downloads > 0  # some were away longer than a round
    patient = _failing_swarm(resume_fraction=1.0, max_staleness=1000).result()
    assert patient.state_downloads == 0 and patient.checkpoint_resumes > 0 and patient.state_bytes_per_peer == 0
    strict = _failing_swarm(resume_fraction=1.0, max_staleness=0).result()
    assert strict.checkpoint_resumes <= close.checkpoint_resumes
    assert np.isfinite(patient.final_loss)


def test_a_downloader_takes_its_donors_epoch_and_a_resumed_peer_keeps_its_own():
    downloading, resuming = _failing_swarm(), _failing_swarm(resume_fraction=1.0, max_staleness=1000)
    for sim in (downloading, resuming):
        assert (sim.epoch <= sim.round).all()  # an epoch counts the rounds a peer applied

    def spread(sim: MoshpitTraining) -> int:
        live = sim.down_until <= sim.clock
        return int(np.ptp(sim.epoch[live]))

    # Downloaders come back at a live peer's epoch; resumed peers keep the rounds they missed behind them.
    assert spread(downloading) < spread(resuming)
