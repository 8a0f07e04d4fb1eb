"""Whose samples count (issue 26, `sample_liar`): trainers this peer, or a peer it averaged with, saw average
(witnesses.py). One reader's view, refreshed every 0.5 s on a fake clock through the steps of
`SwarmProgress._fetch` and `snapshot` (EpochCredit, SampleCredit, TrainerWitnesses, summarize)."""

from __future__ import annotations

from typing import List, Optional

from moshpeer.dht import PeerRecord
from moshpeer.dht.records import MAX_WITNESSED
from moshpeer.peer.optimizer.epoch_credit import EpochCredit
from moshpeer.peer.optimizer.progress import summarize
from moshpeer.peer.optimizer.sample_credit import SampleCredit
from moshpeer.peer.optimizer.witnesses import MIN_ROUNDS, WINDOW_EPOCHS, TrainerWitnesses, witness_tag

REFRESH_S = 0.5
RATE = 10.0  # samples per second of every honest trainer
TARGET = 400
LIAR = 99


def peer_id(k: int) -> str:
    return "Qm" + f"{k:06d}".translate(str.maketrans("0123456789", "abcdefghij")) * 7


def trainer(k: int, epoch: int, samples: int, rate: float = RATE, witnessed=()) -> PeerRecord:
    return PeerRecord(peer_id=peer_id(k), role="trainer", epoch=epoch, samples_accumulated=samples,
                      samples_per_second=rate, version="test", protocol=4, started_at=0.0, updated_at=0.0,
                      witnessed=[witness_tag(peer_id(j)) for j in witnessed])


def averaged_twice(witnesses: TrainerWitnesses, peer_ids) -> None:
    """The reader's rounds of epochs 8 and 9 reached it from `peer_ids` (MIN_ROUNDS rounds: its evidence counts)."""
    for epoch in range(10 - MIN_ROUNDS, 10):
        witnesses.note_round(epoch, peer_ids)


def epoch_seconds(witnesses: Optional[TrainerWitnesses], honest: List[int], *, liars=(LIAR,),
                  vouches=None, epoch: int = 10) -> float:
    """Seconds until the reader (peer 0) sees `epoch` ready: it and `honest` compute at RATE from 0 s (all entered
    `epoch` together; the view saw it begin); each liar claims the target at every refresh. `vouches[k]` is what
    honest peer k's record says it witnessed."""
    vouches = vouches or {}
    epochs, credit = EpochCredit(), SampleCredit()
    before = [trainer(k, epoch - 1, 0, witnessed=vouches.get(k, ())) for k in [0, *honest]]
    epochs.apply(before, peer_id(0), now=0.0)
    credit.apply(before, own=before[0], swarm_epoch=epochs.swarm_epoch, now=0.0)
    now = 0.0
    while now < 120.0:
        now += REFRESH_S
        samples = int(RATE * now)
        records = [trainer(k, epoch, samples, witnessed=vouches.get(k, ())) for k in [0, *honest]]
        records += [trainer(k, epoch, TARGET, rate=1e6) for k in liars]
        own = records[0]
        credited = epochs.apply(records, own.peer_id, now=now)
        credited = credit.apply(credited, own=own, swarm_epoch=epochs.swarm_epoch, now=now)
        uncounted = (witnesses.uncounted(credited, own_peer_id=own.peer_id, epoch=epoch) if witnesses is not None
                     else frozenset())
        view = summarize(credited, own=own, target_batch_size=TARGET, now=now, max_epoch=epochs.swarm_epoch,
                         uncounted=uncounted, capped=credit.capped)
        if view.global_epoch == epoch and view.ready:
            return now
    raise AssertionError("the epoch never ended")


def test_a_liar_that_never_averages_ends_no_epoch():
    """Four honest trainers at 10 samples/s need 10 s for 400 samples. On main (SampleCredit only) a liar that
    claims the target at every refresh counts as up to 4 median trainers (the epoch ends in about half the time);
    once the reader has averaged with the honest peers, it counts nothing."""
    honest = [1, 2, 3]
    honest_epoch = TARGET / (RATE * (len(honest) + 1))
    assert epoch_seconds(None, honest) < 0.8 * honest_epoch  # the attack as SampleCredit alone leaves it
    witnesses = TrainerWitnesses()
    averaged_twice(witnesses, [peer_id(k) for k in honest])
    assert epoch_seconds(witnesses, honest) == honest_epoch


