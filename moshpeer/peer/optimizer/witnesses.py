"""Whose samples count: trainers that some peer this one averaged with saw average (issue 26: `sample_liar`).

A record's sample count is a claim. `SampleCredit` (sample_credit.py) bounds each claim by what a fast trainer
could have computed since the epoch began, but a trainer that never averages still counts as up to 4 median
trainers: with 4 honest peers, a liar claiming the target at every refresh would end every epoch in about half
its time, and its samples never reach the model. So a trainer's samples count toward the target only when
this peer has evidence that it takes part in the averaging:

- **witnessed**: its contribution to the part this peer owns reached this peer in one of its rounds of the
  last WINDOW_EPOCHS epochs (`RoundResult.contributors`: it came through the authenticated data plane, under
  the member's own key, so nobody can claim it for another peer);
- **vouched for**: a peer witnessed that way names it among the trainers it witnessed itself (the record's
  `witnessed` list, short tags of peer ids). One hop only: a record's list holds what its owner witnessed, never
  what it was told, so a liar that never averages needs a peer that averages with this one to vouch for it.
  One hop is what a large swarm needs: a group of g shows a peer g - 1 others per round, and their lists
  cover about (g - 1)^2 more.

This peer counts its own samples, always. Until it has witnessed averaging in rounds of MIN_ROUNDS epochs within
the window (the run's first epochs, a newcomer, a peer whose rounds all failed), it cannot tell and counts every
trainer, as before: a liar can then shorten such epochs within `SampleCredit`'s bound. Why two rounds: after its
first round, a peer and the peers it witnessed know the same group, so one hop adds nobody and it would count
only g of the swarm's trainers (in a swarm of 200 with groups of 16, epochs 12 times too long). Moshpit's next
round groups it along another grid axis: its new mates' records name their first groups, about g^2 peers in all,
the whole of a two-axis grid. A swarm beyond g^2 is counted in full a round or two later (records name up to
MAX_WITNESSED peers of the last WINDOW_EPOCHS epochs); until then its epochs last longer, never shorter.

What it costs honest peers: a newcomer's samples count from its first round on (its first epoch's samples
still reach the model through the round; only the epoch's end waits for the others' samples). A record carries
up to MAX_WITNESSED tags of WITNESS_TAG_BYTES (about 650 bytes), the most recently witnessed first.

A peer with no rounds of its own (a newcomer choosing a state donor) has no witnesses yet, but the records still
show who averaged with whom: `largest_witnessing_group` joins two peers when each names the other (one peer's
claim alone is not enough: a Sybil can name anyone, but an honest peer names only those whose contributions
reached it), and takes the largest group so joined. Sybils that never average with honest peers form their own
group; they win only with more identities than the honest trainers that averaged within the window (a tie
counts as no evidence). That is the bound of an open swarm where identities cost one key each.

This module decides; progress.py feeds it rounds and records and applies the result (no I/O here).
"""

from __future__ import annotations

import hashlib
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence

from moshpeer.dht import PeerRecord
from moshpeer.dht.records import MAX_WITNESSED, WITNESS_TAG_BYTES

# A witness counts for this many epochs after the round it was seen in: long enough for Moshpit's rotating
# groups to show a peer most of the swarm (directly or one hop away), short enough that a peer that stops
# averaging stops counting soon after.
WINDOW_EPOCHS = 8
MAX_TRACKED = 4096  # peers remembered (the most recently witnessed kept)
MIN_ROUNDS = 2  # rounds (distinct epochs within the window) before the evidence is used (module docstring)


def witness_tag(peer_id: str) -> bytes:
    """The short name a record uses for a witnessed peer (collisions cost an attacker ~2^64 identities)."""
    return hashlib.blake2b(peer_id.encode(), digest_size=WITNESS_TAG_BYTES, person=b"moshpeer-witness").digest()


