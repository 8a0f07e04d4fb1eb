"""Helpers for tests that run tests/helpers/preemption_trainer.py as a real process and read its events."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from swarm import SWARM_TAG, watch_stderr

from moshpeer.testing.orphans import Reaper, remove_torch_segments, tagged_pids

TRAINER = Path(__file__).resolve().parent / "preemption_trainer.py"
REPO = TRAINER.parents[2]


class TrainerProcess:
    """A running preemption_trainer.py: its JSON events arrive on a queue, stderr goes to a file."""

    def __init__(self, *args: str, log_dir: Path):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.stderr_path = log_dir / f"trainer-{time.monotonic_ns()}.stderr"
        self._stderr = open(self.stderr_path, "wb")
        self._tag = uuid.uuid4().hex
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), SWARM_TAG: self._tag}
        self._reaper = Reaper(SWARM_TAG, self._tag)  # the trainer and its DHT / p2pd die with the test process
        self.proc = subprocess.Popen(
            [sys.executable, str(TRAINER), *args], stdout=subprocess.PIPE, stderr=self._stderr, env=env, cwd=REPO
        )
        self._family = {self.proc.pid}  # and, seen while alive, what it spawned: their torch segments go at the end
        watch_stderr(f"trainer {TRAINER.name}", lambda: self.stderr_path.read_text(errors="replace"))
        self.events: List[Dict[str, Any]] = []
        self._queue: "queue.Queue[Optional[Dict[str, Any]]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self._queue.put(json.loads(line))
            except ValueError:
                pass
        self._queue.put(None)  # end of output

    def wait_for(self, predicate: Callable[[Dict[str, Any]], bool], timeout: float) -> Dict[str, Any]:
        """The first event (not seen before) that satisfies `predicate`; fails at the deadline or at exit."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"trainer: no matching event within {timeout} s; {self.diagnostics()}") from None
            if event is None:
                self._queue.put(None)
                raise AssertionError(f"trainer exited before a matching event; {self.diagnostics()}")
            self.events.append(event)
            if predicate(event):
                return event

    def event(self, name: str, timeout: float = 120.0) -> Dict[str, Any]:
        return self.wait_for(lambda e: e["event"] == name, timeout)

    def signal(self, signum: int = signal.SIGTERM) -> float:
        """Send a signal; returns the time.monotonic() at which it was sent."""
        sent = time.monotonic()
        self._family |= tagged_pids(SWARM_TAG, self._tag)
        self.proc.send_signal(signum)
        return sent

    def finish(self, timeout: float = 120.0) -> int:
        """Wait for exit, collect the remaining events; the exit code."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"trainer still running after {timeout} s; {self.diagnostics()}") from None
        while True:
            try:
                event = self._queue.get(timeout=10)
            except queue.Empty:
                break
            if event is None:
                self._queue.put(None)
                break
            self.events.append(event)
        self._stderr.close()
        self._reaper.close()  # whatever the trainer left running (it should have left nothing)
        remove_torch_segments(self._family)
        return code

    def last(self, name: str) -> Dict[str, Any]:
        matching = [e for e in self.events if e["event"] == name]
        assert matching, f"no {name!r} event; {self.diagnostics()}"
        return matching[-1]

    def diagnostics(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        tail = self.stderr_path.read_text(errors="replace")[-3000:]
        return f"events so far: {self.events[-5:]}, stderr tail:\n{tail}"

    def kill(self) -> None:
        self._family |= tagged_pids(SWARM_TAG, self._tag)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reaper.close()
        remove_torch_segments(self._family)
