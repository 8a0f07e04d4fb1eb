"""PreemptionWatcher in this process: signals, the notice file, deadlines, callbacks, threads."""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time

import pytest

from moshpeer.peer.runtime.preemption import PreemptionNotice, PreemptionWatcher

pytestmark = pytest.mark.timeout(30)


def wait_for(condition, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_sigterm_sets_the_notice_and_the_deadline():
    previous = signal.getsignal(signal.SIGTERM)
    with PreemptionWatcher(grace_period=20.0) as watcher:
        assert watcher.signals_installed and not watcher.triggered
        assert watcher.deadline is None and watcher.remaining() == math.inf
        before = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        assert watcher.wait(timeout=5)
        notice = watcher.notice
        assert (notice.source, notice.reason, notice.signum) == ("signal", "SIGTERM", signal.SIGTERM)
        assert before <= notice.received_monotonic <= time.monotonic()
        assert watcher.deadline == pytest.approx(notice.received_monotonic + 20.0)
        assert 15.0 < watcher.remaining() <= 20.0
        assert abs(notice.received_at - time.time()) < 5
    assert signal.getsignal(signal.SIGTERM) is previous  # handlers restored on close


def test_sigint_is_graceful_not_keyboard_interrupt():
    with PreemptionWatcher(grace_period=5.0) as watcher:
        os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt without the watcher
        assert watcher.wait(timeout=5) and watcher.notice.reason == "SIGINT"


def test_repeated_signals_are_ignored_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="moshpeer.peer.runtime.preemption"):
        with PreemptionWatcher(grace_period=20.0) as watcher:
            os.kill(os.getpid(), signal.SIGTERM)
            assert watcher.wait(timeout=5)
            first = watcher.notice
            os.kill(os.getpid(), signal.SIGINT)  # the second one: no exit, no new notice
            wait_for(lambda: watcher.signal_count == 2, what="second signal")
            wait_for(
                lambda: any("received again" in r.getMessage() for r in caplog.records), what="'received again' log"
            )
            assert watcher.notice is first
    messages = [r.getMessage() for r in caplog.records]
    assert sum("preemption notice (SIGTERM)" in m for m in messages) == 1


def test_notice_file_appearing_triggers(tmp_path):
    notice_file = tmp_path / "preempted"
    with PreemptionWatcher(notice_file, signals=(), poll_interval=0.05) as watcher:
        assert not watcher.signals_installed
        assert not watcher.wait(timeout=0.2)  # nothing yet
        notice_file.write_text("terminate at 12:00\n")
        assert watcher.wait(timeout=5)
        assert watcher.notice.source == "notice_file" and str(notice_file) in watcher.notice.reason
        assert watcher.notice.signum is None and 0 < watcher.remaining() <= watcher.grace_period


def test_existing_notice_file_counts_at_start(tmp_path, caplog):
    notice_file = tmp_path / "preempted"
    notice_file.touch()
    with caplog.at_level(logging.WARNING):
        with PreemptionWatcher(notice_file, signals=()) as watcher:
            assert watcher.triggered and "already exists" in watcher.notice.reason
    assert any("already exists" in r.getMessage() for r in caplog.records)


def test_callbacks_run_once_with_the_notice(tmp_path):
    calls = []
    threads = []

    def callback(notice: PreemptionNotice) -> None:
        calls.append(notice)
        threads.append(threading.current_thread().name)

    def broken(notice: PreemptionNotice) -> None:
        raise RuntimeError("callback bug")

    with PreemptionWatcher(signals=(), grace_period=3.0) as watcher:
        watcher.add_callback(broken)  # logged, does not stop the others
        watcher.add_callback(callback)
        watcher.trigger("maintenance window")
        watcher.trigger("again")  # a second notice changes nothing
        wait_for(lambda: len(calls) == 1, what="callback")
        assert calls[0].reason == "maintenance window" and calls[0].source == "manual"
        assert threads == ["moshpeer-preemption-watcher"]
        late = []
        watcher.add_callback(late.append)  # after the notice: runs at once, here
        assert late == [calls[0]]
    assert len(calls) == 1


def test_outside_the_main_thread_it_watches_the_file_only(tmp_path, caplog):
    notice_file = tmp_path / "preempted"
    result = {}

    def run() -> None:
        watcher = PreemptionWatcher(notice_file, poll_interval=0.05).start()
        result["installed"] = watcher.signals_installed
        notice_file.touch()
        result["triggered"] = watcher.wait(timeout=5)
        result["source"] = watcher.notice.source if watcher.notice else None
        watcher.close()

    previous = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.WARNING):
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(timeout=20)
    assert result == {"installed": False, "triggered": True, "source": "notice_file"}
    assert signal.getsignal(signal.SIGTERM) is previous
    assert any("outside the main thread" in r.getMessage() for r in caplog.records)


def test_arguments_are_checked():
    with pytest.raises(ValueError):
        PreemptionWatcher(grace_period=0)
    with pytest.raises(ValueError):
        PreemptionWatcher(poll_interval=0)
    with pytest.raises(ValueError):
        PreemptionWatcher(force_exit_after=1)


def test_peer_daemon_owns_signals_with_a_grace_period(dht_node):
    """PeerDaemon runs the watcher: with a grace period the stop has a deadline and work gets its share
    of it, the reason is known at once, and a second SIGTERM is logged and ignored (it would otherwise
    cut a final checkpoint short)."""
    from moshpeer.peer.runtime.daemon import PeerDaemon
    from swarm import LOOPBACK

    boot = dht_node(run_ids=["daemon-grace"])
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    daemon = PeerDaemon("daemon-grace", initial_peers=maddrs, host_maddrs=[LOOPBACK], grace_period=12.0)
    seen = {}

    def work(daemon: PeerDaemon) -> None:
        assert daemon.seconds_left_for_work() == math.inf and daemon.stop_deadline is None
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: daemon.stop_requested, what="the stop request")
        seen["reason"] = daemon.stop_reason  # right away, whether or not the watcher thread ran yet
        seen["left"] = daemon.seconds_left_for_work()
        seen["deadline"] = daemon.stop_deadline - time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)  # impatient: must not exit the process
        wait_for(lambda: daemon._watcher.signal_count == 2, what="the second signal")

    assert daemon.run(work=work) == 0
    assert seen["reason"] == "received SIGTERM"
    # 12 s of grace minus the shutdown budget (3.5 s) and the exit margin (0.5 s) for the work.
    assert 6.0 < seen["left"] <= 8.0 and 10.0 < seen["deadline"] <= 12.0
    assert signal.getsignal(signal.SIGTERM) is not None  # handlers restored, process still alive
