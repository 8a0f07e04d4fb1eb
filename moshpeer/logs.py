"""Logs a user can trust: a peer that leaves is one line, a real bug keeps its traceback.

In a swarm, peers vanish mid-request all the time, and hivemind logs some of those departures with a
full traceback: an ERROR from `hivemind.utils.asyncio` ("Exception in <Task ...
Matchmaking._request_join_potential_leaders()>") with a `BrokenPipeError`, a WARNING from
`hivemind.p2p.p2p_daemon` ("Handler failed with the exception") with a `ConnectionResetError`, and
asyncio's own "Task exception was never retrieved". Each of these is also seen by whoever waits for
the failed request (our averager logs "matchmaking failed: ..." as one line), so here they become a
single DEBUG line, shown with `-v`.

Only records from hivemind's and asyncio's loggers are touched, and only when they carry one of the
exceptions in `EXPECTED_PEER_FAILURES`, an exception raised while its task was being cancelled (our
averager cancels hivemind's matchmaking search at the round's deadline; hivemind's cleanup of a
half-torn-down search can fail, and that is logged with a traceback), or a call into this peer's DHT or p2p
daemon after a stopping peer shut it down. Every other record, tracebacks
of real bugs included, passes unchanged. Our own code reports peer failures as one line where it
handles them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import warnings
from typing import Iterable, Tuple

from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

# What a peer leaving (or a link going down) looks like from this side: the connection broke or was
# reset, a stream ended early, a request timed out, or the p2p daemon could not reach the peer.
EXPECTED_PEER_FAILURES: Tuple[type, ...] = (
    ConnectionError,  # BrokenPipeError, ConnectionResetError, ConnectionRefusedError, ConnectionAbortedError
    TimeoutError,
    asyncio.TimeoutError,  # distinct from TimeoutError before Python 3.11
    concurrent.futures.TimeoutError,
    asyncio.IncompleteReadError,
    EOFError,
    StopAsyncIteration,  # a peer's answer stream ended before its first message (hivemind's join request)
    P2PDaemonError,
    P2PHandlerError,
)

_FILTERED_LOGGERS = ("hivemind", "asyncio")
# Where hivemind opens the unix socket to this peer's p2p daemon (DaemonConnector.open_connection).
_DAEMON_CONTROL = os.path.join("p2p_daemon_bindings", "control.py")
# hivemind names a failed task in its message: "Exception in <Task ... coro=<Matchmaking._request_join...() ...>"
_CORO_NAME = re.compile(r"coro=<([^\s(]+)\(")
# hivemind's DHT request handlers, the tasks a stopping DHT process abandons (AbandonedRpcFilter).
_DHT_RPC_PREFIX = "DHTProtocol.rpc_"


def is_expected_peer_failure(error: BaseException) -> bool:
    """Is `error` what a peer that left (or a broken link) raises on this side?"""
    return isinstance(error, EXPECTED_PEER_FAILURES)


class PeerFailureFilter(logging.Filter):
    """A handler filter: hivemind's / asyncio's records of expected peer failures (and of failures while a
    task was being cancelled) become one DEBUG line (dropped unless the source logger is at DEBUG);
    everything else passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or not _from_filtered_logger(record.name):
            return True
        error = record.exc_info[1]
        if error is None:
            return True
        if is_expected_peer_failure(error):
            what = "a peer went away"
        elif _raised_while_cancelled(error):
            what = "a cancelled task ended"
        elif _dht_already_shut_down(error):
            what = "a task outlived this peer's DHT"
        elif _p2p_daemon_already_gone(error):
            what = "a task outlived this peer's p2p daemon"
        else:
            return True
        where = _CORO_NAME.search(record.getMessage())
        context = f" in {where.group(1).replace('.<locals>.', '.')}" if where else ""
        detail = f": {error}" if str(error) else ""
        record.msg = f"{what}{context}: {type(error).__name__}{detail}"
        record.args = ()
        record.exc_info = record.exc_text = None
        record.stack_info = None
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        # The handler's level check ran before this filter: apply the source logger's level to the new one.
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def _raised_while_cancelled(error: BaseException) -> bool:
    """Was `error` raised while its task was being cancelled (it is, or has in its context chain, a CancelledError)?

    A CancelledError itself reaches a log through Python 3.11's asyncio streams: the done-callback of a
    connection handler's task calls `task.exception()`, which raises for a cancelled task ("Exception in callback
    StreamReaderProtocol.connection_made.<locals>.callback"); our averager's loop cancels the p2p daemon's stream
    handlers still running when it stops (a leader's join-request handler holds its answered stream open).

    Our averager cancels hivemind's matchmaking search when the round's deadline passes; hivemind's
    cleanup can then fail on the half-torn-down search, and `cancel_and_wait` logs that with a traceback.
    The cancellation was the intent, so what its cleanup raised is not a bug of this peer."""
    if isinstance(error, asyncio.CancelledError):
        return True
    seen = set()
    link = error.__context__
    while link is not None and id(link) not in seen:
        if isinstance(link, asyncio.CancelledError):
            return True
        seen.add(id(link))
        link = link.__context__
    return False


