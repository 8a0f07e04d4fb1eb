"""A training process under SIGTERM / a notice file: it checkpoints, exits 0 in time, resumes exactly.

The process is tests/helpers/preemption_trainer.py, which uses PreemptionWatcher and CheckpointStore
directly (the swarm-level versions of these tests come with `moshpeer join`).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from moshpeer.peer.checkpoint import CheckpointStore, Parts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from preemption_trainer import digest, make_model  # noqa: E402
from trainer_process import TrainerProcess  # noqa: E402

pytestmark = pytest.mark.timeout(300)

GRACE = 20.0
TOTAL_STEPS = 400


@pytest.mark.slow  # the same path through `moshpeer join`: tests/swarm/test_preemption_join.py
def test_sigterm_checkpoints_exits_in_time_and_resumes_exactly(tmp_path):
    common = ["--total-steps", str(TOTAL_STEPS), "--grace", str(GRACE)]
    # The same run without interruption, for the final comparison (runs alongside).
    reference = TrainerProcess("--dir", str(tmp_path / "reference"), *common, log_dir=tmp_path)
    first = TrainerProcess("--dir", str(tmp_path / "ckpt"), "--checkpoint-every", "7", *common, log_dir=tmp_path)
    try:
        first.wait_for(lambda e: e["event"] == "step" and e["step"] >= 20, timeout=180)
        sent = first.signal(signal.SIGTERM)
        code = first.finish(timeout=GRACE + 30)
        elapsed = time.monotonic() - sent  # an upper bound: includes collecting the last events
        assert code == 0, first.diagnostics()
        assert elapsed < GRACE, f"took {elapsed:.1f} s to exit after SIGTERM"
        preempted, saved = first.last("preempted"), first.last("checkpoint")
        assert preempted["reason"] == "SIGTERM" and saved["step"] == preempted["step"] < TOTAL_STEPS
        assert saved["remaining"] > 0  # the checkpoint was on disk before the deadline
        assert not any(e["event"] == "done" for e in first.events)

        resumed = TrainerProcess("--dir", str(tmp_path / "ckpt"), *common, log_dir=tmp_path)
        event = resumed.event("resumed", timeout=180)
        # Same step, and parameters + Adam state bit-identical to the live state at exit.
        assert event["step"] == saved["step"] and event["digest"] == saved["digest"]
        assert event["file"] == saved["file"]
        assert resumed.finish(timeout=180) == 0, resumed.diagnostics()
        assert reference.finish(timeout=180) == 0, reference.diagnostics()
        # RNG states and data position came back too: the resumed run ends exactly where the
        # uninterrupted one does.
        assert resumed.last("done")["digest"] == reference.last("done")["digest"]
    finally:
        for process in (reference, first):
            process.kill()


@pytest.mark.slow  # the same path through `moshpeer join`: tests/swarm/test_preemption_join.py
def test_notice_file_takes_the_same_path_as_sigterm(tmp_path):
    notice_file = tmp_path / "preempted"
    directory = tmp_path / "ckpt"
    trainer = TrainerProcess(
        "--dir", str(directory), "--notice-file", str(notice_file), "--grace", str(GRACE), log_dir=tmp_path
    )
    try:
        trainer.wait_for(lambda e: e["event"] == "step" and e["step"] >= 10, timeout=180)
        notice_file.write_text("spot instance termination scheduled\n")
        assert trainer.finish(timeout=GRACE + 30) == 0, trainer.diagnostics()
    finally:
        trainer.kill()
    preempted, saved = trainer.last("preempted"), trainer.last("checkpoint")
    assert "notice file" in preempted["reason"] and saved["remaining"] > 0
    # What is on disk is the state the process had when it left.
    state, meta = CheckpointStore(directory).load_latest()
    assert meta.step == saved["step"] and meta.extra["reason"] == preempted["reason"]
    model = make_model(64, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.load_state_dict(state[Parts.MODEL])
    optimizer.load_state_dict(state[Parts.OPTIMIZER])
    assert digest(model, optimizer) == saved["digest"]


def test_a_second_signal_does_not_interrupt_the_final_checkpoint(tmp_path):
    # A bigger model (~50 MB of state) so the final write takes a while.
    trainer = TrainerProcess(
        "--dir", str(tmp_path / "ckpt"), "--width", "1024", "--depth", "4", "--expect-signals", "2", log_dir=tmp_path
    )
    try:
        trainer.wait_for(lambda e: e["event"] == "step" and e["step"] >= 2, timeout=180)
        trainer.signal(signal.SIGTERM)
        trainer.event("saving_final", timeout=60)
        trainer.signal(signal.SIGINT)  # impatient operator
        assert trainer.finish(timeout=GRACE + 30) == 0, trainer.diagnostics()
    finally:
        trainer.kill()
    saved = trainer.last("checkpoint")
    assert saved["signals"] == 2
    state, meta = CheckpointStore(tmp_path / "ckpt").load_latest()
    assert meta.step == saved["step"]
    assert "signal received again" in trainer.stderr_path.read_text()


def test_third_signal_exits_at_once_and_the_directory_stays_consistent(tmp_path):
    directory = tmp_path / "ckpt"
    trainer = TrainerProcess(
        "--dir", str(directory), "--width", "1024", "--depth", "4", "--checkpoint-every", "3",
        "--expect-signals", "3", log_dir=tmp_path,
    )  # fmt: skip
    try:
        # Let at least one periodic checkpoint land first.
        deadline = time.monotonic() + 180
        while not any(info.valid for info in CheckpointStore(directory).list()):
            assert time.monotonic() < deadline and trainer.proc.poll() is None, trainer.diagnostics()
            time.sleep(0.05)
        trainer.signal(signal.SIGTERM)
        trainer.event("saving_final", timeout=60)
        trainer.signal(signal.SIGTERM)
        # Signals sent back to back can merge into one delivery: send the third after the
        # second has been seen.
        deadline = time.monotonic() + 60
        while "signal received again" not in trainer.stderr_path.read_text():
            assert time.monotonic() < deadline and trainer.proc.poll() is None, trainer.diagnostics()
            time.sleep(0.01)
        trainer.signal(signal.SIGTERM)
        code = trainer.finish(timeout=GRACE + 30)
    finally:
        trainer.kill()
    assert code == 128 + signal.SIGTERM, trainer.diagnostics()
    assert "exiting now" in trainer.stderr_path.read_text()
    assert not any(e["event"] == "checkpoint" for e in trainer.events)
    # Whether the final write had finished or not, the newest loadable checkpoint is intact.
    state, meta = CheckpointStore(directory).load_latest()
    assert meta.step >= 3 and set(state) >= {Parts.MODEL, Parts.OPTIMIZER, Parts.RNG, Parts.DATA}
