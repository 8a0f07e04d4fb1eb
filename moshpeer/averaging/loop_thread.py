"""An asyncio event loop in a daemon thread: where the averager's matchmaking, RPCs and relay run."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Awaitable, Callable, Optional

from moshpeer.errors import UserError

logger = logging.getLogger(__name__)


class LoopThread:
    """Runs `setup()`, then the loop until `stop()`, then `teardown()`, in a thread named `name`."""

    def __init__(self, name: str):
        self.name = name
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._startup_error: Optional[BaseException] = None

    @property
    def running(self) -> bool:
        """Set up and serving (False before `start`, and if setup failed)."""
        return self.loop is not None and self._ready.is_set() and self._startup_error is None

    def start(self, setup: Callable[[], Awaitable[None]], teardown: Callable[[], Awaitable[None]],
              timeout: float) -> None:
        """Start the thread and wait until `setup()` finished. Raises UserError if it takes over `timeout`
        seconds, or `setup`'s own exception. A second call does nothing."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, args=(setup, teardown), name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise UserError(f"averager did not start within {timeout:g} s")
        if self._startup_error is not None:
            raise self._startup_error

    def _run(self, setup, teardown) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(setup())
        except BaseException as e:
            self._startup_error = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(teardown())
        finish_pending_tasks(loop)
        loop.close()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop (its teardown runs) and wait up to `timeout` for the thread to end."""
        if self.loop is not None and self._thread is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=timeout)


def finish_pending_tasks(loop: asyncio.AbstractEventLoop, timeout: float = 1.0) -> None:
    """Cancel the tasks still on `loop` (hivemind's matchmaking leaves waiters behind, our relay its copy
    tasks) and give them `timeout` to end, as asyncio.run does: a task garbage-collected while pending
    logs "Task was destroyed but it is pending!". Then close the async generators left open, one at a time (each
    within `timeout`)."""
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=timeout))
    loop.run_until_complete(_close_generators_one_by_one(loop, timeout))
    loop.run_until_complete(loop.shutdown_asyncgens())  # whatever the loop tracks that we could not see


async def _close_generators_one_by_one(loop: asyncio.AbstractEventLoop, timeout: float) -> None:
    # A leader's answer to a join request is a chain of generators (hivemind's stream handler, our rpc_join_group,
    # join_group, hivemind's rpc_join_group), each closing the next in its `finally`. A peer stopped while one was open
    # left the chain suspended, and asyncio's shutdown_asyncgens closes every generator at once: an inner one was then
    # already being closed by its outer one, and the loop logged "aclose(): asynchronous generator is already running"
    # as an ERROR, three times per chain. One at a time, whichever closes an inner generator first, the others find it
    # closed. (`_asyncgens` is the set asyncio's loops keep for shutdown_asyncgens; a loop without it is left to that.)
    for generator in list(getattr(loop, "_asyncgens", ())):
        try:
            await asyncio.wait_for(generator.aclose(), timeout)
        except Exception as e:  # its own cleanup failed, or took too long: the loop is closing anyway
            logger.debug(f"closing {generator!r} at the loop's end failed: {type(e).__name__}: {e}")
