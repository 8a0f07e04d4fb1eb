"""The simulated swarm of the training level (`Swarm`): per-peer links, compute speeds, the hostile subset and
failure times, and the workload's data (each peer's optimum, the curvature, the loss and its floor; see
`training_config.py` for the problem). One seed gives one swarm: both systems train on the same.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from moshpeer.simulation.training_config import TrainingConfig

HOUR = 3600.0


class Swarm:
    """Per-peer properties and the workload's data; one seed gives one swarm (both systems see the same)."""

    def __init__(self, config: TrainingConfig, seed: int):
        self.config = config.check()
        w = config.workload
        n = config.peers
        data_ss, peer_ss, fail_ss, group_ss, noise_ss, loss_ss = np.random.SeedSequence(seed).spawn(6)
        data_rng, peer_rng = np.random.default_rng(data_ss), np.random.default_rng(peer_ss)
        self.fail_rng = np.random.default_rng(fail_ss)
        self.group_rng = np.random.default_rng(group_ss)
        self.loss_rng = np.random.default_rng(loss_ss)
        self.noise_gen = torch.Generator().manual_seed(int(np.random.default_rng(noise_ss).integers(1 << 62)))
        self.curvature = torch.from_numpy(np.logspace(0, -math.log10(w.condition), w.dim)).float()
        target = data_rng.standard_normal(w.dim)
        self.centers = torch.from_numpy(target + w.heterogeneity * data_rng.standard_normal((n, w.dim))).float()
        self.start = torch.zeros(w.dim)

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
        honest_centers = self.centers[torch.from_numpy(self.honest)]
        self.honest_center_mean = honest_centers.mean(dim=0)
        diff = honest_centers - self.honest_center_mean
        self._floor = float(0.5 * (diff * diff * self.curvature).sum(dim=1).mean())

    def loss_floor(self) -> float:
        """The smallest possible swarm loss: every honest peer at the mean of the honest centers."""
        return self._floor

    def loss(self, models: torch.Tensor) -> float:
        """Mean over rows of the honest peers' mean loss at that row's model (rows: models of honest peers)."""
        diff = models - self.honest_center_mean
        return self._floor + float(0.5 * (diff * diff * self.curvature).sum(dim=1).mean())

    def gradients(self, x: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
        """Minibatch gradients of peers at their models `x` (one row each; `centers`: their rows of the centers)."""
        w = self.config.workload
        noise = torch.randn(x.shape, generator=self.noise_gen).mul_(w.noise / math.sqrt(w.batch))
        return (x - centers).mul_(self.curvature).add_(noise)

    def spread(self, models: torch.Tensor) -> float:
        """Disagreement: mean over rows of 1/2 |x - mean x|_D^2 (the part of the loss that averaging removes)."""
        diff = models - models.mean(dim=0)
        return float(0.5 * (diff * diff * self.curvature).sum(dim=1).mean())

    def next_failure(self, now: np.ndarray) -> np.ndarray:
        """Failure times after `now` (exponential; inf without failures)."""
        rate = self.config.failure_rate_per_hour / HOUR
        if rate <= 0:
            return np.full(np.shape(now), np.inf)
        return now + self.fail_rng.exponential(1 / rate, np.shape(now))
