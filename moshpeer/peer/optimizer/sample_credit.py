"""Sample counts judged from what this peer witnessed (issue 26: the `sample_liar` attack).

Every trainer's record says how many samples it gathered toward the current epoch, and the swarm's progress is
their sum (progress.py). A hostile peer that claims the whole target batch at every refresh would end every
epoch early for everybody, so this peer believes a record's count only up to what that peer could have computed
since the epoch began, as this peer saw it happen, on its own monotonic clock:

    credible = min(declared, RATE_FACTOR x reference rate x (now - start + START_SLACK_S))

- the **reference rate** is the upper median, over the trainers this peer sees (itself included), of each
  trainer's rate: the faster of its declared `samples_per_second` and the increase of its count over the time
  this peer watched it grow within one epoch (at least MIN_RATE_SPAN_S of watching). The faster, because a
  trainer that waits for its round (its count flat at the end of an epoch) or whose meter has not filled yet
  is not slow, and a reference pulled down would cap honest peers. Fewer than half of the trainers cannot
  raise it above the fastest honest rate, however fast they claim or appear to be, nor lower it below the
  slowest; the upper median (as for the swarm epoch) leans to the faster half, so that honest peers
  faster than most are capped later. With only two trainers, the other one sets it: a swarm of two has
  no majority. A peer's own rate never raises its own cap:
  a liar can fake a steady climb from 0 to the target as cheaply as a jump, and a cap that followed a peer's
  believed rate with a factor would let a careful liar multiply its allowance at every refresh;
- **start** is when this peer's view entered that epoch (its own epoch or the swarm epoch rose by one at a
  refresh) or, if later, the last time it saw that trainer at an earlier epoch: the count cannot have
  started growing before. A record at an epoch this peer's
  view has not entered yet has had no time at all (a liar claiming the target at swarm epoch + 1 counts
  nothing extra the moment this peer moves there).

What each constant allows, and why:

- RATE_FACTOR (4): an honest trainer counts in full while it computes at most 4x the median trainer's rate.
  The averaging already weighs a declared weight at most 2x the group's median, so the samples of a peer
  faster than that barely reach the model in proportion anyway; 4 leaves that much again for jittery
  rates. A liar counts as at most 4 median trainers: with n honest peers of rate r, an epoch of length L
  lasts at least L x n / (n + 4) (less START_SLACK_S).
- START_SLACK_S (2 s): honest trainers enter an epoch before this peer's view does (their group's round ended
  first, a refresh every 0.5 s, a DHT store and read); 2 s of head start at 4x the median rate covers that,
  and it is all a record first seen at the very start of an epoch is allowed.
- A peer first seen mid-epoch (it just joined, or this peer's DHT read missed it) counts what a 4x-median
  trainer could have computed since this peer's view entered the epoch: an honest newcomer within the factor,
  which started from 0 when it joined, is not capped; a fresh identity per epoch gains nothing over a
  persistent liar.
- Nothing is capped in an epoch whose start this peer did not witness: its first view of the swarm (a
  newcomer), a view that rose by more than one epoch at once (catching up), or a swarm in which nobody
  computes at any rate yet. Then the caps could only starve honest peers, whose counts it cannot judge.

Memory: at most MAX_TRACKED peers, each with its last HISTORY sightings; a peer not seen for FORGET_S is
forgotten (a returning one is judged like a peer first seen).

This module decides; progress.py feeds it the records it fetched and applies the result (no I/O here).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from moshpeer.dht import PeerRecord

logger = logging.getLogger(__name__)

RATE_FACTOR = 4.0
START_SLACK_S = 2.0
# A rate witnessed over less time is noise: progress is published at most every 0.2 s, in whole micro-batches.
MIN_RATE_SPAN_S = 1.0
HISTORY = 8  # sightings kept per peer: 4 s of watching at the default refresh of 0.5 s
MAX_TRACKED = 1024
FORGET_S = 120.0
KEEP_EPOCHS = 4  # when this peer's view entered each of its last few epochs


@dataclass
class _Witness:
    """What this peer saw of one trainer: its epoch, and (seen_at, samples) at that epoch, oldest first."""

    epoch: int
    last_seen: float
    restarted_at: Optional[float] = None  # last sighting before its current count began
    sightings: Deque[Tuple[float, int]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    logged_epoch: Optional[int] = None  # the epoch whose cap was last logged (once per peer per epoch)

    def see(self, record: PeerRecord, now: float) -> None:
        """Add a sighting; at a new epoch its count restarted after the last sighting. A copy older than one
        already seen (a lower epoch, or fewer samples at the same epoch: a DHT replica that has not caught up)
        is skipped: taken for a restart, it would cap the honest count that the next read shows again."""
        if record.epoch < self.epoch or (record.epoch == self.epoch and self.sightings
                                         and record.samples_accumulated < self.sightings[-1][1]):
            return
        if record.epoch > self.epoch:
            self.restarted_at, self.epoch = self.last_seen, record.epoch
            self.sightings.clear()
        self.sightings.append((now, record.samples_accumulated))
        self.last_seen = now

    def rate(self, declared: float) -> float:
        """Samples per second: the faster of `declared` and its count's growth within its epoch as witnessed
        (only `declared` until watched for MIN_RATE_SPAN_S)."""
        (t0, s0), (t1, s1) = self.sightings[0], self.sightings[-1]
        return max(declared, (s1 - s0) / (t1 - t0)) if t1 - t0 >= MIN_RATE_SPAN_S else declared


class SampleCredit:
    """How many of each trainer's claimed samples this peer believes, across refreshes (module docstring).

    `apply` is deterministic given its arguments (the clock is a parameter); `capped` holds, after each call,
    the samples it refused per peer id.
    """

    def __init__(self, *, factor: float = RATE_FACTOR, slack_s: float = START_SLACK_S,
                 max_tracked: int = MAX_TRACKED, forget_s: float = FORGET_S):
        self.factor, self.slack_s = factor, slack_s
        self.max_tracked, self.forget_s = max_tracked, forget_s
        self._peers: Dict[str, _Witness] = {}
        self._level: Optional[int] = None  # the epoch this peer's view was at (own or swarm epoch, the higher)
        self._opened: Dict[int, float] = {}  # epoch -> when the view entered it, if it saw that happen
        self.capped: Dict[str, int] = {}

    @property
    def tracked(self) -> int:
        """How many peers it remembers (bounded by `max_tracked`)."""
        return len(self._peers)

    def apply(self, records: Sequence[PeerRecord], *, own: PeerRecord, swarm_epoch: Optional[int],
              now: float) -> Tuple[PeerRecord, ...]:
        """`records` (already epoch-credited) with each other trainer's `samples_accumulated` lowered to what is
        credible; `own` (this peer's live record) is trusted and its DHT copy in `records` left as is.
        `swarm_epoch` is the view's swarm epoch (`EpochCredit.swarm_epoch`; None before it saw another peer,
        and then nothing is capped). Never raises on odd records: a count it cannot judge is left alone."""
        self._enter(swarm_epoch, own.epoch, now)
        trainers = [r for r in records if r.role == "trainer" and r.peer_id != own.peer_id]
        for record in trainers:
            witness = self._peers.get(record.peer_id)
            if witness is None:
                witness = self._peers[record.peer_id] = _Witness(epoch=record.epoch, last_seen=now)
            witness.see(record, now)
        reference = self._reference_rate(trainers, own)
        judged = {r.peer_id for r in trainers}
        self.capped = {}
        credited: List[PeerRecord] = []
        for record in records:
            limit = self._limit(record, reference, now) if record.peer_id in judged else None
            if limit is not None and record.samples_accumulated > limit:
                self._note(record, limit)
                record = record.model_copy(update={"samples_accumulated": limit})
            credited.append(record)
        self._forget(now)
        return tuple(credited)

    def _enter(self, swarm_epoch: Optional[int], own_epoch: int, now: float) -> None:
        """Remember when the view entered its epoch, if it saw that happen (a rise by exactly one)."""
        if swarm_epoch is None:  # no view of the swarm yet: nothing witnessed (a newcomer alone)
            return
        level = max(swarm_epoch, own_epoch)
        if self._level is not None and level == self._level + 1:
            self._opened.setdefault(level, now)  # a view that fell back and rose again keeps the first time
        self._level = level
        self._opened = {epoch: at for epoch, at in self._opened.items() if epoch > level - KEEP_EPOCHS}

    def _reference_rate(self, trainers: Sequence[PeerRecord], own: PeerRecord) -> float:
        """The upper median of the trainers' rates (module docstring), this peer's own included; 0 if nobody
        computes at any rate."""
        rates = [self._peers[r.peer_id].rate(r.samples_per_second) for r in trainers]
        if own.role == "trainer":
            rates.append(own.samples_per_second)  # local, not a claim
        rates = sorted(rate for rate in rates if rate > 0)
        return rates[len(rates) // 2] if rates else 0.0

    def _limit(self, record: PeerRecord, reference: float, now: float) -> Optional[int]:
        """The most samples `record` may count now; None when this peer cannot judge (module docstring)."""
        if reference <= 0 or self._level is None:
            return None
        opened = now if record.epoch > self._level else self._opened.get(record.epoch)
        if opened is None:  # the view never saw this epoch begin: it cannot tell what honest peers gathered
            return None
        restarted = self._peers[record.peer_id].restarted_at
        start = opened if restarted is None else max(opened, restarted)
        return int(self.factor * reference * (now - start + self.slack_s))

    def _note(self, record: PeerRecord, limit: int) -> None:
        """Count the refusal; log it once per peer per epoch (not at every refresh)."""
        self.capped[record.peer_id] = record.samples_accumulated - limit
        witness = self._peers[record.peer_id]
        if witness.logged_epoch != record.epoch:
            witness.logged_epoch = record.epoch
            logger.info(f"counting {limit} of the {record.samples_accumulated} samples {record.peer_id[-8:]} "
                        f"claims at epoch {record.epoch}: more than {self.factor:g}x the swarm's median rate "
                        f"allows since this peer saw the epoch begin")

    def _forget(self, now: float) -> None:
        """Drop peers not seen for `forget_s`, then the least recently seen beyond `max_tracked`."""
        live = sorted(((w.last_seen, peer_id) for peer_id, w in self._peers.items()
                       if now - w.last_seen <= self.forget_s), reverse=True)
        keep = {peer_id for _, peer_id in live[:self.max_tracked]}
        self._peers = {peer_id: w for peer_id, w in self._peers.items() if peer_id in keep}
