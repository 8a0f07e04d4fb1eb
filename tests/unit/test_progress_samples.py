"""Sample counts judged from what the reader witnessed (issue 26, `sample_liar`): a simulated swarm seen by one
reader, refreshed every 0.5 s on a fake clock, through the same steps as `SwarmProgress._fetch` and `snapshot`
(EpochCredit, SampleCredit, summarize)."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from moshpeer.dht import PeerRecord
from moshpeer.peer.optimizer.epoch_credit import EpochCredit
from moshpeer.peer.optimizer.progress import ProgressSnapshot, summarize
from moshpeer.peer.optimizer.sample_credit import RATE_FACTOR, START_SLACK_S, SampleCredit

REFRESH_S = 0.5
SWITCH_S = 5.0  # the honest peers enter epoch 10 from here on (they were at epoch 9 before)


def peer_id(k: int) -> str:
    return "Qm" + f"{k:06d}".translate(str.maketrans("0123456789", "abcdefghij")) * 7


def trainer(k: int, epoch: int, samples: int, rate: float) -> PeerRecord:
    return PeerRecord(peer_id=peer_id(k), role="trainer", epoch=epoch, samples_accumulated=samples,
                      samples_per_second=rate, version="test", protocol=2, started_at=0.0, updated_at=0.0)


class Reader:
    """One peer's view across refreshes; `cap=False` is the view without SampleCredit (main before issue 26)."""

    def __init__(self, target: int, cap: bool = True):
        self.target, self.epochs = target, EpochCredit()
        self.samples = SampleCredit() if cap else None

    def view(self, records: List[PeerRecord], own: PeerRecord, now: float) -> ProgressSnapshot:
        credited = self.epochs.apply(records, own.peer_id, now=now)
        capped = {}
        if self.samples is not None:
            credited = self.samples.apply(credited, own=own, swarm_epoch=self.epochs.swarm_epoch, now=now)
            capped = self.samples.capped
        return summarize(credited, own=own, target_batch_size=self.target, now=now,
                         max_epoch=self.epochs.swarm_epoch, capped=capped)


@dataclass
class Honest:
    """A trainer computing at `rate` with jitter from `enters` on (epoch 10), at epoch 9 with 0 samples before."""

    k: int
    rate: float
    enters: float
    samples: float = 0.0

    def record(self, now: float, rng: random.Random) -> PeerRecord:
        if now < self.enters:
            return trainer(self.k, 9, 0, self.rate)
        self.samples += self.rate * min(REFRESH_S, now - self.enters) * rng.uniform(0.6, 1.4)
        return trainer(self.k, 10, int(self.samples), self.rate * rng.uniform(0.8, 1.2))


def run(reader: Reader, honest: List[Honest], own_rate: float, others: Callable[[float], List[PeerRecord]] = lambda now: [],
        seed: int = 0, until: float = 60.0) -> Tuple[float, int]:
    """Refresh until the reader's view of epoch 10 is ready: (seconds after SWITCH_S, samples capped then)."""
    rng = random.Random(seed)
    own = Honest(0, own_rate, SWITCH_S + REFRESH_S)  # the reader's own round ended a refresh after the first
    now = 0.0
    while now < until:
        now += REFRESH_S
        mine = own.record(now, rng)
        snapshot = reader.view([h.record(now, rng) for h in honest] + others(now), mine, now)
        if snapshot.global_epoch == 10 and snapshot.ready:
            return now - SWITCH_S, snapshot.samples_capped
    raise AssertionError("the epoch never ended")


def honest_swarm(rates, spread: float = REFRESH_S, seed: int = 0) -> List[Honest]:
    rng = random.Random(seed)
    return [Honest(k, rate, SWITCH_S + rng.uniform(0.0, spread)) for k, rate in enumerate(rates, start=1)]


def liar(now: float, epoch: Optional[int] = None, target: int = 400) -> PeerRecord:
    """Claims the whole target at the swarm's epoch, at every refresh, and a huge speed."""
    return trainer(99, epoch if epoch is not None else (10 if now >= SWITCH_S else 9), target, 1e6)


