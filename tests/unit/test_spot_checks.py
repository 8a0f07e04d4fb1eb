"""Issue 26, accountability: data assigned per (run, peer, epoch), and spot checks that recompute a member's
contribution from it (moshpeer/peer/accountability/). In-process and deterministic: a member's contribution is built
here the way a trainer builds it (micro-batch gradients x samples, summed, / samples), and a `SpotChecker` at the
same parameters judges it. Before this, nothing recomputed a contribution: a member that sent zeros at its full
weight (bench_trust's `free_rider`) passed every check that existed."""

from __future__ import annotations

import math
import random

import msgpack
import pytest
import torch

from moshpeer.averaging.member_info import pack_member_info, parse_member_info
from moshpeer.averaging.report import ContributionSample
from moshpeer.averaging.suspects import SuspectTracker
from moshpeer.errors import ProtocolError
from moshpeer.peer.accountability import AssignedBatches, SpotChecker, assigned_batches, assignment_seed, compare
from moshpeer.peer.accountability.spot_checks import FAILED, PASSED, SKIPPED, TOLERANCE
from moshpeer.peer.tasks import load_task

RUN, PEER, OTHER, BATCH = "run", "QmMember", "QmOther", 32


@pytest.fixture(scope="module")
def task():
    return load_task("digits")


def contribution(task, peer: str, epoch: int, samples: int) -> torch.Tensor:
    """What a trainer on its assignment averages: its epoch's mean gradient, flat in parameter order."""
    params = list(task.model.parameters())
    sums = [torch.zeros_like(p) for p in params]
    stream, counted = assigned_batches(task, RUN, peer, epoch, BATCH), 0
    while counted < samples:
        task.model.zero_grad()
        loss, count = task.loss(task.model, next(stream))
        loss.backward()
        for acc, p in zip(sums, params):
            acc.add_(p.grad, alpha=float(count))
        counted += count
    task.model.zero_grad()
    return torch.cat([s.reshape(-1) for s in sums]) / samples


def sample_of(values: torch.Tensor, start: int, end: int, work=(3, BATCH), weight: float = 64.0,
              peer: str = PEER) -> ContributionSample:
    return ContributionSample(peer, work, weight, start, values[start:end].clone())


def checker_at_epoch(task, epoch: int = 3) -> SpotChecker:
    checker = SpotChecker(task, RUN, list(task.model.parameters()), rate=1.0, rng=random.Random(0))
    checker.start_epoch(epoch)
    return checker


