"""Noticing that this machine is about to be taken away: signals and a notice file.

`PreemptionWatcher` turns SIGTERM, SIGINT, or the appearance of a notice file (the file a cloud
provider's metadata poller writes when a spot instance is scheduled for termination) into one
`PreemptionNotice`: what happened, when, and the deadline by which the process must have exited
(notice time + grace period). The owner polls `triggered` between steps, or waits on `wait()`,
or registers callbacks; then it stops starting new work, writes a checkpoint and exits.

Design notes:
- The signal handler only records the notice (plain attribute writes) and pokes a socket; the
  watcher thread does everything else (setting the event, logging, running callbacks). Taking
  locks inside a signal handler can deadlock against the interrupted code.
- Later signals do not interrupt the shutdown: they are logged and ignored, so a second Ctrl-C or
  SIGTERM cannot kill a checkpoint write half-way. (Killing it would be safe anyway: checkpoints
  are written to a temp file and renamed, so the previous checkpoint stays intact.) The
  `force_exit_after`-th signal (default: the third) exits at once, for a human who insists.
- Python runs signal handlers only in the main thread, so the handlers are installed only when
  the watcher is started from the main thread; elsewhere it watches the notice file alone, says so
  in a warning, and the owner can feed signals in through `trigger()`.
"""

from __future__ import annotations

import logging
import math
import os
import select
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

logger = logging.getLogger(__name__)

DEFAULT_GRACE_PERIOD = 20.0
DEFAULT_POLL_INTERVAL = 0.5


@dataclass(frozen=True)
class PreemptionNotice:
    """Why and when this process was told to leave, and by when it must be gone."""

    reason: str  # e.g. "SIGTERM", "notice file /run/preempt appeared"
    source: str  # "signal", "notice_file" or "manual"
    received_at: float  # unix time
    received_monotonic: float  # time.monotonic() at reception
    deadline: float  # time.monotonic() by which the process must have exited
    signum: Optional[int] = None


NoticeCallback = Callable[[PreemptionNotice], None]


