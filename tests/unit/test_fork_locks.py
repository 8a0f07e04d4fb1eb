"""A process killed while it held one of hivemind's fork-shared locks must not hang every later DHT start
(moshpeer/dht/fork_locks.py): the lock is replaced, healthy locks are left alone."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

from hivemind.utils.mpfuture import MPFuture, SharedBytes

from moshpeer.dht.fork_locks import repair_fork_locks


def _take_and_wait(lock, taken) -> None:
    lock.acquire()
    taken.set()
    signal.pause()  # killed while holding it


def test_a_lock_held_by_a_killed_process_is_replaced_and_healthy_ones_are_kept():
    before = (MPFuture._update_lock, MPFuture._initialization_lock, SharedBytes._lock)
    assert repair_fork_locks(timeout=0.2) == []  # nothing held: nothing replaced
    assert (MPFuture._update_lock, MPFuture._initialization_lock, SharedBytes._lock) == before

    context = mp.get_context("fork")
    taken = context.Event()
    child = context.Process(target=_take_and_wait, args=(MPFuture._update_lock, taken), daemon=True)
    child.start()
    try:
        assert taken.wait(30)
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        assert not MPFuture._update_lock.acquire(timeout=0.2)  # held for good by a dead process
        assert repair_fork_locks(timeout=0.2) == ["MPFuture._update_lock"]
        assert MPFuture._update_lock.acquire(timeout=0.2)  # a fresh one
        MPFuture._update_lock.release()
        assert MPFuture._initialization_lock is before[1] and SharedBytes._lock is before[2]
    finally:
        if child.is_alive():
            child.kill()
