"""DropCompute: a per-step compute budget, so one slow peer does not set the pace of the swarm.

After Giladi et al., "DropCompute: simple and more robust distributed synchronous training via
compute variance reduction" (NeurIPS 2023). A peer times the micro-batches of its current step;
once the step's elapsed time reaches the threshold tau it stops computing further micro-batches
and contributes what it has. The micro-batch that crosses tau is finished (work in flight is not
thrown away), so a step's compute time is at most tau plus one micro-batch.

Gradients are weighted by the samples actually computed, not by the nominal batch: backward
`loss_mean * num_samples` for every micro-batch (a sum of per-sample losses), then divide the
accumulated gradients by `step.samples` (`BudgetedStep.average_gradients`). In a swarm the peer
then contributes this mean gradient with weight `step.samples`, so the swarm's average is the sum
of per-sample gradients over all samples computed, divided by their number. (The paper's
reference code divides by the nominal number of micro-batches instead, i.e. dropped micro-batches
count as zero gradients; with unequal peers that biases the average toward fast peers' data.)

`ComputeBudget("auto")` picks tau the paper's way: run `warmup_steps` steps without a budget,
logging every micro-batch's time, then simulate each candidate tau on the logged times and keep
the one with the largest effective speed-up; see `simulate_threshold` for the exact formula.

The budget object knows nothing about the training loop: a plain loop uses `with budget.step()`,
and a Hugging Face Trainer callback can call `begin_step()` / `record()` / `finish()` itself.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Optional, Sequence, Union

import torch

from moshpeer.errors import UserError

BudgetSetting = Union[float, int, None, Literal["auto"]]
# worker_logs[w][s] = durations (seconds) of the micro-batches worker w computed in step s.
StepLog = Sequence[float]
WorkerLogs = Sequence[Sequence[StepLog]]


# --------------------------------------------------------------------------------------------
# Simulating a threshold on logged micro-batch times
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThresholdEstimate:
    """What a threshold `tau_s` would have done to the logged steps (`None` = never drop)."""

    tau_s: Optional[float]
    drop_rate: float  # fraction of micro-batches not computed
    time_saved: float  # fraction of step time saved
    speedup: float  # effective speed-up: (1 - drop_rate) / (1 - time_saved) - 1


@dataclass(frozen=True)
class ThresholdChoice:
    """The outcome of choosing tau: the best estimate and every candidate's estimate."""

    best: ThresholdEstimate
    candidates: tuple[ThresholdEstimate, ...]

    @property
    def tau_s(self) -> Optional[float]:
        return self.best.tau_s


def computed_under_threshold(
    durations: StepLog, tau_s: Optional[float], min_micro_batches: int = 1
) -> tuple[int, float]:
    """(micro-batches computed, compute time) of one logged step had tau applied.

    Micro-batch i (1-based) is computed iff i <= min_micro_batches or the step's elapsed time
    before it, T_{i-1} = d_1 + ... + d_{i-1}, is below tau. That is the check `should_continue`
    makes before each micro-batch; the computed ones are a prefix and the time is T_k.
    """
    elapsed = 0.0
    for count, duration in enumerate(durations):
        if count >= min_micro_batches and tau_s is not None and elapsed >= tau_s:
            return count, elapsed
        elapsed += duration
    return len(durations), elapsed


def simulate_threshold(
    tau_s: Optional[float], worker_logs: WorkerLogs, *, overhead_s: float = 0.0, min_micro_batches: int = 1
) -> ThresholdEstimate:
    """Estimate the effect of threshold `tau_s` on synchronous steps from logged micro-batch times.

    For step s, worker w computes k_ws(tau) micro-batches taking c_ws(tau) seconds
    (`computed_under_threshold`). The step ends when the slowest worker is done, plus a fixed
    per-step overhead (communication, optimizer): S_s(tau) = max_w c_ws(tau) + overhead_s.
    With M the number of logged micro-batches and no-drop meaning tau = infinity:

        drop_rate(tau)  = 1 - sum_ws k_ws(tau) / M
        time_saved(tau) = 1 - sum_s S_s(tau) / sum_s S_s(inf)
        speedup(tau)    = (1 - drop_rate) / (1 - time_saved) - 1

    i.e. the relative change of samples per second; 0 for no drop, positive when dropping wins.
    Steps are aligned by index across workers; a worker with fewer steps is cut to the shortest.
    """
    num_steps = min((len(log) for log in worker_logs), default=0)
    total = computed = 0
    time_with = time_without = 0.0
    for step in range(num_steps):
        slowest_with = slowest_without = 0.0
        for log in worker_logs:
            durations = log[step]
            count, seconds = computed_under_threshold(durations, tau_s, min_micro_batches)
            computed += count
            total += len(durations)
            slowest_with = max(slowest_with, seconds)
            slowest_without = max(slowest_without, sum(durations))
        time_with += slowest_with + overhead_s
        time_without += slowest_without + overhead_s
    if total == 0 or time_without <= 0.0:
        raise ValueError("cannot simulate a threshold without logged micro-batch times")
    drop_rate = 1.0 - computed / total
    time_saved = 1.0 - time_with / time_without
    speedup = (1.0 - drop_rate) / (1.0 - time_saved) - 1.0
    return ThresholdEstimate(tau_s, drop_rate, time_saved, speedup)