def test_a_liar_claiming_the_target_every_refresh_cannot_end_the_epoch_at_once():
    """Four honest trainers at 10 samples/s need 10 s for 400 samples. Without the cap the liar ends the epoch at
    the first refresh; with it, the liar counts as at most RATE_FACTOR median trainers: the epoch lasts at least
    10 s x 4 / (4 + RATE_FACTOR), less START_SLACK_S."""
    target, rates = 400, [10.0, 10.0, 10.0]
    honest_epoch = target / (10.0 * (len(rates) + 1))
    uncapped, _ = run(Reader(target, cap=False), honest_swarm(rates), 10.0, others=lambda now: [liar(now)])
    assert uncapped <= 2 * REFRESH_S  # the attack, as on main: the epoch ends as soon as the reader sees it begin
    capped, refused = run(Reader(target), honest_swarm(rates), 10.0, others=lambda now: [liar(now)])
    assert capped >= honest_epoch * 4 / (4 + RATE_FACTOR) - START_SLACK_S
    assert capped < honest_epoch  # the liar still counts, within the factor
    assert refused > 0  # and the view says how much it refused


def test_honest_jittery_swarms_end_at_the_same_refresh_with_and_without_the_cap():
    """Jittery rates (+-40 % per refresh, declared +-20 %), one trainer 3x faster than the median, peers entering
    the epoch up to 1.5 s before the reader: the cap refuses nothing and changes nothing."""
    for seed in range(20):
        rates = [8.0, 11.0, 30.0, 9.5]
        plain = run(Reader(600, cap=False), honest_swarm(rates, spread=1.5, seed=seed), 10.0, seed=seed)
        capped = run(Reader(600), honest_swarm(rates, spread=1.5, seed=seed), 10.0, seed=seed)
        assert capped == plain and capped[1] == 0, seed


def test_a_trainer_10x_faster_than_the_reader_is_not_capped_in_a_swarm_of_two():
    """The upper median of two rates is the faster one: a slow reader believes its one fast partner (a swarm of
    two has no majority to judge by), and both views end the epoch at the same refresh."""
    plain = run(Reader(1000, cap=False), honest_swarm([100.0]), 10.0)
    assert run(Reader(1000), honest_swarm([100.0]), 10.0) == plain and plain[1] == 0


def test_a_newcomer_mid_epoch_counts_in_full_and_a_fresh_liar_does_not():
    """A trainer first seen 4 s into the epoch, counting from 0 at a fast 25 samples/s: counted in full, the epoch
    ends at the same refresh. A fresh identity first seen at the same time claiming the target is capped to what
    a RATE_FACTOR x median trainer could have done since the reader saw the epoch begin."""
    joins = SWITCH_S + 4.0
    newcomer = Honest(50, 25.0, joins)

    def late(now: float) -> List[PeerRecord]:
        return [newcomer.record(now, random.Random(int(now * 10)))] if now >= joins else []

    plain = run(Reader(500, cap=False), honest_swarm([10.0, 10.0]), 10.0, others=late)
    newcomer.samples = 0.0
    assert run(Reader(500), honest_swarm([10.0, 10.0]), 10.0, others=late) == plain

    reader, own = Reader(10_000), None
    for now in (1.0, 1.5, 2.0):  # the reader sees the swarm enter epoch 10 at 2.0 s
        epoch = 9 if now < 2.0 else 10
        own = trainer(0, epoch, 0, 10.0)
        reader.view([trainer(k, epoch, 0, 10.0) for k in (1, 2)], own, now)
    own = trainer(0, 10, 60, 10.0)
    seen = reader.view([trainer(k, 10, 60, 10.0) for k in (1, 2)] + [liar(8.0, epoch=10, target=10_000)], own, 8.0)
    allowed = int(RATE_FACTOR * 10.0 * (8.0 - 2.0 + START_SLACK_S))
    assert seen.samples_accumulated == 3 * 60 + allowed
    assert seen.samples_capped == 10_000 - allowed


def test_a_claim_for_the_next_epoch_counts_nothing_extra_when_the_reader_gets_there():
    """A liar sits at swarm epoch + 1 with the target (credited: one epoch ahead is plausible). When the reader's
    own epoch moves there, the liar's claim counts only START_SLACK_S of a RATE_FACTOR x median trainer."""
    reader = Reader(400)
    for now in (0.5, 1.0, 1.5):
        reader.view([trainer(1, 9, 0, 10.0), trainer(2, 9, 0, 10.0), liar(now, epoch=10)], trainer(0, 9, 0, 10.0),
                    now)
    for now in (20.0, 20.5):  # much later the reader ends its epoch: the liar was "at 10" for 19 s
        seen = reader.view([trainer(1, 9, 90, 10.0), trainer(2, 10, 0, 10.0), liar(now, epoch=10)],
                           trainer(0, 10, 0, 10.0), now)
    assert seen.global_epoch == 10 and not seen.ready
    assert seen.samples_accumulated <= RATE_FACTOR * 10.0 * (REFRESH_S + START_SLACK_S)


