"""An asyncio event loop in a daemon thread: where the averager's matchmaking, RPCs and relay run."""

from __future__ import annotations

import asyncio
import threading
from typing import Awaitable, Callable, Optional

from moshpeer.errors import UserError


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
    logs "Task was destroyed but it is pending!" """
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=timeout))
    loop.run_until_complete(loop.shutdown_asyncgens())
