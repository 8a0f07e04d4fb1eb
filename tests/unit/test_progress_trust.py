"""Swarm progress against faked records (issue 14): the swarm epoch is the upper median of the other trainers'
epochs, a record is credited only plausible steps, and an established view rises by one epoch per refresh."""

from __future__ import annotations

from moshpeer.dht import PeerRecord
from moshpeer.peer.optimizer.epoch_credit import EpochCredit
from moshpeer.peer.optimizer.progress import summarize

TARGET = 256


def record(k: int, epoch: int, samples: int = 0) -> PeerRecord:
    peer_id = "Qm" + "abcdefghijkmnopqrstuvwxyz"[k % 25] * 44
    return PeerRecord(peer_id=peer_id, role="trainer", epoch=epoch, samples_accumulated=samples, version="test",
                      protocol=2, started_at=0.0, updated_at=0.0)


def view(credit: EpochCredit, records, own, now: float = 0.0):
    credited = credit.apply(records, own.peer_id, now=now)
    return summarize(credited, own=own, target_batch_size=TARGET, now=0.0, max_epoch=credit.swarm_epoch)


def test_one_record_claiming_epoch_2_to_62_does_not_move_the_swarm():
    own = record(0, 10, samples=64)
    honest = [record(k, 10, samples=64) for k in (1, 2)]
    liar = record(3, 1 << 62, samples=1 << 40)
    snapshot = view(EpochCredit(), [*honest, liar], own)
    assert snapshot.global_epoch == 10
    assert snapshot.samples_accumulated == 3 * 64  # the liar is credited with epoch 11 at most: no samples


def test_fresh_identities_gain_one_epoch_per_refresh_at_most():
    """Four fresh identities claiming epoch 2^62 next to three honest peers (a majority of the others): a peer
    that already had a view of the swarm moves its view by one epoch per refresh, not to 2^62."""
    own = record(0, 10)
    honest = [record(k, 10) for k in (1, 2)]
    credit = EpochCredit()
    assert view(credit, honest, own).global_epoch == 10
    sybils = [record(k, 1 << 62) for k in (4, 5, 6, 7)]
    epochs = [view(credit, [*honest, *sybils], own).global_epoch for _ in range(3)]
    assert epochs == [11, 12, 13]


def test_the_view_keeps_up_with_a_swarm_faster_than_its_refreshes():
    """A refresh every 2 s and a swarm at 2 epochs per second: the view follows (a few epochs per second at
    most, however far the claims are ahead)."""
    own = record(0, 10)
    credit = EpochCredit()
    assert view(credit, [record(1, 10), record(2, 10)], own, now=0.0).global_epoch == 10
    assert view(credit, [record(1, 14), record(2, 14)], own, now=2.0).global_epoch == 14
    assert view(credit, [record(1, 1 << 62), record(2, 1 << 62)], own, now=4.0).global_epoch == 14 + 20


def test_a_view_after_a_pause_sees_how_far_the_swarm_ran_meanwhile():
    """The frozen peer (SIGSTOP for 30 s in a swarm at 3 epochs per second): its next view came 30 s after the
    last one, and the swarm had run 90 epochs. The whole gap counts: the view jumps there at once (it was allowed 20
    epochs, then 10 a second, and averaged stale gradients with the swarm for the 12 s that took). Saved-up
    allowance is still capped: a view that kept up, then sees a sudden majority claim, rises 20 at most."""
    own = record(0, 10)
    credit = EpochCredit()
    assert view(credit, [record(1, 10), record(2, 10)], own, now=0.0).global_epoch == 10
    assert view(credit, [record(1, 100), record(2, 100)], own, now=30.0).global_epoch == 100
    for k in range(1, 31):  # 30 s of views every second, the swarm at 100: the allowance is not saved up
        assert view(credit, [record(1, 100), record(2, 100)], own, now=30.0 + k).global_epoch == 100
    assert view(credit, [record(1, 1 << 62), record(2, 1 << 62)], own, now=61.0).global_epoch == 100 + 20


def test_a_view_refreshed_often_follows_a_swarm_of_2_6_epochs_per_second():
    """The soak's failure: refreshes every 0.45 s each allowed int(0.45 x 4) = 1 epoch, 2.2 per second, against a
    swarm at 2.6; the laggard's view fell ever further behind and it never caught up. Fractions now carry over."""
    own = record(0, 0)
    credit = EpochCredit()
    for k in range(134):  # 60 s
        now = 0.45 * k
        swarm = int(2.6 * now)
        seen = view(credit, [record(1, swarm), record(2, swarm)], own, now=now).global_epoch
    assert seen >= swarm - 1


