"""`train_locally`: the single-process reference loop for a task.

One optimizer step per global batch, gathered from micro-batches with gradient accumulation and
an optional DropCompute budget, gradients weighted by samples computed. It is the baseline the
swarm is compared against (same samples, same global batch), the loop the examples and docs use
to show a task works, and a worked example of `ComputeBudget` in a plain training loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from moshpeer.errors import UserError
from moshpeer.peer.optimizer.dropcompute import ComputeBudget
from moshpeer.peer.tasks.protocol import Task


@dataclass
class LocalRun:
    """The outcome of `train_locally`."""

    steps: int
    samples: int
    seconds: float
    metrics: dict[str, float]
    losses: list[float] = field(default_factory=list)  # mean training loss of each step
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # (samples, metrics)
    samples_to_target: Optional[int] = None  # first evaluation at which `target` was reached


def train_locally(
    task: Task,
    num_samples: int,
    *,
    global_batch_size: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    seed: int = 0,
    budget: Optional[ComputeBudget] = None,
    eval_every: Optional[int] = None,
    target: Optional[float] = None,
    on_step: Optional[Callable[[int, float], None]] = None,
    max_seconds: Optional[float] = None,
) -> LocalRun:
    """Train `task.model` in this process until `num_samples` samples have been computed.

    Args:
        global_batch_size: samples per optimizer step (default `task.target_batch_size`).
        micro_batch_size: samples per forward/backward (default `task.batch_size`); must divide
            the global batch.
        seed: data shuffling seed.
        budget: DropCompute budget per step (default: none, every micro-batch is computed).
        eval_every: evaluate every this many steps (and always at the end).
        target: record in `samples_to_target` when the task metric first reaches this value.
        on_step: called with (step, mean loss) after every optimizer step.
        max_seconds: also stop after this much training time (checked after each step).
    """
    global_batch_size = global_batch_size or task.target_batch_size
    micro_batch_size = micro_batch_size or task.batch_size
    if global_batch_size % micro_batch_size:
        raise UserError(f"micro-batch size {micro_batch_size} must divide the global batch {global_batch_size}")
    planned = global_batch_size // micro_batch_size
    budget = budget or ComputeBudget(None)
    model = task.model
    model.train()
    optimizer = task.make_optimizer(model.parameters())
    stream = task.open_batches(micro_batch_size, seed=seed)
    run = LocalRun(steps=0, samples=0, seconds=0.0, metrics={})
    start = time.perf_counter()

    def evaluate() -> None:
        metrics = task.metrics(model)
        run.history.append((run.samples, metrics))
        reached = target is not None and (
            metrics[task.metric] >= target if task.higher_is_better else metrics[task.metric] <= target
        )
        if reached and run.samples_to_target is None:
            run.samples_to_target = run.samples

    def out_of_time() -> bool:
        return max_seconds is not None and time.perf_counter() - start >= max_seconds

    while run.samples < num_samples and not out_of_time():
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        with budget.step(planned) as step:
            while step.should_continue():
                loss, count = task.loss(model, next(stream))
                # Backward the *sum* of per-sample losses; average_gradients divides by samples computed.
                (loss * count).backward()
                loss_sum += loss.item() * count
                step.record(count)
        step.average_gradients(model.parameters())
        optimizer.step()
        run.steps += 1
        run.samples += step.samples
        run.losses.append(loss_sum / max(step.samples, 1))
        if on_step is not None:
            on_step(run.steps, run.losses[-1])
        if eval_every and run.steps % eval_every == 0 and run.samples < num_samples and not out_of_time():
            evaluate()
    run.seconds = time.perf_counter() - start
    evaluate()
    run.metrics = run.history[-1][1]
    return run
