"""What a DHT process depends on, and when it must end: `DhtProcessWatch.check()`.

A peer's DHT runs in a process of its own (node.py) whose child is hivemind's libp2p daemon, p2pd; the two talk over
Unix sockets that hivemind puts in /tmp. The DHT process must end its process group, p2pd included, when:
- its main process is gone (SIGKILL, a crash): nothing else would stop it (`ORPHANED`);
- p2pd exited on its own (killed, crashed): hivemind carries on without it, a node that reaches no one, and its peer
  trained alone for ever (measured: 390 lone epochs in 60 s, never an exit);
- one of the two sockets was deleted: every request through p2pd then fails with FileNotFoundError, for ever (measured:
  "matchmaking failed: FileNotFoundError" ten times a second). /tmp cleaners do that: systemd-tmpfiles removes what
  is older than 10 days in /tmp on Fedora and RHEL, and a volunteer's peer runs for weeks. So the watch also touches
  both sockets every SOCKET_TOUCH_S, and their age never reaches a cleaner's limit.
With its DHT process gone, the main process stops with an error (heartbeat.py), and a supervisor restarts it.
Nothing is watched while the node starts or stops (hivemind then starts or stops p2pd itself), and p2pd and the
sockets only where Linux's /proc is.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional, Sequence, Set

from moshpeer.processes import ProcInfo, live_children, proc_available, still_child

logger = logging.getLogger(__name__)

P2PD_NAME = "p2pd"  # the libp2p daemon's process name (hivemind's bundled binary)
ORPHANED = "the main process is gone"
# Well inside any /tmp cleaner's age limit (systemd-tmpfiles: 10 days), and cheap: two utime calls.
SOCKET_TOUCH_S = 3600.0


class DhtProcessWatch:
    """Called in the DHT process every poll: `check()` -> None while all is well, else why the process must end
    (`ORPHANED`, or an error to log)."""

    def __init__(self, parent_pid: int, node_started: Callable[[], bool], stopping: threading.Event,
                 sockets: Callable[[], Sequence[str]], clock: Callable[[], float] = time.monotonic):
        """:param node_started: whether hivemind runs the node (so p2pd and its sockets exist)
        :param stopping: set when the node is being shut down (p2pd's exit is then expected)
        :param sockets: the paths of p2pd's control socket and of hivemind's client socket (either may not exist
            yet: one that existed and is gone was deleted)"""
        self.parent_pid, self.node_started, self.stopping, self.sockets = parent_pid, node_started, stopping, sockets
        self.clock = clock
        self.watch_p2pd = proc_available()
        self._p2pd: Optional[ProcInfo] = None
        self._touched_at = -float("inf")
        # The sockets seen so far: hivemind creates its client socket only when a first handler is added.
        self._seen: Set[str] = set()

    def check(self) -> Optional[str]:
        """None while all is well, else why the DHT process must end. Touches the sockets when they are due."""
        if os.getppid() != self.parent_pid:
            return ORPHANED
        if not self.watch_p2pd or self.stopping.is_set() or (self._p2pd is None and not self.node_started()):
            return None
        if self._p2pd is None:
            # The node runs, so hivemind started p2pd: if it is not among our children, it is gone already.
            self._p2pd = next(iter(live_children(P2PD_NAME)), None)
            alive = self._p2pd is not None
        else:
            alive = still_child(self._p2pd)
        if not alive:
            return "this peer's libp2p daemon (p2pd) exited"
        present = {path for path in self.sockets() if os.path.exists(path)}
        deleted = sorted(self._seen - present)
        if deleted:
            return f"p2pd's socket {deleted[0]} was deleted (a /tmp cleaner?)"
        self._seen |= present
        if self.clock() - self._touched_at >= SOCKET_TOUCH_S:
            self._touched_at = self.clock()
            for path in self._seen:
                try:
                    os.utime(path)
                except OSError as e:  # gone since the check: the next check says so
                    logger.debug(f"could not touch {path}: {e}")
        return None