def test_a_hundred_fake_trainers_do_not_shrink_the_honest_share():
    witnesses = TrainerWitnesses()
    averaged_twice(witnesses, [peer_id(1)])
    fakes = [trainer(100 + k, 10, 0) for k in range(100)]
    records = [trainer(0, 10, 0), trainer(1, 10, 0), *fakes]
    uncounted = witnesses.uncounted(records, own_peer_id=peer_id(0), epoch=10)
    view = summarize(tuple(records), own=records[0], target_batch_size=TARGET, now=0.0, uncounted=uncounted)
    assert view.contributing_trainers == 2  # each honest peer's share stays target / 2, not target / 102


def test_a_trainer_counts_when_a_peer_the_reader_averaged_with_vouches_for_it():
    """The reader averaged with peer 1 only; peer 1 averaged with peers 2 and 3 and says so: all four count,
    and the epoch ends when the honest samples reach the target."""
    witnesses = TrainerWitnesses()
    averaged_twice(witnesses, [peer_id(1)])
    honest_epoch = TARGET / (RATE * 4)
    assert epoch_seconds(witnesses, [1, 2, 3], vouches={1: [0, 2, 3]}) == honest_epoch
    # Without the vouch, peers 2 and 3 wait for their first round with the reader: the epoch takes twice as long.
    assert epoch_seconds(witnesses, [1, 2, 3], liars=()) == 2 * honest_epoch


def test_a_vouch_counts_only_from_a_peer_the_reader_witnessed():
    """The liar names its fellow liar; nobody the reader averaged with does: neither counts."""
    witnesses = TrainerWitnesses()
    averaged_twice(witnesses, [peer_id(1), peer_id(2), peer_id(3)])
    records = [trainer(0, 10, 0), trainer(1, 10, 0), trainer(LIAR, 10, TARGET, witnessed=[LIAR + 1]),
               trainer(LIAR + 1, 10, TARGET, witnessed=[LIAR])]
    assert witnesses.uncounted(records, own_peer_id=peer_id(0), epoch=10) == {peer_id(LIAR), peer_id(LIAR + 1)}


def test_fake_records_outnumbering_the_honest_ones_do_not_raise_the_epoch():
    """Four fresh identities claim ever higher epochs against three honest trainers at epoch 10. Without witnesses
    (main before this change) they are the upper median and raise the reader's view by about 10 epochs per
    second; once the reader has averaged with the honest peers, the fakes' epochs do not count."""
    def view_after(witnesses: Optional[TrainerWitnesses], seconds: float) -> int:
        credit = EpochCredit()
        now, view = 0.0, None
        while now < seconds:
            now += REFRESH_S
            records = [trainer(k, 10, 0) for k in (0, 1, 2)]
            records += [trainer(100 + k, 10 + int(20 * now), 0) for k in range(4)]
            unwitnessed = (witnesses.uncounted(records, own_peer_id=peer_id(0), epoch=10) if witnesses is not None
                           else frozenset())
            credited = credit.apply(records, peer_id(0), now=now, uncorroborated=unwitnessed)
            view = summarize(credited, own=records[0], target_batch_size=TARGET, now=now,
                             max_epoch=credit.swarm_epoch, uncounted=unwitnessed)
        return view.global_epoch

    assert view_after(None, 5.0) >= 10 + 40  # the attack: about 10 epochs per second
    witnesses = TrainerWitnesses()
    averaged_twice(witnesses, [peer_id(1), peer_id(2)])
    assert view_after(witnesses, 5.0) == 10


def test_a_reader_that_witnessed_nobody_counts_everyone():
    """The run's first epoch, a newcomer: no evidence either way, so every trainer counts (SampleCredit bounds)."""
    witnesses = TrainerWitnesses()
    records = [trainer(0, 0, 0), trainer(1, 0, 0), trainer(LIAR, 0, TARGET)]
    assert witnesses.uncounted(records, own_peer_id=peer_id(0), epoch=0) == frozenset()


