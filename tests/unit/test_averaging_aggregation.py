"""Byzantine-robust aggregation (issue 14): capped weights, CenteredClip, trimmed mean, finite averages.

The attacks run through the real group all-reduce (members in threads over the TCP data plane); the
hostile member is the `byzantine` fault mode wrapping its real sender. A swarm test with real processes
is in test_averaging_swarm_byzantine.py.
"""

from __future__ import annotations

import time

import pytest
import torch
from local_group import credentials, members as group_members, run_group

from moshpeer.averaging import DataPlane, FaultConfig, FaultyLinks, GroupAllReduce, wire
from moshpeer.averaging.links import PLAIN_LINKS
from moshpeer.averaging.aggregation import (CLIP_ITERATIONS, CLIP_RADIUS_FACTOR, REJECT_RADIUS_FACTOR, cap_weights,
                                            centered_clip, rejection_distance, trimmed_mean)
from moshpeer.averaging.suspects import (SCORE_CAP, SUSPECT_AFTER_ROUNDS, SUSPECT_SCORE, MemberEvidence,
                                        SuspectTracker)
from moshpeer.compression import get_compression
from moshpeer.errors import UserError

pytestmark = pytest.mark.timeout(90)

N, NUMEL, CHUNK = 4, 4096, 256


def group_round(originals, faults, weights, aggregation: str, distrusted=()):
    """One all-reduce of `originals` (one member per thread; member k's chunks through `faults[k]`, a FaultConfig
    or None) -> (values, results)."""
    tensors = [x.clone() for x in originals]
    results = run_group(tensors, weights=weights, chunk_numel=CHUNK, deadline_s=20.0, aggregation=aggregation,
                        distrusted=distrusted,
                        member_kwargs=lambda k: {"links": FaultyLinks(faults[k]) if faults[k] else PLAIN_LINKS})
    assert all(r is not None for r in results)
    return tensors, results


