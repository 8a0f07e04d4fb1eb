"""The task protocol: loading user tasks from spec strings, and resumable data positions."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moshpeer.errors import UserError
from moshpeer.peer.tasks import (
    IndexedBatches,
    Task,
    load_task,
    parse_task_kwargs,
    restore_stream_position,
    stream_position,
)

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[2]

GOOD_TASK_SOURCE = """
import torch
from torch import nn
from moshpeer.peer.tasks import IndexedBatches, Task

def make_task(width=4):
    x = torch.arange(40, dtype=torch.float32).view(20, 2)
    y = x.sum(1, keepdim=True)
    model = nn.Linear(2, 1)
    return Task(
        model=model,
        train_batches=lambda bs, *, seed=0, peer_index=0, num_peers=1: IndexedBatches(
            20, bs, lambda i, e: (x[i], y[i]), seed=seed, peer_index=peer_index, num_peers=num_peers),
        loss_fn=lambda m, b: (((m(b[0]) - b[1]) ** 2).mean(), len(b[0])),
        make_optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
        evaluate=lambda m: {"mse": ((m(x) - y) ** 2).mean().item(), "width": width},
        metric="mse",
        higher_is_better=False,
        name="toy",
        batch_size=4,
        target_batch_size=8,
    )

def not_a_task():
    return {"model": None}

def raises():
    raise RuntimeError("dataset server\\nis down")

