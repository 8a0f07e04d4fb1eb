"""`DhtProcessWatch`: when a DHT process must end (its main process gone, its p2pd gone, a socket deleted), and the
sockets kept young, with a real child process named p2pd (a copy of `sleep`) and real files for the sockets."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import pytest

from moshpeer.dht.process_watch import ORPHANED, SOCKET_TOUCH_S, DhtProcessWatch
from moshpeer.processes import proc_available
from peer_fakes import FakeClock

pytestmark = pytest.mark.skipif(not proc_available(), reason="needs Linux's /proc")


@pytest.fixture
def p2pd(tmp_path):
    """A child of this process called p2pd."""
    binary = tmp_path / "p2pd"
    shutil.copy(shutil.which("sleep"), binary)
    child = subprocess.Popen([str(binary), "60"])
    try:
        yield child
    finally:
        child.kill()
        child.wait()


@pytest.fixture
def sockets(tmp_path):
    paths = [tmp_path / "hivemind-p2pd-x.sock", tmp_path / "hivemind-p2pclient-x.sock"]
    for path in paths:
        path.touch()
    return [str(path) for path in paths]


def watch_of(sockets, started=True, clock=None):
    stopping = threading.Event()
    watch = DhtProcessWatch(os.getppid(), lambda: started, stopping, lambda: sockets, clock=clock or FakeClock())
    return watch, stopping


def test_a_process_whose_parent_is_gone_is_orphaned(sockets):
    watch = DhtProcessWatch(os.getppid() + 1, lambda: False, threading.Event(), lambda: sockets)
    assert watch.check() == ORPHANED


def test_all_is_well_while_p2pd_runs_and_its_sockets_are_there(p2pd, sockets):
    watch, _ = watch_of(sockets)
    assert watch.check() is None and watch.check() is None


def test_p2pd_that_exits_ends_the_process_unless_the_node_is_stopping(p2pd, sockets):
    watch, stopping = watch_of(sockets)
    assert watch.check() is None
    p2pd.kill()
    p2pd.wait()
    assert "p2pd) exited" in watch.check()
    stopping.set()  # hivemind's shutdown stops p2pd itself
    assert watch.check() is None


def test_a_node_that_started_without_a_p2pd_child_lost_it_before_the_first_look(sockets):
    assert "p2pd) exited" in watch_of(sockets)[0].check()
    assert watch_of(sockets, started=False)[0].check() is None  # hivemind has not started it yet


def test_a_deleted_socket_ends_the_process(p2pd, sockets):
    watch, _ = watch_of(sockets)
    assert watch.check() is None
    os.unlink(sockets[1])
    assert sockets[1] in watch.check()


def test_a_socket_not_created_yet_is_no_deleted_one(p2pd, sockets):
    os.unlink(sockets[1])  # hivemind creates its client socket at the first handler
    watch, _ = watch_of(sockets)
    assert watch.check() is None
    open(sockets[1], "w").close()
    assert watch.check() is None
    os.unlink(sockets[1])
    assert sockets[1] in watch.check()


def test_the_sockets_are_touched_once_per_interval_so_that_no_tmp_cleaner_finds_them_old(p2pd, sockets):
    clock = FakeClock()
    watch, _ = watch_of(sockets, clock=clock)
    for path in sockets:
        os.utime(path, (0, 0))  # as old as can be
    assert watch.check() is None
    assert all(os.stat(path).st_mtime > 0 for path in sockets)
    for path in sockets:
        os.utime(path, (0, 0))
    clock.advance(SOCKET_TOUCH_S / 2)
    assert watch.check() is None and all(os.stat(path).st_mtime == 0 for path in sockets)
    clock.advance(SOCKET_TOUCH_S / 2)
    assert watch.check() is None and all(os.stat(path).st_mtime > 0 for path in sockets)