def default_candidates(worker_logs: WorkerLogs, count: int = 48) -> list[float]:
    """`count` log-spaced thresholds from the median first micro-batch time to the slowest step."""
    first = [log[0] for steps in worker_logs for log in steps if log]
    totals = [sum(log) for steps in worker_logs for log in steps if log]
    if not first:
        raise ValueError("no logged micro-batch times")
    low, high = statistics.median(first), max(totals)
    if high <= low * (1 + 1e-9):
        return [high]
    ratio = (high / low) ** (1.0 / (count - 1))
    return [low * ratio**i for i in range(count)]


def choose_threshold(
    worker_logs: WorkerLogs,
    candidates: Optional[Iterable[float]] = None,
    *,
    overhead_s: float = 0.0,
    max_drop_rate: Optional[float] = None,
    min_micro_batches: int = 1,
) -> ThresholdChoice:
    """Pick the candidate tau with the largest effective speed-up (`simulate_threshold`).

    No drop (tau None, speed-up 0) is always a candidate, so the result never estimates a loss;
    ties go to the larger tau (fewer dropped samples). `max_drop_rate` rules out thresholds that
    would drop more than that fraction of micro-batches.

    With the logs of a single worker the answer is always no drop: nobody waits for a lone
    worker, and by Wald's identity stopping on elapsed time leaves its expected samples per
    second unchanged (E[time of k micro-batches] = E[k] * E[duration] for a stopping time k),
    so any estimated gain would be the noise of the sample (large for heavy tails), not a gain.
    """
    if max_drop_rate is not None and not 0 <= max_drop_rate <= 1:
        raise UserError(f"max_drop_rate must be in [0, 1], got {max_drop_rate}")
    taus = sorted(set(default_candidates(worker_logs) if candidates is None else candidates))
    if any(not (tau > 0 and math.isfinite(tau)) for tau in taus):
        raise UserError(f"DropCompute candidate thresholds must be positive and finite, got {taus}")
    options = [simulate_threshold(None, worker_logs, overhead_s=overhead_s, min_micro_batches=min_micro_batches)]
    options += [
        simulate_threshold(tau, worker_logs, overhead_s=overhead_s, min_micro_batches=min_micro_batches)
        for tau in taus
    ]
    if len(worker_logs) < 2:
        return ThresholdChoice(options[0], tuple(options))
    allowed = [o for o in options if max_drop_rate is None or o.drop_rate <= max_drop_rate]
    # max() keeps the first maximum; scanning from no-drop down through decreasing tau prefers less drop.
    ordered = [allowed[0]] + sorted(allowed[1:], key=lambda o: -(o.tau_s or 0.0))
    best = max(ordered, key=lambda o: o.speedup)
    return ThresholdChoice(best, tuple(options))


def resample_workers(
    step_log: Sequence[StepLog], num_workers: int, num_steps: int = 256, seed: int = 0
) -> list[list[StepLog]]:
    """Synthetic logs of `num_workers` workers whose steps are drawn (with replacement) from one
    worker's logged steps: the estimate to use when only this peer's own times are known."""
    if not step_log:
        raise ValueError("no logged steps to resample")
    rng = random.Random(seed)
    return [[step_log[rng.randrange(len(step_log))] for _ in range(num_steps)] for _ in range(num_workers)]


