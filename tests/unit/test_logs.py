"""moshpeer.logs: hivemind's tracebacks of a peer leaving become one line; real bugs keep theirs."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import logging
import warnings
from typing import Iterator

import pytest
from hivemind.utils.asyncio import await_cancelled

from moshpeer.logs import (AbandonedRpcFilter, PeerFailureFilter, quiet_abandoned_dht_requests,
                           quiet_expected_peer_failures)


@contextlib.contextmanager
def filtered_log(name: str, level: int) -> Iterator[io.StringIO]:
    """What logger `name`, set to `level`, writes through a handler with the filter installed, while open."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger(name)
    saved_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    quiet_expected_peer_failures(handlers=[handler])
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved_level)


def log_failed_task(error: BaseException, level: int) -> str:
    """What hivemind's `await_cancelled` logs for a task that raised `error`, through a filtered handler."""
    async def request_join_potential_leaders() -> None:
        raise error

    async def main() -> None:
        task = asyncio.create_task(request_join_potential_leaders())
        await asyncio.sleep(0)
        await await_cancelled(task)  # logs "Exception in <Task ...>:" with the traceback

    with filtered_log("hivemind.utils.asyncio", level) as stream:
        asyncio.run(main())
    return stream.getvalue()


@pytest.mark.parametrize("error", [BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset"),
                                   asyncio.TimeoutError()])
def test_a_peer_leaving_is_one_debug_line(error):
    assert log_failed_task(error, logging.WARNING) == ""  # default level: our own layer reports it
    output = log_failed_task(error, logging.DEBUG)
    assert "Traceback" not in output
    assert output.count("\n") == 1, output
    assert output.startswith("DEBUG hivemind.utils.asyncio: a peer went away in log_failed_task.request_join_potential_leaders")
    assert type(error).__name__ in output


def test_a_real_bug_keeps_its_traceback():
    output = log_failed_task(ValueError("a bug"), logging.WARNING)
    assert output.startswith("ERROR hivemind.utils.asyncio: Exception in <Task")
    assert "Traceback (most recent call last)" in output and "ValueError: a bug" in output


def test_only_hivemind_and_asyncio_records_are_rewritten():
    try:
        raise BrokenPipeError(32, "Broken pipe")
    except BrokenPipeError:
        import sys

        exc_info = sys.exc_info()
    ours = logging.LogRecord("moshpeer.averaging", logging.ERROR, __file__, 1, "ours", (), exc_info)
    theirs = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Task exception was never retrieved", (),
                               exc_info)
    filt = PeerFailureFilter()
    assert filt.filter(ours) and ours.exc_info is exc_info and ours.levelno == logging.ERROR
    filt.filter(theirs)
    assert theirs.exc_info is None and theirs.levelno == logging.DEBUG


def test_installing_twice_adds_one_filter():
    handler = logging.StreamHandler(io.StringIO())
    quiet_expected_peer_failures(handlers=[handler])
    quiet_expected_peer_failures(handlers=[handler])
    assert sum(isinstance(f, PeerFailureFilter) for f in handler.filters) == 1


def test_what_a_task_raises_while_cancelled_is_one_debug_line():
    async def cleanup_fails_after_cancel() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            raise KeyError("half-torn-down search")  # raised while the CancelledError propagates

    async def main() -> None:
        task = asyncio.create_task(cleanup_fails_after_cancel())
        await asyncio.sleep(0)
        task.cancel()
        await await_cancelled(task)

    with filtered_log("hivemind.utils.asyncio", logging.DEBUG) as stream:
        asyncio.run(main())
    output = stream.getvalue()
    assert "Traceback" not in output and output.count("\n") == 1, output
    assert "a cancelled task ended in" in output and "KeyError" in output


