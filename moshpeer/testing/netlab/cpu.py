"""CPU budgets per peer: a cgroup (v1 `cpu` controller) with a CFS quota of `share` cores.

On one machine, a peer that dies frees CPU for the others; on the internet it frees nothing. A budget makes
the lab behave like the latter: every process a peer's `popen` starts runs in its cgroup, whose quota is
`share` x CFS_PERIOD_US per period, whatever the others do.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable, List, Optional

from moshpeer.testing.netlab.commands import NetlabError

ROOT = Path("/sys/fs/cgroup/cpu")
CFS_PERIOD_US = 100_000


def unavailable() -> Optional[str]:
    """None if CPU budgets can be set here, else why not (one line)."""
    if not (ROOT / "cpu.cfs_quota_us").exists():
        return f"CPU budgets need the cgroup v1 cpu controller at {ROOT}"
    if not os.access(ROOT, os.W_OK):
        return f"CPU budgets need write access to {ROOT} (root)"
    return None


def create(name: str, share: float) -> Path:
    """A cgroup `name` limited to `share` cores; NetlabError if the controller is missing or refuses."""
    reason = unavailable()
    if reason is not None:
        raise NetlabError(f"netlab: {reason}")
    path = ROOT / name
    try:
        path.mkdir(exist_ok=True)
        (path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(max(1000, int(share * CFS_PERIOD_US))))
    except OSError as e:
        raise NetlabError(f"netlab: cannot set up the cgroup {path}: {e.strerror}") from None
    return path


def joiner(path: Path) -> Callable[[], None]:
    """A `preexec_fn` that moves the new process (before it runs the command) into the cgroup at `path`."""
    procs = str(path / "cgroup.procs")

    def join() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    return join


def quota_cores(path: Path) -> float:
    """The cgroup's budget in cores, read back from the kernel."""
    return int((path / "cpu.cfs_quota_us").read_text()) / int((path / "cpu.cfs_period_us").read_text())


def remove(path: Path) -> None:
    """Kill whatever still runs in the cgroup, then delete it (a cgroup with tasks cannot be removed)."""
    deadline = time.monotonic() + 3.0
    while path.exists():
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            path.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)


def leftovers(prefix: str) -> List[Path]:
    """Cgroups whose names start with `prefix` (netlab's, for cleanup)."""
    if not ROOT.exists():
        return []
    return [p for p in ROOT.iterdir() if p.is_dir() and p.name.startswith(prefix)]