class TrainerWitnesses:
    """Which trainers this peer has seen average, and which of the others' samples it counts (module docstring).

    Deterministic: the epochs are parameters, there is no clock.
    """

    def __init__(self, window_epochs: int = WINDOW_EPOCHS, max_tracked: int = MAX_TRACKED):
        self.window_epochs, self.max_tracked = window_epochs, max_tracked
        self._last_seen: Dict[str, int] = {}  # peer id -> epoch of the last round its contribution reached us
        self._round_epochs: List[int] = []  # the epochs of its last rounds that someone contributed to

    def note_round(self, epoch: int, contributors: Iterable[str]) -> None:
        """The peers whose contributions reached this peer in its round of `epoch`."""
        contributors = list(contributors)
        if contributors and epoch not in self._round_epochs:
            self._round_epochs = sorted(self._round_epochs + [epoch])[-MIN_ROUNDS:]
        for peer_id in contributors:
            self._last_seen[peer_id] = max(epoch, self._last_seen.get(peer_id, epoch))
        if len(self._last_seen) > self.max_tracked:
            recent = sorted(self._last_seen.items(), key=lambda kv: -kv[1])[:self.max_tracked]
            self._last_seen = dict(recent)

    def witnessed(self, epoch: int) -> List[str]:
        """Peer ids witnessed within the window before `epoch`, the most recent first."""
        live = [(seen, peer_id) for peer_id, seen in self._last_seen.items() if seen > epoch - self.window_epochs]
        return [peer_id for _, peer_id in sorted(live, reverse=True)]

    def tags(self, epoch: int) -> List[bytes]:
        """What this peer's record says it witnessed (`PeerRecord.witnessed`)."""
        return [witness_tag(peer_id) for peer_id in self.witnessed(epoch)[:MAX_WITNESSED]]

    def corroborated(self, records: Sequence[PeerRecord], epoch: int) -> Optional[FrozenSet[str]]:
        """The peers this peer has evidence for at `epoch`: witnessed, or named by the record of a witnessed peer
        among `records`. None until it has witnessed rounds of MIN_ROUNDS epochs within the window (it cannot
        tell yet)."""
        if sum(seen > epoch - self.window_epochs for seen in self._round_epochs) < MIN_ROUNDS:
            return None
        direct = frozenset(self.witnessed(epoch))
        vouched = {tag for r in records if r.peer_id in direct for tag in r.witnessed}
        return direct | {r.peer_id for r in records if witness_tag(r.peer_id) in vouched}

    def evidence(self, records: Sequence[PeerRecord], epoch: int) -> Optional[FrozenSet[str]]:
        """`corroborated` once this peer has witnessed enough rounds; before, `largest_witnessing_group` of the
        records; None when neither can tell. What a state download asks first."""
        found = self.corroborated(records, epoch)
        return found if found is not None else largest_witnessing_group(records)

    def uncounted(self, records: Sequence[PeerRecord], *, own_peer_id: str, epoch: int) -> FrozenSet[str]:
        """The trainers among `records` whose samples this peer does not count at `epoch`: not `corroborated`.
        Empty while `corroborated` cannot tell."""
        corroborated = self.corroborated(records, epoch)
        if corroborated is None:
            return frozenset()
        return frozenset(r.peer_id for r in records
                         if r.role == "trainer" and r.peer_id != own_peer_id and r.peer_id not in corroborated)


def largest_witnessing_group(records: Sequence[PeerRecord]) -> Optional[FrozenSet[str]]:
    """The largest group of peers among `records` joined by mutual witnessing (each names the other), or None when
    no two peers name each other or two groups tie for the largest (module docstring)."""
    by_tag = {witness_tag(r.peer_id): r.peer_id for r in records}
    named = {r.peer_id: {by_tag[tag] for tag in r.witnessed if tag in by_tag} for r in records}
    neighbours: Dict[str, List[str]] = {peer_id: [] for peer_id in named}
    for peer_id, others in named.items():
        for other in others:
            if other != peer_id and peer_id in named.get(other, ()):
                neighbours[peer_id].append(other)
    groups: List[FrozenSet[str]] = []
    seen: set = set()
    for start in neighbours:
        if start in seen or not neighbours[start]:
            continue
        group, frontier = {start}, [start]
        while frontier:
            for other in neighbours[frontier.pop()]:
                if other not in group:
                    group.add(other)
                    frontier.append(other)
        seen |= group
        groups.append(frozenset(group))
    groups.sort(key=len, reverse=True)
    if not groups or (len(groups) > 1 and len(groups[0]) == len(groups[1])):
        return None
    return groups[0]
