"""CheckpointStore: round trips, corruption handling, keep_last, background saves, RNG states."""

from __future__ import annotations

import logging
import os
import random
import struct
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from moshpeer.errors import UserError
from moshpeer.peer.checkpoint import (
    CheckpointError,
    CheckpointStore,
    CorruptCheckpoint,
    Parts,
    UnsupportedCheckpointVersion,
    WriteAborted,
    capture_rng_state,
    inspect_file,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
)
from moshpeer.peer.checkpoint.format import FORMAT_VERSION, MAGIC

pytestmark = pytest.mark.timeout(60)


def small_training_state(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 16)).pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


def big_state(value: float, megabytes: int = 48):
    """A state large enough that writing it takes many milliseconds."""
    return {"weights": torch.full((megabytes << 18,), value), "meta": {"value": value}}


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(b) is type(a) and list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(b) is type(a) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def newest_file(directory: Path) -> Path:
    return sorted(directory.glob("ckpt-*.mpck"))[-1]


def test_round_trip_keeps_everything(tmp_path):
    model, optimizer = small_training_state()
    base = torch.arange(12.0)
    state = {
        Parts.MODEL: model.state_dict(),
        Parts.OPTIMIZER: optimizer.state_dict(),
        Parts.ERROR_FEEDBACK: {"0.weight": torch.randn(32, 16), "residual_fp16": torch.randn(5).half()},
        Parts.COLLABORATIVE: {"epoch": 7, "samples": 1234, "target_batch_size": 4096},
        Parts.GRID: (1, 0, 3),
        Parts.RNG: capture_rng_state(),
        Parts.DATA: {"data_epoch": 2, "offset": 96},
        "views": {"base": base, "row": base.view(3, 4)[1], "int_keys": {0: 1, 5: [1.5, None, "x"]}},
    }
    with CheckpointStore(tmp_path) as store:
        path = store.save(state, step=42, epoch=7, extra={"peer": "abc"})
    loaded, meta = CheckpointStore(tmp_path).load_latest()
    assert_same(state, loaded)
    assert loaded[Parts.MODEL]._metadata == state[Parts.MODEL]._metadata  # state_dict version info
    # Views of one storage stay views of one storage, as with torch.save.
    assert loaded["views"]["row"].untyped_storage().data_ptr() == loaded["views"]["base"].untyped_storage().data_ptr()
    assert (meta.path, meta.step, meta.epoch, meta.seq, meta.format_version) == (path, 42, 7, 1, FORMAT_VERSION)
    assert meta.extra == {"peer": "abc"} and abs(meta.created - time.time()) < 60
    assert meta.parts[Parts.MODEL] == sum(t.numel() * 4 for t in model.state_dict().values())
    restored_model, restored_optimizer = small_training_state(seed=1)
    restored_model.load_state_dict(loaded[Parts.MODEL])
    restored_optimizer.load_state_dict(loaded[Parts.OPTIMIZER])
    assert_same(optimizer.state_dict()["state"], restored_optimizer.state_dict()["state"])


