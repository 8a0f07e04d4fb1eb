"""`RateLimitedLog`: rejections of untrusted input (connections, records, requests) logged at most a few times
per interval, so a flood of bad input cannot flood the log. Imports nothing heavy (the CLI checks flags with it
loaded)."""

from __future__ import annotations

import logging
import threading
import time

REJECTION_LOG_INTERVAL_S = 10.0
REJECTION_LOGS_PER_INTERVAL = 5


class RateLimitedLog:
    """Logs at most `per_interval` warnings per `interval_s`; the next one after a quiet spell says how many
    were suppressed (a flood of bad connections must not flood the log)."""

    def __init__(self, log: logging.Logger, interval_s: float = REJECTION_LOG_INTERVAL_S,
                 per_interval: int = REJECTION_LOGS_PER_INTERVAL):
        self._log, self._interval, self._per_interval = log, interval_s, per_interval
        self._lock = threading.Lock()
        self._window_start, self._in_window, self.suppressed = 0.0, 0, 0

    def warning(self, message: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._window_start >= self._interval:
                self._window_start, self._in_window = now, 0
            self._in_window += 1
            if self._in_window > self._per_interval:
                self.suppressed += 1
                return
            suppressed, self.suppressed = self.suppressed, 0
        if suppressed:
            message += f" ({suppressed} similar messages suppressed)"
        self._log.warning(message)