def test_one_round_is_not_evidence_enough_in_a_large_swarm():
    """200 trainers in groups of 16. After its first round the reader and its 15 mates know only that group: counted
    on that, its epochs would last 12 times too long. So it counts everyone until a second round, along another
    grid axis, whose mates name their first groups: then every trainer of a 16 x 16 grid is counted."""
    grid = [[16 * row + col for col in range(16)] for row in range(16)]  # peer k sits at (row k // 16, column k % 16)
    records = [trainer(k, 1, 0, witnessed=[j for j in grid[k // 16] if j != k]) for k in range(200)]
    witnesses = TrainerWitnesses()
    witnesses.note_round(0, [peer_id(k) for k in grid[0][1:]])  # the reader, peer 0, averaged with its row
    assert witnesses.uncounted(records, own_peer_id=peer_id(0), epoch=1) == frozenset()
    column = [row[0] for row in grid[1:] if row[0] < 200]  # then with its column, whose records name their rows
    witnesses.note_round(1, [peer_id(k) for k in column])
    assert witnesses.uncounted(records, own_peer_id=peer_id(0), epoch=2) == frozenset()
    records.append(trainer(LIAR + 1000, 2, TARGET))  # a record nobody witnessed
    assert witnesses.uncounted(records, own_peer_id=peer_id(0), epoch=2) == {peer_id(LIAR + 1000)}


def test_a_witness_lapses_after_the_window():
    witnesses = TrainerWitnesses()
    witnesses.note_round(10, [peer_id(1)])
    witnesses.note_round(10 + WINDOW_EPOCHS - 2, [peer_id(2)])
    witnesses.note_round(10 + WINDOW_EPOCHS - 1, [peer_id(2)])
    assert witnesses.witnessed(10 + WINDOW_EPOCHS - 1) == [peer_id(2), peer_id(1)]  # the most recent first
    assert witnesses.witnessed(10 + WINDOW_EPOCHS) == [peer_id(2)]
    records = [trainer(0, 18, 0), trainer(1, 18, 0), trainer(2, 18, 0)]
    assert witnesses.uncounted(records, own_peer_id=peer_id(0), epoch=10 + WINDOW_EPOCHS) == {peer_id(1)}


def test_memory_and_the_published_list_are_bounded():
    witnesses = TrainerWitnesses(max_tracked=50)
    for epoch in range(10):
        witnesses.note_round(epoch, [peer_id(epoch * 100 + k) for k in range(20)])
    assert len(witnesses.witnessed(9)) == 50
    tags = TrainerWitnesses()
    tags.note_round(0, [peer_id(k) for k in range(MAX_WITNESSED + 10)])
    record = trainer(0, 0, 0).updated(witnessed=tags.tags(0))  # the record's schema takes what is published
    assert len(record.witnessed) == MAX_WITNESSED


def test_a_newcomer_prefers_the_largest_group_that_names_each_other_over_a_sybil_clique():
    """Issue 26's open case: a newcomer that has averaged with nobody took a Sybil pair's state at an epoch no honest
    donor held. Now it asks first the largest group of peers whose records name each other: honest peers name only
    peers whose contributions reached them, so Sybils that never averaged with them form their own, smaller group."""
    honest = [1, 2, 3, 4]
    sybils = [7, 8]
    records = [trainer(k, 10, 0, witnessed=[j for j in honest if j != k]) for k in honest]
    # The Sybils name each other and claim every honest peer, who never name them back.
    records += [trainer(k, 11, 0, witnessed=[j for j in sybils + honest if j != k]) for k in sybils]
    newcomer = TrainerWitnesses()
    assert newcomer.corroborated(records, 10) is None  # no rounds of its own
    assert newcomer.evidence(records, 10) == {peer_id(k) for k in honest}

    # As many Sybils as honest trainers: no evidence either way (the old rules decide); none named: no evidence.
    four_sybils = [7, 8, 9, 10]
    tied = records[:4] + [trainer(k, 11, 0, witnessed=[j for j in four_sybils if j != k]) for k in four_sybils]
    assert newcomer.evidence(tied, 10) is None
    assert newcomer.evidence([trainer(k, 10, 0) for k in honest], 10) is None

    # Once the peer has rounds of its own, its own witnesses decide.
    averaged_twice(newcomer, [peer_id(1)])
    assert newcomer.evidence(records, 10) == {peer_id(k) for k in honest}
