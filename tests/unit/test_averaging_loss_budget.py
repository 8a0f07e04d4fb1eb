"""Loss budget (DBLP): the phase signal, and rounds that end at the budget instead of the deadline."""

from __future__ import annotations

import pytest
import torch

from local_group import run_group

from moshpeer.averaging import FaultConfig, FaultyLinks
from moshpeer.averaging.budget_stall import allowance_share
from moshpeer.averaging.links import PLAIN_LINKS
from moshpeer.averaging.loss_budget import CRITICAL, NORMAL, LossBudget
from moshpeer.averaging.partition import Partition

pytestmark = pytest.mark.timeout(60)


def test_phase_signal_switches_the_budget():
    """Accordion's rule on scripted window norms (norm of the gradient summed over each window)."""
    budget = LossBudget(p_low=0.02, p_high=0.42, eta=0.5)
    assert budget.phase == CRITICAL and budget.budget == 0.02  # training starts critical
    script = [
        (10.0, NORMAL),    # end of the first window: nothing to compare yet, P <- P_high (DBLP)
        (9.0, NORMAL),     # -10%
        (8.5, NORMAL),
        (4.0, CRITICAL),   # -53%: critical phase
        (3.9, NORMAL),
        (6.0, CRITICAL),   # +54%
        (6.5, NORMAL),
        (0.0, CRITICAL),   # -100%
        (0.0, NORMAL),     # zero after zero: no change
        (1.0, CRITICAL),   # anything after zero is an infinite change
        (float("nan"), CRITICAL),
    ]
    for norm, phase in script:
        assert budget.on_window(norm) == phase, norm
        assert budget.budget == (0.02 if phase == CRITICAL else 0.42)


def test_signal_windows_are_aligned_on_the_swarm_epoch():
    budget = LossBudget(window=5)
    assert [e for e in range(16) if budget.window_ends(e)] == [4, 9, 14]
    assert all(LossBudget(window=1).window_ends(e) for e in range(4))
    from moshpeer.errors import UserError
    for bad in (0, -1, 2.5):
        with pytest.raises(UserError):
            LossBudget(window=bad)


def test_windowed_signal_ignores_step_noise():
    """Near convergence one step's gradient norm swings by more than eta; the norm of the gradient
    summed over a window of those steps does not (scripted: a steady mean gradient plus alternating
    noise that changes the per-step norm by +-60%)."""
    torch.manual_seed(0)
    mean = torch.ones(100)
    steps = [mean + (1.6 if k % 2 else -0.6) * mean for k in range(20)]  # per-step norms 4, 26, 4, 26, ...
    per_step, windowed = LossBudget(window=1), LossBudget(window=4)
    step_phases, window_phases, total = [], [], torch.zeros(100)
    for epoch, g in enumerate(steps):
        step_phases.append(per_step.on_window(float(g.norm())))
        total += g
        if windowed.window_ends(epoch):
            window_phases.append(windowed.on_window(float(total.norm())))
            total.zero_()
    assert step_phases.count(CRITICAL) >= 15  # every step looks like a phase change
    assert window_phases == [NORMAL] * 5  # window sums are steady


def test_group_applies_the_smallest_declared_budget():
    from moshpeer.averaging.loss_budget import group_budget

    assert group_budget([(0.42, NORMAL), (0.02, CRITICAL), (0.42, NORMAL)]) == (0.02, CRITICAL)
    assert group_budget([(0.42, NORMAL)] * 3) == (0.42, NORMAL)
    with pytest.raises(ValueError):
        group_budget([])


def test_fixed_budget_never_changes():
    budget = LossBudget.fixed(0.0)
    for norm in (1.0, 100.0, 0.01):
        budget.on_window(norm)
        assert budget.budget == 0.0


def _round(loss_budget: float, slow_delay: float = 0.15, faults=None, group_id: bytes = b""):
    """4 members in threads; member 3 sends every chunk `slow_delay` late (a lossy, retransmitting link),
    or, with `faults`, every member's outgoing chunks go through that FaultConfig."""
    tensors = [torch.randn(4096) + k for k in range(4)]

    def links(k: int) -> dict:
        if faults is not None:
            return {"links": FaultyLinks(faults)}
        return {"links": FaultyLinks(FaultConfig(delay_s=slow_delay)) if k == 3 else PLAIN_LINKS}

    results = run_group(tensors, group_id=group_id or None, chunk_numel=64, deadline_s=8.0, loss_budget=loss_budget,
                        member_kwargs=links)
    return results, tensors


def test_round_ends_at_the_budget_not_the_deadline():
    baseline, _ = _round(loss_budget=0.0)
    budgeted, tensors = _round(loss_budget=0.42)
    fast_baseline = max(r.total_s for r in baseline[:3])
    fast_budgeted = max(r.total_s for r in budgeted[:3])
    assert fast_baseline > 1.5  # waits for the slow member's 16 chunks
    assert fast_budgeted < fast_baseline / 3
    for r in budgeted[:3]:
        assert r.reduce.chunks_lost > 0  # the budget accepted the loss and reports it
    # The fast members hold identical values on every chunk of a fast owner that they all received.
    compared = 0
    for part in range(3):
        for chunk in range(16):
            if any((part, chunk) in r.missing_chunks for r in budgeted[:3]):
                continue
            lo, hi = part * 1024 + chunk * 64, part * 1024 + (chunk + 1) * 64
            assert torch.equal(tensors[0][lo:hi], tensors[1][lo:hi]) and torch.equal(tensors[1][lo:hi], tensors[2][lo:hi])
            compared += 1
    assert compared > 0


