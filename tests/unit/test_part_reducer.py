"""`PartReducer`, `GatherReceipts` and the loss budget's stall decision, called directly: no sockets, no
threads, no clock (times are passed in). What a discrete-event simulator of many peers would call."""

from __future__ import annotations

import pytest
import torch

from moshpeer.averaging.budget_stall import BUDGET_STALL_FLOOR_S, PhaseArrivals, allowance_share, quorum
from moshpeer.averaging.part_reducer import ACCEPTED, LATE, GatherReceipts, PartReducer
from moshpeer.averaging.partition import Partition
from moshpeer.compression.codec import HalfPrecision, NoCompression

N, CHUNK, PART = 4, 4, 8  # 4 members, parts of 8 values in 2 chunks of 4
NONE = NoCompression()


def member_values(n: int = N) -> list:
    """Member k's vector: every value is k + 1 plus a per-position offset (so chunks differ)."""
    return [torch.arange(n * PART, dtype=torch.float32) * 0.01 + (k + 1) for k in range(n)]


def reducer(owner: int = 0, weights=None, **kwargs) -> tuple:
    values = member_values()
    flat = values[owner].clone()
    partition = Partition(flat.numel(), N, CHUNK)
    r = PartReducer(flat, partition, owner, weights or [1.0] * N, gather_codec=kwargs.pop("gather_codec", NONE),
                    chunk_seed=lambda part, chunk: 0, **kwargs)
    return r, values, partition


def deliver(r: PartReducer, values: list, member: int, chunk: int, codec=NONE):
    start, end = r.partition.chunk_range(r.my_index, chunk)
    return r.add_contribution(member, r.my_index, chunk, codec.encode(values[member][start:end]), codec)


def owner_chunk(r: PartReducer, chunk: int) -> torch.Tensor:
    start, end = r.partition.chunk_range(r.my_index, chunk)
    return r.flat[start:end]


def weighted_mean(values: list, members, weights, r: PartReducer, chunk: int) -> torch.Tensor:
    start, end = r.partition.chunk_range(r.my_index, chunk)
    total = sum(weights[i] for i in members)
    return sum(weights[i] * values[i][start:end] for i in members) / total


def test_a_chunk_is_final_once_every_other_member_delivered_it():
    r, values, _ = reducer()
    for member in (1, 2):
        assert deliver(r, values, member, 0) is ACCEPTED
        assert r.finalize_ready((0,)) == [] and not r.finalized[0]
    assert deliver(r, values, 3, 0) is ACCEPTED
    assert r.finalize_ready((0,)) == [0] and r.finalized[0] and not r.all_final
    assert torch.allclose(owner_chunk(r, 0), weighted_mean(values, range(N), [1.0] * N, r, 0))
    assert r.finalize_ready() == [] and r.finalized_count == 1  # chunk 1: nothing arrived, nobody finished
    assert r.contributed() == [0, 1, 1, 1] and r.departed == []


def test_refusals_change_nothing():
    r, values, partition = reducer()
    assert deliver(r, values, 1, 0) is ACCEPTED
    assert "duplicate" in deliver(r, values, 1, 0).rejected
    assert "not ours" in r.add_contribution(1, 1, 0, NONE.encode(values[1][:CHUNK]), NONE).rejected
    assert "not ours" in r.add_contribution(1, 0, 2, NONE.encode(values[1][:CHUNK]), NONE).rejected
    assert "bytes for" in r.add_contribution(2, 0, 0, NONE.encode(values[2][: CHUNK + 1]), NONE).rejected
    bad = NONE.encode(torch.full((CHUNK,), float("nan")))
    assert "non-finite" in r.add_contribution(2, 0, 0, bad, NONE).rejected
    assert r.arrived_from[0][2] == 0 and r.arrived_weight[0] == 1.0 and r.contributed() == [0, 1, 0, 0]


def test_a_chunk_after_its_finalization_is_refused_without_a_budget_and_late_with_one():
    for budget, expected in ((0.0, "after its deadline"), (0.1, None)):
        r, values, _ = reducer(loss_budget=budget)
        deliver(r, values, 1, 0)
        r.finalize_all()
        verdict = deliver(r, values, 2, 0)
        if expected is None:
            assert verdict is LATE and not verdict.accepted and not verdict.rejected
            assert r.late == []  # the budget chose to stop waiting: nothing says the deadline was short
        else:
            assert expected in verdict.rejected
            assert r.late == [2]  # alive, but slower than the deadline (a deadline learner's evidence)


