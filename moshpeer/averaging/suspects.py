"""Members whose contributions robust aggregation keeps clipping: once that is a pattern, weigh them at zero.

CenteredClip bounds how far one hostile member moves a part's average per round, but not to zero: a
member that always sends the same far-away value pulls the result by about tau / n every round, in the
same direction (with 1 hostile of 4 members the result settles ~tau/3 from the honest mean). Over a
training run that steady pull costs accuracy. A part's owner therefore keeps, per peer id, a suspicion
score: each round the peer contributed to the owner's part, the score decays by `DECAY` and gains the
fraction of those chunks in which the peer was flagged (clipped or rejected), a rejected chunk counting
REJECTED_EVIDENCE times,

    score = min(DECAY * score + (flagged + (REJECTED_EVIDENCE - 1) * rejected) / contributed, SCORE_CAP)

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

A rejected chunk is stronger evidence than a clipped one. Clipping starts at two median distances from the
owner's value, where chance reaches an honest member a few times in a run; rejection at ten
(aggregation.REJECT_RADIUS_FACTOR), where no honest member's contribution lies. So a round in which all of a
member's chunks were rejected puts it at the cap at once (REJECTED_EVIDENCE = SCORE_CAP): one that sends -100x in
a quarter of its chunks, one chunk per part, is distrusted after its first such round until the decay clears it
(the 7th clean round), not only after a lucky streak of such rounds. In bench_trust's `sparse_chunks` arm every
honest owner distrusted it by epoch 20 in 10 of 10 runs (5 of 10 with rejections counted as clips). A rejected
quarter of a member's chunks adds 0.75 a round.

A member that stays inside the clip radius is never clipped: sending the reverse of its update at the honest
scale biases every round it is in (bench_trust's `inside_radius` arm). The same Gram matrix that CenteredClip
already computes gives each contribution's alignment with the mean of the others (`aggregation.alignments`,
z = sqrt(d) cos, in standard deviations of chance). One chunk's z says little: near convergence honest z spread
~17 around +5 in digits, and 30% of honest chunks fell below -3. So the owner keeps, per peer, decayed sums of
the z it measured (`AlignmentRecord`, in `AlignmentEvidence`) and asks a one-sided t-test: is this peer's mean
alignment negative, by ALIGNMENT_T_SUSPECT standard errors (the spread pooled over every peer's deviations from
its own mean)? An honest member's mean is positive (its update and the others' estimate one mean), so this
practically never fires on it; a reversed one's is negative, and early in training, where honest z is ~+40 and
its own ~-40, it is distrusted after two measurements (MIN_ALIGNMENT_CHUNKS). It is cleared when its t rises above ALIGNMENT_T_CLEAR (hysteresis: near
convergence its t hovers around -2 with a decay of 0.98, and flickering in and out would let it pull half the
time).

A spot check (moshpeer/peer/accountability/) is the strongest evidence an owner has: it recomputed what the member
should have sent from the data assigned to it and found something else. A failed check distrusts the member at
once, and only a later check of it that passes clears it (`record_spot_check`); the table keeps at most
MAX_FAILED_CHECKS peers, the oldest forgotten first.

What this cannot do: tell a hostile member from an honest one whose data really differs (a non-IID
shard far from the others is flagged, then ignored, too), or defend against a hostile owner. Each owner
decides for its own part, from what it saw itself; nothing here travels over the network.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

from moshpeer.bounded_memory import remember

DECAY = 0.9
SUSPECT_SCORE = 1.5
SCORE_CAP = 2 * SUSPECT_SCORE
# What the constants above give for a member flagged in every chunk it contributes: 1.0, then 1.9.
SUSPECT_AFTER_ROUNDS = 2
REJECTED_EVIDENCE = SCORE_CAP  # a rejected chunk counts this many flagged ones (module docstring)
# The direction check (module docstring): evidence decays by this per round (a window of ~50 chunk measurements).
ALIGNMENT_DECAY = 0.98
ALIGNMENT_T_SUSPECT = -5.0
ALIGNMENT_T_CLEAR = -2.0
MIN_ALIGNMENT_CHUNKS = 1.5  # a peer's own decayed count of measured chunks before its mean is judged: two
MIN_POOLED_DOF = 3.0  # degrees of freedom of the pooled spread before anyone is judged
MAX_FAILED_CHECKS = 1024

logger = logging.getLogger(__name__)


@dataclass
class AlignmentRecord:
    """Sums over measured chunks of one member's alignment z (aggregation.alignments): how many, sum, sum of
    squares. Records of two all-reduces of a round add up; the tracker decays them per round."""

    chunks: float = 0.0
    total: float = 0.0
    squares: float = 0.0

    def add(self, z: Optional[float]) -> None:
        if z is not None and math.isfinite(z):
            self.chunks += 1
            self.total += z
            self.squares += z * z

    def __add__(self, other: "AlignmentRecord") -> "AlignmentRecord":
        return AlignmentRecord(self.chunks + other.chunks, self.total + other.total, self.squares + other.squares)

    def decayed(self, factor: float) -> "AlignmentRecord":
        return AlignmentRecord(self.chunks * factor, self.total * factor, self.squares * factor)

    @property
    def deviation_squares(self) -> float:
        """Sum of squared deviations from this record's own mean."""
        return max(self.squares - self.total * self.total / self.chunks, 0.0) if self.chunks > 0 else 0.0


