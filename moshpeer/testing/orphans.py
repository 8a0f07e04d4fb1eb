"""No orphans: whatever a test or benchmark harness spawns dies with it, also when the harness is killed.

A harness gives every process it spawns an environment tag, `KEY=VALUE` (children inherit it: a peer's DHT
process, p2pd), and starts a `Reaper` for that tag first. The reaper is a watchdog process in a session of
its own (signals to the harness's process group do not reach it) that reads a pipe from the harness. When the
pipe closes, because the harness called `close()` at its teardown or because it died (SIGKILL included: the
kernel closes its end), the watchdog SIGTERMs every live process carrying the tag and each one's process
group, waits up to `grace` seconds, SIGKILLs what is left, and exits.

Killed processes leave files behind: hivemind shares its futures' state through torch's `file_system` strategy,
whose segments (/dev/shm/torch_<creator pid>_...) torch_shm_manager removes about 2 s after its last client is gone,
unless it is killed first. So `kill_tagged` stops every other tagged process first and gives the managers
`SHM_MANAGER_GRACE_S` to end by themselves (they carry the tag too: they inherit their clients' environment), then
removes the segments of every process it saw once those are dead (`remove_torch_segments`), and so does the swarm
harness for the processes it stopped itself. (Killing the managers with the rest left the segments of clients that
had ended before the reaper ran: `moshpeer demo` under the swarm harness left 6 per run.)

`python -m moshpeer.testing.orphans KEY VALUE [GRACE]` is the watchdog itself (what `Reaper` runs).
Linux only (/proc); elsewhere `tagged_processes` finds nothing.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from typing import Iterable, List, Set

from moshpeer.processes import SHM_MANAGER_GRACE_S, ProcInfo, all_pids, read_proc_info

DEFAULT_GRACE_S = 3.0
SHARED_MEMORY_DIR = "/dev/shm"


def _environ_has(pid: int, key: str, value: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{key}={value}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def tagged_processes(key: str, value: str, *, include_zombies: bool = False) -> List[ProcInfo]:
    """Processes whose environment holds `key=value`, wherever they were re-parented to."""
    found = []
    for pid in all_pids():
        if pid == os.getpid() or not _environ_has(pid, key, value):
            continue
        info = read_proc_info(pid)
        if info is not None and (include_zombies or info.alive):
            found.append(info)
    return found


def tagged_pids(key: str, value: str) -> Set[int]:
    """The pids of the live processes tagged `key=value`."""
    return {info.pid for info in tagged_processes(key, value)}


def _signal_all(infos: List[ProcInfo], sig: int) -> None:
    """`sig` to each process, and to each process group whose leader is among them (a tagged child started
    in a session of its own); never to a group led by an untagged process (e.g. the harness's own)."""
    pids = {info.pid for info in infos}
    for send, target in [(os.kill, pid) for pid in pids] + [(os.killpg, info.pgid) for info in infos
                                                             if info.pgid in pids and info.pgid == info.pid]:
        try:
            send(target, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(key: str, value: str, deadline: float, managers: bool) -> List[ProcInfo]:
    """The tagged processes still alive at `deadline` or once none is; torch_shm_managers only if `managers`."""
    while True:
        survivors = [info for info in tagged_processes(key, value) if managers or not info.is_torch_shm_manager]
        if not survivors or time.monotonic() >= deadline:
            return survivors
        time.sleep(0.05)


def remove_torch_segments(pids: Iterable[int]) -> int:
    """Remove the torch shared-memory segments that the processes `pids` created, of those no longer alive (a live
    one may still use its own); -> how many were removed. Never raises for a file already gone."""
    removed = 0
    for pid in pids:
        info = read_proc_info(pid)
        if info is not None and info.alive:
            continue
        for path in glob.glob(os.path.join(SHARED_MEMORY_DIR, f"torch_{pid}_*")):
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
    return removed


def kill_tagged(key: str, value: str, grace: float = DEFAULT_GRACE_S) -> List[ProcInfo]:
    """SIGTERM every live process tagged `key=value` but torch_shm_manager (and the process groups they lead),
    SIGKILL what is left after `grace` seconds; then wait up to SHM_MANAGER_GRACE_S for the managers to end and
    SIGKILL those that did not; remove the torch segments of those that died; returns what still lives `grace`
    seconds after that (normally [])."""
    everyone = tagged_processes(key, value)
    seen = {info.pid for info in everyone}  # kept: the processes are gone when their segments are removed
    survivors = [info for info in everyone if not info.is_torch_shm_manager]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not survivors:
            break
        _signal_all(survivors, sig)
        survivors = _wait_gone(key, value, time.monotonic() + grace, managers=False)
    # The managers, whose clients are gone now: they remove the clients' segments and end by themselves.
    survivors = _wait_gone(key, value, time.monotonic() + SHM_MANAGER_GRACE_S, managers=True)
    if survivors:
        _signal_all(survivors, signal.SIGKILL)
        survivors = _wait_gone(key, value, time.monotonic() + grace, managers=True)
    remove_torch_segments(seen)
    return survivors


class Reaper:
    """The watchdog of one tag (see the module docstring): start it before spawning, `close()` at teardown.

    Raises OSError if the watchdog process cannot be started.
    """

    def __init__(self, key: str, value: str, grace: float = DEFAULT_GRACE_S):
        self.key, self.value = key, value
        env = {k: v for k, v in os.environ.items() if k != key}  # the watchdog must not carry the tag itself
        self._watchdog = subprocess.Popen(
            [sys.executable, "-m", "moshpeer.testing.orphans", key, value, str(grace)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, start_new_session=True,
        )

    def close(self, timeout: float = 30.0) -> None:
        """Let the watchdog kill what carries the tag now, and wait for it to finish."""
        if self._watchdog.stdin is not None and not self._watchdog.stdin.closed:
            self._watchdog.stdin.close()
        try:
            self._watchdog.wait(timeout)
        except subprocess.TimeoutExpired:
            self._watchdog.kill()
            self._watchdog.wait()


def main(argv: List[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: python -m moshpeer.testing.orphans KEY VALUE [GRACE_SECONDS]", file=sys.stderr)
        return 2
    key, value = argv[0], argv[1]
    grace = float(argv[2]) if len(argv) == 3 else DEFAULT_GRACE_S
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe's end stops the watch
    while sys.stdin.buffer.read(4096):
        pass  # nothing is ever written; EOF is the signal
    survivors = kill_tagged(key, value, grace)
    if survivors:
        print(f"orphans: could not kill {[(s.pid, s.name) for s in survivors]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
