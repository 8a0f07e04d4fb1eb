"""How often a round's connections could be kept ones: the members of a group that were in a group together a few
rounds before (averaging/kept_links.py keeps a connection that ended cleanly for the next all-reduce between the
same two peers). Moshpit rotates its groups so that peers meet new ones, so in a large swarm few pairs meet again;
this measures how few on the production grouping rule."""

from __future__ import annotations

from typing import Dict, Tuple

from moshpeer.averaging import grid


class LinkReuse:
    """Remembers when each ordered pair of peers last shared a group; `observe` says, for one round's groups, which
    fraction of its sender -> receiver links had shared a group within the last `window_rounds` rounds."""

    def __init__(self, window_rounds: int):
        if window_rounds < 1:
            raise ValueError(f"window_rounds must be >= 1, got {window_rounds}")
        self.window_rounds = window_rounds
        self._last_met: Dict[Tuple[int, int], int] = {}

    def observe(self, round_number: int, grouping: grid.Grouping) -> float:
        """Record round `round_number`'s groups; -> the fraction of its links met within the window (0.0 when the
        round had no group)."""
        links = reused = 0
        for start, size in zip(grouping.starts.tolist(), grouping.sizes.tolist()):
            members = grouping.members[start:start + size].tolist()
            for sender in members:
                for receiver in members:
                    if sender == receiver:
                        continue
                    last = self._last_met.get((sender, receiver))
                    reused += last is not None and round_number - last <= self.window_rounds
                    self._last_met[(sender, receiver)] = round_number
                    links += 1
        return reused / links if links else 0.0