def test_a_member_that_finished_without_sending_departs_and_leaves_the_weights():
    r, values, _ = reducer()
    for member in (1, 2):
        for chunk in range(2):
            deliver(r, values, member, chunk)
    assert r.finalize_ready() == []
    r.member_finished(3)  # e.g. its END_REDUCE arrived, or its connection closed
    assert r.finalize_ready() == [0, 1] and r.all_final and r.departed == [3]
    for chunk in range(2):
        assert torch.allclose(owner_chunk(r, chunk), weighted_mean(values, (0, 1, 2), [1.0] * N, r, chunk))
    assert "after its deadline" in deliver(r, values, 3, 0).rejected


def test_a_departed_member_is_refused_in_the_chunks_still_open():
    r, values, _ = reducer()
    deliver(r, values, 1, 0)
    deliver(r, values, 2, 0)
    r.member_finished(3)
    r.finalize_ready((0,))  # 3 sent nothing so far: departed, once and for the whole round
    assert r.departed == [3] and not r.finalized[1] and r.late == []
    assert "departed" in deliver(r, values, 3, 1).rejected
    assert r.late == [3]  # it was alive after all: counted departed, and late


def test_at_the_deadline_a_missing_chunk_is_estimated_without_bias():
    """Member 3 delivered chunk 0 but not chunk 1: it is present (not departed), so chunk 1 is estimated from
    what arrived, scaled to all present members' weight (estimator.py), not divided by what arrived."""
    weights = [1.0, 2.0, 1.0, 3.0]
    r, values, _ = reducer(weights=weights)
    for member in (1, 2, 3):
        deliver(r, values, member, 0)
    deliver(r, values, 1, 1)
    deliver(r, values, 2, 1)
    assert r.finalize_ready() == [0]
    assert r.finalize_all() == [1] and r.departed == []
    start, end = r.partition.chunk_range(0, 1)
    own, present_weight, arrived_weight = values[0][start:end], 2.0 + 1.0 + 3.0, 2.0 + 1.0
    arrived = 2.0 * values[1][start:end] + 1.0 * values[2][start:end]
    expected = (1.0 * own + present_weight * arrived / arrived_weight) / (1.0 + present_weight)
    assert torch.allclose(owner_chunk(r, 1), expected)
    assert torch.allclose(owner_chunk(r, 0), weighted_mean(values, range(N), weights, r, 0))


def test_nothing_arrived_keeps_the_owners_value():
    r, values, _ = reducer()
    assert r.finalize_all() == [0, 1] and r.departed == [1, 2, 3]
    assert torch.equal(r.flat, values[0])


def test_a_non_finite_average_keeps_the_owners_value_and_is_counted():
    r, values, _ = reducer()
    big = [v.clone() for v in values]
    for member in (1, 2, 3):
        big[member][:] = 3e38  # finite, but their sum overflows
        deliver(r, big, member, 0)
    assert r.finalize_ready((0,)) == [0]
    assert r.nonfinite_averages == 1 and torch.equal(owner_chunk(r, 0), values[0][:CHUNK])


@pytest.mark.parametrize("mode", ["clipped", "trimmed"])
def test_robust_aggregation_flags_an_outlier_and_stays_near_the_honest_mean(mode):
    r, values, _ = reducer(aggregation=mode)
    values[3] = values[3] + 1000.0
    for member in (1, 2, 3):
        for chunk in range(2):
            deliver(r, values, member, chunk)
    assert r.finalize_ready() == [0, 1]
    evidence = r.evidence()
    assert evidence[3].flagged == 2  # in both chunks
    if mode == "clipped":  # (a trimmed mean also trims the lowest honest value: here always the owner's)
        assert [e.flagged for e in evidence[:3]] == [0, 0, 0]
        assert evidence[3].rejected == 2  # 1000 away: far past the rejection radius
    honest = weighted_mean(values, (0, 1, 2), [1.0] * N, r, 0)
    assert float((owner_chunk(r, 0) - honest).abs().max()) < 1.0


