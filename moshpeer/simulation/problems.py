"""What the training level trains: a problem holds each peer's data and computes minibatch gradients, the swarm's
loss and its floor, for many models at once (one row per model). `make_problem` builds the one a `Workload` names.

- `Quadratic` (`kind="quadratic"`): least squares in its population form. Peer i's loss is
  f_i(x) = 1/2 (x - c_i)^T D (x - c_i), D diagonal with eigenvalues log-spaced in [1/condition, 1], c_i = c* + a
  per-peer offset (non-IID shards, `heterogeneity`); a minibatch of B samples gives the gradient D (x - c_i) plus
  N(0, noise^2 / B) per coordinate. The loss is the mean of the honest peers' f_i, so its floor (every honest peer
  at the mean of their c_i) is the spread of the c_i. Convex, and every figure has a closed form.
- `TeacherMLP` (`kind="mlp"`): a small non-convex model whose gradients are cheap. A one-hidden-layer tanh network
  (`dim` inputs, `hidden` units, one output) learns a fixed teacher network of the same shape from noisy labels
  (sd `noise`). Shards are non-IID by covariate shift: peer i draws its inputs from N(m_i, I), m_i ~
  N(0, heterogeneity^2 I), labelled by the same teacher. The loss is the expected squared error on the honest peers'
  input mixture, 1/2 E (f(x) - y)^2 (a fixed evaluation set of `EVAL_SAMPLES` inputs, exact teacher outputs, plus
  the label noise's 1/2 noise^2); since the student can represent the teacher, the floor is 1/2 noise^2. Gradients
  are written out by hand over batched matrix products, so 1,000 peers take one step in milliseconds.

Failure semantics: constructors trust a `Workload` that passed `check()`; methods raise nothing of their own.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:  # training_config imports nothing from here; the hint only
    from moshpeer.simulation.training_config import Workload

# The MLP's loss is estimated on this many inputs of the honest peers' mixture, and over at most this many models
# (evenly spaced rows): a curve point costs milliseconds at 1,000 peers, at the price of a sampled estimate.
EVAL_SAMPLES = 512
MAX_EVAL_MODELS = 128
# The teacher's output weights are scaled so that its output has about unit variance on its inputs.
TEACHER_OUTPUT_GAIN = 1.6


class Problem(Protocol):
    """What the training level needs from a workload (rows of `models` and `x` are flat parameter vectors)."""

    dim: int  # parameters per model
    start: torch.Tensor  # every peer's first model

    def gradients(self, x: torch.Tensor, peers: np.ndarray) -> torch.Tensor:
        """Minibatch gradients of `peers` (one row each) at their models `x`."""

    def mean_gradient(self, x: torch.Tensor, peers: np.ndarray) -> torch.Tensor:
        """The mean of `peers`' minibatch gradients at one model `x` (the synchronous baseline's step)."""

    def loss(self, models: torch.Tensor) -> float:
        """The honest peers' loss, averaged over the rows of `models`."""

    def loss_floor(self) -> float:
        """The smallest loss any model reaches."""

    def spread(self, models: torch.Tensor) -> float:
        """Disagreement between the rows of `models` (0 when they are equal)."""


class Quadratic:
    """The convex problem (module docstring)."""

    def __init__(self, workload: "Workload", peers: int, honest: np.ndarray, data_rng: np.random.Generator,
                 noise_gen: torch.Generator):
        self.workload, self.noise_gen = workload, noise_gen
        self.dim = workload.dim
        self.curvature = torch.from_numpy(np.logspace(0, -math.log10(workload.condition), workload.dim)).float()
        target = data_rng.standard_normal(workload.dim)
        offsets = workload.heterogeneity * data_rng.standard_normal((peers, workload.dim))
        self.centers = torch.from_numpy(target + offsets).float()
        self.start = torch.zeros(workload.dim)
        honest_centers = self.centers[torch.from_numpy(honest)]
        self.honest_center_mean = honest_centers.mean(dim=0)
        diff = honest_centers - self.honest_center_mean
        self._floor = float(0.5 * (diff * diff * self.curvature).sum(dim=1).mean())

    def gradients(self, x: torch.Tensor, peers: np.ndarray) -> torch.Tensor:
        w = self.workload
        noise = torch.randn(x.shape, generator=self.noise_gen).mul_(w.noise / math.sqrt(w.batch))
        return (x - self.centers[torch.from_numpy(peers)]).mul_(self.curvature).add_(noise)

    def mean_gradient(self, x: torch.Tensor, peers: np.ndarray) -> torch.Tensor:
        # Drawn directly: the same distribution as the mean of len(peers) minibatch gradients, in O(dim).
        w = self.workload
        center = self.centers[torch.from_numpy(peers)].mean(dim=0)
        noise = torch.randn(self.dim, generator=self.noise_gen).mul_(w.noise / math.sqrt(w.batch * len(peers)))
        return (x - center).mul_(self.curvature).add_(noise)

    def loss(self, models: torch.Tensor) -> float:
        diff = models - self.honest_center_mean
        return self._floor + float(0.5 * (diff * diff * self.curvature).sum(dim=1).mean())

    def loss_floor(self) -> float:
        return self._floor

    def spread(self, models: torch.Tensor) -> float:
        """Mean over rows of 1/2 |x - mean x|_D^2: the part of the loss that averaging removes."""
        diff = models - models.mean(dim=0)
        return float(0.5 * (diff * diff * self.curvature).sum(dim=1).mean())


