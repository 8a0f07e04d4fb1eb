"""Noticing that this process did not run for a while: stopped (SIGSTOP, a debugger), its VM or laptop suspended, or
its machine so overloaded that no thread of it ran.

Why it matters: a paused peer wakes up with everything it knew from before the pause, and the swarm ran on meanwhile.
Measured (3 trainers on loopback, one stopped for 15-30 s while the other two ran 60-90 epochs): on waking, it took
the swarm for where it was when it stopped and averaged the work of stale epochs with it, for up to 12 s (19 rounds),
and the others' loss rose 10x. Its first view after the pause is not enough either: its own record had expired in
the DHT meanwhile, so the first reads came back incomplete and the old view stood (three rounds in 0.6 s).

`PauseWatch` is the decision, with an injectable clock: a ticker thread calls `tick` every TICK_S; a tick more than
PAUSE_S after the previous one ends a pause. `paused_since(t)` says whether a pause ended after time `t`, or one is
just ending (the ticker itself has not run yet: every thread resumes at once, in any order). The clock counts time
while the machine is suspended (CLOCK_BOOTTIME where there is one; `time.monotonic` stops during a suspend on Linux).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

# How often the ticker runs, and how late a tick must be to count as a pause (a loaded 2-core machine schedules a
# thread within a fraction of a second; a false alarm costs one extra read of the swarm's progress).
TICK_S = 0.5
PAUSE_S = 3.0


def boot_clock() -> float:
    """Seconds on a clock that runs on while the machine is suspended (CLOCK_BOOTTIME), else `time.monotonic`."""
    if hasattr(time, "CLOCK_BOOTTIME"):
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.monotonic()


class PauseWatch:
    """When this process last stopped running for longer than `pause_s` (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = boot_clock, pause_s: float = PAUSE_S):
        self._clock, self.pause_s = clock, pause_s
        self._lock = threading.Lock()
        self._last_tick = clock()
        self.last_pause_end = -math.inf  # when the last pause ended (by `now`)

    def now(self) -> float:
        """The watch's clock (compare `paused_since` arguments with it, not with `time.monotonic`)."""
        return self._clock()

    def tick(self) -> Optional[float]:
        """The ticker's beat -> the length of the pause it ends (its gap since the last beat), or None."""
        now = self._clock()
        with self._lock:
            gap, self._last_tick = now - self._last_tick, now
            if gap <= self.pause_s:
                return None
            self.last_pause_end = now
            return gap

    def paused_since(self, t: float) -> bool:
        """Did a pause end after `t` (by `now`), or is one ending now (the ticker is late itself)?"""
        now = self._clock()
        with self._lock:
            return self.last_pause_end > t or now - self._last_tick > self.pause_s

    def run(self, stop: threading.Event) -> None:
        """The ticker: `tick` every TICK_S until `stop` is set, logging each pause it notices."""
        while not stop.wait(TICK_S):
            gap = self.tick()
            if gap is not None:
                logger.warning(f"this process did not run for {gap:.1f} s (stopped, suspended or starved): rounds "
                               f"in flight lost what they waited for, and the swarm is read again before the next")
