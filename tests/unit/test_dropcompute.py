"""DropCompute: the per-step compute budget, sample weighting, the automatic threshold, stragglers."""

from __future__ import annotations

import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from moshpeer.errors import UserError
from moshpeer.peer.optimizer.dropcompute import (
    ComputeBudget,
    StepReport,
    choose_threshold,
    computed_under_threshold,
    default_candidates,
    parse_compute_budget,
    simulate_threshold,
)
from moshpeer.peer.runtime.straggler import StragglerDelay, parse_straggler

pytestmark = pytest.mark.timeout(60)


def heavy_tailed_logs(seed: int, workers: int, steps: int, micro_batches: int, sigma: float = 1.0) -> list:
    """Synthetic per-micro-batch times: 1 ms of compute plus a lognormal delay of mean 5 ms."""
    delay = StragglerDelay("lognormal", mean_s=0.005, sigma=sigma, seed=seed)
    return [[[0.001 + delay.sample() for _ in range(micro_batches)] for _ in range(steps)] for _ in range(workers)]


# ---------------------------------------------------------------- the threshold rule


def test_simulated_threshold_matches_a_hand_computed_step():
    # Worker 0: 1+1+1+1 s. Worker 1: 1+5+1+1 s. tau = 2.5 s.
    logs = [[[1.0, 1.0, 1.0, 1.0]], [[1.0, 5.0, 1.0, 1.0]]]
    # Worker 0 starts micro-batches at 0, 1, 2 (< 2.5) and not at 3: 3 computed, done at 3 s.
    assert computed_under_threshold(logs[0][0], 2.5) == (3, 3.0)
    # Worker 1 starts at 0 and 1, not at 6: 2 computed, done at 6 s.
    assert computed_under_threshold(logs[1][0], 2.5) == (2, 6.0)
    estimate = simulate_threshold(2.5, logs)
    # 5 of 8 micro-batches computed; the step takes max(3, 6) = 6 s instead of max(4, 8) = 8 s.
    assert estimate.drop_rate == pytest.approx(3 / 8)
    assert estimate.time_saved == pytest.approx(1 / 4)
    assert estimate.speedup == pytest.approx((5 / 8) / (3 / 4) - 1)
    # A 2 s per-step overhead: 8 s instead of 10 s.
    with_overhead = simulate_threshold(2.5, logs, overhead_s=2.0)
    assert with_overhead.speedup == pytest.approx((5 / 8) / (8 / 10) - 1)
    assert simulate_threshold(None, logs).speedup == 0.0


def test_min_micro_batches_are_always_computed():
    assert computed_under_threshold([5.0, 5.0, 5.0], 1.0, min_micro_batches=2) == (2, 10.0)
    assert computed_under_threshold([5.0, 5.0, 5.0], 1.0, min_micro_batches=0) == (1, 5.0)


def test_auto_threshold_beats_no_drop_on_heavy_tailed_times():
    logs = heavy_tailed_logs(seed=1, workers=8, steps=40, micro_batches=8)
    candidates = default_candidates(logs)
    choice = choose_threshold(logs)
    assert choice.tau_s in candidates
    assert choice.best.speedup == max(c.speedup for c in choice.candidates)
    assert choice.best.speedup > 0.05
    # The choice must hold on times it was not chosen on, not just on its own log.
    fresh = heavy_tailed_logs(seed=2, workers=8, steps=200, micro_batches=8)
    held_out = simulate_threshold(choice.tau_s, fresh)
    assert held_out.speedup > 0.02, held_out
    assert held_out.drop_rate < 0.5

    explicit = [0.01, 0.02, 0.04, 0.08, 0.16]
    assert choose_threshold(logs, explicit).tau_s in explicit


def test_auto_threshold_keeps_everything_when_dropping_cannot_help():
    steady = [[[0.01] * 8 for _ in range(20)] for _ in range(4)]
    assert choose_threshold(steady, overhead_s=0.01).tau_s is None
    # A lone worker never waits for anyone: no drop, however the sample looks.
    lone = heavy_tailed_logs(seed=3, workers=1, steps=10, micro_batches=8, sigma=1.5)
    assert choose_threshold(lone).tau_s is None
    # A drop-rate cap rules out aggressive thresholds.
    logs = heavy_tailed_logs(seed=1, workers=8, steps=40, micro_batches=8)
    capped = choose_threshold(logs, max_drop_rate=0.05)
    assert capped.best.drop_rate <= 0.05


