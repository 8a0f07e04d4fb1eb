"""Adaptive deadlines (moshpeer.averaging.adaptive_deadlines): median + k*MAD of what was measured, bounded by
the user's floor and cap, robust to a dead member's round, doubling on a real slowdown."""

from __future__ import annotations

import random
import statistics

import pytest

from moshpeer.averaging.adaptive_deadlines import (
    MAD_TO_SIGMA,
    AdaptiveDeadline,
    MarginPolicy,
    DeadlineLearner,
    FASTEST_ASSEMBLY_RECENT,
    payload_class,
    robust_deadline,
)


def test_robust_deadline_is_median_plus_k_sigma_and_at_least_ratio_times_median():
    policy = MarginPolicy(k=3.0, ratio=1.2, min_samples=3)
    samples = [1.0, 1.2, 0.8, 1.1, 0.9]
    median, mad = 1.0, 0.1
    assert robust_deadline(samples, policy) == pytest.approx(median + 3.0 * MAD_TO_SIGMA * mad)
    # No spread at all: the ratio margin holds.
    assert robust_deadline([2.0] * 5, policy) == pytest.approx(2.4)
    assert robust_deadline([1.0, 1.0], policy) is None  # too few samples


def test_cap_until_enough_samples_then_the_estimate_within_floor_and_cap():
    deadline = AdaptiveDeadline(0.5, 10.0, policy=MarginPolicy(min_samples=4))
    for seconds in (0.3, 0.31, 0.29):
        deadline.observe(seconds)
        assert deadline.current() == 10.0
    deadline.observe(0.3)
    assert 0.5 <= deadline.current() < 1.0  # 1.5 x 0.3 = 0.45 -> the floor (0.5) at the least
    for _ in range(10):
        deadline.observe(30.0)  # slower than the cap allows: capped
    assert deadline.current() == 10.0


def test_one_outlier_barely_moves_it_but_a_shift_in_the_distribution_does():
    rng = random.Random(0)
    deadline = AdaptiveDeadline(0.01, 100.0, policy=MarginPolicy(k=4.0, ratio=1.5, min_samples=4), history=32)
    for _ in range(32):
        deadline.observe(rng.gauss(1.0, 0.05))
    calm = deadline.current()
    assert 1.1 < calm < 1.6
    deadline.observe(20.0)  # one round that ran into a departed member's silence
    assert deadline.current() == pytest.approx(calm, rel=0.1)
    for _ in range(20):  # the machine got twice as slow
        deadline.observe(rng.gauss(2.0, 0.1))
    assert deadline.current() > 2.2


def test_deadline_hits_without_deaths_double_it_until_a_round_fits():
    deadline = AdaptiveDeadline(0.1, 8.0, policy=MarginPolicy(k=0.0, ratio=1.0, min_samples=2, growth=2.0))
    deadline.observe(0.5)
    deadline.observe(0.5)
    assert deadline.current() == pytest.approx(0.5)
    deadline.observe_deadline_hit()
    assert deadline.current() == pytest.approx(1.0)
    deadline.observe_deadline_hit()
    assert deadline.current() == pytest.approx(2.0)
    for _ in range(10):
        deadline.observe_deadline_hit()
    assert deadline.current() == 8.0  # never past the cap
    deadline.observe(1.9)  # a round fitted again: the streak ends
    assert deadline.current() == pytest.approx(statistics.median([0.5, 0.5, 1.9]))


def test_bad_bounds_and_policies_are_refused():
    with pytest.raises(ValueError):
        AdaptiveDeadline(2.0, 1.0)
    with pytest.raises(ValueError):
        AdaptiveDeadline(0.0, 1.0)
    with pytest.raises(ValueError):
        DeadlineLearner(matchmaking_floor=1.0, matchmaking_cap=0.5, round_floor=1.0, round_cap=10.0)
    with pytest.raises(ValueError):
        MarginPolicy(ratio=0.5)
    deadline = AdaptiveDeadline(0.5, 10.0, policy=MarginPolicy(min_samples=1))
    deadline.observe(float("nan"))
    deadline.observe(-1.0)
    assert deadline.samples == []


def _deadlines(**policy) -> DeadlineLearner:
    return DeadlineLearner(matchmaking_floor=0.2, matchmaking_cap=5.0, round_floor=0.1, round_cap=30.0,
                          policy=MarginPolicy(k=0.0, ratio=1.0, min_samples=3, **policy))


