"""hivemind's process-global multiprocessing locks, repaired when a process that held one was killed.

hivemind's `MPFuture` (results travelling between the DHT process and ours) and `SharedBytes` keep class-level
`multiprocessing.Lock`s. They are POSIX semaphores shared with every process forked from ours, the DHT's among
them. A DHT process killed while it held one (sending a result through its pipe when a shutdown timed out and it
was killed) leaves that lock held for good: from then on every DHT started from this process hangs before it
reports ready ("the DHT did not start in time"), and so does every result sent under the lock. A test run saw
exactly that: one slow start under load, then every later start in that process failed for 13 minutes.

`repair_fork_locks` replaces a lock that nobody releases within a short wait. The replacement is what processes
forked afterwards share; a process forked before keeps the old one (it was stuck on it already).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from typing import List

logger = logging.getLogger(__name__)

# How long a lock may be held before it counts as orphaned: sending one result holds it for microseconds.
HELD_FOR_GOOD_S = 1.0


def _locks():
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    return [(MPFuture, "_update_lock"), (MPFuture, "_initialization_lock"), (SharedBytes, "_lock")]


def repair_fork_locks(timeout: float = HELD_FOR_GOOD_S) -> List[str]:
    """Replace each of hivemind's fork-shared locks that cannot be taken within `timeout` seconds (a process that
    held it died); -> the names of the replaced locks (logged). Never raises for a healthy lock: it is taken and
    released at once."""
    replaced = []
    for owner, name in _locks():
        lock = getattr(owner, name)
        if lock.acquire(timeout=timeout):
            lock.release()
            continue
        setattr(owner, name, mp.Lock())
        replaced.append(f"{owner.__name__}.{name}")
    if replaced:
        logger.warning(f"replaced hivemind locks left held by a killed process: {', '.join(replaced)}")
    return replaced
