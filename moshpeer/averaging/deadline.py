"""One round's deadlines, computed once when the round is asked for, and the future that carries them.

`MoshpitAverager.step()` computes a `RoundDeadline` from its settings before anything else and passes it
down: matchmaking stops looking at `search_end`, a peer committed to a group waits for it until
`assembly_end`, and nothing of the round runs past `end`. The data plane has `data_s` from the group's
assembly, capped at `end` (`data_plane_end`); `data_s` is the adaptive deadline in force
(`adaptive_deadlines`), `end` is `assembly_end` plus the `round_timeout` cap, so an event loop stalled by a
loaded machine that delivers the group late still gets to run it. Within the data plane, owners stop
waiting for contributions at `reduce_scatter_end` (REDUCE_SCATTER_SHARE of the time left), and the rest is
the all-gather's. No layer below adds time of its own: they split these deadlines and bound every wait by
them; only teardown (closing sockets, joining threads for at most a second each) runs past them.
`step(wait=False)` returns a `RoundFuture`, resolved by `deadline.end` plus the time the round needs to
write its result back.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Optional

from hivemind.utils import get_dht_time


# Share of a data plane's time left at its start that the reduce-scatter gets (owners stop waiting for
# contributions then); the all-gather, which overlaps it, has until the data plane's end.
REDUCE_SCATTER_SHARE = 0.6
# The most of the `round_timeout` cap a paced round may spread its upload over (pacing.py): the rest is left for
# the transfer itself.
MAX_PACED_SHARE = 0.5


def reduce_scatter_end(now: float, end: float) -> float:
    """When owners stop waiting for contributions, for a data plane that starts at `now` and ends at `end`."""
    return now + REDUCE_SCATTER_SHARE * (end - now)


@dataclass(frozen=True)
class RoundDeadline:
    """Absolute `time.monotonic()` times of one round."""

    search_end: float  # matchmaking: no new declarations or join requests after this
    assembly_end: float  # a peer accepted by a leader (or leading followers) waits for its group until then
    end: float  # nothing of the round runs past this
    dht_offset: float  # get_dht_time() - time.monotonic(), for matchmaking, which speaks DHT time
    started: float = 0.0  # when the deadline was computed
    data_s: float = 0.0  # the data plane's budget from the group's assembly (never past `end`)
    paced_s: float = 0.0  # of data_s, the span the round's upload is spread over (pacing.py); 0: unpaced

    @classmethod
    def starting_now(cls, search_s: float, grace_s: float, round_timeout: float,
                     data_s: Optional[float] = None, spread_s: float = 0.0) -> "RoundDeadline":
        """Search for `search_s`, wait `grace_s` longer while committed, then `data_s` (default: all of
        `round_timeout`, the cap) for the data plane; nothing runs past `round_timeout` after the grace. A round
        that spreads its upload over `spread_s` (pacing.py) gets that much more data-plane time, within the cap;
        the spread granted (`paced_s`) is at most MAX_PACED_SHARE of the cap."""
        now = time.monotonic()
        data_s = min(data_s, round_timeout) if data_s is not None else round_timeout
        paced_s = max(0.0, min(spread_s, MAX_PACED_SHARE * round_timeout))
        return cls(search_end=now + search_s, assembly_end=now + search_s + grace_s,
                   end=now + search_s + grace_s + round_timeout, dht_offset=get_dht_time() - now, started=now,
                   data_s=min(data_s + paced_s, round_timeout), paced_s=paced_s)

    @property
    def budget_s(self) -> float:
        """The round's budget in force (seconds from when it was computed): search, assembly grace and
        `data_s`. Past it only a group delivered late by a stalled event loop can run (up to `end`)."""
        return self.assembly_end + self.data_s - self.started

    def data_plane_end(self, assembled: float) -> float:
        """When the data plane of a group assembled at `assembled` (time.monotonic()) must end: `data_s` later,
        never past `end`."""
        return min(assembled + self.data_s, self.end)

    def dht_time(self, monotonic: float) -> float:
        """`monotonic` (one of this deadline's times) in DHT time."""
        return monotonic + self.dht_offset

    def remaining(self) -> float:
        """Seconds until `end` (0 once it has passed)."""
        return max(0.0, self.end - time.monotonic())


class RoundFuture(concurrent.futures.Future):
    """A round in flight (`MoshpitAverager.step(wait=False)`): a `concurrent.futures.Future` of its
    `RoundResult`, with the round's `deadline`. `cancel()` succeeds only before the round has started."""

    def __init__(self, deadline: RoundDeadline):
        super().__init__()
        self.deadline = deadline