@pytest.mark.parametrize("mode", ["clipped", "trimmed"])
def test_robust_modes_keep_the_owners_value_below_three_contributions(mode):
    """A hostile peer that gets an honest one alone (a group of two, or a group whose others are missing) moves
    nothing in a robust mode: two contributions cannot be told apart, so the owner keeps its own value and counts
    the chunk. With a third contribution the robust aggregate is taken again. The mean mode still averages."""
    r, values, _ = reducer(aggregation=mode)
    values[3] = values[3] + 1000.0
    own = owner_chunk(r, 0).clone()
    deliver(r, values, 3, 0)  # only the hostile member's chunk arrived
    r.member_finished(1)
    r.member_finished(2)
    r.finalize_ready((0,))
    assert torch.equal(owner_chunk(r, 0), own) and r.robust_too_few == 1
    r, values, _ = reducer(aggregation=mode)
    values[3] = values[3] + 1000.0
    deliver(r, values, 3, 0)
    deliver(r, values, 2, 0)  # a third contribution: aggregated, the outlier flagged
    r.member_finished(1)
    r.finalize_ready((0,))
    assert r.robust_too_few == 0 and r.evidence()[3].flagged == 1
    start, end = r.partition.chunk_range(0, 0)  # within the honest values (a trimmed mean of 3 is the median)
    assert bool((owner_chunk(r, 0) >= values[0][start:end] - 1e-6).all())
    assert bool((owner_chunk(r, 0) <= values[2][start:end] + 1e-6).all())

    mean, values, _ = reducer()
    deliver(mean, values, 3, 0)
    mean.member_finished(1)
    mean.member_finished(2)
    mean.finalize_ready((0,))
    assert torch.allclose(owner_chunk(mean, 0), weighted_mean(values, (0, 3), [1.0] * N, mean, 0))
    assert mean.robust_too_few == 0


def test_clipped_weighs_a_distrusted_member_at_zero_but_still_takes_its_chunks():
    results = {}
    for distrusted in ((), (3,)):
        r, values, _ = reducer(aggregation="clipped", distrusted=distrusted)
        values[3] = values[3] + 1.5
        for member in (1, 2, 3):
            assert deliver(r, values, member, 0) is ACCEPTED
        r.finalize_ready((0,))
        assert r.contributed()[3] == 1
        honest = weighted_mean(values, (0, 1, 2), [1.0] * N, r, 0)
        results[distrusted] = float((owner_chunk(r, 0) - honest).abs().max())
    assert results[(3,)] < results[()]


def test_robust_aggregation_refuses_a_buffer_over_the_limit():
    with pytest.raises(ValueError, match="would buffer"):
        reducer(aggregation="clipped", max_buffer_bytes=16)


def test_a_lossy_gather_codec_encodes_each_final_chunk_once_and_keeps_its_bits():
    fp16 = HalfPrecision(torch.float16)
    r, values, _ = reducer(gather_codec=fp16)
    for member in (1, 2, 3):
        deliver(r, values, member, 0)
    r.finalize_ready((0,))
    payload = r.gather_payloads[0]
    assert payload is not None and r.gather_payloads[1] is None
    assert torch.equal(owner_chunk(r, 0), fp16.decode(payload, CHUNK))


def test_the_reducer_uses_the_locks_it_is_given():
    entered = []

    class Counting:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            entered.append(self.name)

        def __exit__(self, *exc):
            return False

    r, values, _ = reducer(lock=Counting("shared"), chunk_lock=lambda: Counting("chunk"))
    deliver(r, values, 1, 0)
    assert "chunk" in entered and "shared" in entered


def test_gather_receipts():
    partition = Partition(N * PART, N, CHUNK)
    receipts = GatherReceipts(partition, my_index=0)
    assert receipts.check(1, 1, 0, 4 * CHUNK, NONE) is None
    assert "does not belong" in receipts.check(1, 2, 0, 4 * CHUNK, NONE)
    assert "does not belong" in receipts.check(1, 1, 5, 4 * CHUNK, NONE)
    assert "bytes for" in receipts.check(1, 1, 0, 4 * CHUNK + 1, NONE)
    receipts.note(1, 0)
    assert "duplicate" in receipts.check(1, 1, 0, 4 * CHUNK, NONE)
    assert not receipts.complete(1)
    receipts.note(1, 1)
    assert receipts.complete(1)
    assert receipts.missing() == [(2, 0), (2, 1), (3, 0), (3, 1)]