# --------------------------------------------------------------------------------------------
# The budget a training loop consults
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepReport:
    """What one budgeted step computed."""

    samples: int
    micro_batches: int
    planned_micro_batches: Optional[int]
    compute_s: float  # from begin_step() to the last record()
    micro_batch_s: tuple[float, ...]
    tau_s: Optional[float]
    stopped_by_budget: bool

    @property
    def dropped_micro_batches(self) -> Optional[int]:
        if self.planned_micro_batches is None:
            return None
        return max(self.planned_micro_batches - self.micro_batches, 0)


class BudgetedStep:
    """One step's compute: ask `should_continue()` before each micro-batch, `record(n)` after it."""

    def __init__(self, budget: "ComputeBudget", planned_micro_batches: Optional[int]):
        self._budget = budget
        self._clock = budget.clock
        self.planned_micro_batches = planned_micro_batches
        self.tau_s = budget.tau_s
        self.samples = 0
        self.micro_batch_s: list[float] = []
        self.stopped_by_budget = False
        self.report: Optional[StepReport] = None
        self._start = self._last = self._clock()

    @property
    def micro_batches(self) -> int:
        return len(self.micro_batch_s)

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._start

    def should_continue(self) -> bool:
        """Whether to compute another micro-batch in this step.

        False once the planned number of micro-batches is done, or once the elapsed time has
        reached tau (after at least `min_micro_batches`).
        """
        if self.report is not None:
            raise RuntimeError("this step is finished")
        if self.planned_micro_batches is not None and self.micro_batches >= self.planned_micro_batches:
            return False
        if self.micro_batches < self._budget.min_micro_batches or self.tau_s is None:
            return True
        if self._clock() - self._start >= self.tau_s:
            self.stopped_by_budget = True
            return False
        return True

    def record(self, num_samples: int) -> float:
        """Mark the end of a micro-batch of `num_samples` samples; returns its duration."""
        if self.report is not None:
            raise RuntimeError("this step is finished")
        now = self._clock()
        duration = now - self._last
        self._last = now
        self.micro_batch_s.append(duration)
        self.samples += int(num_samples)
        return duration

    def average_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> int:
        """Turn gradients accumulated from `loss_mean * num_samples` into the mean over the samples
        computed in this step. Returns that sample count (the weight to average with)."""
        if self.samples > 0:
            for parameter in parameters:
                if parameter.grad is not None:
                    parameter.grad.div_(self.samples)
        return self.samples

    def finish(self) -> StepReport:
        """End the step (idempotent) and hand its timings to the budget."""
        if self.report is None:
            self.report = StepReport(
                samples=self.samples,
                micro_batches=self.micro_batches,
                planned_micro_batches=self.planned_micro_batches,
                compute_s=self._last - self._start,
                micro_batch_s=tuple(self.micro_batch_s),
                tau_s=self.tau_s,
                stopped_by_budget=self.stopped_by_budget,
            )
            self._budget._on_step_finished(self.report)
        return self.report

    def __enter__(self) -> "BudgetedStep":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()