def honest_values(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [1.0 + 0.1 * torch.randn(NUMEL, generator=g) for _ in range(N)]


HOSTILE = FaultConfig.parse("byzantine=-100,weight=1e6")  # the hostile member also declares weight 1e6


def test_weights_are_capped_at_a_multiple_of_the_median():
    assert cap_weights([1.0, 1.0, 2.0, 1e6], 2.0) == [1.0, 1.0, 2.0, 3.0]
    assert cap_weights([0.0, 0.0, 5.0], 1.0) == [0.0, 0.0, 5.0]
    assert cap_weights([0.0, 0.0], 2.0) == [0.0, 0.0]


def test_centered_clip_and_trimmed_mean_resist_one_outlier_and_are_exact_without_one():
    g = torch.Generator().manual_seed(1)
    honest = torch.randn(3, 1000, generator=g)
    rows = torch.cat([honest, torch.full((1, 1000), -1e4)])
    for aggregate, flagged in (centered_clip(rows, torch.ones(4))[:2], trimmed_mean(rows)):
        assert (aggregate - honest.mean(0)).norm() < 1.5 * honest.std(0).norm()  # the outlier moved it little
        assert flagged.tolist() == [False, False, False, True]
    clean = torch.cat([honest, torch.randn(1, 1000, generator=g)])
    value, flagged, *_ = centered_clip(clean, torch.ones(4))
    assert torch.allclose(value, clean.mean(0), atol=1e-5) and not flagged.any()  # no honest member clipped


def _centered_clip_in_value_space(rows: torch.Tensor, weights: torch.Tensor, own: int):
    """The textbook iteration on d-long vectors (float64), to check the Gram-matrix form against."""
    x = rows.double()
    v = x[own].clone()
    from_own = (x - v).norm(dim=1)
    median = float(torch.cat([from_own[:own], from_own[own + 1:]]).median())
    tau = CLIP_RADIUS_FACTOR * median
    rejected = from_own > REJECT_RADIUS_FACTOR * median
    kept = torch.where(rejected, 0.0, weights.double())
    shares = kept / kept.sum()
    for _ in range(CLIP_ITERATIONS):
        distances = (x - v).norm(dim=1)
        v = v + ((tau / distances.clamp_min(1e-30)).clamp(max=1.0) * shares) @ (x - v)
    return v, rejected | ((x - v).norm(dim=1) > tau * (1 + 1e-4))


def test_centered_clip_on_the_gram_matrix_matches_the_iteration_on_vectors():
    """The owner's row anywhere, rows a strided view of a larger buffer, a hostile row, unequal and zero weights."""
    g = torch.Generator().manual_seed(2)
    buffer = 1.0 + 0.1 * torch.randn(5, 3000, generator=g)
    buffer[1] *= -100.0
    buffer[4] = 1.0 + 0.5 * torch.randn(3000, generator=g)  # far, but within reach of the clip radius
    rows = buffer[:, 500:2500]
    weights = torch.tensor([1.0, 1.0, 2.0, 0.0, 1.0])
    for own in (0, 2, 4):
        value, flagged, *_ = centered_clip(rows, weights, own)
        expected, expected_flagged = _centered_clip_in_value_space(rows, weights, own)
        assert torch.allclose(value.double(), expected, atol=1e-4), own
        assert flagged.tolist() == expected_flagged.tolist() and flagged[1], own


def test_centered_clip_rejects_a_far_contribution_outright_and_averages_a_group_of_two():
    """A contribution hundreds of median distances out does not pull the result at all (clipping alone would
    leave ~tau/n of pull); two members average (the clip radius comes from the other member, not the owner's
    zero distance to itself)."""
    g = torch.Generator().manual_seed(3)
    honest = 1.0 + 0.1 * torch.randn(3, 1000, generator=g)
    rows = torch.cat([honest, -100.0 * honest[:1]])
    value, flagged, *_ = centered_clip(rows, torch.ones(4))
    assert torch.allclose(value, honest.mean(0), atol=1e-5)
    assert flagged.tolist() == [False, False, False, True]
    value, flagged, *_ = centered_clip(honest[:2], torch.ones(2), own=1)
    assert torch.allclose(value, honest[:2].mean(0), atol=1e-5) and not flagged.any()


def test_two_colluders_of_four_are_rejected_by_an_owner_that_counts_itself():
    """Issue 26: two members of four sending the same far value were 2 of the owner's 3 others, so the median
    distance over the others was theirs: nothing was rejected or clipped and the result moved half way to them
    (707x the signal, unflagged). The rejection radius now counts the owner's own zero distance in its median: it
    comes from the honest member, and both colluders are rejected; an honest group of four is still not clipped."""
    g = torch.Generator().manual_seed(4)
    honest = 1.0 + 0.1 * torch.randn(2, 1000, generator=g)
    far = -707.0 * honest.mean(0)
    value, flagged, rejected, _ = centered_clip(torch.stack([honest[0], honest[1], far, far]), torch.ones(4))
    assert torch.allclose(value, honest.mean(0), atol=1e-5)
    assert flagged.tolist() == [False, False, True, True] and rejected == [False, False, True, True]
    four = 1.0 + 0.1 * torch.randn(4, 1000, generator=g)
    value, flagged, *_ = centered_clip(four, torch.ones(4))
    assert torch.allclose(value, four.mean(0), atol=1e-5) and not flagged.any()
    assert rejection_distance([0.0, 3.0, 1.0, 2.0], own=0) == 1.0  # the nearest other in a group of 4
    assert rejection_distance([5.0, 0.0], own=1) == 5.0  # a group of two: the other's
    assert rejection_distance([0.0, 7, 1, 6, 2, 5, 3, 4], own=0) == 3  # the 3rd nearest of 7 others
    assert rejection_distance([0.0, 0.0, 2.0, 3.0], own=0) == 2.0  # a copy of the owner's value does not count


def test_hostile_member_moves_the_mean_but_not_clipped_or_trimmed():
    """Member 3 sends -100x its values with weight 1e6. With the (capped) mean the honest members' values move
    far from 1; with CenteredClip and the trimmed mean they stay near the honest mean, every owner flags member 3
    in each chunk, and no honest member is flagged."""
    originals = honest_values()
    honest_mean = sum(originals[:3]) / 3
    faults = [None, None, None, HOSTILE]
    weights = [1.0, 1.0, 1.0, 1e6]
    values, _ = group_round(originals, faults, weights, "mean")
    for v in values[:3]:
        assert float((v - honest_mean).abs().mean()) > 10  # e.g. 1 -> about -39
    for mode in ("clipped", "trimmed"):
        values, results = group_round(originals, faults, weights, mode)
        for v in values[:3]:
            assert float((v - honest_mean).abs().mean()) < 0.3, mode
        for k in range(3):  # owners of honest parts flagged member 3 in every chunk of their part
            flagged = [e.flagged for e in results[k].evidence_by_index]
            assert flagged[3] == NUMEL // N // CHUNK and sum(flagged[:3]) == 0, mode


def test_a_distrusted_member_weighs_nothing_in_centered_clip_but_is_still_flagged():
    """CenteredClip alone leaves the honest result pulled ~tau/3 toward a persistent outlier inside the rejection
    radius (here 1.5x the honest value); once the owners distrust it (suspects.py) the honest members end at
    CenteredClip of the honest rows, and the outlier is still checked and flagged in every chunk (so a round in
    which it behaves can clear it)."""
    originals = honest_values()
    honest_mean = sum(originals[:3]) / 3
    faults, weights = [None, None, None, FaultConfig.parse("byzantine=1.5")], [1.0] * N
    pulled, _ = group_round(originals, faults, weights, "clipped")
    values, results = group_round(originals, faults, weights, "clipped", distrusted=[3])
    for k in range(3):
        bias, before = float((values[k] - honest_mean).abs().mean()), float((pulled[k] - honest_mean).abs().mean())
        assert bias < 0.02 < before, (bias, before)
        evidence = results[k].evidence_by_index[3]
        assert evidence.flagged == evidence.contributed == NUMEL // N // CHUNK and evidence.rejected == 0


def seen(flagged, contributed, rejected=None):
    """Per member: MemberEvidence of chunks flagged (of which `rejected`, default none) out of those contributed."""
    rejected = rejected or [0] * len(flagged)
    return [MemberEvidence(c, f, r) for f, c, r in zip(flagged, contributed, rejected)]


def test_a_member_clipped_in_every_chunk_is_a_suspect_from_its_second_round_and_clean_rounds_clear_it():
    tracker = SuspectTracker()
    peers = ["me", "honest", "hostile"]
    assert tracker.record_round(peers, seen([0, 1, 4], [0, 4, 4])) == []  # one chunk of four: chance, not a pattern
    assert SUSPECT_AFTER_ROUNDS == 2
    assert tracker.record_round(peers, seen([0, 0, 4], [0, 4, 4])) == ["hostile"]
    assert tracker.distrusted(["hostile", "me"]) == [0] and tracker.suspects == ["hostile"]
    tracker.record_round(peers, seen([0, 0, 0], [0, 4, 0]))  # absent from our part: its score stands
    assert tracker.suspects == ["hostile"]
    clean_rounds = 0
    while tracker.suspects:
        tracker.record_round(peers, seen([0, 0, 0], [0, 4, 4]))
        clean_rounds += 1
    assert clean_rounds == 3 and tracker.score("honest") < 0.25  # 1.9 -> 1.71 -> 1.54 -> 1.39
    for _ in range(50):  # however long an attack lasted, the cap bounds the clean rounds that clear it
        tracker.record_round(peers, seen([0, 0, 4], [0, 4, 4]))
    assert tracker.score("hostile") == 3.0
    assert [tracker.record_round(peers, seen([0, 0, 0], [0, 4, 4])) or tracker.suspects for _ in range(7)][-1] == []


@pytest.mark.parametrize("pattern, rounds_to_suspect", [
    ([1, 0], 3),  # the whole part every other round
    ([0.25], 9),  # a quarter of the chunks every round (bench_trust's sparse_chunks)
])
def test_members_that_attack_part_of_the_time_become_suspects(pattern, rounds_to_suspect):
    """Issue 26: a streak of flagged rounds, cleared by one clean round, never caught these two."""
    tracker, peers, chunks = SuspectTracker(), ["hostile"], 100
    became = [tracker.record_round(peers, seen([round(pattern[k % len(pattern)] * chunks)], [chunks]))
              for k in range(20)]
    assert [k + 1 for k, names in enumerate(became) if names][:1] == [rounds_to_suspect]
    assert tracker.suspects == ["hostile"]


def test_one_rejected_chunk_weighs_like_a_whole_part_of_clipped_ones():
    """Issue 26's sparse attacker: -100x in a quarter of its chunks, one chunk per part, so most rounds it sends
    nothing wrong. Counted as a clip, a rejection took a streak of hostile rounds to make a suspect; counted as
    the strong evidence it is (no honest value lies 10 median distances out), its first one puts the member at
    the cap, and it stays distrusted until the 7th clean round."""
    tracker, peers = SuspectTracker(), ["hostile"]
    assert tracker.record_round(peers, seen([1], [1], rejected=[1])) == ["hostile"]
    assert tracker.score("hostile") == SCORE_CAP
    assert [bool(tracker.record_round(peers, seen([0], [1])) or tracker.suspects) for _ in range(8)] == \
        [True] * 6 + [False] * 2  # 3.0 -> 2.7 -> ... -> 1.59, then 1.43: the 7th clean round clears it
    # Rejected in a quarter of many chunks: 0.75 a round, a suspect in its third round (clipped only: its ninth).
    tracker = SuspectTracker()
    assert [bool(tracker.record_round(peers, seen([25], [100], rejected=[25]))) for _ in range(3)] == \
        [False, False, True]


def test_an_honest_member_clipped_by_chance_is_never_a_suspect():
    """Chance clipping at 10% of its chunks, more than bench_trust ever saw (0-2 chunks in a whole run), settles
    the score at 1.0, below the threshold."""
    tracker, generator = SuspectTracker(), torch.Generator().manual_seed(0)
    for _ in range(200):
        hits = int((torch.rand(40, generator=generator) < 0.10).sum())
        assert tracker.record_round(["honest"], seen([hits], [40])) == []
    assert tracker.score("honest") < SUSPECT_SCORE


def test_overflowing_contributions_never_leave_an_infinite_average():
    """Two members send 3e38 (finite, but their sum overflows): each owner keeps and sends its own value for
    such chunks, so every member holds finite, identical values (before: inf at the owner, and the others
    silently kept different values)."""
    originals = honest_values(2)
    overflow = FaultConfig.parse("value=3e38")
    values, results = group_round(originals, [None, overflow, overflow, None], [1.0] * N, "mean")
    for v in values:
        assert torch.isfinite(v).all()
        assert torch.equal(v, values[0])
    assert sum(r.nonfinite_averages for r in results) > 0


def test_bad_aggregation_and_byzantine_spec_are_user_errors():
    with pytest.raises(UserError):
        FaultConfig.parse("byzantine=nan")
    plane = DataPlane()
    try:
        tag = wire.allreduce_tag(b"g" * 20, 0)
        with pytest.raises(UserError):
            GroupAllReduce(plane, torch.zeros(8), members=group_members([plane.address]), my_index=0, tag=tag,
                           secret=b"s" * 32, credentials=credentials(tag, 0), compression=get_compression("none"),
                           chunk_numel=16, deadline=time.monotonic() + 1, aggregation="median-of-means")
    finally:
        plane.close()


def test_a_byzantine_peer_can_attack_a_share_of_its_chunks():
    """`--faults byzantine=S,chunks=F` (issue 26's sparse attack): the hostile contribution replaces about F of the
    chunks, the same ones for the same seeds, and the others carry the peer's true values."""
    from moshpeer.averaging.faults import HostileCodec

    config = FaultConfig.parse("byzantine=-100,chunks=0.25,seed=3")
    attacked = [config.attacks_chunk(seed) for seed in range(4000)]
    assert 0.2 < sum(attacked) / len(attacked) < 0.3
    assert attacked == [config.attacks_chunk(seed) for seed in range(4000)]
    codec = HostileCodec(get_compression("none").reduce_codec, config)
    values = torch.ones(8)
    for seed in range(20):
        sent = codec.encode(values, seed=seed).view(torch.float32)
        assert torch.equal(sent, values * (-100.0 if config.attacks_chunk(seed) else 1.0))
    with pytest.raises(UserError, match="byzantine_chunks"):
        FaultConfig.parse("byzantine=-1,chunks=1.5")
