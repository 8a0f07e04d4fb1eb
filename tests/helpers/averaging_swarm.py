"""Test helper: a swarm of `averaging_worker.py` processes driven over stdin (see that file)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from swarm import SWARM_TAG, watch_stderr

from moshpeer.testing.orphans import Reaper, kill_tagged, remove_torch_segments, tagged_pids

WORKER = Path(__file__).with_name("averaging_worker.py")
READY_TIMEOUT = 90.0


class Worker:
    """One worker process; `send` a command, `read_event` its answers (each with a deadline)."""

    def __init__(self, index: int, args: Sequence[str], env: dict, script: Path = WORKER,
                 wrap: Optional[Callable[[int, List[str]], List[str]]] = None):
        self.index = index
        argv = [sys.executable, str(script), "--index", str(index), *args]
        self.popen = subprocess.Popen(
            wrap(index, argv) if wrap is not None else argv,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, start_new_session=True, text=True, bufsize=1,
        )
        self.lines: List[dict] = []
        self.stderr_lines: List[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.ready: Optional[dict] = None
        watch_stderr(f"worker {index} ({script.name})", lambda: "\n".join(self.stderr_lines))

    def _read_stdout(self) -> None:
        for raw in self.popen.stdout:
            if raw.startswith("{"):
                with self._cond:
                    self.lines.append(json.loads(raw))
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _read_stderr(self) -> None:
        for raw in self.popen.stderr:
            with self._cond:
                self.stderr_lines.append(raw.rstrip("\n"))
                self._cond.notify_all()

    def send(self, **command) -> None:
        self.popen.stdin.write(json.dumps(command) + "\n")
        self.popen.stdin.flush()

    def read_event(self, event: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for k, line in enumerate(self.lines):
                    if line.get("event") == event:
                        return self.lines.pop(k)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.popen.poll() is not None:
                    tail = "\n".join(self.stderr_lines[-20:])
                    raise AssertionError(f"worker {self.index}: no {event!r} within {timeout} s "
                                         f"(rc={self.popen.poll()})\n{tail}")
                self._cond.wait(min(remaining, 0.5))

    def wait_stderr(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.stderr_lines:
                    if needle in line:
                        return line
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"worker {self.index}: no stderr line with {needle!r} in {timeout} s")
                self._cond.wait(min(remaining, 0.5))

    def kill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait()


class AveragingSwarm:
    """Starts n workers (the first one bootstraps the DHT); kills all of them and their children on exit, or,
    if the test process dies first, its `Reaper` does.

    `script` is the worker program: any script speaking averaging_worker.py's stdin/stdout protocol.
    `wrap(index, argv)` -> the command line that runs worker `index` (e.g. `Netlab.command`: in its namespace)."""

    def __init__(self, n: int, *args: str, per_worker_args=None, script: Path = WORKER,
                 wrap: Optional[Callable[[int, List[str]], List[str]]] = None):
        self.tag = uuid.uuid4().hex
        repo = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONUNBUFFERED": "1", SWARM_TAG: self.tag,
               "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
        self.workers: List[Worker] = []
        self._reaper = Reaper(SWARM_TAG, self.tag)
        try:
            extra = (per_worker_args or (lambda k: []))
            first = Worker(0, [*args, *extra(0)], env, script, wrap)
            self.workers.append(first)
            boot = first.read_event("ready", READY_TIMEOUT)
            first.ready = boot
            for k in range(1, n):
                self.workers.append(Worker(k, [*args, *extra(k), "--initial-peers", *boot["maddrs"]], env, script,
                                           wrap))
            for worker in self.workers[1:]:
                worker.ready = worker.read_event("ready", READY_TIMEOUT)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "AveragingSwarm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def all(self, event: str, timeout: float, workers=None, **command) -> List[dict]:
        """Send `command` to every worker (or `workers`) at once, then collect one `event` from each."""
        workers = self.workers if workers is None else workers
        for worker in workers:
            worker.send(**command)
        deadline = time.monotonic() + timeout
        return [worker.read_event(event, max(0.1, deadline - time.monotonic())) for worker in workers]

    def close(self) -> None:
        family = tagged_pids(SWARM_TAG, self.tag) | {worker.popen.pid for worker in self.workers}
        for worker in self.workers:
            if worker.popen.poll() is None:
                try:
                    worker.send(cmd="exit")
                except (BrokenPipeError, OSError, ValueError):
                    pass
        deadline = time.monotonic() + 8.0
        for worker in self.workers:
            try:
                worker.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.popen.kill()
                worker.popen.wait()
        kill_tagged(SWARM_TAG, self.tag, grace=1.0)  # what the workers spawned and left (DHT processes, p2pd)
        self._reaper.close()
        remove_torch_segments(family)  # of the workers SIGKILLed above (their torch_shm_manager may be gone)