def test_rounds_are_kept_per_group_size_and_payload_class_with_pooling_for_new_sizes():
    deadlines = _deadlines()
    assert deadlines.round_deadline(4, 1 << 20) == 30.0  # nothing measured: the cap
    for _ in range(3):
        deadlines.observe_round(4, 1 << 20, 2.0, hit_deadline=False, member_died=False)
        deadlines.observe_round(4, 1 << 26, 9.0, hit_deadline=False, member_died=False)
    assert deadlines.round_deadline(4, 1 << 20) == pytest.approx(2.0)
    assert deadlines.round_deadline(4, (1 << 20) + 1000) == pytest.approx(2.0)  # same payload class
    assert deadlines.round_deadline(4, 1 << 26) == pytest.approx(9.0)
    # A group size never seen borrows from the other sizes of its payload class.
    assert deadlines.round_deadline(3, 1 << 20) == pytest.approx(2.0)
    for _ in range(3):
        deadlines.observe_round(3, 1 << 20, 1.0, hit_deadline=False, member_died=False)
    assert deadlines.round_deadline(3, 1 << 20) == pytest.approx(1.0)
    assert payload_class(1 << 20) != payload_class(1 << 21)


def test_a_member_dying_costs_one_deadline_and_does_not_grow_the_next_one():
    deadlines = _deadlines(growth=2.0)
    for _ in range(3):
        deadlines.observe_round(4, 4096, 0.5, hit_deadline=False, member_died=False)
    before = deadlines.round_deadline(4, 4096)
    deadlines.observe_round(4, 4096, before, hit_deadline=True, member_died=True)
    deadlines.observe_round(4, 4096, 0.6 * before, hit_deadline=False, member_died=True)  # gave up at 60 %
    assert deadlines.round_deadline(4, 4096) == pytest.approx(before)
    assert deadlines.round_deadline_samples(4, 4096) == [0.5, 0.5, 0.5]
    deadlines.observe_round(4, 4096, before, hit_deadline=True, member_died=False)  # slow, nobody died
    assert deadlines.round_deadline(4, 4096) == pytest.approx(2 * before)


def test_a_member_whose_chunk_came_late_was_alive_and_grows_the_next_deadline():
    """A member counted departed at the owners' deadline whose chunk then came (`RoundResult.late`) was slower than
    the deadline, not dead: the round ran into its deadline (on netlab 200 ms apart, two relayed peers' chunks came
    late in most rounds and the deadline never grew, each round taken for a death)."""
    from moshpeer.averaging.report import DataPlaneStats, RoundResult

    deadlines = _deadlines(growth=2.0)
    for _ in range(3):
        deadlines.observe_round(4, 4096, 0.5, hit_deadline=False, member_died=False)
    before = deadlines.round_deadline(4, 4096)

    def result(departed, late):
        return RoundResult(ok=True, group_id="ab", group_size=4, matchmaking_s=0.1, data_deadline_s=before,
                           data=DataPlaneStats(departed=departed, late=late, total_s=0.7 * before))

    deadlines.observe_result(result([2], []), target=4, payload_bytes=4096)  # silent: a death, nothing learned
    assert deadlines.round_deadline(4, 4096) == pytest.approx(before)
    deadlines.observe_result(result([2], [2]), target=4, payload_bytes=4096)  # its chunk came: late, not dead
    assert deadlines.round_deadline(4, 4096) == pytest.approx(2 * before)


def test_a_round_whose_reduce_scatter_is_nearly_all_of_it_learns_a_budget_that_leaves_that_phase_its_share():
    """Owners stop waiting for contributions at REDUCE_SCATTER_SHARE of the budget. A budget learned from the rounds'
    whole times (1.9 s, 1.8 of it reducing: a slow peer far away behind a NAT, on netlab) cut that phase at 0.9x
    the time it needs: every round whose budget had not just doubled lost its slowest members' chunks."""
    from moshpeer.averaging.deadline import REDUCE_SCATTER_SHARE
    from moshpeer.averaging.report import DataPlaneStats, RoundResult

    deadlines = _deadlines(growth=2.0)
    for _ in range(6):
        deadlines.observe_result(RoundResult(ok=True, group_id="ab", group_size=4, matchmaking_s=0.1,
                                             data_deadline_s=10.0,
                                             data=DataPlaneStats(reduce_scatter_s=1.8, total_s=1.9)),
                                 target=4, payload_bytes=4096)
    # With no margin (k=0, ratio 1), the reduce-scatter gets exactly what it took; the default policy adds 1.5x.
    assert REDUCE_SCATTER_SHARE * deadlines.round_deadline(4, 4096) == pytest.approx(1.8)
    assert deadlines.round_deadline_samples(4, 4096) == [pytest.approx(1.8 / REDUCE_SCATTER_SHARE)] * 6