@dataclass
class MemberEvidence:
    """What an owner saw of one member's contributions to its part in one all-reduce, or in a round's all-reduces
    added up with `+`: the SuspectTracker's input."""

    contributed: int = 0  # chunks of our part its contribution reached us in
    flagged: int = 0  # of those, chunks in which robust aggregation clipped, trimmed or rejected it
    rejected: int = 0  # of the flagged, chunks in which it was rejected (weighed at zero from the start)
    alignment: AlignmentRecord = field(default_factory=AlignmentRecord)  # "clipped" only: the direction check's

    def note(self, flagged: bool, rejected: bool, z: Optional[float]) -> None:
        """One chunk's verdict on this member (`aggregation.Combined`'s row)."""
        self.flagged += int(flagged)
        self.rejected += int(rejected)
        self.alignment.add(z)

    def __add__(self, other: "MemberEvidence") -> "MemberEvidence":
        return MemberEvidence(self.contributed + other.contributed, self.flagged + other.flagged,
                              self.rejected + other.rejected, self.alignment + other.alignment)

    @property
    def suspicion(self) -> float:
        """What this round adds to the member's suspicion score (module docstring); 0 when it contributed nothing."""
        if self.contributed <= 0:
            return 0.0
        flagged = min(self.flagged, self.contributed)
        rejected = min(self.rejected, flagged)
        return (flagged + (REJECTED_EVIDENCE - 1) * rejected) / self.contributed


class AlignmentEvidence:
    """One owner's decayed AlignmentRecord per peer, and the t statistic of each peer's mean alignment.

    Decay is lazy (a record is stored with the round it was last updated in), and the pooled spread is kept as
    running totals, so a round costs O(members) however many peers the owner has met: the simulator's owners
    meet hundreds."""

    FORGET_CHUNKS = 0.05  # a record decayed below this many chunks is forgotten (swept every SWEEP_ROUNDS)
    SWEEP_ROUNDS = 64

    def __init__(self, decay: float = ALIGNMENT_DECAY):
        self.decay = decay
        self.round = 0
        self._records: Dict[str, Tuple[int, AlignmentRecord]] = {}  # peer -> (round of the record, record)
        self._chunks = self._deviations = 0.0  # pooled over the records, as of `round`

    def next_round(self) -> None:
        self.round += 1
        self._chunks *= self.decay
        self._deviations *= self.decay
        if self.round % self.SWEEP_ROUNDS == 0:
            for peer in [p for p in self._records if self.current(p).chunks < self.FORGET_CHUNKS]:
                self._replace(peer, AlignmentRecord())
                del self._records[peer]

    def current(self, peer: str) -> AlignmentRecord:
        stamp, record = self._records.get(peer, (self.round, AlignmentRecord()))
        return record.decayed(self.decay ** (self.round - stamp)) if stamp != self.round else record

    def add(self, peer: str, record: AlignmentRecord) -> None:
        self._replace(peer, self.current(peer) + record)

    def _replace(self, peer: str, new: AlignmentRecord) -> None:
        old = self.current(peer)
        self._chunks += new.chunks - old.chunks
        self._deviations += new.deviation_squares - old.deviation_squares
        self._records[peer] = (self.round, new)

    def t(self, peer: str) -> Optional[float]:
        """The peer's mean alignment in pooled standard errors; None without enough evidence (module docstring)."""
        record = self.current(peer)
        dof = self._chunks - len(self._records)  # each peer's own mean takes one
        if record.chunks < MIN_ALIGNMENT_CHUNKS or dof < MIN_POOLED_DOF:
            return None
        variance = max(self._deviations / dof, 1.0)  # at least chance's spread (z ~ N(0, 1))
        return record.total / math.sqrt(record.chunks * variance)


