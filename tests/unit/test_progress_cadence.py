"""How often a peer reads and publishes swarm progress (progress_cadence.py), and SwarmProgress keeping to it."""

from __future__ import annotations

import concurrent.futures
import math
import time
import types

import pytest
from peer_fakes import FakeClock
from test_dht_records import make_record

from moshpeer.dht import MUTABLE_FIELDS, Identity
import moshpeer.peer.optimizer.progress as progress_module
from moshpeer.peer.optimizer.progress import SwarmProgress
from moshpeer.peer.optimizer.pause_watch import PauseWatch
from moshpeer.peer.optimizer.progress_cadence import ProgressCadence

pytestmark = pytest.mark.timeout(60)


def test_reads_come_often_near_the_epoch_end_and_seldom_far_from_it():
    cadence = ProgressCadence(min_interval_s=0.3, max_interval_s=5.0, eta_fraction=0.5, budget_bps=math.inf)
    assert cadence.interval(0.0, peers=4) == 0.3
    assert cadence.interval(2.0, peers=4) == 1.0
    assert cadence.interval(60.0, peers=4) == 5.0
    assert cadence.interval(math.inf, peers=4) == 5.0  # nobody computes yet: the slowest cadence


def test_the_byte_budget_stretches_the_interval_with_the_swarm():
    cadence = ProgressCadence(min_interval_s=0.3, max_interval_s=5.0, budget_bps=128_000, bytes_per_record=16_000)
    assert cadence.interval(0.0, peers=2) == 0.3
    assert cadence.interval(0.0, peers=8) == pytest.approx(1.0)
    # 100 peers: past the eta-based maximum too; the budget holds whatever the epoch says.
    assert cadence.interval(0.0, peers=100) == pytest.approx(12.5)
    assert cadence.interval(math.inf, peers=100) == pytest.approx(12.5)
    # The cost of all reads and publications stays within the budget at any size.
    for peers in (1, 4, 16, 64, 1000):
        assert peers * 16_000 / cadence.interval(0.0, peers) <= 128_000 + 1e-6


def test_a_fixed_cadence_ignores_the_epoch_and_the_swarm():
    fixed = ProgressCadence.fixed(0.3)
    assert {fixed.interval(eta, peers) for eta in (0.0, 10.0, math.inf) for peers in (1, 500)} == {0.3}


def test_a_users_progress_refresh_is_the_shortest_interval():
    assert ProgressCadence.fastest(0.2).interval(0.0, peers=1) == 0.2
    assert ProgressCadence.fastest(7.0).interval(0.0, peers=1) == 7.0  # longer than the default maximum: kept


