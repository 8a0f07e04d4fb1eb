"""Members whose contributions robust aggregation keeps clipping: after a few rounds, weigh them at zero.

CenteredClip bounds how far one hostile member moves a part's average per round, but not to zero: a
member that always sends the same far-away value pulls the result by about tau / n every round, in the
same direction (with 1 hostile of 4 members the result settles ~tau/3 from the honest mean). Over a
training run that steady pull costs accuracy. A part's owner therefore remembers, per peer id, in how
many consecutive rounds the peer was flagged (clipped in at least half of the chunks it contributed to
the owner's part). From `SUSPECT_AFTER_ROUNDS` such rounds on, the owner's CenteredClip weighs the
peer's contributions at zero. They are still received, checked and flagged, so the first round in
which the peer is not flagged clears it: an honest member clipped by chance (tau is twice the median
distance, so that is rare) loses at most the rounds until then.

What this cannot do: tell a hostile member from an honest one whose data really differs (a non-IID
shard far from the others is flagged, then ignored, too), or defend against a hostile owner. Each owner
decides for its own part, from what it saw itself; nothing here travels over the network.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

SUSPECT_AFTER_ROUNDS = 2


class SuspectTracker:
    """Consecutive flagged rounds per peer id, as seen by this peer as a part's owner."""

    def __init__(self, after_rounds: int = SUSPECT_AFTER_ROUNDS):
        self.after_rounds = after_rounds
        self._streaks: Dict[str, int] = {}

    def distrusted(self, peer_ids: Sequence[str]) -> List[int]:
        """Group indices (into `peer_ids`) whose contributions this owner should weigh at zero."""
        return [i for i, peer in enumerate(peer_ids) if self._streaks.get(peer, 0) >= self.after_rounds]

    def record_round(self, peer_ids: Sequence[str], flagged: Sequence[int], contributed: Sequence[int]) -> List[str]:
        """Update the streaks from one round (per member index: chunks flagged, chunks contributed to our part);
        -> the peers that became suspects in this round. Members that contributed nothing keep their streak."""
        became = []
        for peer, hits, chunks in zip(peer_ids, flagged, contributed):
            if chunks <= 0:
                continue
            if 2 * hits >= chunks:
                self._streaks[peer] = self._streaks.get(peer, 0) + 1
                if self._streaks[peer] == self.after_rounds:
                    became.append(peer)
            else:
                self._streaks.pop(peer, None)
        return became

    @property
    def suspects(self) -> List[str]:
        """Peers currently weighed at zero."""
        # A copy first: other threads (the progress view) ask while the round thread records.
        return sorted(peer for peer, streak in list(self._streaks.items()) if streak >= self.after_rounds)
