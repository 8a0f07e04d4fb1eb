"""`PeerDaemon`: the lifecycle of one peer process.

start    start (or join) the DHT, publish this peer's record, start the heartbeat thread
run      handle SIGINT / SIGTERM / SIGHUP, run the caller's work (or just wait) in the main thread
shutdown a fixed sequence of steps, each bounded in time:
           1. stop the heartbeat thread
           2. withdraw the record (others stop counting this peer at once)
           3. run shutdown hooks, newest first (later layers: checkpoint, hand over state, ...)
           4. stop the DHT and its p2pd (graceful, then kill whatever is left of their process group)

The training layer updates the record's mutable fields (step, epoch, samples, grid, ...) with
`update_record`; the heartbeat thread (heartbeat.py) re-publishes the record every `heartbeat` seconds with an
expiration of `expiration` seconds, so a peer that dies without withdrawing disappears by itself. It also brings
a peer whose network went away back into the swarm (moshpeer/dht/reconnect.py), and stops the peer, with an
error `run` raises after the shutdown, when another machine runs with this peer's identity and started first
(moshpeer/dht/twins.py).

Signals (and the preemption notice file) have one owner: the daemon's `PreemptionWatcher`.
Without a grace period, a signal that arrives after a stop was already requested skips whatever is
left: the DHT's process group is killed and the process exits at once (press Ctrl-C twice to leave
immediately). With a grace period (`moshpeer join --checkpoint-dir ...`), the stop has a deadline
(notice + grace period): work gets until the deadline minus the shutdown budget to wind down (finish
the averaging round, write the final checkpoint), a second signal is logged and ignored so it cannot
cut that checkpoint short, the third exits at once (the atomic checkpoint write makes that safe), and
a watchdog ends the process (exit code 1) if it is still there when the deadline is about to pass.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

from moshpeer.dht import (DEFAULT_HOST_MADDRS, MUTABLE_FIELDS, PeerRecord, Role, StartCancelled, SwarmDHT, start_dht,
                          validate_run_id)
from moshpeer.errors import UserError
from moshpeer.peer.record_publisher import RecordPublisher, fresh_record
from moshpeer.peer.runtime.heartbeat import Heartbeat
from moshpeer.peer.runtime.preemption import PreemptionNotice, PreemptionWatcher

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT = 5.0
# Records live this many heartbeats: one lost heartbeat does not make a live peer vanish.
EXPIRATION_HEARTBEATS = 3
# The whole shutdown sequence fits in this budget, leaving margin for interpreter exit (< 5 s total).
DEFAULT_SHUTDOWN_BUDGET = 3.5
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How often an idle main thread wakes up so that pending signal handlers run (see _idle_until_stopped).
_SIGNAL_CHECK_SECONDS = 0.1
# With a grace period: what the process needs after the shutdown sequence to be gone (flush, _exit).
_EXIT_MARGIN = 0.5

Work = Callable[["PeerDaemon"], None]
ShutdownHook = Callable[[], None]


def _describe_notice(notice: PreemptionNotice) -> str:
    return f"received {notice.reason}" if notice.source == "signal" else notice.reason


class PeerDaemon:
    """One peer of run `run_id`: DHT membership, heartbeat, signals and an orderly shutdown.

    Typical use (what `moshpeer join` does)::

        daemon = PeerDaemon("my-run", initial_peers=[...])
        daemon.add_shutdown_hook(save_checkpoint)         # optional
        exit_code = daemon.run(work=train_loop)           # train_loop(daemon) checks daemon.stop_requested

    :param heartbeat: seconds between re-publications of this peer's record
    :param expiration: seconds a record lives without a heartbeat (default: 3 heartbeats)
    :param connect_timeout: how long to keep trying to reach `initial_peers` at start
    :param shutdown_budget: seconds the whole shutdown sequence may take before it cuts steps short
    :param grace_period: seconds from a stop request (signal, notice file) to the moment the process
        must be gone; None: no deadline (the second signal exits at once)
    :param notice_file: a path whose appearance requests a stop, like SIGTERM (a preemption notice)
    :param dht_kwargs: extra arguments for `moshpeer.dht.start_dht` / hivemind.DHT
    """

    def __init__(
        self,
        run_id: str,
        *,
        role: Role = "trainer",
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS,
        announce_maddrs: Sequence[str] = (),
        identity_path: Optional[str] = None,
        client_mode: bool = False,
        heartbeat: float = DEFAULT_HEARTBEAT,
        expiration: Optional[float] = None,
        connect_timeout: float = 30.0,
        shutdown_budget: float = DEFAULT_SHUTDOWN_BUDGET,
        grace_period: Optional[float] = None,
        notice_file: Optional[Union[str, os.PathLike]] = None,
        **dht_kwargs: Any,
    ):
        if heartbeat <= 0:
            raise ValueError("heartbeat must be positive")
        expiration = EXPIRATION_HEARTBEATS * heartbeat if expiration is None else expiration
        if expiration <= heartbeat:
            raise ValueError("expiration must be longer than the heartbeat, or live peers would flicker out")
        self.run_id = validate_run_id(run_id)
        self.role = role
        self.heartbeat = heartbeat
        self.expiration = expiration
        self.shutdown_budget = shutdown_budget
        self.grace_period: Optional[float] = None
        self.notice_file: Optional[Union[str, os.PathLike]] = None
        self.configure_preemption(grace_period=grace_period, notice_file=notice_file)
        self._dht_options = dict(
            initial_peers=list(initial_peers),
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs),
            identity_path=identity_path,
            client_mode=client_mode,
            connect_timeout=connect_timeout,
            **dht_kwargs,
        )

        self._dht: Optional[SwarmDHT] = None
        self._publisher: Optional[RecordPublisher] = None  # this peer's record (record_publisher.py)
        self._stop_event = threading.Event()
        self._stop_reason = ""
        self._stop_at: Optional[float] = None  # time.monotonic() of the stop request
        self._watcher: Optional[PreemptionWatcher] = None
        self._watchdog: Optional[threading.Timer] = None
        self._heartbeat: Optional[Heartbeat] = None
        self._shutdown_hooks: List[Tuple[str, ShutdownHook]] = []
        self._exit_code = 0  # what `run` returns (`fail`)
        self._shutdown_lock = threading.Lock()
        self._shut_down = False
        self._visible_maddrs: List[str] = []

    # ---- state -------------------------------------------------------------------------------

    @property
    def dht(self) -> SwarmDHT:
        """The running DHT (for other layers: averaging, progress). Raises before `start`."""
        if self._dht is None:
            raise RuntimeError("PeerDaemon is not started")
        return self._dht

    @property
    def started(self) -> bool:
        return self._dht is not None

    @property
    def peer_id(self) -> str:
        return self.dht.identity.peer_id

    @property
    def visible_maddrs(self) -> List[str]:
        """Multiaddrs (with /p2p/<peer id>) under which other peers can reach this one."""
        return list(self._visible_maddrs)

    @property
    def record(self) -> PeerRecord:
        """The record as last published (or about to be)."""
        if self._publisher is None:
            raise RuntimeError("PeerDaemon is not started")
        return self._publisher.record

    @property
    def cut_off(self) -> bool:
        """Whether this peer's DHT had no neighbour at the last heartbeat (an outage: moshpeer/dht/reconnect.py)."""
        return self._heartbeat is not None and self._heartbeat.cut_off

    @property
    def stop_requested(self) -> bool:
        """True once a signal, the notice file or `request_stop` asked this peer to stop; work loops must
        check it. (True from inside the signal handler on: the watcher's callback only adds the reason.)"""
        watcher = self._watcher
        return self._stop_event.is_set() or (watcher is not None and watcher.triggered)

    @property
    def stop_deadline(self) -> Optional[float]:
        """`time.monotonic()` by which the process must be gone: stop request + grace period; None
        without a grace period or before a stop."""
        if self.grace_period is None:
            return None
        watcher = self._watcher
        if watcher is not None and watcher.triggered:
            return watcher.deadline
        return None if self._stop_at is None else self._stop_at + self.grace_period

    def seconds_left_for_work(self) -> float:
        """How long work may still take to wind down after a stop (finish a round, write the final
        checkpoint) and leave the shutdown sequence its budget; infinity before a stop or without a
        grace period."""
        deadline = self.stop_deadline
        if deadline is None:
            return math.inf
        return max(0.0, deadline - self.shutdown_budget - _EXIT_MARGIN - time.monotonic())

    @property
    def stop_reason(self) -> str:
        """Why the peer stops ("" before a stop); set at once, even before the watcher thread has run."""
        if self._stop_reason:
            return self._stop_reason
        watcher = self._watcher
        notice = watcher.notice if watcher is not None else None
        return _describe_notice(notice) if notice is not None else ""

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the DHT, publish this peer's record and start heartbeating. Blocks until done.

        :raises UserError: bad addresses, port in use, bad identity, unreachable initial peers
        :raises StartCancelled: a stop was requested while still connecting
        """
        if self._dht is not None:
            raise RuntimeError("PeerDaemon is already started")
        self._dht = start_dht(run_ids=[self.run_id], should_stop=lambda: self.stop_requested, **self._dht_options)
        self._visible_maddrs = [str(m) for m in self._dht.get_visible_maddrs()]
        self._publisher = RecordPublisher(self._dht, self.run_id,
                                          fresh_record(self._dht, self.role, self._visible_maddrs), self.expiration)
        # Publish once before returning, so that whoever waits for "ready" finds the record.
        if not self._publisher.publish(timeout=self.heartbeat):
            logger.warning("could not publish this peer's record yet; the heartbeat will keep trying")
        self._heartbeat = Heartbeat(self._dht, self.run_id, self._publisher, self.heartbeat, self.request_stop)
        self._heartbeat.start()
        logger.info(f"peer {self.peer_id} is in run {self.run_id!r} as {self.role}")

    def configure_preemption(
        self, *, grace_period: Optional[float] = None, notice_file: Optional[Union[str, os.PathLike]] = None
    ) -> None:
        """Set the grace period and notice file (see the class parameters); call before `run`.

        :raises UserError: a grace period too short for the shutdown sequence
        """
        minimum = self.shutdown_budget + _EXIT_MARGIN
        if grace_period is not None and grace_period <= minimum:
            raise UserError(f"the grace period must be longer than {minimum:g} s (the shutdown sequence's budget)")
        self.grace_period = grace_period
        self.notice_file = notice_file

    def update_record(self, *, publish_now: bool = False, **fields: Any) -> PeerRecord:
        """Change mutable record fields (step, epoch, samples_accumulated, samples_per_second, grid,
        group_bits, addresses); they go out with the next heartbeat, or at once with `publish_now`.

        :raises ValueError: an unknown or immutable field, or a value the schema rejects
        """
        not_mutable = set(fields) - MUTABLE_FIELDS
        if not_mutable:
            raise ValueError(f"cannot update record fields {sorted(not_mutable)}; mutable: {sorted(MUTABLE_FIELDS)}")
        if self._publisher is None:
            raise RuntimeError("PeerDaemon is not started")
        record = self._publisher.update(**fields)
        if publish_now:
            self._heartbeat.wake()
        return record

    def add_shutdown_hook(self, hook: ShutdownHook, name: Optional[str] = None) -> None:
        """Run `hook()` during shutdown, after the record is withdrawn and while the DHT still runs.

        Hooks run newest first (like atexit); an exception in one is logged and the others still run.
        """
        self._shutdown_hooks.append((name or getattr(hook, "__qualname__", repr(hook)), hook))

    def request_stop(self, reason: str = "requested") -> None:
        """Ask the peer to stop: `run` returns after the work notices and the shutdown sequence ends."""
        if not self._stop_event.is_set():
            self._stop_reason = reason
            self._stop_at = time.monotonic()
            self._stop_event.set()
            self._start_watchdog()

    def wait_for_stop(self, timeout: Optional[float] = None) -> bool:
        """Block until a stop is requested (True) or `timeout` passes (False)."""
        return self._stop_event.wait(timeout)

    def run(self, work: Optional[Work] = None, on_ready: Optional[Work] = None) -> int:
        """Run this peer until a signal (or `request_stop`), then shut down; returns the exit code (0, what `fail`
        set, or 1 when the peer stopped because its DHT process died).

        Call from the main thread. Starts the peer if needed, calls `on_ready(self)` once it is in the
        swarm, then `work(self)` in this thread (it must return soon after `stop_requested` turns
        True), or, without work, waits for a stop. Shutdown runs however work ends; an exception from
        work propagates after it.

        Signal handlers run in the main thread between Python bytecodes, so `work` should not block
        in one call for long (use timeouts on waits) or the stop request is noticed late.

        :raises UserError: after the shutdown, when this peer stopped because another machine runs with its
            identity (twins.py)
        """
        with self._signals_handled():
            try:
                if not self.started:
                    try:
                        self.start()
                    except StartCancelled:
                        logger.info(f"stopped while connecting ({self.stop_reason})")
                        return 0
                if not self.stop_requested:
                    if on_ready is not None:
                        on_ready(self)
                    if work is not None:
                        work(self)
                    else:
                        self._idle_until_stopped()
                if self.stop_requested:
                    logger.info(f"stopping: {self.stop_reason}")
            finally:
                self.shutdown()
        if self._twin_error is not None:
            raise self._twin_error
        if self._heartbeat is not None and self._heartbeat.dht_died:
            return max(self._exit_code, 1)  # not a clean stop: a supervisor should restart this peer
        return self._exit_code

    def fail(self, exit_code: int = 1) -> None:
        """Make `run` return `exit_code` instead of 0 after its shutdown (e.g. a shutdown hook could not write the
        final checkpoint: a supervisor must not take the stop for a clean one). The caller logs why."""
        self._exit_code = exit_code

    def shutdown(self) -> None:
        """The shutdown sequence (see module docstring); idempotent, bounded by `shutdown_budget`."""
        with self._shutdown_lock:
            if self._shut_down:
                return
            self._shut_down = True
        self.request_stop(self._stop_reason or "shutdown")
        deadline = time.monotonic() + self.shutdown_budget
        if self.stop_deadline is not None:  # whatever work left of the grace period, never past it
            deadline = min(deadline, self.stop_deadline - _EXIT_MARGIN)
        steps = (
            ("stop heartbeat", self._stop_heartbeat),
            ("withdraw record", self._withdraw),
            ("shutdown hooks", self._run_shutdown_hooks),
            ("stop DHT", self._stop_dht),
        )
        for name, step in steps:
            started = time.monotonic()
            try:
                step(deadline)
            except Exception:
                logger.exception(f"shutdown step {name!r} failed")
            logger.debug(f"shutdown step {name!r} took {time.monotonic() - started:.3f} s")
        if self._watchdog is not None:
            # Shut down in time: what is left (exit_now, or a library caller going on) is not ours to cut.
            self._watchdog.cancel()

    def __enter__(self) -> "PeerDaemon":
        if not self.started:
            self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # ---- internals -----------------------------------------------------------------------------

    @property
    def _twin_error(self) -> Optional[UserError]:
        """Why this peer stopped, if another machine runs with its identity (the heartbeat found out)."""
        return None if self._heartbeat is None else self._heartbeat.fatal

    def _idle_until_stopped(self) -> None:
        # Python runs signal handlers in the main thread, between bytecodes. A signal the kernel
        # delivers to another thread (heartbeat, hivemind's) does not interrupt a main thread blocked
        # in an untimed wait, so the handler would only run whenever that wait ends: wake up often.
        while not self._stop_event.wait(_SIGNAL_CHECK_SECONDS):
            pass

    def _stop_heartbeat(self, deadline: float) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop(timeout=max(0.0, min(1.0, deadline - time.monotonic())))

    def _withdraw(self, deadline: float) -> None:
        if self._dht is None or self._publisher is None or not self._dht.is_alive():
            return
        if self._twin_error is not None:
            return  # the entry under this key is also the twin's, which goes on
        timeout = max(0.1, min(1.5, deadline - time.monotonic()))
        # The publisher's expiration is the heartbeats': the leaving version must outlive every live one.
        if not self._publisher.withdraw(timeout=timeout):
            logger.warning("could not withdraw this peer's record; it will expire by itself")

    def _run_shutdown_hooks(self, deadline: float) -> None:
        for name, hook in reversed(self._shutdown_hooks):
            if time.monotonic() > deadline:
                logger.warning(f"shutdown budget spent; skipping hook {name!r}")
                continue
            try:
                hook()
            except Exception:
                logger.exception(f"shutdown hook {name!r} failed")

    def _stop_dht(self, deadline: float) -> None:
        if self._dht is not None:
            self._dht.stop(timeout=max(0.2, min(2.0, deadline - time.monotonic())))

    def _kill_dht(self) -> None:
        """Before an immediate exit: kill the DHT's process group (p2pd included), or it outlives us."""
        if self._dht is not None:
            self._dht.kill()

    def _on_notice(self, notice: PreemptionNotice) -> None:
        self.request_stop(_describe_notice(notice))

    def _start_watchdog(self) -> None:
        """With a grace period: make sure the process is gone by the deadline, whatever hangs."""
        deadline = self.stop_deadline
        if deadline is None or self._watchdog is not None:
            return

        def expire() -> None:
            logger.error(f"grace period of {self.grace_period:g} s is over and the peer has not exited: leaving now")
            logging.shutdown()
            self._kill_dht()
            os._exit(1)

        # A little before the deadline: the exit itself takes a moment.
        self._watchdog = threading.Timer(max(0.0, deadline - 0.25 - time.monotonic()), expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    @contextmanager
    def _signals_handled(self) -> Iterator[None]:
        # One owner for SIGINT / SIGTERM / SIGHUP and the notice file. Signal handlers can only be
        # installed from the main thread; elsewhere only the notice file is watched.
        in_main = threading.current_thread() is threading.main_thread()
        if not in_main and self.notice_file is None:
            yield  # nothing to watch
            return
        graceful = self.grace_period is not None
        watcher = PreemptionWatcher(
            self.notice_file,
            signals=_HANDLED_SIGNALS if in_main else (),
            grace_period=self.grace_period if graceful else math.inf,
            # With a grace period a second signal must not cut the final checkpoint short.
            force_exit_after=3 if graceful else 2,
            on_force_exit=self._kill_dht,
            poll_interval=0.25,
        )
        watcher.add_callback(self._on_notice)
        self._watcher = watcher.start()
        try:
            yield
        finally:
            watcher.close()
