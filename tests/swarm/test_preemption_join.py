"""Preemption of a real `moshpeer join` training peer: SIGTERM or a notice file -> final checkpoint,
exit 0 inside the grace period; a restart resumes at the same step with bit-identical state.

The peers train the built-in digits task alone (no --initial-peers: a swarm of one), which is
enough for the checkpoint and signal path; tests/swarm/test_preemption_swarm.py covers the swarm.
"""

from __future__ import annotations

import resource
import signal
import time

import pytest

from moshpeer.peer.checkpoint import CheckpointStore, load_checkpoint
from moshpeer.peer.checkpoint.training import state_digest
from swarm import LOOPBACK
from training_swarm import events, wait_event

pytestmark = pytest.mark.timeout(240)

GRACE = 20.0
STARTUP = 120.0  # spawn to first epoch on a loaded 2-core machine (imports torch, starts p2pd)


def start_peer(swarm, run_id: str, checkpoint_dir, *extra: str):
    return swarm.spawn("join", "--run-id", run_id, "--host-maddrs", LOOPBACK, "--heartbeat", "1",
                       "--checkpoint-dir", str(checkpoint_dir), "--grace-period", str(GRACE), *extra)


def stop_and_check(peer, how) -> dict:
    """Trigger a stop with `how()`; the peer must exit 0 inside the grace period after writing its
    final checkpoint. Returns that checkpoint's event."""
    sent = time.monotonic()
    how()
    code = peer.wait_exit(GRACE + 15)
    elapsed = time.monotonic() - sent
    assert code == 0, peer.describe(40)
    assert elapsed < GRACE, f"exited {elapsed:.1f} s after the stop; grace period {GRACE} s"
    final = [e for e in events(peer, "checkpoint") if e["kind"] == "final"]
    assert len(final) == 1, peer.describe(40)
    assert final[0]["seconds_left"] > 0  # durable before the time reserved for the shutdown
    assert "Traceback" not in peer.stderr, peer.describe(60)
    return final[0]


def wait_periodic_checkpoint(peer) -> dict:
    return wait_event(peer, "checkpoint", timeout=STARTUP, predicate=lambda e: e["kind"] == "periodic")


def test_sigterm_checkpoints_in_time_restart_resumes_exactly_and_a_notice_file_does_the_same(swarm, tmp_path):
    directory, notice = tmp_path / "ckpt", tmp_path / "preempted"
    peer = start_peer(swarm, "preempt-join", directory, "--checkpoint-every-steps", "7")
    # A few epochs in: Adam state exists and a periodic checkpoint was written in the background. Waited for as
    # such: a write still in flight at the stop is superseded by the final one and never announced (CI, once).
    wait_periodic_checkpoint(peer)
    wait_event(peer, "epoch", timeout=STARTUP, predicate=lambda e: e["epoch"] >= 2)
    final = stop_and_check(peer, lambda: peer.send_signal(signal.SIGTERM))
    assert final["reason"] == "received SIGTERM"
    done = wait_event(peer, "done", timeout=1)
    assert done["reason"] == "stopped" and done["params_digest"] == final["params_digest"]

    # On disk: the newest valid checkpoint is the final one, and it holds exactly the state the peer had.
    state, meta = CheckpointStore(directory).load_latest()
    assert meta.path.name == final["file"] and meta.step == final["step"] and meta.epoch == final["epoch"]
    assert meta.extra["reason"] == "received SIGTERM"
    assert state_digest(state) == final["state_digest"]
    assert set(state) >= {"model", "optimizer", "collaborative", "grid", "rng", "data"}
    assert state["optimizer"]["state"], "Adam's moments are in the checkpoint"
    assert state["collaborative"]["epoch"] == final["epoch"] and state["collaborative"]["micro_steps"] == final["step"]

    restarted = start_peer(swarm, "preempt-join", directory, "--checkpoint-every-steps", "7",
                           "--preemption-notice", str(notice))
    resumed = wait_event(restarted, "resumed", timeout=STARTUP)
    # Same file, same step and epoch; parameters, optimizer state, accumulators bit-identical to the
    # saved tensors (digest of the live state after loading == digest of the file's tensors).
    assert resumed["file"] == final["file"]
    assert (resumed["step"], resumed["epoch"]) == (final["step"], final["epoch"])
    assert resumed["state_digest"] == state_digest(load_checkpoint(directory / final["file"])[0])
    assert resumed["params_digest"] == final["params_digest"]
    started = wait_event(restarted, "started", timeout=60)
    assert started["step"] == final["step"] and started["epoch"] == final["epoch"]
    # It trains on from there; then a preemption notice file appears: the same path as SIGTERM.
    wait_event(restarted, "epoch", timeout=STARTUP, predicate=lambda e: e["previous_epoch"] == final["epoch"])
    second = stop_and_check(restarted, lambda: notice.write_text("spot instance termination scheduled\n"))
    assert second["reason"] == f"notice file {notice} appeared"
    assert second["step"] > final["step"] and second["epoch"] > final["epoch"]
    state, meta = CheckpointStore(directory).load_latest()
    assert meta.path.name == second["file"] and state_digest(state) == second["state_digest"]
    assert "preemption notice" in restarted.stderr


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


