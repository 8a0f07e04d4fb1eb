"""SIGKILL a checkpoint writer at 20 random moments, most of them in the middle of a write.

Each round starts a writer process that resumes from the newest checkpoint (as a restarted peer
would) and saves ~16 MB states in a loop, alternating synchronous and background saves. It prints
a line when a write starts and when it is durable. The test kills it with SIGKILL at a random
delay after a "start" line, then checks in this process that `load_latest()` returns the newest
checkpoint that can exist (the last one reported durable, or the one being written if the kill
landed after its rename) with exactly the content that step saved, and that nothing corrupt is
ever loaded.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from moshpeer.peer.checkpoint import CheckpointStore

pytestmark = pytest.mark.timeout(600)

ROUNDS = 20
STATE_MEGABYTES = 16  # big enough that most kills land mid-write (the delay scales with the measured write time)
REPO = Path(__file__).resolve().parents[2]


def expected_state(step: int) -> dict:
    """What the writer saves at `step`: every value depends on the step."""
    generator = torch.Generator().manual_seed(step)
    return {
        "big": torch.full((STATE_MEGABYTES << 18,), float(step)),
        "random": torch.randn(1000, generator=generator),
        "info": {"step": step, "name": f"state-{step}"},
    }


def writer_main(directory: str) -> None:
    """The child: wait for "go" on stdin, resume from the newest checkpoint, then save forever.

    (Waiting lets the test start the next writer, and pay for its imports, during this round.)
    """
    if sys.stdin.readline().strip() != "go":
        return  # the test ended without needing this writer
    store = CheckpointStore(directory, keep_last=3, background_nice=0)  # full speed: this tests atomicity
    resumed = store.load_latest()
    step = resumed[1].step if resumed else 0
    while True:
        step += 1
        state = expected_state(step)
        print(json.dumps({"event": "start", "step": step}), flush=True)
        started = time.perf_counter()
        if step % 2:
            store.save(state, step=step, epoch=step // 4)
        else:
            store.save_async(state, step=step, epoch=step // 4).result()
        print(json.dumps({"event": "saved", "step": step, "seconds": time.perf_counter() - started}), flush=True)


def _read_lines(proc: subprocess.Popen, lines: "queue.Queue") -> None:
    for line in proc.stdout:
        lines.put(json.loads(line))
    lines.put(None)


def test_sigkill_at_random_moments_never_yields_a_corrupt_checkpoint(tmp_path, caplog):
    directory = tmp_path / "ckpt"
    rng = random.Random(20240607)
    write_seconds = [0.2]  # refined from the writer's own reports
    last_durable = 0  # newest step any writer reported durable
    killed_mid_write = 0
    leftover_warnings = 0
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def spawn() -> subprocess.Popen:
        command = [sys.executable, __file__, str(directory)]
        return subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
        )

    upcoming = spawn()
    try:
        for round_index in range(ROUNDS):
            proc, upcoming = upcoming, (spawn() if round_index + 1 < ROUNDS else None)
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            lines: "queue.Queue" = queue.Queue()
            threading.Thread(target=_read_lines, args=(proc, lines), daemon=True).start()
            starts_before_kill = rng.randint(1, 2)
            started_steps, durable_steps = [], []
            try:
                deadline = time.monotonic() + 120
                while len(started_steps) < starts_before_kill:
                    event = lines.get(timeout=max(0.1, deadline - time.monotonic()))
                    assert event is not None, "writer exited on its own"
                    if event["event"] == "start":
                        started_steps.append(event["step"])
                    else:
                        durable_steps.append(event["step"])
                        write_seconds.append(event["seconds"])
                # Somewhere inside the write that just started (or a little after it).
                time.sleep(rng.uniform(0.0, 1.2 * statistics.median(write_seconds)))
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=60)
            while (event := lines.get(timeout=30)) is not None:
                if event["event"] == "start":
                    started_steps.append(event["step"])
                else:
                    durable_steps.append(event["step"])
            last_durable = max([last_durable, *durable_steps])
            in_progress = started_steps[-1]
            if in_progress not in durable_steps:
                killed_mid_write += 1

            caplog.clear()
            with caplog.at_level(logging.WARNING):
                loaded = CheckpointStore(directory).load_latest()
            leftover_warnings += any("leftover temp file" in r.getMessage() for r in caplog.records)
            if loaded is None:
                assert last_durable == 0, "a checkpoint reported durable was lost"
                continue
            state, meta = loaded
            # The newest checkpoint that can exist: the last durable one, or the one in progress if
            # the kill came between its rename and the "saved" line.
            assert meta.step in (last_durable, in_progress), (round_index, meta.step, last_durable, in_progress)
            last_durable = meta.step  # the next writer resumes from here
            expected = expected_state(meta.step)
            assert torch.equal(state["big"], expected["big"]) and torch.equal(state["random"], expected["random"])
            assert state["info"] == expected["info"]
    finally:
        if upcoming is not None:
            upcoming.kill()
            upcoming.wait()
    print(f"{killed_mid_write} of {ROUNDS} kills landed inside a write")
    assert killed_mid_write >= ROUNDS // 4, f"only {killed_mid_write} of {ROUNDS} kills landed inside a write"
    assert leftover_warnings >= 1  # interrupted writes left temp files, and they were skipped


if __name__ == "__main__":
    writer_main(sys.argv[1])
