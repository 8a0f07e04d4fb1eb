"""The lab's namespaces as the kernel lists them, and their end: every process in them stopped, then deleted."""

from __future__ import annotations

import os
import signal
import time
from typing import Callable, List, Optional, Sequence

from moshpeer.processes import SHM_MANAGER_GRACE_S, read_proc_info
from moshpeer.testing.netlab.commands import run

KILL_GRACE_S = 3.0


def list_netns() -> List[str]:
    out = run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(namespaces: Sequence[str]) -> List[int]:
    pids = []
    for netns in namespaces:
        out = run(["ip", "netns", "pids", netns], check=False).stdout
        pids += [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]
    return pids


def _is_shm_manager(pid: int) -> bool:
    info = read_proc_info(pid)
    return info is not None and info.is_torch_shm_manager


def _stop(list_pids: Callable[[], List[int]], first: Optional[signal.Signals], grace: float) -> None:
    """Send `first` (None: nothing) to what `list_pids()` returns until it returns nothing; after `grace` s, SIGKILL
    it; give up 1 s after that."""
    deadline, sig = time.monotonic() + grace, first
    while True:
        pids = list_pids()
        if not pids:
            return
        for pid in pids if sig is not None else ():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            if sig == signal.SIGKILL:
                return
            sig, deadline = signal.SIGKILL, time.monotonic() + 1.0
        time.sleep(0.05)


def delete_namespaces(namespaces: Sequence[str]) -> None:
    """SIGTERM every process in `namespaces` (this lab's), SIGKILL what is left after KILL_GRACE_S, delete them
    (which deletes every link and TUN device inside them). torch_shm_manager is not signalled while its clients
    live: it removes their /dev/shm segments once they are gone, which a signal would prevent."""
    _stop(lambda: [pid for pid in _netns_pids(namespaces) if not _is_shm_manager(pid)], signal.SIGTERM,
          KILL_GRACE_S)
    _stop(lambda: _netns_pids(namespaces), None, SHM_MANAGER_GRACE_S)
    for netns in namespaces:
        run(["ip", "netns", "del", netns], check=False)