def test_a_final_checkpoint_that_cannot_be_written_is_one_error_line_and_exit_code_1(swarm, tmp_path):
    """A full disk, made here with a file size limit below a checkpoint's size (RLIMIT_FSIZE: Python ignores
    SIGXFSZ, so a write fails with EFBIG as it would with ENOSPC; the reference kernels, so that no compiled
    extension is built under the limit). Before: a line per failure, the final one twice, and exit code 0, so a
    supervisor took the stop for a clean one. Now the peer trains on through failed periodic writes, and on SIGTERM
    says once that the training since the last checkpoint is lost and what a resume would start from, and exits 1."""
    peer = swarm.spawn("join", "--run-id", "full-disk", "--host-maddrs", LOOPBACK, "--heartbeat", "1",
                       "--checkpoint-dir", str(tmp_path / "ckpt"), "--grace-period", str(GRACE),
                       "--checkpoint-every-steps", "7", preexec=_limit_file_size, env={"MOSHPEER_KERNELS": "torch"})
    peer.wait_for_line(lambda line: "background checkpoint for step" in line and "failed" in line, timeout=STARTUP,
                       stream="stderr")
    wait_event(peer, "epoch", timeout=60, predicate=lambda e: e["epoch"] >= 2)  # training goes on
    peer.send_signal(signal.SIGTERM)
    assert peer.wait_exit(GRACE + 15) == 1, peer.describe(40)
    failed = [line for line in peer.stderr_lines if "final checkpoint failed" in line]
    assert len(failed) == 1 and "there is no checkpoint yet" in failed[0] and "exiting with code 1" in failed[0]
    assert not events(peer, "checkpoint") and "Traceback" not in peer.stderr, peer.describe(40)


@pytest.mark.slow  # two more peer processes; the skipping itself is unit-tested in test_checkpoint.py
def test_corrupt_newest_checkpoint_is_reported_and_skipped(swarm, tmp_path):
    directory = tmp_path / "ckpt"
    peer = start_peer(swarm, "preempt-corrupt", directory, "--checkpoint-every-steps", "5")
    wait_periodic_checkpoint(peer)
    wait_event(peer, "epoch", timeout=STARTUP, predicate=lambda e: e["epoch"] >= 1)
    final = stop_and_check(peer, lambda: peer.send_signal(signal.SIGTERM))
    valid = [info for info in CheckpointStore(directory).list() if info.valid]
    assert len(valid) >= 2 and valid[-1].name == final["file"]
    with open(valid[-1].path, "r+b") as f:  # flip a payload byte of the newest checkpoint
        f.seek(valid[-1].size - 100)
        byte = f.read(1)
        f.seek(valid[-1].size - 100)
        f.write(bytes([byte[0] ^ 0xFF]))

    restarted = start_peer(swarm, "preempt-corrupt", directory)
    resumed = wait_event(restarted, "resumed", timeout=STARTUP)
    assert resumed["file"] == valid[-2].name and resumed["step"] == valid[-2].meta.step
    warnings = [line for line in restarted.stderr_lines if final["file"] in line]
    assert len(warnings) == 1 and "skipping corrupt checkpoint" in warnings[0], warnings
    stop_and_check(restarted, lambda: restarted.send_signal(signal.SIGTERM))
