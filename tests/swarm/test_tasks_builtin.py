"""The built-in tasks and the custom task example train for real, in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moshpeer.peer.tasks import load_task, train_locally

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_digits_reaches_90_percent_with_a_large_global_batch():
    task = load_task("digits")
    before = task.metrics()["accuracy"]
    run = train_locally(task, num_samples=8192, global_batch_size=256, micro_batch_size=32, eval_every=4, target=0.9)
    assert before < 0.3
    assert run.metrics["accuracy"] >= 0.90, run.metrics
    assert run.samples_to_target is not None and run.samples_to_target <= 8192
    assert run.losses[-1] < run.losses[0] / 5


def test_digits_data_is_scikit_learns_read_without_importing_it():
    """A restarting peer should not wait for `import sklearn`: the task reads the file scikit-learn ships.
    The images and labels are exactly `load_digits()`'s, and the split is stratified and seeded."""
    import subprocess
    import sys

    probe = ("import sys; from moshpeer.peer.tasks.digits import load_digits_split; d = load_digits_split(); "
             "print(len(d['y_train']), len(d['y_test']), 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=100, check=True)
    assert out.stdout.split() == ["1258", "539", "False"], out.stdout + out.stderr

    from sklearn.datasets import load_digits

    from moshpeer.peer.tasks.digits import _read_digits, load_digits_split

    features, labels = _read_digits()
    reference = load_digits()
    assert torch.equal(features, torch.tensor(reference.data, dtype=torch.float32))
    assert torch.equal(labels, torch.tensor(reference.target))
    split, again, other = load_digits_split(), load_digits_split(), load_digits_split(split_seed=1)
    assert torch.equal(split["test_index"], again["test_index"])
    assert not torch.equal(split["test_index"], other["test_index"])
    assert set(split["train_index"].tolist()).isdisjoint(split["test_index"].tolist())
    per_class = torch.bincount(labels[split["test_index"]]) / torch.bincount(labels)
    assert torch.allclose(per_class, torch.full((10,), 0.3), atol=0.01)


def test_micro_batches_weighted_by_samples_equal_one_big_batch():
    """Gradient accumulation over 8 micro-batches gives the same step as one batch of 256."""
    accumulated, single = load_task("digits"), load_task("digits")
    train_locally(accumulated, num_samples=3 * 256, global_batch_size=256, micro_batch_size=32)
    train_locally(single, num_samples=3 * 256, global_batch_size=256, micro_batch_size=256)
    for a, b in zip(accumulated.model.parameters(), single.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_charlm_perplexity_decreases_in_a_few_steps():
    task = load_task("charlm", max_bytes=300_000, eval_windows=32)
    assert task.higher_is_better is False and task.metric == "perplexity"
    before = task.metrics()["perplexity"]
    assert 200 < before < 320, "an untrained byte model is close to uniform over 256 values"
    run = train_locally(task, num_samples=16 * 40, global_batch_size=16, micro_batch_size=16)
    after = run.metrics["perplexity"]
    assert after < before / 4, (before, after)
    assert task.is_better(after, before)


def test_charlm_corpus_is_deterministic_and_held_out():
    from moshpeer.peer.tasks.charlm import stdlib_corpus

    train, val, files = stdlib_corpus(200_000)
    assert (train, val, files) == stdlib_corpus(200_000)
    assert len(train) == 200_000 and len(val) == 20_000
    assert files == sorted(files)
    assert val[:500] not in train, "validation text comes from files not used for training"


def test_custom_task_example_trains(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(REPO_ROOT)
    task = load_task("examples/custom_task.py:make_task")
    run = train_locally(task, num_samples=64 * 30)
    assert run.metrics["accuracy"] >= 0.9, run.metrics
