"""The direction check (issue 26): a member that sends the reverse of its update inside the clip radius is never
clipped, but its contributions' alignment with the others' (aggregation.alignments) gives it away over rounds
(suspects.SuspectTracker); honest members, however noisy, are not distrusted."""

from __future__ import annotations

import math

import pytest
import torch
from local_group import run_group

from moshpeer.averaging import FaultConfig, FaultyLinks
from moshpeer.averaging.aggregation import alignments, centered_clip
from moshpeer.averaging.links import PLAIN_LINKS
from moshpeer.averaging.suspects import (ALIGNMENT_T_SUSPECT, AlignmentEvidence, AlignmentRecord, MemberEvidence,
                                        SuspectTracker)

pytestmark = pytest.mark.timeout(90)

PEERS = ["owner", "honest-1", "honest-2", "reverser"]


def updates(generator: torch.Generator, snr: float, numel: int = 4096, reverse_last: bool = True) -> torch.Tensor:
    """One round's contributions to a chunk: 4 noisy estimates of one mean (per-value signal / noise = `snr`),
    the last one negated when `reverse_last` (the honest scale, so it stays inside the clip radius)."""
    mean = snr * torch.randn(numel, generator=generator)
    rows = mean + torch.randn(4, numel, generator=generator)
    if reverse_last:
        rows[3] = -rows[3]
    return rows


def one_round(tracker: SuspectTracker, rows: torch.Tensor, chunks: int = 1):
    """What an owner does with `chunks` chunks of its part: CenteredClip each, then record the round. -> (clipped
    rows per chunk, what became a suspect)."""
    distrusted = tracker.distrusted(PEERS)
    weights = torch.tensor([0.0 if i in distrusted else 1.0 for i in range(4)])
    evidence = [MemberEvidence(contributed=chunks) for _ in PEERS]
    clipped = []
    for piece in rows.chunk(chunks, dim=1):
        _, flagged, _, aligned = centered_clip(piece, weights, own=0)
        clipped.append(flagged.tolist())
        for seen, z in zip(evidence, aligned):
            seen.alignment.add(z)  # the flags are left out: this checks the direction check alone
    return clipped, tracker.record_round(PEERS, evidence)


def test_alignment_is_root_d_times_the_cosine_with_the_others_mean_and_chance_gives_a_standard_normal():
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 1000, generator=generator) + 0.2
    gram = (rows @ rows.T).double().tolist()
    reference = [True, True, False, True]  # row 2 kept no weight: it is measured, but not a reference
    z = alignments(gram, 1000, reference)
    for i in range(4):
        others = rows[[j for j in range(4) if j != i and reference[j]]].mean(0)
        expected = math.sqrt(1000) * float(torch.nn.functional.cosine_similarity(rows[i], others, dim=0))
        assert z[i] == pytest.approx(expected, rel=1e-4)
    assert alignments([[1.0, 0.0], [0.0, 0.0]], 10, [True, True]) == [None, None]  # a zero vector
    assert alignments([[1.0]], 10, [True]) == [None]
    chance = [z for _ in range(300) for z in alignments(
        (lambda x: (x @ x.T).double().tolist())(torch.randn(4, 2000, generator=generator)), 2000, [True] * 4)]
    mean = sum(chance) / len(chance)
    spread = math.sqrt(sum((z - mean) ** 2 for z in chance) / len(chance))
    assert abs(mean) < 0.1 and 0.9 < spread < 1.1


def test_a_reversed_member_inside_the_clip_radius_is_distrusted_within_two_rounds_and_stays_so():
    """Per-value SNR 0.3 in chunks of 4096: the reverser is never clipped (CenteredClip cannot see it), yet it is
    distrusted after MIN_ALIGNMENT_CHUNKS measurements and stays distrusted while it keeps reversing."""
    tracker, generator = SuspectTracker(), torch.Generator().manual_seed(1)
    became_at = None
    for k in range(40):
        clipped, became = one_round(tracker, updates(generator, snr=0.3))
        assert not clipped[0][3], "the premise: inside the clip radius"
        if became:
            assert became == ["reverser"] and became_at is None
            became_at = k + 1
    assert became_at == 2
    assert tracker.suspects == ["reverser"] and tracker.distrusted(PEERS) == [3]
    assert tracker.alignment_t("reverser") < ALIGNMENT_T_SUSPECT < 0 < tracker.alignment_t("honest-1")