NOT_CALLABLE = 3
"""


def write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


@pytest.fixture
def toy_file(tmp_path: Path) -> Path:
    return write(tmp_path / "toy_task.py", GOOD_TASK_SOURCE)


# ---------------------------------------------------------------- good specs


def test_builtin_name_and_full_module_spec_give_the_same_task():
    by_name = load_task("digits")
    by_module = load_task("moshpeer.peer.tasks.digits:make_task")
    assert by_name.name == by_module.name == "digits"
    assert by_name.fingerprint == by_module.fingerprint
    for a, b in zip(by_name.model.parameters(), by_module.model.parameters()):
        assert torch.equal(a, b), "same kwargs must give the same initial weights"
    assert load_task("digits", seed=1).fingerprint != by_name.fingerprint


def test_file_spec_with_kwargs_and_default_attribute(toy_file: Path):
    task = load_task(f"{toy_file}:make_task", width=7)
    assert task.name == "toy" and task.metrics()["width"] == 7.0
    assert load_task(str(toy_file)).name == "toy", "the attribute defaults to make_task"


def test_module_spec_is_importable_from_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    package = tmp_path / "mytasks_pkg_cwd"
    package.mkdir()
    write(package / "__init__.py", "")
    write(package / "toy.py", GOOD_TASK_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    assert load_task("mytasks_pkg_cwd.toy:make_task").name == "toy"


def test_examples_load_by_module_and_by_path(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(REPO_ROOT)
    by_module = load_task("examples.custom_task:make_task")
    by_path = load_task("examples/custom_task.py:make_task")
    assert by_module.name == by_path.name == "wine"
    assert by_module.fingerprint == by_path.fingerprint


def test_parse_task_kwargs():
    assert parse_task_kwargs(["hidden=64", "lr=0.01", "flag=True", "corpus=stdlib", "name='x y'"]) == {
        "hidden": 64, "lr": 0.01, "flag": True, "corpus": "stdlib", "name": "x y"}
    with pytest.raises(UserError):
        parse_task_kwargs(["novalue"])
    with pytest.raises(UserError):
        parse_task_kwargs(["1bad=3"])


# ---------------------------------------------------------------- bad specs


def bad_cases(toy_file: Path, tmp_path: Path) -> list[tuple[str, dict, str]]:
    """(spec, kwargs, a phrase the one-line message must contain)."""
    broken = write(tmp_path / "broken_task.py", "import torch\nraise ValueError('bad\\nconfig')\n")
    needs_missing = write(tmp_path / "needs_missing.py", "import moshpeer_no_such_dependency_xyz\n")
    return [
        ("", {}, "empty task spec"),
        ("   ", {}, "empty task spec"),
        ("not a module!:make_task", {}, "is not a module name"),
        ("a:b:c", {}, "is not a module name"),
        ("moshpeer_no_such_module_xyz:make_task", {}, "not found"),
        ("moshpeer.peer.no_such_module_xyz:make_task", {}, "not found"),
        ("moshpeer.peer.tasks.digits:make_tsk", {}, "did you mean 'make_task'"),
        ("moshpeer.peer.tasks.digits:nothing_like_it", {}, "has no attribute"),
        (f"{toy_file}:NOT_CALLABLE", {}, "not a callable task factory"),
        (f"{toy_file}:not_a_task", {}, "returned dict, expected a moshpeer.peer.tasks.Task"),
        (f"{toy_file}:raises", {}, "raised RuntimeError: dataset server is down"),
        (f"{toy_file}:make_task", {"depth": 3}, "unexpected keyword argument 'depth'"),
        (f"{tmp_path}/missing_task.py:make_task", {}, "does not exist"),
        (f"{broken}:make_task", {}, "failed to load: ValueError: bad config"),
        (f"{needs_missing}:make_task", {}, "needs 'moshpeer_no_such_dependency_xyz'"),
    ]


def test_bad_specs_give_one_clear_user_error(toy_file: Path, tmp_path: Path):
    for spec, kwargs, phrase in bad_cases(toy_file, tmp_path):
        with pytest.raises(UserError) as info:
            load_task(spec, **kwargs)
        message = str(info.value)
        assert "\n" not in message, f"{spec!r}: message spans lines: {message!r}"
        assert phrase in message, f"{spec!r}: {message!r} lacks {phrase!r}"


def test_task_validates_its_fields():
    good = load_task("digits")
    with pytest.raises(UserError, match="must be a torch.nn.Module"):
        Task(**{**good.__dict__, "model": "not a model"})
    with pytest.raises(UserError, match="metric"):
        Task(**{**good.__dict__, "metric": ""})
    with pytest.raises(UserError, match="train_batches must accept"):
        Task(**{**good.__dict__, "train_batches": lambda batch_size: iter([])})
    with pytest.raises(UserError, match="no 'accuracy'"):
        Task(**{**good.__dict__, "evaluate": lambda model: {"acc": 1.0}}).metrics()
    with pytest.raises(UserError, match="return \\(loss, num_samples\\)"):
        Task(**{**good.__dict__, "loss_fn": lambda model, batch: 1.0}).loss(good.model, None)


# ---------------------------------------------------------------- data position


def collect(stream, count: int) -> list[torch.Tensor]:
    return [next(stream)[0].clone() for _ in range(count)]


def test_position_round_trip_resumes_the_same_batches():
    data = torch.arange(50)

    def make_batch(indices: torch.Tensor, epoch: int):
        return (data[indices], epoch)

    original = IndexedBatches(50, 8, make_batch, seed=3)
    collect(original, 9)  # 6 batches per epoch: 9 batches crosses into epoch 1
    state = json.loads(json.dumps(stream_position(original)))  # survives any checkpoint format
    assert state["epoch"] == 1 and state["offset"] == 3 * 8
    expected = collect(original, 10)  # crosses into epoch 2 as well

    resumed = IndexedBatches(50, 8, make_batch, seed=999)  # seed comes from the saved state
    restore_stream_position(resumed, state)
    assert all(torch.equal(a, b) for a, b in zip(collect(resumed, 10), expected))


def test_position_counts_examples_so_batch_size_may_change():
    data = torch.arange(64)
    stream = IndexedBatches(64, 8, lambda i, e: (data[i],), seed=1)
    collect(stream, 2)
    state = stream.state_dict()
    rest_of_epoch = torch.cat(collect(stream, 6))
    bigger = IndexedBatches(64, 16, lambda i, e: (data[i],), seed=1)
    bigger.load_state_dict(state)
    assert torch.equal(torch.cat(collect(bigger, 3)), rest_of_epoch)


def test_epochs_are_permutations_and_shards_are_disjoint():
    data = torch.arange(40)
    shards = [IndexedBatches(40, 5, lambda i, e: (data[i],), seed=7, peer_index=p, num_peers=4) for p in range(4)]
    seen = [torch.cat(collect(shard, 2)) for shard in shards]  # one epoch of each 10-example shard
    assert sorted(torch.cat(seen).tolist()) == list(range(40))
    next_epoch = torch.cat(collect(shards[0], 2))
    assert not torch.equal(next_epoch, seen[0]), "each epoch is a new permutation"


def test_bad_positions_are_user_errors():
    stream = IndexedBatches(30, 5, lambda i, e: i)
    with pytest.raises(UserError, match="30"):
        IndexedBatches(31, 5, lambda i, e: i).load_state_dict(stream.state_dict())
    with pytest.raises(UserError, match="bad data position"):
        stream.load_state_dict({"epoch": "x"})
    with pytest.raises(UserError, match="does not fit"):
        IndexedBatches(30, 5, lambda i, e: i, peer_index=0, num_peers=8)
    with pytest.raises(UserError, match="load_state_dict"):
        restore_stream_position(iter([1, 2]), stream.state_dict())
    assert stream_position(iter([1, 2])) is None


def test_builtin_task_stream_resumes_exactly():
    task = load_task("digits")
    stream = task.open_batches(32, seed=5, peer_index=1, num_peers=2)
    collect(stream, 30)  # 30 batches of 32 cross the 502-example shard's epoch boundary
    state = stream_position(stream)
    expected = collect(stream, 5)
    fresh = load_task("digits").open_batches(32, seed=0)
    restore_stream_position(fresh, state)
    assert all(torch.equal(a, b) for a, b in zip(collect(fresh, 5), expected))
