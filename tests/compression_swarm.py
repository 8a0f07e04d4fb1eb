"""Test helper: a swarm of `compression_swarm_worker.py` processes (same driver as averaging_swarm.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import List, Sequence

from averaging_swarm import READY_TIMEOUT, AveragingSwarm, Worker
from swarm import SWARM_TAG

WORKER = Path(__file__).with_name("compression_swarm_worker.py")


class CodecWorker(Worker):
    """A `Worker` (send / read_event / kill) running compression_swarm_worker.py."""

    def __init__(self, index: int, args: Sequence[str], env: dict):  # noqa: super().__init__ would spawn the other script
        self.index = index
        self.popen = subprocess.Popen(
            [sys.executable, str(WORKER), "--index", str(index), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, start_new_session=True, text=True, bufsize=1,
        )
        self.lines: List[dict] = []
        self.stderr_lines: List[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.ready = None


class CodecSwarm(AveragingSwarm):
    """n codec workers (the first bootstraps the DHT); `all()` and cleanup as in AveragingSwarm."""

    def __init__(self, n: int, *args: str):  # noqa: the parent's __init__ spawns averaging workers
        self.tag = uuid.uuid4().hex
        repo = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONUNBUFFERED": "1", SWARM_TAG: self.tag,
               "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
        self.workers: List[Worker] = []
        try:
            first = CodecWorker(0, list(args), env)
            self.workers.append(first)
            first.ready = first.read_event("ready", READY_TIMEOUT)
            for k in range(1, n):
                self.workers.append(CodecWorker(k, [*args, "--initial-peers", *first.ready["maddrs"]], env))
            for worker in self.workers[1:]:
                worker.ready = worker.read_event("ready", READY_TIMEOUT)
        except BaseException:
            self.close()
            raise