def test_a_newcomer_reader_does_not_cap_the_epoch_it_did_not_see_begin():
    """The reader's first view of the swarm is mid-epoch: it cannot tell what honest peers gathered, so it
    believes the counts (a cap would starve them and make it miss the round); the next epoch is judged."""
    reader = Reader(1000)
    seen = reader.view([trainer(k, 40, 300, 10.0) for k in (1, 2, 3)], trainer(0, 40, 0, 0.0), 1.0)
    assert seen.samples_accumulated == 900 and seen.samples_capped == 0
    seen = reader.view([trainer(k, 41, 300, 10.0) for k in (1, 2, 3)], trainer(0, 41, 0, 0.0), 1.5)
    assert seen.global_epoch == 41 and seen.samples_capped > 0


def test_caps_are_logged_once_per_peer_per_epoch(caplog):
    reader = Reader(400)
    with caplog.at_level(logging.INFO, logger="moshpeer.peer.optimizer.sample_credit"):
        for k in range(40):
            now = 0.5 * (k + 1)
            epoch = 9 if now < 5.0 else (10 if now < 12.0 else 11)
            reader.view([trainer(1, epoch, 5, 10.0), trainer(2, epoch, 5, 10.0), liar(now, epoch=epoch)],
                        trainer(0, epoch, 5, 10.0), now)
    lines = [r.getMessage() for r in caplog.records if "claims at epoch" in r.getMessage()]
    assert len(lines) == 2 and "epoch 10" in lines[0] and "epoch 11" in lines[1]


def test_memory_is_bounded():
    """Fresh identities at every refresh: at most `max_tracked` peers are remembered, and a peer not seen for
    `forget_s` is forgotten."""
    credit = SampleCredit(max_tracked=50, forget_s=10.0)
    own = trainer(0, 10, 0, 10.0)
    for step in range(100):
        records = [trainer(1000 + step * 7 + i, 10, 5, 10.0) for i in range(7)]
        credit.apply(records, own=own, swarm_epoch=10, now=float(step))
        assert credit.tracked <= 50
    credit.apply([trainer(1, 10, 5, 10.0)], own=own, swarm_epoch=10, now=200.0)
    assert credit.tracked == 1  # everyone else was last seen more than 10 s ago


def test_a_peer_seen_computing_slowly_cannot_jump_to_the_target():
    """A trainer watched gaining 10 samples/s for 3 s that jumps to the target at the next refresh (a turncoat, or a
    bug) is capped: nobody here was seen computing anywhere near that fast."""
    reader = Reader(1000)
    aux = PeerRecord(peer_id=peer_id(0), role="aux", epoch=9, version="test", protocol=2, started_at=0.0,
                     updated_at=0.0)
    reader.view([trainer(k, 9, 0, 10.0) for k in (1, 2, 3)], aux, 0.5)
    for step in range(7):  # the reader (an aux peer: no rate of its own) sees them enter epoch 10 at 1.0 s
        now = 1.0 + REFRESH_S * step
        seen = reader.view([trainer(k, 10, 5 * step, 0.0) for k in (1, 2, 3)], aux.updated(epoch=10), now)
    assert seen.samples_accumulated == 3 * 30 and seen.samples_capped == 0
    now += REFRESH_S  # the declared speeds are 0: the reference is the growth the reader watched, 10 samples/s
    seen = reader.view([trainer(1, 10, 1000, 0.0)] + [trainer(k, 10, 35, 0.0) for k in (2, 3)], aux.updated(epoch=10),
                       now)
    allowed = int(RATE_FACTOR * 10.0 * (now - 1.0 + START_SLACK_S))
    assert seen.samples_accumulated == allowed + 2 * 35 and seen.samples_capped == 1000 - allowed


def test_older_copies_from_a_lagging_replica_do_not_cap_an_honest_peer():
    """A DHT read may return an older copy of a record (the previous epoch, or fewer samples). Taken for a restart
    of the peer's count, it would cap the honest count that the next read shows again (to what 2.5 s allow)."""
    credit, own = SampleCredit(), trainer(0, 10, 0, 10.0)
    credit.apply([trainer(1, 9, 0, 30.0)], own=own.updated(epoch=9), swarm_epoch=9, now=0.5)
    reads = [(1.0, 10, 0), (15.0, 10, 420), (15.5, 9, 0), (16.0, 10, 450), (16.5, 10, 300), (17.0, 10, 480)]
    for now, epoch, samples in reads:  # 30 samples/s from 1.0 s on, and two stale copies
        credited = credit.apply([trainer(1, epoch, samples, 30.0)], own=own, swarm_epoch=10, now=now)
        assert credited[0].samples_accumulated == samples and not credit.capped, now
