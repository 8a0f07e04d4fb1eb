"""Test helper: spawn real `python -m moshpeer ...` processes, wait on what they print, clean up.

    with Swarm() as swarm:
        boot = swarm.bootstrap("my-run")                       # `moshpeer dht`, waits for readiness
        peers = swarm.join(3, "my-run", boot.maddrs)           # 3 x `moshpeer join`, all ready
        result = swarm.run("status", "--initial-peers", *boot.maddrs, "--run-id", "my-run", "--json")
        peers[0].terminate()                                   # SIGTERM, wait, exit code
    # leaving the block: every process of this swarm, p2pd included, is gone (or the test fails)

Any command line works (`swarm.spawn("join", ...)` / `swarm.run(...)`), so other subcommands can
use the same helper. Processes start in their own session (`start_new_session=True`), and every
process spawned, plus everything it spawns (its DHT process, p2pd), inherits an environment tag
naming its swarm and process. Cleanup SIGTERMs them, then SIGKILLs their process groups and whatever
carries the tag in /proc, wherever it was re-parented. A killed test run (SIGKILL, `timeout`) runs no
cleanup: for that, each swarm starts a `moshpeer.testing.orphans.Reaper` first, a watchdog that kills
every process with the swarm's tag as soon as the test process is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from moshpeer.processes import ProcInfo, all_processes  # noqa: F401 (re-exported)
from moshpeer.testing.orphans import (Reaper, kill_tagged, remove_torch_segments,  # noqa: F401 (re-exported)
                                      tagged_pids, tagged_processes)

REPO_ROOT = Path(__file__).resolve().parents[2]
SWARM_TAG = "MOSHPEER_TEST_SWARM"
PROC_TAG = "MOSHPEER_TEST_PROC"
SWARM_LOG_DIR = "SWARM_LOG_DIR"  # a folder: every spawned process's stdout and stderr are copied there
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# How long a peer may take from spawn to readiness on a slow shared machine (imports torch + p2pd).
READY_TIMEOUT = 60.0


# ---- stderr that must stay clean ---------------------------------------------------------------

# A peer leaving is one log line; a traceback or an asyncio task left pending means a bug (or an
# expected failure logged as one). conftest fails a test whose spawned processes printed either.
FORBIDDEN_STDERR = ("Traceback (most recent call last)", "Task was destroyed but it is pending")
_watched_stderr: List[Tuple[str, Callable[[], str]]] = []


def watch_stderr(name: str, read: Callable[[], str]) -> None:
    """Have conftest check what `read()` returns (a spawned process's stderr so far) after the test."""
    _watched_stderr.append((name, read))


def forbidden_stderr(*, forget: bool = True) -> List[str]:
    """'name: line' for the first forbidden line of each watched process (with the log line before it and
    the 60 after: the whole traceback); then forget them (the next test starts with none)."""
    found = []
    for name, read in _watched_stderr:
        lines = read().splitlines()
        for k, line in enumerate(lines):
            if any(marker in line for marker in FORBIDDEN_STDERR):
                context = "\n    ".join(lines[max(k - 1, 0) : k + 60])
                found.append(f"{name}: {context}")
                break
    if forget:
        _watched_stderr.clear()
    return found


# ---- /proc (Linux) ------------------------------------------------------------------------------


def process_group(pgid: int) -> List[ProcInfo]:
    """Live members of process group `pgid`."""
    return [info for info in all_processes() if info.pgid == pgid and info.alive]


# ---- one process --------------------------------------------------------------------------------


class ProcessFailed(AssertionError):
    """A spawned process exited, or did not print what a test waited for in time."""


class Proc:
    """One spawned `python -m moshpeer ...` process, with its stdout and stderr collected line by line."""

    def __init__(self, args: Sequence[str], *, name: str, swarm_tag: str, env: Dict[str, str], cwd: str,
                 preexec: Optional[Callable[[], None]] = None, prefix: Sequence[str] = ()):
        self.args = list(args)
        self.name = name
        self.tag = f"{name}-{uuid.uuid4().hex[:8]}"
        env = {**env, SWARM_TAG: swarm_tag, PROC_TAG: self.tag}
        self.started_at = time.monotonic()
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", "moshpeer", *(["-v"] if os.environ.get("SWARM_VERBOSE") else []),
             *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,  # own process group: signals to pytest's group do not reach it
            preexec_fn=preexec,  # e.g. joining a CPU budget's cgroup (moshpeer.testing.netlab.cpu.joiner)
        )
        self.stdout_lines: List[str] = []
        self.stdout_times: List[float] = []  # time.monotonic() at which each stdout line arrived
        self.stderr_lines: List[str] = []
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(self.popen.stdout, self.stdout_lines, self.stdout_times,
                                                      self._log_file("stdout")), daemon=True),
            threading.Thread(target=self._read, args=(self.popen.stderr, self.stderr_lines, None,
                                                      self._log_file("stderr")), daemon=True),
        ]
        for reader in self._readers:
            reader.start()
        self.ready: Optional[dict] = None
        watch_stderr(f"{self.name} ({' '.join(self.args[:1])})", lambda: self.stderr)

    def _log_file(self, stream: str) -> Optional[Path]:
        """Where this process's `stream` is copied, line by line, when SWARM_LOG_DIR names a folder (to read a
        failed run's whole logs: a failure message shows only their tails)."""
        folder = os.environ.get(SWARM_LOG_DIR)
        if not folder:
            return None
        Path(folder).mkdir(parents=True, exist_ok=True)  # a folder that is not there failed every reader, silently
        return Path(folder) / f"{self.tag}.{stream}.log"

    def _read(self, stream, lines: List[str], times: Optional[List[float]], copy_to: Optional[Path]) -> None:
        copy = copy_to.open("w", buffering=1) if copy_to else None
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if copy:
                copy.write(f"{line}\n")
            with self._changed:
                lines.append(line)
                if times is not None:
                    times.append(time.monotonic())
                self._changed.notify_all()
        stream.close()
        if copy:
            copy.close()
        with self._changed:
            self._changed.notify_all()

    def __repr__(self) -> str:
        return f"<Proc {self.name} pid={self.pid} rc={self.returncode}>"

    # -- state --

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.popen.poll()

    @property
    def stdout(self) -> str:
        with self._changed:
            return "\n".join(self.stdout_lines)

    def timed_stdout(self) -> List[Tuple[float, str]]:
        """(time.monotonic() at arrival, line) of every stdout line so far."""
        with self._changed:
            return list(zip(self.stdout_times, self.stdout_lines))

    @property
    def stderr(self) -> str:
        with self._changed:
            return "\n".join(self.stderr_lines)

    @property
    def peer_id(self) -> str:
        return self._ready_field("peer_id")

    @property
    def maddrs(self) -> List[str]:
        return self._ready_field("maddrs")

    def _ready_field(self, field: str):
        if self.ready is None:
            raise RuntimeError(f"{self.name} is not ready yet: call wait_ready() first")
        return self.ready[field]

    def family(self) -> List[ProcInfo]:
        """This process and everything it spawned (DHT process, p2pd, ...) that is still alive."""
        return tagged_processes(PROC_TAG, self.tag)

    def p2pd_processes(self) -> List[ProcInfo]:
        return [info for info in self.family() if info.name == "p2pd"]

    def describe(self, tail: int = 15) -> str:
        err = "\n".join(self.stderr_lines[-tail:])
        return f"{self!r}: {' '.join(self.args)}\n--- stderr (last {tail} lines) ---\n{err}"

    # -- waiting --

    def wait_for_line(
        self, predicate: Callable[[str], bool], timeout: float, *, stream: str = "stdout"
    ) -> str:
        """The first line of `stream` ("stdout", "stderr") that satisfies `predicate`, waiting up to `timeout`."""
        lines = {"stdout": self.stdout_lines, "stderr": self.stderr_lines}[stream]
        deadline = time.monotonic() + timeout
        seen = 0
        exited_at = None
        with self._changed:
            while True:
                for line in lines[seen:]:
                    if predicate(line):
                        return line
                seen = len(lines)
                if exited_at is None and self.popen.poll() is not None:
                    exited_at = time.monotonic()
                # After the exit, give the readers a moment to deliver the last lines still in the pipe.
                readers_done = not any(reader.is_alive() for reader in self._readers)
                if exited_at is not None and (readers_done or time.monotonic() - exited_at > 1.0):
                    raise ProcessFailed(f"exited with {self.popen.returncode} before the line came\n{self.describe()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ProcessFailed(f"no matching {stream} line within {timeout:g} s\n{self.describe()}")
                self._changed.wait(min(remaining, 0.5))

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> dict:
        """Wait for the JSON readiness line ({"event": "ready", ...}) and return it as a dict."""
        if self.ready is None:
            line = self.wait_for_line(_is_ready_line, timeout)
            self.ready = json.loads(line)
        return self.ready

    def wait_exit(self, timeout: float) -> int:
        """Wait for the process to exit; its exit code. Raises ProcessFailed after `timeout`."""
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise ProcessFailed(f"still running after {timeout:g} s\n{self.describe()}") from None
        # Let the readers collect the last lines. Pipes may stay open a little longer if a helper
        # process (torch_shm_manager) inherited them, so this wait is short and never fails.
        for reader in self._readers:
            reader.join(timeout=0.5)
        return code

    # -- stopping --

    def send_signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM (what a user's `kill` or a preemption sends) and wait for the exit code."""
        self.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def kill(self) -> None:
        """SIGKILL the main process only, like a crash: what it spawned must clean up after itself."""
        self.send_signal(signal.SIGKILL)
        self.popen.wait()


def _is_ready_line(line: str) -> bool:
    if not line.startswith("{"):
        return False
    try:
        return json.loads(line).get("event") == "ready"
    except ValueError:
        return False


@dataclass
class RunResult:
    """Outcome of a command run to completion."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self) -> List[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


# ---- a swarm of processes -----------------------------------------------------------------------


class Swarm:
    """Spawns moshpeer processes on 127.0.0.1 and guarantees none of them (nor their p2pd) outlives it."""

    def __init__(self, *, cwd: Optional[str] = None, env: Optional[Dict[str, str]] = None):
        self.tag = uuid.uuid4().hex
        self.procs: List[Proc] = []
        self.cwd = cwd or str(REPO_ROOT)
        pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        # Carries the swarm's tag: a process a test starts itself with this environment is reaped like the others.
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath, **(env or {}), SWARM_TAG: self.tag}
        self._counter = 0
        self._reaper = Reaper(SWARM_TAG, self.tag)  # kills this swarm's processes if the test process dies

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc_info) -> None:
        leftovers = self.cleanup()
        if leftovers and exc_info[0] is None:
            raise AssertionError(f"processes survived the swarm's cleanup: {leftovers}")

    # -- spawning --

    def spawn(self, *args: str, name: Optional[str] = None, preexec: Optional[Callable[[], None]] = None,
              env: Optional[Dict[str, str]] = None, prefix: Sequence[str] = ()) -> Proc:
        """Start `python -m moshpeer *args`; returns at once (use wait_ready / wait_for_line / wait_exit).
        `preexec` runs in the child before it starts (e.g. joining a cgroup); `env` adds to the swarm's environment;
        `prefix` is what the command runs under (e.g. `Netlab.command(k, [])`: in lab peer k's namespace)."""
        self._counter += 1
        command = next((arg for arg in args if not arg.startswith("-")), "moshpeer")
        proc = Proc(args, name=name or f"{command}{self._counter}", swarm_tag=self.tag, env={**self.env, **(env or {})},
                    cwd=self.cwd, preexec=preexec, prefix=prefix)
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout: float = 60.0, name: Optional[str] = None) -> RunResult:
        """Run a command to completion (e.g. `status`, or a command expected to fail)."""
        proc = self.spawn(*args, name=name)
        code = proc.wait_exit(timeout)
        return RunResult(code, proc.stdout, proc.stderr)

    def bootstrap(self, run_id: str, *extra: str, timeout: float = READY_TIMEOUT) -> Proc:
        """`moshpeer dht` on loopback, waited until ready."""
        proc = self.spawn("dht", "--run-id", run_id, "--host-maddrs", LOOPBACK, *extra, name=f"dht{self._counter + 1}")
        proc.wait_ready(timeout)
        return proc

    def join(
        self, n: int, run_id: str, initial_peers: Sequence[str], *extra: str, timeout: float = READY_TIMEOUT
    ) -> List[Proc]:
        """Start `n` `moshpeer join` processes on loopback at once, then wait until all are ready."""
        peers_args = ["--initial-peers", *initial_peers] if initial_peers else []
        procs = [
            self.spawn("join", *peers_args, "--run-id", run_id, "--host-maddrs", LOOPBACK, *extra)
            for _ in range(n)
        ]
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait_ready(max(1.0, deadline - time.monotonic()))
        return procs

    # -- cleanup --

    def alive_processes(self) -> List[ProcInfo]:
        """Every live process this swarm spawned, directly or not (DHT processes, p2pd)."""
        return tagged_processes(SWARM_TAG, self.tag)

    def cleanup(self, grace: float = 5.0) -> List[ProcInfo]:
        """SIGTERM what still runs, wait up to `grace`, SIGKILL the rest, remove the torch segments of what this
        swarm ran (`orphans.remove_torch_segments`); returns survivors (should be [])."""
        family = tagged_pids(SWARM_TAG, self.tag) | {proc.pid for proc in self.procs}
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # Anything left, wherever it was re-parented to: kill it (process groups first, then by pid).
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        # What the groups held that lives elsewhere (a DHT process re-parented, ...): torch_shm_managers last, once
        # their clients are gone, so that they remove their segments.
        survivors = kill_tagged(SWARM_TAG, self.tag, grace=1.0)
        for proc in self.procs:
            if proc.popen.poll() is None:
                proc.popen.wait()
            for reader in proc._readers:  # pipes reach EOF once every holder is gone
                reader.join(timeout=1.0)
        self._reaper.close()
        remove_torch_segments(family)
        return survivors