def test_a_write_that_fails_is_counted_and_logged_with_what_a_resume_would_start_from(tmp_path, caplog, monkeypatch):
    """A full disk: the write raises (the temp file is gone), the store counts it, the log line says which checkpoint
    a resume would start from, and the previous checkpoint stays the newest valid one."""
    state = {Parts.MODEL: small_training_state()[0].state_dict()}
    with CheckpointStore(tmp_path) as store:
        first = store.save(state, step=1, epoch=0)

        def no_space(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr("moshpeer.peer.checkpoint.store.write_checkpoint_file", no_space)
        with pytest.raises(OSError):
            store.save(state, step=2, epoch=0)
        with caplog.at_level(logging.ERROR, logger="moshpeer.peer.checkpoint.store"):
            handle = store.save_async(state, step=3, epoch=0)
            assert handle.wait(10) and isinstance(handle.exception(), OSError)
        assert store.stats.failed == 2 and store.stats.saved == 1
    [line] = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert "No space left on device" in line and f"the newest checkpoint is {first.name}" in line
    assert [p.name for p in tmp_path.iterdir() if p.suffix == first.suffix] == [first.name]


def test_load_latest_of_missing_or_empty_directory(tmp_path):
    assert CheckpointStore(tmp_path / "missing").load_latest() is None
    assert CheckpointStore(tmp_path).load_latest() is None
    assert not (tmp_path / "missing").exists()  # reading never creates the directory


def _flip_bit(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def _truncate(path: Path, keep: float) -> None:
    size = path.stat().st_size
    os.truncate(path, int(size * keep))


CORRUPTIONS = {
    # name: (damage, expected reason fragment)
    "truncated payload": (lambda p: _truncate(p, 0.6), "truncated"),
    "truncated header": (lambda p: _truncate(p, 0.0001), "truncated header"),
    "empty file": (lambda p: _truncate(p, 0), "truncated header"),
    "bit flip in payload": (lambda p: _flip_bit(p, p.stat().st_size - 5000), "payload checksum mismatch"),
    "bit flip in metadata": (lambda p: _flip_bit(p, 40), "header checksum mismatch"),
    "bit flip in version field": (lambda p: _flip_bit(p, 9), "header checksum mismatch"),
    "garbage": (lambda p: p.write_bytes(os.urandom(70000)), "bad magic"),
    "trailing bytes": (lambda p: p.open("ab").write(b"extra"), "unexpected bytes"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_newest_is_skipped_with_one_log_line(tmp_path, caplog, kind):
    damage, reason = CORRUPTIONS[kind]
    with CheckpointStore(tmp_path, keep_last=None) as store:
        store.save(big_state(1.0, megabytes=1), step=1, epoch=0)
        store.save(big_state(2.0, megabytes=1), step=2, epoch=0)
    damaged = newest_file(tmp_path)
    damage(damaged)
    with caplog.at_level(logging.WARNING):
        state, meta = CheckpointStore(tmp_path).load_latest()
    assert meta.step == 1 and torch.equal(state["weights"], big_state(1.0, megabytes=1)["weights"])
    lines = [r.getMessage() for r in caplog.records if damaged.name in r.getMessage()]
    assert len(lines) == 1 and "skipping corrupt checkpoint" in lines[0] and reason in lines[0], lines
    info = inspect_file(damaged)
    assert not info.valid and reason in info.reason
    with pytest.raises(CorruptCheckpoint):
        load_checkpoint(damaged)


def test_leftover_temp_and_misnamed_files_are_skipped_and_cleaned(tmp_path, caplog):
    with CheckpointStore(tmp_path) as store:
        store.save(big_state(1.0, megabytes=1), step=1, epoch=0)
    # What a writer killed mid-write leaves behind, under a newer sequence number.
    temp = tmp_path / "ckpt-00000009-epoch0-step9.mpck.tmp"
    temp.write_bytes(os.urandom(5000))
    misnamed = tmp_path / "latest.mpck"
    misnamed.write_bytes(newest_file(tmp_path).read_bytes())
    with caplog.at_level(logging.WARNING):
        state, meta = CheckpointStore(tmp_path).load_latest()
    assert meta.step == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any(temp.name in m and "leftover temp file" in m for m in messages)
    assert any(misnamed.name in m and "not a checkpoint name" in m for m in messages)
    rows = {info.name: info for info in list_checkpoints(tmp_path)}
    assert rows[temp.name].valid is False and "leftover temp file" in rows[temp.name].reason
    assert rows[misnamed.name].valid is False
    # The next writer owns the directory: it removes the temp file and numbers after it.
    with CheckpointStore(tmp_path) as store:
        path = store.save(big_state(2.0, megabytes=1), step=2, epoch=0)
    assert not temp.exists() and path.name.startswith("ckpt-00000002-")


def test_temp_file_of_a_live_writer_is_not_called_leftover(tmp_path):
    import subprocess

    with CheckpointStore(tmp_path) as store:
        store.save(big_state(1.0, megabytes=1), step=1, epoch=0)
    temp = tmp_path / "ckpt-00000002-epoch0-step2.mpck.tmp"
    temp.write_bytes(b"partial")
    other_writer = subprocess.Popen(["sleep", "60"])  # stands in for a peer that holds the lock
    try:
        (tmp_path / ".moshpeer-checkpoints.lock").write_text(f"{other_writer.pid}\n")
        rows = {info.name: info for info in list_checkpoints(tmp_path)}
        assert f"pid {other_writer.pid} is writing here" in rows[temp.name].reason
    finally:
        other_writer.kill()
        other_writer.wait()
    rows = {info.name: info for info in list_checkpoints(tmp_path)}
    assert rows[temp.name].reason == "leftover temp file of an interrupted write"


def test_unknown_format_version_is_refused_not_skipped(tmp_path):
    with CheckpointStore(tmp_path) as store:
        store.save(big_state(1.0, megabytes=1), step=1, epoch=0)
        newer = store.save(big_state(2.0, megabytes=1), step=2, epoch=0)
    # Rewrite the header as a future format version would: intact checksum, version 2.
    data = bytearray(newer.read_bytes())
    header_size = struct.unpack_from("<I", data, 12)[0]
    struct.pack_into("<I", data, 8, FORMAT_VERSION + 1)
    crc = zlib.crc32(bytes(data[20:header_size]), zlib.crc32(bytes(data[:16])))
    struct.pack_into("<I", data, 16, crc)
    newer.write_bytes(bytes(data))
    assert data[:8] == MAGIC
    with pytest.raises(UnsupportedCheckpointVersion, match=r"format version 2.*reads version 1"):
        CheckpointStore(tmp_path).load_latest()
    assert isinstance(UnsupportedCheckpointVersion(newer, 2), UserError)  # CLI: one line, exit 2
    info = inspect_file(newer)
    assert not info.valid and info.reason == "unknown format version 2"


def test_keep_last_deletes_only_older_checkpoints(tmp_path):
    with CheckpointStore(tmp_path, keep_last=2) as store:
        for step in range(1, 6):
            store.save(big_state(float(step), megabytes=1), step=step, epoch=step // 2)
        assert store.wait(timeout=30)
        names = sorted(p.name for p in tmp_path.glob("*.mpck"))
    assert names == ["ckpt-00000004-epoch2-step4.mpck", "ckpt-00000005-epoch2-step5.mpck"]
    with CheckpointStore(tmp_path, keep_last=None) as store:
        for step in range(6, 9):
            store.save(big_state(float(step), megabytes=1), step=step, epoch=3)
        assert store.wait(timeout=30)
    assert len(list(tmp_path.glob("*.mpck"))) == 5
    assert [info.meta.step for info in CheckpointStore(tmp_path).list()] == [4, 5, 6, 7, 8]
    with pytest.raises(ValueError):
        CheckpointStore(tmp_path, keep_last=0)


def test_sequence_not_step_decides_which_is_newest(tmp_path):
    """A fresh run (step counter back at 1) in an old directory: its checkpoints are the newest."""
    with CheckpointStore(tmp_path, keep_last=2) as store:
        store.save(big_state(500.0, megabytes=1), step=500, epoch=50)
    with CheckpointStore(tmp_path, keep_last=2) as store:
        store.save(big_state(1.0, megabytes=1), step=1, epoch=0)
        store.save(big_state(2.0, megabytes=1), step=2, epoch=0)
        assert store.wait(timeout=30)
    state, meta = CheckpointStore(tmp_path).load_latest()
    assert meta.step == 2 and float(state["weights"][0]) == 2.0
    assert sorted(p.name for p in tmp_path.glob("*.mpck"))[0].startswith("ckpt-00000002-")


def test_one_writer_per_directory(tmp_path):
    with CheckpointStore(tmp_path) as first:
        first.save(big_state(1.0, megabytes=1), step=1, epoch=0)
        second = CheckpointStore(tmp_path)
        with pytest.raises(UserError, match=f"pid {os.getpid()}"):
            second.save(big_state(2.0, megabytes=1), step=2, epoch=0)
        assert second.load_latest()[1].step == 1  # readers are welcome
    with CheckpointStore(tmp_path) as third:  # the lock went with the first store
        third.save(big_state(3.0, megabytes=1), step=3, epoch=0)


def test_save_async_snapshot_is_the_state_at_call_time(tmp_path):
    model, optimizer = small_training_state()
    big = torch.full((48 << 18,), 1.0)  # 48 MB: its write outlasts the call by far
    state = {Parts.MODEL: model.state_dict(), Parts.OPTIMIZER: optimizer.state_dict(), "big": big, "info": {"n": 1}}
    expected = {
        Parts.MODEL: {k: v.clone() for k, v in model.state_dict().items()},
        "exp_avg": optimizer.state_dict()["state"][0]["exp_avg"].clone(),
    }
    with CheckpointStore(tmp_path) as store:
        handle = store.save_async(state, step=10, epoch=1)
        returned_at = time.monotonic()
        # Training goes on and mutates everything in place right away.
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
        optimizer.state_dict()["state"][0]["exp_avg"].mul_(3.0)
        big.fill_(2.0)
        state["info"]["n"] = 2
        path = handle.result(timeout=30)
    # The call returned long before the 48 MB write (and its fsync) ended.
    assert handle.finished_at > returned_at, "save_async waited for the write"
    loaded, meta = load_checkpoint(path)
    assert meta.step == 10
    for name, tensor in expected[Parts.MODEL].items():
        assert torch.equal(loaded[Parts.MODEL][name], tensor)
    assert torch.equal(loaded[Parts.OPTIMIZER]["state"][0]["exp_avg"], expected["exp_avg"])
    assert bool((loaded["big"] == 1.0).all()) and loaded["info"] == {"n": 1}


def test_save_async_copying_in_background_holds_the_values_at_the_call_once_fenced(tmp_path):
    # What the training loop does: save_async(copy_in_background=True), a forward/backward pass that
    # only reads the tensors, fence(), then the in-place update.
    weights = torch.arange(12 << 20, dtype=torch.float32)  # 48 MB: the copy takes a while
    view = weights[5:10]  # a view of the same storage stays a view in the snapshot
    state = {"weights": weights, "view": view, "info": {"n": 1}}
    with CheckpointStore(tmp_path) as store:
        assert store.fence(timeout=0) is True  # nothing in flight
        handle = store.save_async(state, step=1, epoch=0, copy_in_background=True)
        state["info"]["n"] = 2  # plain objects are copied inside the call
        assert store.fence(timeout=30) is True and handle.wait_copied(timeout=0)
        weights.mul_(-1.0)
        path = handle.result(timeout=30)
    loaded, _ = load_checkpoint(path)
    assert torch.equal(loaded["weights"], torch.arange(12 << 20, dtype=torch.float32))
    assert loaded["view"].untyped_storage().data_ptr() == loaded["weights"].untyped_storage().data_ptr()
    assert torch.equal(loaded["view"], torch.arange(5, 10, dtype=torch.float32)) and loaded["info"] == {"n": 1}


def test_save_async_reuses_buffers_without_mixing_snapshots(tmp_path):
    with CheckpointStore(tmp_path, keep_last=None) as store:
        paths = []
        for value in (1.0, 2.0, 3.0):
            state = big_state(value, megabytes=8)
            state["small"] = torch.tensor([value])
            paths.append(store.save_async(state, step=int(value), epoch=0, if_busy="wait").result(timeout=30))
    for value, path in zip((1.0, 2.0, 3.0), paths):
        loaded, _ = load_checkpoint(path)
        assert bool((loaded["weights"] == value).all()) and float(loaded["small"]) == value


def test_save_async_while_busy_skips_or_waits(tmp_path, caplog):
    with CheckpointStore(tmp_path, keep_last=None) as store:
        first = store.save_async(big_state(1.0), step=1, epoch=0)
        with caplog.at_level(logging.WARNING):
            skipped = store.save_async(big_state(2.0), step=2, epoch=0)
        assert skipped is None and store.stats.skipped_busy == 1
        assert any("skipped" in r.getMessage() and "step 1" in r.getMessage() for r in caplog.records)
        waited = store.save_async(big_state(3.0), step=3, epoch=0, if_busy="wait")
        assert first.done()  # "wait" waited for the first write before snapshotting
        waited.result(timeout=30)
        with pytest.raises(ValueError):
            store.save_async(big_state(4.0, megabytes=1), step=4, epoch=0, if_busy="coalesce")
    assert [info.meta.step for info in list_checkpoints(tmp_path)] == [1, 3]


def test_wait_honours_the_deadline(tmp_path):
    with CheckpointStore(tmp_path) as store:
        handle = store.save_async(big_state(1.0, megabytes=64), step=1, epoch=0)
        assert store.wait(deadline=time.monotonic()) is False or handle.done()
        assert store.wait(timeout=30) is True and handle.done()
        assert store.in_flight is None


def test_sync_save_can_abandon_the_background_write(tmp_path):
    with CheckpointStore(tmp_path, keep_last=None) as store:
        handle = store.save_async(big_state(1.0, megabytes=96), step=1, epoch=0)
        final = store.save(big_state(2.0, megabytes=1), step=2, epoch=0, abort_in_flight=True)
        assert handle.done()
        if handle.exception() is not None:  # usually: the big write was still running
            assert isinstance(handle.exception(), WriteAborted) and store.stats.aborted == 1
            with pytest.raises(WriteAborted):
                handle.result()
            assert not handle.path.exists()
    assert not list(tmp_path.glob("*.tmp"))
    assert CheckpointStore(tmp_path).load_latest()[1].path == final


def test_background_failure_is_reported_through_the_handle(tmp_path, caplog):
    class NotPicklable:  # a local class: copyable, but pickle cannot name it
        pass

    with CheckpointStore(tmp_path) as store:
        with caplog.at_level(logging.ERROR):
            handle = store.save_async({"obj": NotPicklable(), "big": torch.ones(1 << 20)}, step=2, epoch=0)
            assert handle.wait(timeout=30)
        assert handle.exception() is not None and store.stats.failed == 1
        with pytest.raises(type(handle.exception())):
            handle.result()
        assert any("background checkpoint for step 2 failed" in r.getMessage() for r in caplog.records)
        # The failed write left nothing behind, and the store keeps working.
        assert list(tmp_path.glob("*.mpck*")) == []
        store.save(big_state(3.0, megabytes=1), step=3, epoch=0)
    assert CheckpointStore(tmp_path).load_latest()[1].step == 3


def test_weights_only_refusal_is_an_error_not_a_skip(tmp_path):
    with CheckpointStore(tmp_path) as store:
        store.save(big_state(1.0, megabytes=1), step=1, epoch=0)
        store.save({"custom": Path("/not/a/tensor")}, step=2, epoch=0)
    with pytest.raises(CheckpointError, match="weights_only"):
        CheckpointStore(tmp_path).load_latest()
    state, meta = CheckpointStore(tmp_path).load_latest(weights_only=False)  # a trusted directory
    assert state["custom"] == Path("/not/a/tensor") and meta.step == 2


def test_state_must_be_named_parts(tmp_path):
    with CheckpointStore(tmp_path) as store:
        with pytest.raises(TypeError):
            store.save([torch.zeros(1)], step=1, epoch=0)
        with pytest.raises(TypeError):
            store.save({1: torch.zeros(1)}, step=1, epoch=0)


def _draw():
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist() + np.random.randn(3).tolist(),  # odd count leaves a cached gaussian
        torch.rand(3).tolist() + torch.randn(3).tolist(),
    )


def test_rng_round_trip_in_memory_and_through_a_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()
    captured = capture_rng_state()
    expected = _draw()
    assert _draw() != expected  # the generators moved on
    restore_rng_state(captured)
    assert _draw() == expected
    with CheckpointStore(tmp_path) as store:
        store.save({Parts.RNG: captured}, step=1, epoch=0)
    state, _ = CheckpointStore(tmp_path).load_latest()  # weights_only=True
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(state[Parts.RNG])
    assert _draw() == expected


def test_list_reports_sizes_and_reasons(tmp_path):
    with CheckpointStore(tmp_path, keep_last=None) as store:
        good = store.save(big_state(1.0, megabytes=1), step=3, epoch=1)
        bad = store.save(big_state(2.0, megabytes=1), step=4, epoch=1)
    _flip_bit(bad, bad.stat().st_size - 100)
    quick = {info.name: info for info in list_checkpoints(tmp_path, verify=False)}
    full = {info.name: info for info in list_checkpoints(tmp_path)}
    assert quick[bad.name].valid  # headers and sizes are fine: only the checksum pass sees it
    assert not full[bad.name].valid and full[bad.name].reason == "payload checksum mismatch"
    assert full[good.name].valid and full[good.name].size == good.stat().st_size
    assert full[good.name].meta.epoch == 1 and full[good.name].meta.step == 3
    assert full[good.name].to_json()["parts"] == {"weights": 1 << 20, "meta": 0}
    with pytest.raises(UserError, match="does not exist"):
        list_checkpoints(tmp_path / "nope")


def test_snapshot_keeps_parameters_and_ordered_dicts():
    from moshpeer.peer.checkpoint.snapshot import SnapshotBuffers

    parameter = torch.nn.Parameter(torch.randn(4))
    state = OrderedDict(p=parameter, t=(1, torch.ones(2)), n=np.arange(3))
    snapshot, events = SnapshotBuffers().take(state)
    assert events == [] and type(snapshot) is OrderedDict
    assert isinstance(snapshot["p"], torch.nn.Parameter) and torch.equal(snapshot["p"], parameter)
    assert snapshot["p"].untyped_storage().data_ptr() != parameter.untyped_storage().data_ptr()
    assert isinstance(snapshot["t"], tuple) and torch.equal(snapshot["t"][1], torch.ones(2))
    state["n"][0] = 7
    assert snapshot["n"][0] == 0