def test_matchmaking_window_learns_from_full_groups_only():
    deadlines = _deadlines()
    assert deadlines.matchmaking_window(4) == 5.0
    for _ in range(3):
        deadlines.observe_assembly(4, 0.6, full=True)
        deadlines.observe_assembly(4, 5.0, full=False)  # peers gone: the window ran out, says nothing
    assert deadlines.matchmaking_window(4) == pytest.approx(0.6)
    assert deadlines.matchmaking_window(2) == 5.0  # per target size
    assert deadlines.describe()["assembly"] == {4: 3, 2: 0}


def test_fastest_assembly_is_the_quickest_recent_full_group():
    deadlines = _deadlines()
    assert deadlines.fastest_assembly_s(4) is None  # no full group yet
    deadlines.observe_assembly(4, 0.05, full=False)  # a partial group says nothing
    assert deadlines.fastest_assembly_s(4) is None
    for seconds in [0.1] + [0.3] * FASTEST_ASSEMBLY_RECENT:  # 0.1 is older than the latest RECENT
        deadlines.observe_assembly(4, seconds, full=True)
    assert deadlines.fastest_assembly_s(4) == pytest.approx(0.3)
    deadlines.observe_assembly(4, 0.2, full=True)
    assert deadlines.fastest_assembly_s(4) == pytest.approx(0.2) and deadlines.fastest_assembly_s(2) is None


def test_averagers_tighten_their_deadlines_and_a_silent_member_costs_one_deadline_once(dht_node):
    """Two real averagers: the data-plane deadline starts at the cap (10 s), tightens to what rounds take,
    a member that goes silent (stop_after_chunks=0: a hang) costs the other about that deadline, and the
    next deadline does not grow."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from moshpeer.averaging import MoshpitAverager
    from moshpeer.averaging.faults import FaultConfig, FaultyLinks

    run = "adaptive"
    boot = dht_node(run_ids=[run])
    other = dht_node(initial_peers=[str(m) for m in boot.get_visible_maddrs()], run_ids=[run])
    averagers = [MoshpitAverager([torch.randn(4096)], dht=dht, run_id=run, target_group_size=2, matchmaking_time=2.0,
                                 round_timeout=10.0, min_matchmaking_time=0.5, min_round_timeout=0.5)
                 for dht in (boot, other)]

    pool = ThreadPoolExecutor(len(averagers))

    def one_round():
        futures = [pool.submit(a.step, timeout=6.0) for a in averagers]
        return [f.result(timeout=60.0) for f in futures]

    try:
        first, tightened = None, None
        for _ in range(12):  # a loaded machine may keep the two apart in a round: bounded retries
            results = one_round()
            if not all(r.ok for r in results):
                continue
            first = first or results[0]
            if len(averagers[0].deadlines.round_deadline_samples(2, 4 * 4096)) >= 4:
                tightened = results[0]
                break
        assert first is not None and first.data_deadline_s == pytest.approx(10.0, abs=0.5), first
        assert tightened is not None, "too few complete rounds to learn from"
        learned = averagers[0].deadlines.round_deadline(2, 4 * 4096)
        assert 0.5 <= learned < 5.0, learned

        averagers[1].links = FaultyLinks(FaultConfig(stop_after_chunks=0))  # the second member hangs in its next round
        for _ in range(6):
            started = time.monotonic()
            silent = one_round()[0]
            if silent.ok:
                break
        assert silent.ok and silent.departed == [1 - silent.my_index], silent  # the other member
        assert silent.data_deadline_s == pytest.approx(learned, rel=0.05)
        assert silent.round_deadline_s < first.round_deadline_s - 5.0  # 10 s cap -> the learned deadline
        assert silent.total_s <= silent.data_deadline_s + 1.0, silent  # one deadline, not the 10 s cap
        assert time.monotonic() - started < silent.round_deadline_s + 5.0
        # Once: the silence is not taken for slowness, the next deadline is the same.
        assert averagers[0].deadlines.round_deadline(2, 4 * 4096) == pytest.approx(learned)
    finally:
        pool.shutdown(wait=False)
        for averager in averagers:
            averager.shutdown()