def test_auto_budget_calibrates_after_warmup_with_real_delays():
    candidates = [0.005, 0.01, 0.02, 0.04, 0.08]
    budget = ComputeBudget("auto", warmup_steps=20, num_workers=8, candidates=candidates)
    delay = StragglerDelay("lognormal", mean_s=0.002, sigma=1.5, seed=4)
    for step_index in range(22):
        with budget.step(planned_micro_batches=6) as step:
            while step.should_continue():
                delay()
                step.record(4)
        if step_index < 20:
            assert budget.tau_s is None and step.report.micro_batches == 6
    assert not budget.warming_up and len(budget.step_log) == 20
    assert budget.tau_s in candidates
    assert budget.choice is not None and budget.choice.best.speedup > 0


# ---------------------------------------------------------------- the budget in a real loop


def run_worker_step(budget: ComputeBudget, model: nn.Module, delay: StragglerDelay, planned: int) -> StepReport:
    """One worker's step: real forward/backward per micro-batch, slowed by the injected delay."""
    model.zero_grad()
    with budget.step(planned) as step:
        while step.should_continue():
            inputs = torch.randn(16, 32)
            loss = model(inputs).pow(2).mean()
            (loss * 16).backward()
            delay()
            step.record(16)
    step.average_gradients(model.parameters())
    return step.report


def synchronous_steps(tau_s, num_steps: int, planned: int = 8) -> list[tuple[float, list[StepReport]]]:
    """4 workers in threads; a step ends when all are done. Worker 0 is a heavy-tailed straggler."""
    delays = [StragglerDelay("lognormal", mean_s=0.015, sigma=1.2, seed=11)] + [
        StragglerDelay("constant", mean_s=0.003) for _ in range(3)
    ]
    budgets = [ComputeBudget(tau_s) for _ in range(4)]
    models = [nn.Linear(32, 4) for _ in range(4)]
    steps = []
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(num_steps):
            start = time.perf_counter()
            futures = [pool.submit(run_worker_step, budgets[w], models[w], delays[w], planned) for w in range(4)]
            reports = [future.result(timeout=30) for future in futures]
            steps.append((time.perf_counter() - start, reports))
    return steps


def test_budgeted_steps_take_the_budget_not_the_straggler():
    tau = 0.03
    unlimited = synchronous_steps(None, num_steps=12)
    budgeted = synchronous_steps(tau, num_steps=12)

    for wall, reports in unlimited:
        assert all(r.micro_batches == 8 and not r.stopped_by_budget for r in reports)
        # Without a budget the step lasts as long as its slowest worker's micro-batches.
        assert wall >= max(r.compute_s for r in reports)
    for wall, reports in budgeted:
        for r in reports:
            # The last micro-batch started before tau: compute time <= tau + one micro-batch.
            assert r.compute_s - r.micro_batch_s[-1] < tau
        assert wall < tau + max(r.micro_batch_s[-1] for r in reports) + 0.05

    straggler_unlimited = statistics.mean(reports[0].compute_s for _, reports in unlimited)
    assert straggler_unlimited > 3 * tau, "the injected delays make worker 0 a real straggler"
    mean_unlimited = statistics.mean(wall for wall, _ in unlimited)
    mean_budgeted = statistics.mean(wall for wall, _ in budgeted)
    assert mean_budgeted < 0.6 * mean_unlimited, (mean_budgeted, mean_unlimited)
    assert any(reports[0].stopped_by_budget for _, reports in budgeted)