def test_a_task_that_outlives_the_dht_of_a_stopping_peer_is_one_debug_line():
    # What multiprocessing's Connection raises once the DHT process's pipe is closed (a SIGTERMed peer shutting down).
    output = log_failed_task(OSError("handle is closed"), logging.DEBUG)
    assert "Traceback" not in output and output.count("\n") == 1, output
    assert "a task outlived this peer's DHT" in output
    assert "Traceback" in log_failed_task(OSError("another error"), logging.WARNING)  # other OSErrors keep theirs


def test_a_task_that_outlives_the_p2p_daemon_of_a_stopping_peer_is_one_debug_line(tmp_path):
    # What hivemind's DaemonConnector raises once the peer's p2p daemon has exited and its control socket is gone.
    from hivemind.p2p.p2p_daemon_bindings.control import DaemonConnector
    from hivemind.utils.multiaddr import Multiaddr

    async def connect() -> None:
        await DaemonConnector(Multiaddr(f"/unix{tmp_path}/p2pd.sock")).open_connection()

    try:
        asyncio.run(connect())
    except FileNotFoundError as e:
        gone = e
    output = log_failed_task(gone, logging.DEBUG)
    assert "Traceback" not in output and output.count("\n") == 1, output
    assert "a task outlived this peer's p2p daemon" in output
    assert "Traceback" in log_failed_task(FileNotFoundError("elsewhere"), logging.WARNING)  # not from the daemon


def test_a_cancelled_connection_handler_is_one_debug_line(tmp_path):
    """Python 3.11's asyncio logs "Exception in callback" with the CancelledError of a connection handler cancelled
    while it runs (what the averager's loop does to hivemind's stream handlers when it stops): one debug line."""
    async def main() -> None:
        started = asyncio.Event()

        async def serve(reader, writer) -> None:
            started.set()
            await asyncio.sleep(60)  # e.g. an answered join request's stream, held open

        server = await asyncio.start_unix_server(serve, path=str(tmp_path / "handler.sock"))
        _, writer = await asyncio.open_unix_connection(str(tmp_path / "handler.sock"))
        await started.wait()
        handlers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        # asyncio's done-callback on each handler came first: it has run by the time gather returns.
        await asyncio.gather(*handlers, return_exceptions=True)
        writer.close()
        server.close()

    with filtered_log("asyncio", logging.DEBUG) as stream:
        asyncio.run(main())
    output = stream.getvalue()
    assert "Traceback" not in output, output
    assert all("a cancelled task ended" in line for line in output.splitlines() if "callback" in line), output


class DHTProtocol:  # named like hivemind's: what a DHT process's abandoned request handlers are
    async def rpc_ping(self) -> None:
        await asyncio.sleep(1)


async def our_own_work() -> None:
    await asyncio.sleep(1)


def destroy_pending_task(coroutine) -> None:
    """What a DHT process whose loop closes under a request does: the task is freed while still pending."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(coroutine)
    loop.close()
    del task
    gc.collect()


def test_a_dht_request_abandoned_by_a_closing_loop_is_no_error_but_our_own_pending_task_is(caplog):
    """A DHT process whose start failed (CI, session 36: a refused clock) closed its loop under a peer's ping, and
    asyncio's "Task was destroyed but it is pending!" and "never awaited" reached stderr beside our one line."""
    asyncio_logger = logging.getLogger("asyncio")
    filters = list(asyncio_logger.filters)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_abandoned_dht_requests()
            quiet_abandoned_dht_requests()  # once is enough
            assert sum(isinstance(f, AbandonedRpcFilter) for f in asyncio_logger.filters) == 1
            with caplog.at_level(logging.ERROR, logger="asyncio"):
                destroy_pending_task(DHTProtocol().rpc_ping())
                assert not caplog.records
                destroy_pending_task(our_own_work())
            assert [r.getMessage().splitlines()[0] for r in caplog.records] == ["Task was destroyed but it is pending!"]
            assert "our_own_work" in caplog.records[0].getMessage()
        unawaited = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert unawaited == ["coroutine 'our_own_work' was never awaited"], unawaited
    finally:
        asyncio_logger.filters[:] = filters
