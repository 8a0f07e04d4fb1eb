"""The simulated swarm of the training level (`Swarm`): per-peer links, compute speeds, the hostile subset and
failure times, and the problem it trains (problems.py: each peer's data, gradients, the loss and its floor). One
seed gives one swarm: both systems train on the same.
"""

from __future__ import annotations


import numpy as np
import torch

from moshpeer.simulation.problems import Problem, make_problem
from moshpeer.simulation.training_config import TrainingConfig

HOUR = 3600.0


class Swarm:
    """Per-peer properties and the problem; one seed gives one swarm (both systems see the same)."""

    def __init__(self, config: TrainingConfig, seed: int):
        self.config = config.check()
        n = config.peers
        data_ss, peer_ss, fail_ss, group_ss, noise_ss, loss_ss = np.random.SeedSequence(seed).spawn(6)
        data_rng, peer_rng = np.random.default_rng(data_ss), np.random.default_rng(peer_ss)
        self.fail_rng = np.random.default_rng(fail_ss)
        self.group_rng = np.random.default_rng(group_ss)
        self.loss_rng = np.random.default_rng(loss_ss)
        noise_gen = torch.Generator().manual_seed(int(np.random.default_rng(noise_ss).integers(1 << 62)))

        def spread(sd: float) -> np.ndarray:
            return np.exp(sd * peer_rng.standard_normal(n) - sd * sd / 2) if sd > 0 else np.ones(n)

        self.uplink = config.uplink * spread(config.link_spread)
        self.downlink = config.downlink * spread(config.link_spread)
        self.rtt = config.rtt_s * spread(config.link_spread)
        self.speed = config.speed * spread(config.speed_spread)
        hostile = int(round(config.hostile_fraction * n))
        self.hostile = np.zeros(n, dtype=bool)
        self.hostile[peer_rng.choice(n, hostile, replace=False)] = True
        self.honest = ~self.hostile
        self.problem: Problem = make_problem(config.workload, n, self.honest, data_rng, noise_gen)

    def next_failure(self, now: np.ndarray) -> np.ndarray:
        """Failure times after `now` (exponential; inf without failures)."""
        rate = self.config.failure_rate_per_hour / HOUR
        if rate <= 0:
            return np.full(np.shape(now), np.inf)
        return now + self.fail_rng.exponential(1 / rate, np.shape(now))