def test_gradients_are_weighted_by_samples_computed():
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    sizes = [3, 5, 7, 2, 6, 4]  # unequal micro-batches
    batches = [(torch.randn(n, 5), torch.randn(n, 1)) for n in sizes]
    budget = ComputeBudget(0.1, min_micro_batches=2)
    delay = StragglerDelay("constant", mean_s=0.04)
    with budget.step(planned_micro_batches=len(sizes)) as step:
        for inputs, targets in batches:
            if not step.should_continue():
                break
            loss = (model(inputs) - targets).pow(2).mean()
            (loss * len(inputs)).backward()
            delay()
            step.record(len(inputs))
    weight = step.average_gradients(model.parameters())
    computed = step.micro_batches
    assert 2 <= computed < len(sizes), "the budget must cut this step short"
    assert weight == step.samples == sum(sizes[:computed])
    assert step.report.dropped_micro_batches == len(sizes) - computed

    # Reference: the mean loss over exactly the samples computed, in one batch.
    reference = nn.Linear(5, 1)
    reference.load_state_dict(model.state_dict())
    inputs = torch.cat([b[0] for b in batches[:computed]])
    targets = torch.cat([b[1] for b in batches[:computed]])
    (reference(inputs) - targets).pow(2).mean().backward()
    for ours, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, expected.grad)

    # Averaging per-micro-batch means instead (equal weights) would give another gradient.
    per_batch = []
    for inputs, targets in batches[:computed]:
        reference.zero_grad()
        (reference(inputs) - targets).pow(2).mean().backward()
        per_batch.append(reference.weight.grad.clone())
    assert not torch.allclose(torch.stack(per_batch).mean(0), model.weight.grad)


def test_step_api_without_context_manager_for_trainer_callbacks():
    budget = ComputeBudget(None)
    step = budget.begin_step()
    assert step.should_continue()
    step.record(8)
    report = step.finish()
    assert step.finish() is report and budget.last_report is report
    assert (budget.steps, budget.samples, budget.micro_batches) == (1, 8, 1)
    assert report.dropped_micro_batches is None
    with pytest.raises(RuntimeError):
        step.record(1)


# ---------------------------------------------------------------- stragglers and parsing


def test_straggler_delay_is_heavy_tailed_with_the_requested_mean():
    delay = StragglerDelay("lognormal", mean_s=0.02, sigma=1.0, seed=5)
    draws = [delay.sample() for _ in range(20000)]
    assert statistics.mean(draws) == pytest.approx(0.02, rel=0.05)
    assert max(draws) > 10 * statistics.median(draws)
    assert StragglerDelay("lognormal", seed=5).sample() == StragglerDelay("lognormal", seed=5).sample()
    spiky = StragglerDelay("constant", mean_s=0.01, probability=0.1, seed=1)
    hits = sum(spiky.sample() > 0 for _ in range(10000))
    assert 800 < hits < 1200

    slept = []
    sleeper = StragglerDelay("constant", mean_s=0.25, sleep=slept.append)
    assert sleeper() == 0.25 and slept == [0.25] and sleeper.total_s == 0.25


def test_parsing_budgets_and_stragglers():
    assert parse_compute_budget("auto") == "auto"
    assert parse_compute_budget("none") is None
    assert parse_compute_budget("0.5") == 0.5
    assert parse_compute_budget("250ms") == pytest.approx(0.25)
    assert parse_compute_budget("2s") == 2.0
    for bad in ("-1", "soon", "0", "nan"):
        with pytest.raises(UserError):
            parse_compute_budget(bad)
    straggler = parse_straggler("lognormal:mean_s=0.03,sigma=1.5,seed=7")
    assert (straggler.distribution, straggler.mean_s, straggler.sigma, straggler.seed) == ("lognormal", 0.03, 1.5, 7)
    assert parse_straggler("constant").distribution == "constant"
    slept = []
    spiky = parse_straggler("constant:mean_s=1,spike_s=3,spike_at=2")
    spiky.sleep = slept.append
    assert [spiky() for _ in range(4)] == [1.0, 1.0, 4.0, 1.0] and slept == [1.0, 1.0, 4.0, 1.0]
    for bad in ("gamma", "lognormal:mean=1", "lognormal:sigma=x", "constant:spike_s=-1", "constant:spike_at=1.5"):
        with pytest.raises(UserError):
            parse_straggler(bad)
    for bad in (-1.0, 0, math.inf, "fast", True):
        with pytest.raises(UserError):
            ComputeBudget(bad)  # type: ignore[arg-type]