class PreemptionWatcher:
    """Watches for a preemption notice; see the module docstring.

    Args:
        notice_file: path whose appearance means "preempted"; None to watch signals only. If it
            already exists at start, that counts as a notice (with a warning: delete stale files).
        signals: signals that mean "preempted"; () to install no handler.
        grace_period: seconds from the notice to the moment the process must have exited
            (`math.inf`: no deadline, for owners that only want the signal handling).
        poll_interval: how often the notice file's existence is checked (one stat() call).
        force_exit_after: the n-th signal exits immediately (None: never).
        on_force_exit: called from the signal handler just before that immediate exit (e.g. to kill
            child processes that would otherwise outlive this one); it must not take locks.

    Use as a context manager, or call `start()` and `close()`.
    """

    def __init__(
        self,
        notice_file: Optional[Union[str, os.PathLike]] = None,
        signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
        grace_period: float = DEFAULT_GRACE_PERIOD,
        *,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        force_exit_after: Optional[int] = 3,
        on_force_exit: Optional[Callable[[], None]] = None,
    ):
        if not grace_period > 0:
            raise ValueError(f"grace_period must be > 0, got {grace_period}")
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
        if force_exit_after is not None and force_exit_after < 2:
            raise ValueError("force_exit_after must be >= 2 (the first signal is the graceful one) or None")
        self.notice_file = Path(notice_file) if notice_file is not None else None
        self.signals = tuple(signals)
        self.grace_period = float(grace_period)
        self.poll_interval = float(poll_interval)
        self.force_exit_after = force_exit_after
        self._on_force_exit = on_force_exit
        self._notice: Optional[PreemptionNotice] = None
        self._event = threading.Event()
        self._callbacks: List[NoticeCallback] = []
        self._callbacks_lock = threading.Lock()
        self._previous_handlers: Dict[int, Any] = {}
        self._signal_count = 0
        self._signals_reported = 0
        self._wake_reader: Optional[socket.socket] = None
        self._wake_writer: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self.signals_installed = False

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> "PreemptionWatcher":
        """Install the signal handlers (main thread only) and start watching."""
        if self._thread is not None:
            return self
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        if self.signals:
            if threading.current_thread() is threading.main_thread():
                for signum in self.signals:
                    self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
                self.signals_installed = True
            else:
                logger.warning(
                    "PreemptionWatcher started outside the main thread: cannot handle "
                    f"{', '.join(signal.Signals(s).name for s in self.signals)}; watching "
                    f"{'the notice file only' if self.notice_file else 'nothing but trigger() calls'}"
                )
        if self.notice_file is not None and self.notice_file.exists():
            logger.warning(f"notice file {self.notice_file} already exists: treating it as a preemption notice")
            self._record(f"notice file {self.notice_file} already exists", "notice_file")
        self._thread = threading.Thread(target=self._watch, name="moshpeer-preemption-watcher", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching and restore the previous signal handlers (where they were installed)."""
        if self._thread is None:
            return
        if self.signals_installed and threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous_handlers.items():
                signal.signal(signum, previous)
            self.signals_installed = False
        self._stopping = True
        self._poke()
        self._thread.join(timeout=5.0)
        self._thread = None
        for sock in (self._wake_reader, self._wake_writer):
            if sock is not None:
                sock.close()
        self._wake_reader = self._wake_writer = None

    def __enter__(self) -> "PreemptionWatcher":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # --- what the owner asks ---------------------------------------------------------------------

    @property
    def triggered(self) -> bool:
        """True once a notice arrived (set inside the signal handler, so it is immediate)."""
        return self._notice is not None

    @property
    def notice(self) -> Optional[PreemptionNotice]:
        return self._notice

    @property
    def deadline(self) -> Optional[float]:
        """`time.monotonic()` by which the process must have exited; None before any notice."""
        notice = self._notice
        return notice.deadline if notice is not None else None

    @property
    def signal_count(self) -> int:
        """How many of the watched signals arrived so far (the first one included)."""
        return self._signal_count

    def remaining(self) -> float:
        """Seconds left until the deadline (0 when past it, infinity before any notice)."""
        deadline = self.deadline
        return math.inf if deadline is None else max(0.0, deadline - time.monotonic())

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until a notice arrives or `timeout` passes; True if triggered."""
        if self._notice is not None:
            return True
        return self._event.wait(timeout) or self._notice is not None

    def add_callback(self, callback: NoticeCallback) -> None:
        """Call `callback(notice)` once when the notice arrives, from the watcher thread.

        Callbacks should be short and thread-safe (set a flag, enqueue a message); exceptions are
        logged. Registered after the notice, the callback runs at once in the caller's thread.
        """
        with self._callbacks_lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        self._run_callback(callback, self._notice)

    def trigger(self, reason: str = "requested") -> None:
        """Deliver a notice by hand (for example from an asyncio signal handler of the owner)."""
        if self._record(reason, "manual"):
            self._poke()

    # --- internals -------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        # Runs in the main thread between two bytecodes: no locks, no logging here.
        self._signal_count += 1
        name = signal.Signals(signum).name
        if not self._record(name, "signal", signum):
            if self.force_exit_after is not None and self._signal_count >= self.force_exit_after:
                message = f"moshpeer: {name} received {self._signal_count} times: exiting now, without waiting\n"
                os.write(2, message.encode())
                try:
                    if self._on_force_exit is not None:
                        self._on_force_exit()
                finally:
                    os._exit(128 + signum)
        self._poke()

    def _record(self, reason: str, source: str, signum: Optional[int] = None) -> bool:
        """Store the first notice; False if there already was one."""
        if self._notice is not None:
            return False
        now = time.monotonic()
        self._notice = PreemptionNotice(
            reason=reason,
            source=source,
            received_at=time.time(),
            received_monotonic=now,
            deadline=now + self.grace_period,
            signum=signum,
        )
        return True

    def _poke(self) -> None:
        writer = self._wake_writer
        if writer is None:
            return
        try:
            writer.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the watcher is already awake (buffer full) or shutting down

    def _watch(self) -> None:
        announced = False
        while not self._stopping:
            if self._notice is None and self.notice_file is not None and self.notice_file.exists():
                self._record(f"notice file {self.notice_file} appeared", "notice_file")
            if self._notice is not None and not announced:
                announced = True
                self._announce(self._notice)
            self._report_repeated_signals()
            reader = self._wake_reader
            if reader is None:
                break
            try:
                ready, _, _ = select.select([reader], [], [], self.poll_interval)
                if ready:
                    reader.recv(4096)
            except (OSError, ValueError):  # closed under us
                break

    def _announce(self, notice: PreemptionNotice) -> None:
        if math.isinf(self.grace_period):  # an owner without a grace period: a plain stop request
            logger.info(f"stop requested ({notice.reason})")
        else:
            logger.warning(
                f"preemption notice ({notice.reason}): finishing up, must exit within {self.grace_period:g} s"
            )
        with self._callbacks_lock:
            callbacks = list(self._callbacks)
            self._callbacks.clear()
            self._event.set()
        for callback in callbacks:
            self._run_callback(callback, notice)

    def _report_repeated_signals(self) -> None:
        count = self._signal_count
        first_was_signal = self._notice is not None and self._notice.source == "signal"
        repeated = count - (1 if first_was_signal else 0)
        if repeated > self._signals_reported:
            self._signals_reported = repeated
            logger.warning(
                f"signal received again while shutting down: ignored ({self.remaining():.1f} s left "
                "until the deadline; the checkpoint in progress continues)"
            )

    @staticmethod
    def _run_callback(callback: NoticeCallback, notice: Optional[PreemptionNotice]) -> None:
        try:
            callback(notice)
        except Exception:
            logger.exception(f"preemption callback {callback!r} failed")
