"""Members whose contributions robust aggregation keeps clipping: once that is a pattern, weigh them at zero.

CenteredClip bounds how far one hostile member moves a part's average per round, but not to zero: a
member that always sends the same far-away value pulls the result by about tau / n every round, in the
same direction (with 1 hostile of 4 members the result settles ~tau/3 from the honest mean). Over a
training run that steady pull costs accuracy. A part's owner therefore keeps, per peer id, a suspicion
score: each round the peer contributed to the owner's part, the score decays by `DECAY` and gains the
fraction of those chunks in which the peer was flagged (clipped or rejected),

    score = min(DECAY * score + flagged / contributed, SCORE_CAP)

and while the score is at least `SUSPECT_SCORE` the owner's CenteredClip weighs the peer's contributions
at zero. They are still received, checked and flagged, so a peer that behaves again clears itself.

Why a decaying score and not a streak of flagged rounds (the rule before issue 26): a streak forgives
everything after one clean round, so a member that attacks every other round, or a quarter of its chunks
every round (bench_trust's `sparse_chunks` arm), was never a suspect. With DECAY 0.9 the score settles
at 10x the member's long-run flagged fraction: anything flagged in more than ~15% of its chunks becomes a
suspect (a quarter of the chunks: after 9 rounds), a member flagged in every chunk after 2 rounds
(`SUSPECT_AFTER_ROUNDS`, as before). An honest member is flagged by chance in a few chunks of a run (the
clip radius is two median distances): its score stays far below the threshold. One clipped in four fifths
of its chunks for two rounds in a row is distrusted, as before, and the cap bounds what it then costs:
from the cap, 7 clean rounds clear any peer.

What this cannot do: tell a hostile member from an honest one whose data really differs (a non-IID
shard far from the others is flagged, then ignored, too), or defend against a hostile owner. Each owner
decides for its own part, from what it saw itself; nothing here travels over the network.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Sequence

DECAY = 0.9
SUSPECT_SCORE = 1.5
SCORE_CAP = 2 * SUSPECT_SCORE
# What the constants above give for a member flagged in every chunk it contributes: 1.0, then 1.9.
SUSPECT_AFTER_ROUNDS = 2

logger = logging.getLogger(__name__)


class SuspectTracker:
    """Decaying suspicion scores per peer id, as seen by this peer as a part's owner (see the module docstring)."""

    def __init__(self, decay: float = DECAY, threshold: float = SUSPECT_SCORE, cap: float = SCORE_CAP):
        if not (0 <= decay < 1 and 0 < threshold <= cap):
            raise ValueError(f"need 0 <= decay < 1 and 0 < threshold <= cap; got {decay}, {threshold}, {cap}")
        self.decay, self.threshold, self.cap = decay, threshold, cap
        self._scores: Dict[str, float] = {}

    def distrusted(self, peer_ids: Sequence[str]) -> List[int]:
        """Group indices (into `peer_ids`) whose contributions this owner should weigh at zero."""
        return [i for i, peer in enumerate(peer_ids) if self._scores.get(peer, 0.0) >= self.threshold]

    def record_round(self, peer_ids: Sequence[str], flagged: Sequence[int], contributed: Sequence[int]) -> List[str]:
        """Update the scores from one round (per member index: chunks flagged, chunks contributed to our part);
        -> the peers that became suspects in this round (a WARNING line names each). Members that contributed
        nothing keep their score (an absence is neither evidence for nor against them)."""
        became = []
        for peer, hits, chunks in zip(peer_ids, flagged, contributed):
            if chunks <= 0:
                continue
            before = self._scores.get(peer, 0.0)
            score = min(self.decay * before + min(hits, chunks) / chunks, self.cap)
            if score < 0.01:  # forgotten: keeps the table to the peers that were flagged lately
                self._scores.pop(peer, None)
                continue
            self._scores[peer] = score
            if before < self.threshold <= score:
                logger.warning(f"peer {peer[-8:]} is clipped round after round (suspicion score {score:.2f}): its "
                               f"contributions to our parts count for nothing until it behaves for a few rounds")
                became.append(peer)
        return became

    def score(self, peer_id: str) -> float:
        """The peer's suspicion score (0 for a peer never flagged)."""
        return self._scores.get(peer_id, 0.0)

    @property
    def suspects(self) -> List[str]:
        """Peers currently weighed at zero."""
        # A copy first: other threads (the progress view) ask while the round thread records.
        return sorted(peer for peer, score in list(self._scores.items()) if score >= self.threshold)
