"""Waiting in tests for what another thread or process does and signals nothing: a condition polled under a
deadline (never a bare sleep, never a wait without one)."""

from __future__ import annotations

import time
from typing import Callable

POLL_S = 0.01


def holds_within(condition: Callable[[], bool], timeout: float) -> bool:
    """Whether `condition()` comes true within `timeout` s (it is checked once more at the deadline)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return bool(condition())
        time.sleep(POLL_S)
    return True