def _dht_already_shut_down(error: BaseException) -> bool:
    """Is `error` a call into this peer's DHT after its process was shut down (the pipe to it is closed)?

    A peer that stops shuts its DHT down while one of hivemind's matchmaking tasks may still look up leaders in it
    (session 19's CI: `PotentialLeaders._update_queue_periodically` logged OSError("handle is closed") with a
    traceback as a SIGTERMed peer exited). The peer is stopping on purpose; there is nothing to report."""
    return isinstance(error, OSError) and str(error) == "handle is closed"


def _p2p_daemon_already_gone(error: BaseException) -> bool:
    """Is `error` a request to this peer's p2p daemon after the daemon stopped (its control socket is gone)?

    A stopping peer's p2p daemon exits while a matchmaking task may still open a stream through it (session 25's
    CI: `Matchmaking._request_join_potential_leaders` logged FileNotFoundError from `DaemonConnector.open_connection`
    with a traceback as a SIGTERMed peer exited; the averager logged the same failure as one line)."""
    if not isinstance(error, FileNotFoundError):
        return False
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "open_connection" and code.co_filename.endswith(_DAEMON_CONTROL):
            return True
        tb = tb.tb_next
    return False


class AbandonedRpcFilter(logging.Filter):
    """For the asyncio logger of a DHT process: drops "Task was destroyed but it is pending!" for a hivemind DHT RPC
    handler (`DHTProtocol.rpc_*`). A DHT process that stops, or whose start failed (a refused clock, an unreachable
    initial peer), closes its event loop with whatever requests other peers were still sending it; their handler
    tasks are then freed unfinished, and asyncio says so on stderr: the user then saw three lines of asyncio's on
    top of our one-line error (CI, session 36: the wrong-clock case, once in four runs). Tasks of anything else
    pass: a pending task of ours is a bug to see."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("Task was destroyed but it is pending!"):
            return True
        where = _CORO_NAME.search(message)
        return not (where and where.group(1).startswith(_DHT_RPC_PREFIX))


def quiet_abandoned_dht_requests() -> None:
    """In a DHT process: no asyncio noise for the requests its closing event loop abandons (AbandonedRpcFilter),
    nor the warning that their coroutines were never awaited."""
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(existing, AbandonedRpcFilter) for existing in asyncio_logger.filters):
        asyncio_logger.addFilter(AbandonedRpcFilter())
    warnings.filterwarnings("ignore", message=r"coroutine 'DHTProtocol\.rpc_\w+' was never awaited",
                            category=RuntimeWarning)


def _from_filtered_logger(name: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in _FILTERED_LOGGERS)


def quiet_expected_peer_failures(handlers: Iterable[logging.Handler] = ()) -> None:
    """Install `PeerFailureFilter` on the root logger's handlers, hivemind's own handlers and `handlers`.

    Call it after configuring logging (handlers added later are not covered); calling it again is
    harmless. `moshpeer` commands call it at start; a program that uses the library calls it itself.
    Never fails: a handler list that changes meanwhile is read once.
    """
    targets = [*logging.getLogger().handlers, *logging.getLogger("hivemind").handlers, *handlers]
    for handler in targets:
        if not any(isinstance(existing, PeerFailureFilter) for existing in handler.filters):
            handler.addFilter(PeerFailureFilter())