def test_a_newcomer_catches_up_to_honest_peers():
    """A peer at epoch 0 sees the others at 40: that is where the swarm is (it must download state)."""
    own = record(0, 0)
    snapshot = view(EpochCredit(), [record(k, 40, samples=32) for k in (1, 2, 3)], own)
    assert snapshot.global_epoch == 40 and snapshot.samples_accumulated == 96


def test_a_newcomer_whose_first_views_were_empty_still_sees_the_swarm_at_once():
    """The CI failure: a newcomer's first refreshes found only its own record (its DHT had not found the swarm
    yet); that must not anchor its view at epoch 0, or a swarm at 200 takes it 200 refreshes to see."""
    own = record(0, 0)
    credit = EpochCredit()
    for _ in range(3):
        assert view(credit, [own], own).global_epoch == 0
    assert view(credit, [own, *(record(k, 200) for k in (1, 2))], own).global_epoch == 200


def test_a_record_cannot_jump_past_the_swarm():
    own = record(0, 10)
    credit = EpochCredit()
    honest = [record(k, 10) for k in (1, 2)]
    view(credit, [*honest, record(3, 10)], own)
    credited = credit.apply([*honest, record(3, 50)], own.peer_id)
    assert [r.epoch for r in credited] == [10, 10, 11]


def test_laggards_do_not_hold_the_swarm_back():
    """A newcomer sees another newcomer (epoch 0) and one peer that trains at epoch 40: the swarm is at 40 (the
    churn case: peers that just joined or resumed from an old checkpoint show old epochs)."""
    own = record(0, 0)
    assert view(EpochCredit(), [record(1, 0), record(2, 40)], own).global_epoch == 40
    assert view(EpochCredit(), [record(1, 3), record(2, 40), record(3, 40)], own).global_epoch == 40


def test_samples_of_peers_weighed_at_zero_do_not_count():
    """A hostile peer whose gradients robust aggregation discards must not shorten the honest peers' epochs:
    its samples (and speed) are left out of this peer's view; this peer's own samples always count."""
    own = record(0, 10, samples=64)
    honest = [record(k, 10, samples=64) for k in (1, 2)]
    hostile = record(3, 10, samples=200)
    everyone = summarize((*honest, hostile), own=own, target_batch_size=TARGET, now=0.0)
    assert everyone.samples_accumulated == 3 * 64 + 200 and everyone.ready
    suspect = summarize((*honest, hostile), own=own, target_batch_size=TARGET, now=0.0,
                        uncounted={hostile.peer_id, own.peer_id})
    assert suspect.samples_accumulated == 3 * 64 and not suspect.ready
    assert suspect.global_epoch == 10 and suspect.num_trainers == 4  # still a live peer (groups, matchmaking)
    assert everyone.contributing_trainers == 4 and suspect.contributing_trainers == 3  # each share: target / 3


def test_the_epoch_reached_outlives_the_trainers_that_withdrew():
    """The aux test's hang: both trainers ended epoch 16 without the aux and withdrew at once; the aux's view
    then had no trainer to follow and it waited at epoch 15 forever. Leaving records now count towards
    `reached`, at most one epoch above what each was credited with while live."""
    own = record(0, 15)
    credit = EpochCredit()
    trainers = [record(1, 15), record(2, 15)]
    assert view(credit, trainers, own).global_epoch == 15 and credit.reached == 15
    view(credit, [], own)  # the trainers are gone from the live records: nothing to follow...
    credit.note_departures([r.updated(epoch=16, leaving=True) for r in trainers])
    assert credit.reached == 16  # ...but where they left is remembered
    credit.note_departures([record(1, 1 << 62).updated(leaving=True), record(9, 1 << 62).updated(leaving=True)])
    assert credit.reached == 16  # a leaving claim past its credit (or of a peer never seen live) raises nothing


def test_trainers_count_as_started_once_their_record_says_so():
    own = record(0, 0).updated(training=True)
    starting, started = record(1, 0), record(2, 0).updated(training=True)
    snapshot = summarize((starting, started), own=own, target_batch_size=TARGET, now=0.0)
    assert snapshot.num_trainers == 3 and snapshot.started_trainers == 2