# ---- the loss budget's stall decision (budget_stall.py), with explicit timestamps ---------------------

def arrivals(times, expected: int, budget: float, start: float = 0.0) -> PhaseArrivals:
    a = PhaseArrivals(budget, start=start)
    for received, t in enumerate(times, start=1):
        a.note(t, received, expected)
    return a


def test_no_budget_never_stops_a_phase():
    a = arrivals([0.1 * k for k in range(1, 10)], expected=10, budget=0.0)
    assert not a.may_stop(1000.0, 9, 10)


def test_below_the_quorum_a_phase_waits():
    assert quorum(0.2, 10) == 8
    a = arrivals([0.1 * k for k in range(1, 8)], expected=10, budget=0.2)  # 7 of 10
    assert a.quorum_reached == 0.0 and not a.may_stop(1000.0, 7, 10)


def test_at_the_quorum_a_phase_stops_only_once_arrivals_stalled_and_it_waited_as_long_as_the_quorum_took():
    # 8 of 10 arrived, one every 0.1 s from t=0.1 to 0.8: quorum reached at 0.8 after a start at 0.
    a = arrivals([0.1 * k for k in range(1, 9)], expected=10, budget=0.2)
    assert a.quorum_reached == pytest.approx(0.8)
    assert not a.may_stop(0.85, 8, 10)  # still streaming: 0.05 s < 5 mean gaps (0.5 s)
    assert not a.may_stop(1.4, 8, 10)  # stalled 0.6 s (> 0.5 s), but waited 0.6 s < 0.8 s past the quorum
    assert a.may_stop(1.6, 8, 10)  # stalled, and waited 0.8 s past the quorum


def test_a_single_arrival_stalls_after_the_floor():
    a = arrivals([0.01], expected=1, budget=0.5)
    assert not a.may_stop(0.01 + BUDGET_STALL_FLOOR_S / 2, 1, 1)
    assert a.may_stop(0.01 + 2 * BUDGET_STALL_FLOOR_S, 1, 1)


def test_allowance_shares_add_up_to_the_receivers_allowance():
    partition = Partition(4096 + 100, N, 64)
    for receiver in range(N):
        senders = [k for k in range(N) if k != receiver]
        for phase, expected in (("reduce", partition.num_chunks(receiver) * (N - 1)),
                                ("gather", sum(partition.num_chunks(k) for k in senders))):
            shares = [allowance_share(0.05, partition, phase, k, receiver) for k in senders]
            assert sum(shares) == int(0.05 * expected) and max(shares) - min(shares) <= 1
            assert all(allowance_share(0.0, partition, phase, k, receiver) == 0 for k in senders)


def test_on_final_is_told_each_chunk_as_it_becomes_final():
    told = []
    r, values, _ = reducer(on_final=told.append)
    for member in (1, 2, 3):
        deliver(r, values, member, 1)
    r.finalize_ready()
    assert told == [1]
    r.finalize_all()
    assert told == [1, 0] and r.all_final


def test_a_robust_owner_keeps_a_members_contribution_as_it_arrived_for_a_spot_check():
    """Spot checks (issue 26) compare a member's contribution as the owner received it with a recomputation: the
    copy holds exactly what arrived, NaN where a chunk did not, and stays as it was after the robust combination."""
    r, values, _ = reducer(aggregation="clipped")
    for member in (1, 2, 3):
        deliver(r, values, member, 0)
    deliver(r, values, 2, 1)
    r.finalize_all()
    kept = r.member_contribution(1)
    start, end = r.partition.chunk_range(0, 0)
    assert torch.equal(kept[start:end], values[1][start:end])  # not the clipped or averaged values
    assert torch.isnan(kept[end:]).all()  # its second chunk never arrived
    assert torch.equal(r.member_contribution(2), values[2][:PART])
    assert r.member_contribution(0) is None  # the owner's own value is not a contribution
    plain, values, _ = reducer()
    deliver(plain, values, 1, 0)
    assert plain.member_contribution(1) is None  # "mean" sums contributions as they arrive: nothing kept apart