class TeacherMLP:
    """The small non-convex model (module docstring). Parameters, flat: W1 (hidden x dim), b1, w2 (hidden), b2."""

    def __init__(self, workload: "Workload", peers: int, honest: np.ndarray, data_rng: np.random.Generator,
                 noise_gen: torch.Generator):
        self.workload, self.noise_gen = workload, noise_gen
        d, h = workload.dim, workload.hidden
        self.inputs, self.hidden = d, h
        self.dim = workload.parameters()  # the layout of _split

        def network(scale_out: float) -> torch.Tensor:
            w1 = data_rng.standard_normal((h, d)) / math.sqrt(d)
            w2 = data_rng.standard_normal(h) * scale_out / math.sqrt(h)
            return torch.from_numpy(np.concatenate([w1.ravel(), np.zeros(h), w2, [0.0]])).float()

        self.teacher = network(TEACHER_OUTPUT_GAIN)
        self.start = network(1.0)  # one shared initialisation, as a run starts every peer from one seed
        self.shifts = torch.from_numpy(workload.heterogeneity * data_rng.standard_normal((peers, d))).float()
        honest_peers = np.flatnonzero(honest)
        owners = data_rng.choice(honest_peers, EVAL_SAMPLES) if honest_peers.size else np.zeros(0, dtype=np.int64)
        self.eval_inputs = (torch.from_numpy(data_rng.standard_normal((owners.size, d))).float()
                            + self.shifts[torch.from_numpy(owners)])
        self.eval_targets = self.forward(self.teacher[None], self.eval_inputs[None])[0][0]

    def _split(self, x: torch.Tensor):
        d, h = self.inputs, self.hidden
        k = x.shape[0]
        return (x[:, :h * d].view(k, h, d), x[:, h * d:h * d + h], x[:, h * d + h:h * d + 2 * h], x[:, -1])

    def forward(self, x: torch.Tensor, inputs: torch.Tensor):
        """Outputs (k, B) of the k models `x` on inputs (k or 1, B, dim), and the hidden activations (k, B, h)."""
        w1, b1, w2, b2 = self._split(x)
        hidden = torch.tanh(torch.matmul(inputs, w1.transpose(1, 2)).add_(b1[:, None, :]))
        return torch.matmul(hidden, w2[:, :, None]).squeeze(-1).add_(b2[:, None]), hidden

    def gradients(self, x: torch.Tensor, peers: np.ndarray) -> torch.Tensor:
        return self.batch_gradients(x, *self.minibatches(peers))

    def minibatches(self, peers: np.ndarray):
        """One minibatch per peer: inputs (k, B, dim) from its shifted distribution, noisy teacher labels (k, B)."""
        w = self.workload
        k, batch = len(peers), w.batch
        inputs = torch.randn((k, batch, self.inputs), generator=self.noise_gen).add_(
            self.shifts[torch.from_numpy(peers)][:, None, :])
        labels = self.forward(self.teacher[None], inputs.view(1, k * batch, self.inputs))[0].view(k, batch)
        return inputs, labels.add_(torch.randn((k, batch), generator=self.noise_gen), alpha=w.noise)

    def batch_gradients(self, x: torch.Tensor, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Gradients of 1/2 mean (f(inputs) - labels)^2 for each row of `x` on its row of the batch (backprop by
        hand: one batched product per layer)."""
        k, batch = labels.shape
        out, hidden = self.forward(x, inputs)
        residual = out.sub_(labels).div_(batch)  # d(1/2 mean (f - y)^2) / d f
        _, _, w2, _ = self._split(x)
        d_pre = residual[:, :, None] * w2[:, None, :] * (1 - hidden * hidden)  # (k, B, h)
        grad_w1 = torch.matmul(d_pre.transpose(1, 2), inputs)  # (k, h, dim)
        grad_w2 = torch.matmul(hidden.transpose(1, 2), residual[:, :, None]).squeeze(-1)
        return torch.cat([grad_w1.reshape(k, -1), d_pre.sum(dim=1), grad_w2, residual.sum(dim=1, keepdim=True)],
                         dim=1)

    def mean_gradient(self, x: torch.Tensor, peers: np.ndarray) -> torch.Tensor:
        return self.gradients(x.expand(len(peers), -1), peers).mean(dim=0)

    def loss(self, models: torch.Tensor) -> float:
        if models.shape[0] > MAX_EVAL_MODELS:
            models = models[torch.linspace(0, models.shape[0] - 1, MAX_EVAL_MODELS).long()]
        out, _ = self.forward(models, self.eval_inputs[None])
        return float(0.5 * (out - self.eval_targets).pow(2).mean()) + self.loss_floor()

    def loss_floor(self) -> float:
        return 0.5 * self.workload.noise ** 2

    def spread(self, models: torch.Tensor) -> float:
        """Mean over rows of 1/2 |x - mean x|^2, in parameter space (the loss has no closed form to split)."""
        diff = models - models.mean(dim=0)
        return float(0.5 * (diff * diff).sum(dim=1).mean())


PROBLEMS = {"quadratic": Quadratic, "mlp": TeacherMLP}


def make_problem(workload: "Workload", peers: int, honest: np.ndarray, data_rng: np.random.Generator,
                 noise_gen: torch.Generator) -> Problem:
    """The problem `workload.kind` names, with its data drawn from `data_rng` (gradient noise from `noise_gen`)."""
    return PROBLEMS[workload.kind](workload, peers, honest, data_rng, noise_gen)