def test_a_reverser_that_behaves_again_is_cleared():
    tracker, generator = SuspectTracker(), torch.Generator().manual_seed(2)
    for _ in range(10):
        one_round(tracker, updates(generator, snr=0.3))
    assert tracker.suspects == ["reverser"]
    for rounds in range(1, 200):
        one_round(tracker, updates(generator, snr=0.3, reverse_last=False))
        if not tracker.suspects:
            break
    assert tracker.suspects == [] and rounds < 60, rounds


@pytest.mark.parametrize("snr", [0.0, 0.02, 1.0])
def test_honest_members_are_never_distrusted_from_pure_noise_to_a_strong_signal(snr):
    """500 rounds of 4 chunks: pure noise (z ~ N(0, 1), negative half the time), a weak signal, a strong one."""
    tracker, generator = SuspectTracker(), torch.Generator().manual_seed(3)
    for _ in range(500):
        _, became = one_round(tracker, updates(generator, snr=snr, numel=2048, reverse_last=False), chunks=4)
        assert became == []
    assert tracker.suspects == []


def test_the_data_plane_reports_each_members_alignment_in_a_clipped_round():
    """Through the real group all-reduce (members in threads over TCP): member 3 sends its values negated
    (`byzantine=-1`: the honest scale, inside the clip radius), and every honest owner measured it as opposed to
    the others in each chunk of its part, the honest members as aligned."""
    generator = torch.Generator().manual_seed(4)
    mean = 0.5 * torch.randn(4096, generator=generator)
    tensors = [mean + torch.randn(4096, generator=generator) for _ in range(4)]
    faults = [None, None, None, FaultConfig.parse("byzantine=-1")]
    results = run_group(tensors, weights=[1.0] * 4, chunk_numel=256, deadline_s=20.0, aggregation="clipped",
                        member_kwargs=lambda k: {"links": FaultyLinks(faults[k]) if faults[k] else PLAIN_LINKS})
    for owner in range(3):
        records = [e.alignment for e in results[owner].evidence_by_index]
        assert [r.chunks for r in records] == [4] * 4  # each member's 4 chunks of this owner's part
        assert records[3].total / records[3].chunks < -3
        # The honest ones' reference holds the reverser: it cancels one honest member's signal, so theirs is lower.
        assert all(records[i].total / records[i].chunks > 0.5 for i in range(3))


def test_lazy_decay_and_running_totals_give_what_decaying_every_record_every_round_gives():
    """AlignmentEvidence stores each record with its round and pools the spread in running totals (a round costs
    O(members), not O(peers met)); the t statistics equal the eager computation's."""
    generator = torch.Generator().manual_seed(5)
    lazy, eager = AlignmentEvidence(), {}
    peers = [f"p{k}" for k in range(12)]
    for _ in range(150):
        lazy.next_round()
        eager = {peer: record.decayed(lazy.decay) for peer, record in eager.items()}
        eager = {peer: record for peer, record in eager.items() if record.chunks >= 1e-9}
        for k in torch.randperm(12, generator=generator)[:4].tolist():  # a group of four of the peers met
            record = AlignmentRecord()
            for z in (3.0 * torch.randn(3, generator=generator) + (k - 6)).tolist():
                record.add(z)
            lazy.add(peers[k], record)
            eager[peers[k]] = eager.get(peers[k], AlignmentRecord()) + record
    dof = sum(r.chunks for r in eager.values()) - len(eager)
    variance = max(sum(r.deviation_squares for r in eager.values()) / dof, 1.0)
    for peer, record in eager.items():
        assert lazy.t(peer) == pytest.approx(record.total / math.sqrt(record.chunks * variance), rel=1e-6)