class SuspectTracker:
    """Decaying suspicion scores per peer id, as seen by this peer as a part's owner (see the module docstring)."""

    def __init__(self, decay: float = DECAY, threshold: float = SUSPECT_SCORE, cap: float = SCORE_CAP,
                 warn: bool = True):
        """`warn`: a WARNING line names each new suspect (the simulator's thousands of owners turn it off)."""
        if not (0 <= decay < 1 and 0 < threshold <= cap):
            raise ValueError(f"need 0 <= decay < 1 and 0 < threshold <= cap; got {decay}, {threshold}, {cap}")
        self.decay, self.threshold, self.cap, self.warn = decay, threshold, cap, warn
        self._scores: Dict[str, float] = {}
        self._alignment = AlignmentEvidence()
        self._reversed: Set[str] = set()  # peers the direction check distrusts (kept until their t clears)
        self._failed_checks: Dict[str, None] = {}  # peers whose last spot check failed, oldest first

    def distrusted(self, peer_ids: Sequence[str]) -> List[int]:
        """Group indices (into `peer_ids`) whose contributions this owner should weigh at zero."""
        return [i for i, peer in enumerate(peer_ids)
                if self._scores.get(peer, 0.0) >= self.threshold or peer in self._reversed
                or peer in self._failed_checks]

    def alignment_t(self, peer_id: str) -> Optional[float]:
        """The direction check's t statistic of the peer's mean alignment (None: not enough evidence yet)."""
        return self._alignment.t(peer_id)

    def record_round(self, peer_ids: Sequence[str], evidence: Sequence[MemberEvidence]) -> List[str]:
        """Update the scores from one round (`evidence` per member index, as the peer's PartReducer counted it);
        -> the peers that became suspects in this round (a WARNING line names each). Members that contributed
        nothing keep their score (an absence is neither evidence for nor against them)."""
        became = self._record_alignment(peer_ids, [e.alignment for e in evidence])
        for peer, seen in zip(peer_ids, evidence):
            if seen.contributed <= 0:
                continue
            before = self._scores.get(peer, 0.0)
            score = min(self.decay * before + seen.suspicion, self.cap)
            if score < 0.01:  # forgotten: keeps the table to the peers that were flagged lately
                self._scores.pop(peer, None)
                continue
            self._scores[peer] = score
            if before < self.threshold <= score and peer not in became:
                self._warn(f"peer {peer[-8:]} is clipped round after round (suspicion score {score:.2f}): its "
                           f"contributions to our parts count for nothing until it behaves for a few rounds")
                became.append(peer)
        return became

    def _record_alignment(self, peer_ids: Sequence[str], alignment: Sequence[AlignmentRecord]) -> List[str]:
        self._alignment.next_round()
        for peer, record in zip(peer_ids, alignment):
            if record.chunks > 0:
                self._alignment.add(peer, record)
        became = []
        for peer in {p for p, r in zip(peer_ids, alignment) if r.chunks > 0}:
            t = self.alignment_t(peer)
            if t is None:
                continue
            if peer not in self._reversed and t <= ALIGNMENT_T_SUSPECT:
                self._reversed.add(peer)
                self._warn(f"peer {peer[-8:]} sends contributions opposed to the others' (alignment t {t:.1f}): "
                           f"they count for nothing until its alignment recovers")
                became.append(peer)
            elif peer in self._reversed and t >= ALIGNMENT_T_CLEAR:
                self._reversed.discard(peer)
        return sorted(became)

    def record_spot_check(self, peer_id: str, passed: bool) -> bool:
        """A spot check's verdict on `peer_id` (module docstring) -> whether it became distrusted by it now."""
        if passed:
            self._failed_checks.pop(peer_id, None)
            return False
        became = peer_id not in self._failed_checks
        remember(self._failed_checks, peer_id, limit=MAX_FAILED_CHECKS)
        if became:
            self._warn(f"peer {peer_id[-8:]} failed a spot check (what it sent is not what its assigned data gives): "
                       f"its contributions count for nothing until a later check passes")
        return became

    def _warn(self, message: str) -> None:
        if self.warn:
            logger.warning(message)

    def score(self, peer_id: str) -> float:
        """The peer's suspicion score (0 for a peer never flagged)."""
        return self._scores.get(peer_id, 0.0)

    @property
    def suspects(self) -> List[str]:
        """Peers currently weighed at zero."""
        # A copy first: other threads (the progress view) ask while the round thread records.
        flagged = {peer for peer, score in list(self._scores.items()) if score >= self.threshold}
        return sorted(flagged | set(self._reversed) | set(list(self._failed_checks)))
