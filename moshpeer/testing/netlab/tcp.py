"""Which TCP congestion control the lab's peers run: the kernel's default, or one named.

A volunteer's Linux machine runs CUBIC, stock Linux's default; this kernel may default to another (BBR on some
cloud VMs), and a lab's figures depend on it (bench_wan's rtt100: 0.87 of the link with CUBIC peers, 0.83-0.84
with BBR ones, docs/benchmarks.md). A namespace may only pick an algorithm listed in the host's
net.ipv4.tcp_allowed_congestion_control (the kernel answers EPERM otherwise), so `allow` adds it there while a lab
needs it and `release` puts the list back once no lab of this process needs it. A killed process leaves the name
on the list: that only widens which algorithms unprivileged sockets may choose.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Dict, List, Optional

from moshpeer.testing.netlab.commands import NetlabError

SYSCTL = Path("/proc/sys/net/ipv4")
_lock = threading.Lock()
_added: Dict[str, list] = {}  # name -> [labs using it, the allowed list before we added it]


def available(sysctl: Path = SYSCTL) -> List[str]:
    """The congestion controls this kernel has (loaded); none where it does not say (not Linux)."""
    try:
        return (sysctl / "tcp_available_congestion_control").read_text().split()
    except OSError:
        return []


def check_available(name: str, sysctl: Path = SYSCTL) -> None:
    """NetlabError (one line) unless this kernel has the congestion control `name`."""
    if name not in available(sysctl):
        raise NetlabError(f"netlab: this kernel has no TCP congestion control {name!r} "
                          f"(available: {', '.join(available(sysctl))})")


def allow(name: str, sysctl: Path = SYSCTL) -> None:
    """Make `name` choosable in namespaces; NetlabError (one line) if this kernel does not have it."""
    check_available(name, sysctl)
    with _lock:
        if name in _added:
            _added[name][0] += 1
            return
        allowed_file = sysctl / "tcp_allowed_congestion_control"
        before = allowed_file.read_text().strip()
        if name in before.split():
            return
        allowed_file.write_text(f"{before} {name}".strip())
        _added[name] = [1, before]


def release(name: Optional[str], sysctl: Path = SYSCTL) -> None:
    """A lab that `allow`ed `name` is down: the last one of this process puts the allowed list back."""
    with _lock:
        entry = _added.get(name) if name is not None else None
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del _added[name]
            try:
                (sysctl / "tcp_allowed_congestion_control").write_text(entry[1])
            except OSError:  # teardown goes on; the name merely stays allowed
                pass