# Microbursts on every link: a burst starts with probability 0.03 per chunk, lasts 6 transmissions and
# loses 75% of them. Links are reliable (TCP-like): a lost chunk is resent after 0.2 s unless the
# budget lets the sender leave it lost.
BURSTS = dict(burst_prob=0.03, burst_len=6, burst_loss=0.75, retransmit_s=0.2)


def test_bursts_end_rounds_at_the_budget_not_the_deadline():
    # A fixed group id and seed: both runs meet the same bursts on the same links.
    seed, group_id = 2, bytes([2]) * 20
    baseline, _ = _round(loss_budget=0.0, faults=FaultConfig(**BURSTS, seed=seed), group_id=group_id)
    budgeted, _ = _round(loss_budget=0.42, faults=FaultConfig(**BURSTS, seed=seed), group_id=group_id)
    slowest_baseline = max(r.total_s for r in baseline)
    slowest_budgeted = max(r.total_s for r in budgeted)
    # The reliable baseline loses nothing but waits out retransmissions inside the bursts.
    assert all(r.reduce.chunks_lost == 0 and r.gather.chunks_lost == 0 for r in baseline)
    assert slowest_baseline > 0.6, [r.total_s for r in baseline]
    assert slowest_budgeted < slowest_baseline / 3, (slowest_budgeted, slowest_baseline)
    # Bounded by the budget rule: what each member lost in a phase stays within P of what it expected.
    lost_any = 0
    for r in budgeted:
        for phase in (r.reduce, r.gather):
            assert phase.chunks_lost <= 0.42 * phase.chunks_expected, phase
            lost_any += phase.chunks_lost
    assert lost_any > 0  # the bursts did hit, and the budget absorbed them


def test_settings_parse_and_bad_ones_are_user_errors():
    from moshpeer.averaging.loss_budget import parse_loss_budget
    from moshpeer.errors import UserError

    assert parse_loss_budget(None).budget == 0.0 and parse_loss_budget("fixed").budget == 0.0
    assert parse_loss_budget("0.1").budget == 0.1 and not parse_loss_budget(0.1).phase_aware
    phased = parse_loss_budget("0.05,0.3", eta=0.25)
    assert phased.phase_aware and (phased.p_low, phased.p_high, phased.eta) == (0.05, 0.3, 0.25)
    assert parse_loss_budget("phase").describe() == {"mode": "phase", "p_low": 0.02, "p_high": 0.42, "eta": 0.5,
                                                     "window": 5}
    assert parse_loss_budget("phase", window=3).window == 3
    for bad in ("lots", "1.5", "0.5,0.1", "0.1,0.2,0.3", "-0.1"):
        with pytest.raises(UserError):
            parse_loss_budget(bad)


def test_allowance_is_per_receiver_and_phase():
    """DBLP counts the budget over everything a receiver expects in a phase: the senders' shares of the
    allowance add up to floor(P x that), whatever the stream sizes."""
    n, numel, chunk, budget = 4, 4096 + 100, 64, 0.05
    partition = Partition(numel, n, chunk)
    for j in range(n):
        expected = {"reduce": partition.num_chunks(j) * (n - 1),
                    "gather": sum(partition.num_chunks(k) for k in range(n) if k != j)}
        for phase, total in expected.items():
            shares = [allowance_share(budget, partition, phase, k, j) for k in range(n) if k != j]
            assert sum(shares) == int(budget * total), (j, phase, shares)
            assert max(shares) - min(shares) <= 1


def test_critical_budget_resends_beyond_it_without_stalling():
    """P_low: the budget covers few chunks, so losses beyond it are resent, selectively (DBLP's transport):
    later chunks do not wait behind a resend as they do on the TCP-like baseline link."""
    seed, group_id = 2, bytes([2]) * 20
    baseline, _ = _round(loss_budget=0.0, faults=FaultConfig(**BURSTS, seed=seed), group_id=group_id)
    critical, _ = _round(loss_budget=0.05, faults=FaultConfig(**BURSTS, seed=seed), group_id=group_id)
    slowest_baseline = max(r.total_s for r in baseline)
    slowest_critical = max(r.total_s for r in critical)
    # The same bursts on the same links: the baseline's extra time is what its later chunks waited behind resends
    # (retransmission timeouts slept in turn): 3.5 s against 1.6 s beside two busy loops on 2 cores, six runs. The
    # ratio asked before (< 1/2) left 8% of margin, and failed once under `-n 2`; the waiting does not scale
    # with the machine's load.
    assert slowest_baseline - slowest_critical > 1.0, (slowest_critical, slowest_baseline)
    dropped = lost = 0
    for r in critical:
        for phase in (r.reduce, r.gather):
            assert phase.chunks_lost <= int(0.05 * phase.chunks_expected), phase  # 2 of 48
            dropped, lost = dropped + phase.chunks_dropped_by_faults, lost + phase.chunks_lost
    assert dropped > lost  # the bursts lost more than the budget allows: the rest was resent