@pytest.mark.parametrize("kwargs", [dict(min_interval_s=0), dict(min_interval_s=6.0, max_interval_s=5.0),
                                    dict(eta_fraction=0), dict(budget_bps=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        ProgressCadence(**kwargs)


class _EmptyDHT:
    """A DHT whose membership dictionary is empty: every read succeeds at once and returns no records."""

    def __init__(self):
        self.reads = 0

    def get(self, key, latest=True, return_future=False):
        self.reads += 1
        future = concurrent.futures.Future()
        future.set_result(None)
        return future


def _progress(dht, published, cadence):
    own = make_record(Identity.generate())
    return SwarmProgress(dht, "unit-run", target_batch_size=1000, own_record=lambda: own,
                         publish=lambda **fields: published.append(fields), cadence=cadence)


def test_far_from_the_epoch_end_a_peer_publishes_once_per_interval_except_a_new_epoch():
    published = []
    cadence = ProgressCadence(min_interval_s=0.01, max_interval_s=60.0, budget_bps=math.inf)
    progress = _progress(_EmptyDHT(), published, cadence)
    try:
        for samples in range(10):
            progress.report(epoch=3, samples_accumulated=samples, samples_per_second=1.0, step=samples,
                            epoch_eta_s=1000.0)
        assert len(published) == 1  # the interval is 60 s: the other nine waited
        progress.report(epoch=4, samples_accumulated=0, samples_per_second=1.0, step=10, epoch_eta_s=1000.0)
        progress.report(epoch=4, samples_accumulated=1, samples_per_second=1.0, step=11, force=True)
        assert [p["epoch"] for p in published] == [3, 4, 4]
        progress.report(epoch=4, samples_accumulated=1, samples_per_second=1.0, step=12, epoch_eta_s=0.5)
        assert progress.next_interval() == pytest.approx(0.25, abs=0.01)  # near the end: half the time left
        progress.report(epoch=4, samples_accumulated=2, samples_per_second=1.0, step=13, epoch_eta_s=0.0)
        # The epoch ends now: its record goes out at once (the others' straggler waits read it), and while its
        # round is on, background reads slow to the longest interval (the round asks for what it needs).
        assert [p["samples_accumulated"] for p in published][-1] == 2
        assert progress.next_interval() == 60.0
        # Every field a report sets is one a daemon lets its record change, and the count says when it was taken.
        assert all(set(fields) <= MUTABLE_FIELDS and fields["samples_counted_at"] > 0 for fields in published)
    finally:
        progress.shutdown()


def test_waiting_for_a_refresh_asks_for_one_at_once():
    dht = _EmptyDHT()
    progress = _progress(dht, [], ProgressCadence(min_interval_s=0.01, max_interval_s=60.0))
    try:
        progress.report(epoch=0, samples_accumulated=0, samples_per_second=1.0, step=0, epoch_eta_s=1000.0)
        # The background thread would wait 60 s; a caller that waits for a refresh gets one now.
        assert progress.wait_for_refresh(timeout=20.0)
        assert progress.wait_for_refresh(timeout=20.0)
        assert dht.reads >= 2
    finally:
        progress.shutdown()


def test_a_read_without_this_peers_own_record_leaves_the_view_as_it_was(monkeypatch):
    """A DHT read whose requests timed out answers None or part of the membership dictionary (hivemind's get, in a
    swarm where this peer's node does not store the run's key itself); taken as the swarm, the peer would think its
    partners left and end its epoch "alone". A read lacking this peer's own record is incomplete: the view stays,
    and a waiter is still woken."""
    own = make_record(Identity.generate(), epoch=3)
    others = [make_record(Identity.generate(), epoch=3) for _ in range(2)]
    reads = iter([[own, *others], [], others[:1], [own, others[0]]])
    monkeypatch.setattr("moshpeer.peer.optimizer.progress.list_peers", lambda *args, **kwargs: next(reads))
    progress = SwarmProgress(_EmptyDHT(), "unit-run", target_batch_size=1000, own_record=lambda: own,
                             publish=lambda **fields: None,
                             cadence=ProgressCadence(min_interval_s=0.01, max_interval_s=60.0))
    try:
        assert progress.refresh_now(timeout=1.0).num_trainers == 3
        assert progress.wait_for_refresh(timeout=20.0)  # answered with nothing: incomplete
        assert progress.snapshot().num_trainers == 3
        assert progress.refresh_now(timeout=1.0).num_trainers == 3  # another's record, not ours: incomplete
        assert progress.refresh_now(timeout=1.0).num_trainers == 2  # complete: one peer left
    finally:
        progress.shutdown()


def test_an_epoch_of_its_own_count_publishes_at_the_longest_interval_but_its_end_at_once(monkeypatch):
    # Near the end of a target-batch epoch the others' sums decide it: publications follow the fast read cadence.
    # An epoch of the peer's own count is predictable from its record's count and rate: the longest interval.
    clock = FakeClock()
    monkeypatch.setattr(progress_module, "time", types.SimpleNamespace(monotonic=clock, sleep=time.sleep))
    cadence = ProgressCadence(min_interval_s=0.01, max_interval_s=60.0, budget_bps=math.inf)
    own_count, target_batch = [], []
    progress, swarm = _progress(_EmptyDHT(), own_count, cadence), _progress(_EmptyDHT(), target_batch, cadence)
    try:
        for step in range(5):
            # 0.03 s apart: more than the read cadence near an epoch's end (half of the 0.05 s left)
            progress.report(epoch=1, samples_accumulated=step, samples_per_second=1.0, step=step, epoch_eta_s=0.05)
            swarm.report(epoch=1, samples_accumulated=step, samples_per_second=1.0, step=step)
            clock.advance(0.03)
        assert len(own_count) == 1  # the epoch's start only
        assert progress.publish_interval() == 60.0 and progress.next_interval() < 0.1  # reads stay fast
        progress.report(epoch=1, samples_accumulated=5, samples_per_second=1.0, step=5, epoch_eta_s=0.0)
        assert [p["samples_accumulated"] for p in own_count] == [0, 5]  # the end goes out at once
        assert swarm.publish_interval() == swarm.next_interval()
    finally:
        progress.shutdown()
        swarm.shutdown()



@pytest.mark.parametrize("paused", [False, True])
def test_after_a_pause_the_view_an_epoch_end_decides_on_comes_from_a_complete_read_begun_after_it(monkeypatch,
                                                                                                   paused):
    """`current()` is the cached view unless this process was paused since the read behind it; then it waits for
    a complete read begun after the pause (an incomplete one, lacking this peer's own record, which expired from
    the DHT during the pause, does not count)."""
    own = make_record(Identity.generate(), epoch=3)
    others = [make_record(Identity.generate(), epoch=3) for _ in range(2)]
    reads = iter([[own, *others], [], [others[0]]] + [[own, others[0]]] * 100)  # then one of the others left
    monkeypatch.setattr(progress_module, "list_peers", lambda *args, **kwargs: next(reads))
    clock = FakeClock()
    pauses = PauseWatch(clock=clock)
    progress = SwarmProgress(_EmptyDHT(), "unit-run", target_batch_size=1000, own_record=lambda: own,
                             publish=lambda **fields: None, pauses=pauses,
                             cadence=ProgressCadence(min_interval_s=0.01, max_interval_s=60.0))
    try:
        assert progress.refresh_now(timeout=1.0).num_trainers == 3
        if paused:
            clock.advance(30.0)  # stopped for 30 s: whichever of the ticker and the epoch end runs first sees it
        started = time.monotonic()
        assert progress.current(timeout=20.0).num_trainers == (2 if paused else 3)
        assert time.monotonic() - started < 10.0
    finally:
        progress.shutdown()


def test_a_view_that_reads_have_not_renewed_for_long_is_read_again_and_else_marked_stale(monkeypatch):
    """Reads failing in a row (a stalled DHT process or p2pd) age the view while this process runs on: past
    STALE_VIEW_INTERVALS longest intervals an epoch end waits for a complete read; without one it gets the old view
    marked `stale` (waiting in full once per view), and the first read that answers ends it."""
    own = make_record(Identity.generate(), epoch=3)
    others = [make_record(Identity.generate(), epoch=3) for _ in range(2)]
    answers = {"records": [own, *others]}

    def list_peers(*args, **kwargs):
        if answers["records"] is None:
            raise TimeoutError("the DHT did not answer")
        return answers["records"]

    monkeypatch.setattr(progress_module, "list_peers", list_peers)
    monkeypatch.setattr(progress_module, "STALE_REWAIT_S", 0.2)
    clock = FakeClock()
    progress = SwarmProgress(_EmptyDHT(), "unit-run", target_batch_size=1000, own_record=lambda: own,
                             publish=lambda **fields: None, pauses=PauseWatch(clock=clock, pause_s=math.inf),
                             cadence=ProgressCadence(min_interval_s=0.01, max_interval_s=5.0))
    try:
        assert progress.refresh_now(timeout=1.0).num_trainers == 3
        answers["records"] = None
        clock.advance(14.0)  # within 3 x 5 s: a read is due, the view still counts
        assert not progress.current(timeout=5.0).stale
        clock.advance(2.0)
        started = time.monotonic()
        view = progress.current(timeout=0.6)
        assert view.stale and view.num_trainers == 3 and time.monotonic() - started >= 0.6
        started = time.monotonic()
        assert progress.current(timeout=5.0).stale and time.monotonic() - started < 1.0  # the same view: a short wait
        answers["records"] = [own, others[0]]  # the DHT answers again; one of the others left meanwhile
        view = progress.current(timeout=5.0)
        assert not view.stale and view.num_trainers == 2
    finally:
        progress.shutdown()


def test_a_tick_late_by_more_than_the_threshold_ends_a_pause():
    clock = FakeClock(now=0.0)
    watch = PauseWatch(clock=clock, pause_s=3.0)
    clock.advance(0.5)
    assert watch.tick() is None and not watch.paused_since(0.0)
    clock.advance(20.0)  # stopped: every thread resumes at once, the ticker maybe last
    assert watch.paused_since(0.4)  # the ticker is late itself
    assert watch.tick() == 20.0 and watch.last_pause_end == 20.5
    assert watch.paused_since(20.0) and not watch.paused_since(20.5)  # a read begun after it is fresh
    clock.advance(0.5)
    assert watch.tick() is None and not watch.paused_since(20.5)
