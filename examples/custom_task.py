"""A complete custom moshpeer task: a wine classifier on scikit-learn's bundled wine dataset.

Train it in a swarm (each volunteer runs the same command):

    moshpeer join --task examples/custom_task.py:make_task      # by file path
    moshpeer join --task examples.custom_task:make_task         # as a module, from the repo root

or try it alone, in this process, with `python examples/custom_task.py`.

A task is a function returning a `moshpeer.peer.tasks.Task`. The rules (docs/tasks.md):
- deterministic: the same arguments give the same initial weights and data on every machine;
- `train_batches(batch_size, *, seed, peer_index, num_peers)` returns an endless iterator of
  micro-batches; `IndexedBatches` makes it shuffled per epoch, shardable and resumable;
- `loss_fn(model, batch)` returns (mean loss over the batch, number of samples);
- `evaluate(model)` returns a dict of floats containing the task's `metric`.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from moshpeer.peer.tasks import IndexedBatches, Task


def make_task(seed: int = 0, hidden: int = 32, lr: float = 1e-2) -> Task:
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split

    # 1. Data: 178 wines, 13 chemical measurements, 3 cultivars. Fixed, seeded split.
    wine = load_wine()
    features = torch.tensor(wine.data, dtype=torch.float32)
    labels = torch.tensor(wine.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        list(range(len(labels))), test_size=0.3, random_state=0, stratify=wine.target
    )
    mean, std = features[train_idx].mean(0), features[train_idx].std(0)
    x_train, y_train = (features[train_idx] - mean) / std, labels[train_idx]
    x_test, y_test = (features[test_idx] - mean) / std, labels[test_idx]

    # 2. Model: seeded, so every peer starts from the same weights.
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(13, hidden), nn.ReLU(), nn.Linear(hidden, 3))

    # 3. Micro-batches: IndexedBatches shuffles each epoch with `seed`, reads this peer's shard,
    #    and saves/restores its position (epoch, offset) for checkpoints.
    def train_batches(batch_size: int, *, seed: int = 0, peer_index: int = 0, num_peers: int = 1) -> IndexedBatches:
        return IndexedBatches(
            len(y_train),
            batch_size,
            lambda indices, epoch: (x_train[indices], y_train[indices]),
            seed=seed,
            peer_index=peer_index,
            num_peers=num_peers,
        )

    # 4. Loss: mean over the batch, plus the batch's sample count (moshpeer weights by samples).
    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets), len(targets)

    # 5. The local optimizer; moshpeer wraps it for collaborative steps.
    def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=lr)

    # 6. Evaluation on held-out data; moshpeer calls it in eval mode under torch.no_grad().
    def evaluate(model: nn.Module) -> dict[str, float]:
        logits = model(x_test)
        return {
            "accuracy": (logits.argmax(1) == y_test).float().mean().item(),
            "loss": F.cross_entropy(logits, y_test).item(),
        }

    return Task(
        model=model,
        train_batches=train_batches,
        loss_fn=loss_fn,
        make_optimizer=make_optimizer,
        evaluate=evaluate,
        metric="accuracy",
        higher_is_better=True,
        name="wine",
        batch_size=16,  # micro-batch
        target_batch_size=64,  # global batch the swarm gathers per step
    )


if __name__ == "__main__":
    from moshpeer.peer.tasks import train_locally

    task = make_task()
    print("before:", task.metrics())
    run = train_locally(task, num_samples=64 * 40)
    print(f"after {run.steps} steps ({run.samples} samples, {run.seconds:.2f}s):", run.metrics)
