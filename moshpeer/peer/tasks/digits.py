"""Built-in task `digits`: an MLP classifier on scikit-learn's bundled handwritten digits.

The data (1,797 8x8 grey-scale images, 10 classes) ships inside scikit-learn, so it is available
offline on every machine; it is read from the file scikit-learn ships, without importing scikit-learn
(seconds a restarting peer would wait). A fixed stratified split (seeded) keeps 30% for testing;
features are standardised with the training set's statistics. The default settings are tuned for
large-batch training: with a global batch of 256 the model passes 95% test accuracy after about 5-6k
samples and ends near 98.5% (see docs/tasks.md for measured numbers). This is the default task of `moshpeer join`.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import logging
import os
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from moshpeer.errors import UserError
from moshpeer.peer.tasks.batches import IndexedBatches
from moshpeer.peer.tasks.protocol import Task

NUM_CLASSES = 10
NUM_FEATURES = 64
DATASET_SIZE = 1797

logger = logging.getLogger(__name__)


def load_digits_split(test_fraction: float = 0.3, split_seed: int = 0) -> dict[str, torch.Tensor]:
    """The standardised train/test tensors (x_train, y_train, x_test, y_test) and the split indices
    (train_index, test_index) into the dataset's order. Stratified: each class keeps `test_fraction` of its
    images (rounded) for testing, chosen by a torch generator seeded with `split_seed`."""
    features, labels = _read_digits()
    generator = torch.Generator().manual_seed(split_seed)
    train_parts, test_parts = [], []
    for label in range(NUM_CLASSES):
        members = (labels == label).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        n_test = round(test_fraction * len(members))
        test_parts.append(members[:n_test])
        train_parts.append(members[n_test:])
    train_idx, test_idx = torch.cat(train_parts).sort().values, torch.cat(test_parts).sort().values
    x_train, x_test = features[train_idx], features[test_idx]
    mean, std = x_train.mean(0), x_train.std(0)
    # +1 rather than a tiny epsilon: border pixels are almost always 0, and their std is ~0.
    scale = std + 1.0
    return {
        "x_train": (x_train - mean) / scale,
        "y_train": labels[train_idx],
        "x_test": (x_test - mean) / scale,
        "y_test": labels[test_idx],
        "train_index": train_idx,
        "test_index": test_idx,
    }


def _read_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits (1,797 rows of 64 pixel values and a label), read from the file it ships,
    without importing scikit-learn: that import takes seconds, and a restarted peer pays it before it can
    train (churn, issue 16). The file's layout is scikit-learn's `load_digits` one; if it is not where
    this expects, `load_digits` itself reads it.

    :raises UserError: scikit-learn is not installed (the data ships with it)
    """
    spec = importlib.util.find_spec("sklearn")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the digits task needs scikit-learn (pip install scikit-learn): its data ships with it")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    try:
        with gzip.open(path, "rt") as f:
            rows = np.loadtxt(f, delimiter=",", dtype=np.float32)
        if rows.shape != (DATASET_SIZE, NUM_FEATURES + 1):
            raise ValueError(f"unexpected shape {rows.shape}")
    except (OSError, ValueError) as e:
        logger.debug(f"reading {path} directly failed ({e}); using sklearn.datasets.load_digits")
        from sklearn.datasets import load_digits

        digits = load_digits()
        return torch.tensor(digits.data, dtype=torch.float32), torch.tensor(digits.target, dtype=torch.long)
    return torch.from_numpy(rows[:, :NUM_FEATURES].copy()), torch.from_numpy(rows[:, NUM_FEATURES]).long()


def build_model(hidden: int = 128, depth: int = 2) -> nn.Module:
    """An MLP: 64 inputs, `depth` hidden ReLU layers of width `hidden`, 10 logits."""
    layers: list[nn.Module] = []
    width = NUM_FEATURES
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, NUM_CLASSES))
    return nn.Sequential(*layers)


def make_task(
    seed: int = 0,
    hidden: int = 128,
    depth: int = 2,
    lr: float = 5e-3,
    test_fraction: float = 0.3,
    split_seed: int = 0,
    batch_size: int = 32,
    target_batch_size: int = 256,
) -> Task:
    """The digits classifier. `seed` fixes the initial weights (the same on every peer)."""
    data = load_digits_split(test_fraction, split_seed)
    x_train, y_train = data["x_train"], data["y_train"]
    x_test, y_test = data["x_test"], data["y_test"]

    torch.manual_seed(seed)
    model = build_model(hidden, depth)

    def train_batches(batch_size: int, *, seed: int = 0, peer_index: int = 0, num_peers: int = 1) -> IndexedBatches:
        def make_batch(indices: torch.Tensor, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
            return x_train[indices], y_train[indices]

        return IndexedBatches(
            len(y_train), batch_size, make_batch, seed=seed, peer_index=peer_index, num_peers=num_peers
        )

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        inputs, targets = _to_model_device(model, *batch)
        return F.cross_entropy(model(inputs), targets), len(targets)

    def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=lr)

    def evaluate(model: nn.Module) -> dict[str, float]:
        inputs, targets = _to_model_device(model, x_test, y_test)
        logits = model(inputs)
        return {
            "accuracy": (logits.argmax(dim=1) == targets).float().mean().item(),
            "loss": F.cross_entropy(logits, targets).item(),
        }

    # Everything peers must agree on; the micro-batch size is each peer's own choice.
    config = {"task": "digits", "seed": seed, "hidden": hidden, "depth": depth, "lr": lr,
              "test_fraction": test_fraction, "split_seed": split_seed}
    return Task(
        model=model,
        train_batches=train_batches,
        loss_fn=loss_fn,
        make_optimizer=make_optimizer,
        evaluate=evaluate,
        metric="accuracy",
        higher_is_better=True,
        name="digits",
        batch_size=batch_size,
        target_batch_size=target_batch_size,
        fingerprint=_fingerprint(config, data["train_index"], data["test_index"], y_train),
    )


def _to_model_device(model: nn.Module, *tensors: torch.Tensor) -> list[torch.Tensor]:
    device = next(model.parameters()).device
    return [tensor.to(device, non_blocking=True) for tensor in tensors]


def _fingerprint(config: dict[str, Any], *tensors: torch.Tensor) -> str:
    # Integer tensors only: float features could differ in the last bit between machines.
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for tensor in tensors:
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]