class ComputeBudget:
    """How long a peer may compute per step: `None` (no limit), seconds, or `"auto"`.

    Args:
        seconds: the threshold tau, None for no limit, or "auto" to choose tau after a warm-up.
        warmup_steps: "auto" only: complete steps to log before choosing tau. The estimate is a
            ratio of sums over the logged times: with heavy tails it needs tens of steps.
        num_workers: "auto" only: workers that synchronise each step. When `calibrate()` is given
            no logs of other workers, this peer's own steps are resampled into that many workers;
            with 1 (a lone worker) "auto" never drops (see `choose_threshold`).
        overhead_s: per-step time outside compute (averaging, optimizer), used in the simulation.
        candidates: thresholds "auto" may pick from (default: `default_candidates`).
        max_drop_rate: "auto" only: never pick a tau estimated to drop more than this fraction.
        min_micro_batches: micro-batches computed in every step whatever the budget.
        seed: seeds the resampling of logged steps.
        clock: monotonic time source in seconds.
    """

    def __init__(
        self,
        seconds: BudgetSetting = None,
        *,
        warmup_steps: int = 20,
        num_workers: int = 1,
        overhead_s: float = 0.0,
        candidates: Optional[Sequence[float]] = None,
        max_drop_rate: Optional[float] = None,
        min_micro_batches: int = 1,
        seed: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.auto = seconds == "auto"
        if not self.auto and seconds is not None:
            is_number = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
            if not (is_number and seconds > 0 and math.isfinite(seconds)):
                raise UserError(f"compute budget must be a positive number of seconds, None or 'auto', got {seconds!r}")
        if warmup_steps < 1 or num_workers < 1 or min_micro_batches < 0 or overhead_s < 0:
            raise UserError(
                "ComputeBudget: warmup_steps and num_workers must be >= 1, min_micro_batches and overhead_s >= 0"
            )
        if max_drop_rate is not None and not 0 <= max_drop_rate <= 1:
            raise UserError(f"ComputeBudget: max_drop_rate must be in [0, 1], got {max_drop_rate}")
        self.tau_s: Optional[float] = None if self.auto or seconds is None else float(seconds)
        self.warmup_steps = warmup_steps
        self.num_workers = num_workers
        self.overhead_s = overhead_s
        self.candidates = None if candidates is None else list(candidates)
        self.max_drop_rate = max_drop_rate
        self.min_micro_batches = min_micro_batches
        self.seed = seed
        self.clock = clock
        self.step_log: list[tuple[float, ...]] = []  # "auto": micro-batch times of warm-up steps
        self.choice: Optional[ThresholdChoice] = None
        self.last_report: Optional[StepReport] = None
        self.steps = self.samples = self.micro_batches = self.dropped_micro_batches = 0

    @property
    def warming_up(self) -> bool:
        """True while "auto" is still logging times (no threshold yet)."""
        return self.auto and self.choice is None

    def step(self, planned_micro_batches: Optional[int] = None) -> BudgetedStep:
        """Begin a step; use as `with budget.step(n) as s:`. Same as `begin_step`."""
        return self.begin_step(planned_micro_batches)

    def begin_step(self, planned_micro_batches: Optional[int] = None) -> BudgetedStep:
        """Begin a step of at most `planned_micro_batches` micro-batches (None: only time limits it)."""
        if self.warming_up and len(self.step_log) >= self.warmup_steps:
            self.calibrate()
        return BudgetedStep(self, planned_micro_batches)

    def calibrate(self, worker_logs: Optional[WorkerLogs] = None) -> ThresholdChoice:
        """Choose tau from logged times and use it from the next step on.

        `worker_logs[w][s]` are the micro-batch times of worker w in step s, steps aligned across
        workers (e.g. gathered from the swarm). Without them, this peer's own warm-up steps are
        resampled into `num_workers` workers (`resample_workers`).
        """
        if worker_logs is None:
            if not self.step_log:
                raise RuntimeError("no steps logged yet; run warm-up steps or pass worker_logs")
            worker_logs = (
                [self.step_log]
                if self.num_workers == 1
                else resample_workers(self.step_log, self.num_workers, seed=self.seed)
            )
        self.choice = choose_threshold(
            worker_logs,
            self.candidates,
            overhead_s=self.overhead_s,
            max_drop_rate=self.max_drop_rate,
            min_micro_batches=self.min_micro_batches,
        )
        self.tau_s = self.choice.tau_s
        return self.choice

    def _on_step_finished(self, report: StepReport) -> None:
        self.last_report = report
        self.steps += 1
        self.samples += report.samples
        self.micro_batches += report.micro_batches
        self.dropped_micro_batches += report.dropped_micro_batches or 0
        complete = report.planned_micro_batches is None or report.micro_batches >= report.planned_micro_batches
        # Only complete warm-up steps are logged: a cut-short step would hide the tail it cut.
        if self.warming_up and complete and report.micro_batch_s:
            self.step_log.append(report.micro_batch_s)


def parse_compute_budget(text: str) -> BudgetSetting:
    """Parse a CLI value: "auto", "none"/"off", or seconds ("0.5", "500ms", "2s")."""
    value = text.strip().lower()
    if value == "auto":
        return "auto"
    if value in ("none", "off", ""):
        return None
    scale = 1.0
    if value.endswith("ms"):
        value, scale = value[:-2], 1e-3
    elif value.endswith("s"):
        value = value[:-1]
    try:
        seconds = float(value) * scale
    except ValueError:
        raise UserError(f"bad compute budget {text!r}; expected 'auto', 'none' or seconds like 0.5 or 500ms") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise UserError(f"compute budget must be positive, got {text!r}")
    return seconds
