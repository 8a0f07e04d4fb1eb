"""What Linux's /proc says about processes: `ProcInfo` (pid, parent, group, name, state) of one or of all.

Used by the DHT process's watchdog (dht/node.py: is its p2pd still running?) and by the test harnesses' reaper
(testing/orphans.py). Where there is no /proc, `read_proc_info` returns None and `all_processes` [].
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

# torch_shm_manager as /proc/PID/stat names it (15 characters). It removes its clients' /dev/shm segments (torch's
# file_system sharing strategy, which hivemind uses) about 2 s after the last client is gone (torch/lib/libshm);
# signalled before that, it dies and leaves them. Whoever stops processes that use torch spares it until its clients
# are gone, then gives it SHM_MANAGER_GRACE_S to finish.
SHM_MANAGER_NAME = "torch_shm_manag"
SHM_MANAGER_GRACE_S = 3.0


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    pgid: int
    name: str
    state: str  # one letter, as in /proc/PID/stat: R, S, D, Z (zombie), ...

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")

    @property
    def is_torch_shm_manager(self) -> bool:
        return self.name == SHM_MANAGER_NAME


def proc_available() -> bool:
    """Whether this system has a Linux /proc to read processes from."""
    return os.path.exists(f"/proc/{os.getpid()}/stat")


def read_proc_info(pid: int) -> Optional[ProcInfo]:
    """The /proc/PID/stat facts of `pid`; None if it is gone (or /proc is not there)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # The name is in parentheses and may itself contain spaces or parentheses.
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    return ProcInfo(pid=pid, ppid=int(fields[1]), pgid=int(fields[2]), name=name, state=fields[0])


def all_pids() -> List[int]:
    """Every pid visible in /proc ([] without /proc)."""
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []


def all_processes() -> List[ProcInfo]:
    """Every process visible in /proc."""
    infos = (read_proc_info(pid) for pid in all_pids())
    return [info for info in infos if info is not None]


def live_children(name: str, parent: Optional[int] = None) -> List[ProcInfo]:
    """The live children called `name` of `parent` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    return [info for info in all_processes() if info.ppid == parent and info.name == name and info.alive]


def still_child(info: ProcInfo) -> bool:
    """Is the process `info` described still alive and still this one (same parent and name: a pid is reused)?"""
    now = read_proc_info(info.pid)
    return now is not None and now.alive and now.ppid == info.ppid and now.name == info.name
