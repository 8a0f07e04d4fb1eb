"""`SpeedMeter`: this peer's training throughput (samples per second), as published in its progress record."""

from __future__ import annotations

import math
import time
from typing import List


class SpeedMeter:
    """Samples per second over a sliding window of recent micro-batches."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._events: List[tuple] = []

    def add(self, samples: int) -> None:
        now = time.monotonic()
        self._events.append((now, samples))
        cutoff = now - self.window_s
        while self._events and self._events[0][0] < cutoff:
            self._events.pop(0)

    def rate(self) -> float:
        if len(self._events) < 2:
            return 0.0
        span = self._events[-1][0] - self._events[0][0]
        return sum(s for _, s in self._events[1:]) / span if span > 0 else 0.0

    def mean_batch(self) -> float:
        """Mean samples per micro-batch over the window (0 before the first)."""
        return sum(s for _, s in self._events) / len(self._events) if self._events else 0.0

    def seconds_for(self, micro_batches: int) -> float:
        """Seconds until `micro_batches` more are computed at the recent rate (inf: no rate yet)."""
        rate = self.rate()
        return micro_batches * self.mean_batch() / rate if rate > 0 else math.inf