def test_an_honest_contribution_passes_and_anything_else_fails(task):
    honest = contribution(task, PEER, 3, 64)
    part = (honest.numel() // 4, honest.numel() // 2)  # the owner's quarter
    checker = checker_at_epoch(task)
    before = [p.detach().clone() for p in task.model.parameters()]
    verdict = checker.check(sample_of(honest, *part), epoch=3, own_samples=64)
    assert verdict.outcome == PASSED and verdict.relative_error < 1e-5 and verdict.samples == 64, verdict
    for name, sent in (("zeros", torch.zeros_like(honest)), ("reversed", -honest), ("doubled", 2 * honest),
                       ("another epoch's data", contribution(task, PEER, 4, 64)),
                       ("another peer's data", contribution(task, OTHER, 3, 64))):
        verdict = checker.check(sample_of(sent, *part), epoch=3, own_samples=64)
        assert verdict.outcome == FAILED and verdict.relative_error > TOLERANCE, (name, verdict)
    # The checker's model is as it was: parameters, and no gradients left behind.
    assert all(torch.equal(b, p) for b, p in zip(before, task.model.parameters()))
    assert all(p.grad is None or not p.grad.any() for p in task.model.parameters())


def test_what_a_member_declares_must_hold(task):
    honest = contribution(task, PEER, 3, 64)
    part = (0, honest.numel() // 4)
    checker = checker_at_epoch(task)
    assert checker.check(sample_of(honest, *part, work=None), 3, 64).outcome == FAILED  # no work declared
    assert checker.check(sample_of(honest, *part, weight=63.5), 3, 64).outcome == FAILED  # not a sample count
    assert checker.check(sample_of(honest, *part, weight=96.0), 3, 64).outcome == FAILED  # more than it computed
    # A claim nobody could afford to recompute is no way around the checks.
    assert checker.check(sample_of(honest, *part, weight=1e6), 3, 64).outcome == FAILED
    assert checker.check(sample_of(honest, *part, work=(3, 1 << 20)), 3, 64).outcome == FAILED  # batch > samples
    huge = sample_of(honest, *part, work=(3, 2000), weight=2000.0)  # more than the task's 1,257 examples per batch
    assert checker.check(huge, 3, 400).outcome == FAILED
    assert checker.check(sample_of(honest, *part, weight=0.0, work=None), 3, 64).outcome == SKIPPED  # an aux peer
    # What the checker cannot judge fairly is skipped, not held against the member.
    assert checker.check(sample_of(honest, *part, work=(2, BATCH)), 3, 64).outcome == SKIPPED  # another epoch
    assert checker.check(sample_of(honest, *part, work=(2, BATCH)), 3, 64).outcome == SKIPPED  # ... twice in a row
    assert checker.check(sample_of(honest, *part, work=(2, BATCH)), 3, 64).outcome == FAILED  # a third: a dodge
    assert checker.check(sample_of(honest, *part), 3, 64).outcome == PASSED  # a fair check starts the count over
    assert checker.check(sample_of(honest, *part, work=(2, BATCH)), 3, 64).outcome == SKIPPED

    numel = honest.numel()
    params_half = ContributionSample(PEER, (3, BATCH), 64.0, numel, torch.zeros(10))  # a parameters round's values
    assert checker.check(params_half, 3, 64).outcome == SKIPPED


def test_only_the_chunks_that_arrived_are_compared(task):
    honest = contribution(task, PEER, 3, 64)
    start, end = 0, honest.numel() // 4
    sent = honest[start:end].clone()
    sent[: sent.numel() // 2] = float("nan")  # half the part's chunks never arrived
    checker = checker_at_epoch(task)
    assert checker.check(ContributionSample(PEER, (3, BATCH), 64.0, start, sent), 3, 64).outcome == PASSED
    assert checker.check(ContributionSample(PEER, (3, BATCH), 64.0, start, torch.full_like(sent, math.nan)),
                         3, 64).outcome == SKIPPED
    assert compare(torch.tensor([1.0, math.nan]), torch.tensor([1.0, 5.0])) == 0.0
    assert compare(torch.tensor([0.0, 0.0]), torch.tensor([3.0, 4.0])) == pytest.approx(1.0)


def test_checks_run_at_the_given_rate_after_rounds_that_sampled_someone(task):
    class Round:
        def __init__(self, sample):
            self.epoch, self.samples = 3, 64
            self.result = type("R", (), {"ok": True, "sample": sample})()

    honest = contribution(task, PEER, 3, 64)
    sample = sample_of(honest, 0, 100)
    never = SpotChecker(task, RUN, list(task.model.parameters()), rate=0.0)
    assert never.after_round(Round(sample)) is None
    sometimes = SpotChecker(task, RUN, list(task.model.parameters()), rate=0.3, rng=random.Random(1))
    sometimes.start_epoch(3)
    ran = [sometimes.after_round(Round(sample)) for _ in range(200)]
    assert 40 <= sum(r is not None for r in ran) <= 80
    assert all(r.outcome == PASSED for r in ran if r is not None)
    assert sometimes.samples_checked == 64 * sum(r is not None for r in ran)
    assert sometimes.after_round(Round(None)) is None  # a "mean" round keeps no contribution


def test_the_assignment_is_a_function_of_run_peer_and_epoch_and_resumes_exactly(task):
    first = [b[1].tolist() for b, _ in zip(assigned_batches(task, RUN, PEER, 3, BATCH), range(3))]
    assert first == [b[1].tolist() for b, _ in zip(assigned_batches(task, RUN, PEER, 3, BATCH), range(3))]
    assert assignment_seed(RUN, PEER, 3) != assignment_seed(RUN, PEER, 4) != assignment_seed(RUN, OTHER, 4)
    assert assignment_seed(RUN, PEER, 3) != assignment_seed("other-run", PEER, 3)

    epoch = [3]
    stream = AssignedBatches(task, BATCH, RUN, PEER, lambda: epoch[0])
    taken = [next(stream)[1].tolist() for _ in range(2)]
    assert taken == first[:2]
    saved = stream.state_dict()
    expected = next(stream)[1].tolist()
    resumed = AssignedBatches(task, BATCH, RUN, PEER, lambda: epoch[0])
    resumed.load_state_dict(saved)
    assert next(resumed)[1].tolist() == expected == first[2]
    epoch[0] = 4  # the next epoch starts its own stream from its first batch
    assert next(stream)[1].tolist() == next(iter(assigned_batches(task, RUN, PEER, 4, BATCH)))[1].tolist()


def test_a_failed_check_distrusts_until_a_check_passes():
    tracker = SuspectTracker(warn=False)
    peers = ["QmA", "QmB", "QmC"]
    assert tracker.record_spot_check("QmB", passed=False) is True
    assert tracker.record_spot_check("QmB", passed=False) is False  # already distrusted
    assert tracker.distrusted(peers) == [1] and tracker.suspects == ["QmB"]
    assert tracker.record_spot_check("QmB", passed=True) is False
    assert tracker.distrusted(peers) == [] and tracker.suspects == []


def test_declared_work_travels_in_the_member_metadata_and_is_checked():
    packed = pack_member_info("127.0.0.1", 4000, 64.0, bytes(16), work=(7, 32))
    assert parse_member_info(packed).work == (7, 32)
    assert parse_member_info(pack_member_info("127.0.0.1", 4000, 64.0, bytes(16))).work is None
    info = msgpack.unpackb(packed, raw=False)
    for bad in ([7], [7, 0], [-1, 32], [7.0, 32], "7,32", [1 << 62, 32]):
        with pytest.raises(ProtocolError):
            parse_member_info(msgpack.packb({**info, "work": bad}))
