"""Two machines with one identity, found while both run: the newer one stops.

A peer's identity (its key, hence its peer id) belongs to one machine. Copied with a disk image or a config
folder, it makes two machines one peer to the swarm: their records overwrite each other under the one owner key,
libp2p routes the peer id to either machine, `--min-peers` counts them once, and neither says anything (measured:
two `moshpeer join` with copies of one `--identity` file and a third peer, `--min-peers 3`: nobody trained in
40 s, and the third peer's heartbeats failed every other time). hivemind's start check (it asks the swarm whether
the peer id answers) catches a copy started after the first is known; two machines started together (instances
launched from one image) both pass it, or one of them fails it as if behind a NAT.

So a running peer reads its run's records just before it publishes its own: whatever stands under its key then was
published after its own last publication, so a twin's record shows up at the first check. It does so at every
heartbeat for its first EAGER_TWIN_CHECK_S, then every few: the newer twin stops at its second heartbeat and leaves
its last record standing only until the older one next publishes, so an older peer that read only every few beats
would miss a twin launched beside it (CI saw it: the newer stopped, the older never warned).
The newer's stop is certain: the older publishes at every beat, so the newer's next check reads it. The older's warning
is not: a record publication and a read are not one atomic step, and a twin's publication that lands between the
older's read and its own publication (which expires later, so it replaces the twin's) is overwritten unseen; if the
twin stops at its next check, the older never reads its record. Beside busy loops, where a publication takes tens of
milliseconds, the older missed its warning in the fast lane once (session 45); the newer's error is what an operator
acts on.
A record under this peer's id that started at another time and was published after this peer started is a twin's
(a previous run of this machine stopped publishing before this one could start: the identity file is locked). Of
the two, the one that started later stops with an error; the earlier one goes on, with a warning if it read the
twin's record (above). Both compare the same two `started_at` (floats of the owners' clocks: they do not tie by
chance), so they agree on which is which.

What a record says decides nothing here but this peer's own exit: only a holder of this peer's key can sign a
record under it.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, Optional, Sequence

from moshpeer.bounded_memory import remember
from moshpeer.dht.records import PeerRecord
from moshpeer.errors import UserError

logger = logging.getLogger(__name__)

# The first check comes this many heartbeats after the start, then one at every heartbeat for the first
# EAGER_TWIN_CHECK_S seconds (twins launched together meet then, whatever their start-up took), then one every
# TWIN_CHECK_EVERY heartbeats (30 s at the default 5 s heartbeat): a listing of the run's records costs what a progress
# refresh does.
FIRST_TWIN_CHECK = 2
EAGER_TWIN_CHECK_S = 60.0
TWIN_CHECK_EVERY = 6
# Twins this peer already warned of (a twin that restarts comes back with another start time).
MAX_WARNED_TWINS = 16


def find_twin(records: Sequence[PeerRecord], own: PeerRecord) -> Optional[PeerRecord]:
    """The record of another live machine running with `own`'s identity, if `records` hold one."""
    for record in records:
        if (record.peer_id == own.peer_id and record.started_at != own.started_at and not record.leaving
                and record.updated_at > own.started_at):
            return record
    return None


class TwinWatch:
    """When to look for a twin (`due`, once per heartbeat) and what to do about one (`check`)."""

    def __init__(self, heartbeat_s: float, first: int = FIRST_TWIN_CHECK, eager_s: float = EAGER_TWIN_CHECK_S,
                 every: int = TWIN_CHECK_EVERY):
        self.first, self.every = first, every
        self.eager_until = max(first, math.ceil(eager_s / heartbeat_s))  # the last beat of the eager checks
        self._beats = 0
        self._warned: Dict[float, None] = {}  # the start times of twins already named in a warning

    def due(self) -> bool:
        """Count a heartbeat; True when this one should read the records first."""
        self._beats += 1
        if self._beats < self.first:
            return False
        return self._beats <= self.eager_until or (self._beats - self.eager_until) % self.every == 0

    def check(self, records: Sequence[PeerRecord], own: PeerRecord) -> Optional[UserError]:
        """The error this peer must stop with, if it is the newer of two twins; None otherwise (a warning is logged,
        once per twin, if it is the older)."""
        twin = find_twin(records, own)
        if twin is None:
            return None
        where = f"at {twin.addresses[0]!r}" if twin.addresses else "at an unknown address"
        apart = abs(own.started_at - twin.started_at)
        if twin.started_at > own.started_at:  # the twin is the newer one: it stops itself
            if twin.started_at not in self._warned:
                remember(self._warned, twin.started_at, limit=MAX_WARNED_TWINS)
                logger.warning(
                    f"another machine runs with this peer's identity ({own.peer_id}, {where}, started {apart:.1f} s "
                    "after this one): the swarm sees the two as one peer; each machine needs its own --identity file. "
                    "The newer one stops itself")
            return None
        return UserError(
            f"another machine runs with this peer's identity ({own.peer_id}, {where}, started {apart:.1f} s "
            "before this one): the swarm sees the two as one peer. Each machine needs its own --identity file (a "
            "missing file is created with a new key); this one, the newer, stops")
