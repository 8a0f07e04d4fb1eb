"""Train a task alone, in this process: check a task before bringing it to a swarm.

    python -m moshpeer.peer.tasks digits --samples 16384
    python -m moshpeer.peer.tasks examples/custom_task.py:make_task --samples 2560
    python -m moshpeer.peer.tasks charlm --seconds 60 --task-arg d_model=64

Prints the metrics at every evaluation, then one JSON line with the result.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

import torch

from moshpeer.errors import UserError
from moshpeer.peer.optimizer.dropcompute import ComputeBudget, parse_compute_budget
from moshpeer.peer.tasks.loading import DEFAULT_TASK, load_task, parse_task_kwargs
from moshpeer.peer.tasks.local import train_locally


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moshpeer.peer.tasks", description=__doc__.split("\n")[0])
    parser.add_argument("task", nargs="?", default=DEFAULT_TASK, help="task spec (default: %(default)s)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="factory kwarg")
    parser.add_argument("--samples", type=int, default=None, help="samples to train on")
    parser.add_argument("--seconds", type=float, default=None, help="or: train for this long")
    parser.add_argument("--global-batch", type=int, default=None, help="default: the task's target_batch_size")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the task's batch_size")
    parser.add_argument("--seed", type=int, default=0, help="data shuffling seed")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
    parser.add_argument("--target", type=float, default=None, help="report samples to reach this metric")
    parser.add_argument("--budget", type=parse_compute_budget, default=None, help="DropCompute budget per step")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        task = load_task(args.task, **parse_task_kwargs(args.task_arg))
        if args.samples is not None:
            samples = args.samples
        else:
            samples = 10**15 if args.seconds is not None else 50 * task.target_batch_size
        print(f"task {task.name} (fingerprint {task.fingerprint or '-'}): {task.metrics()}", flush=True)
        run = train_locally(
            task, samples, global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
            seed=args.seed, budget=ComputeBudget(args.budget), eval_every=args.eval_every,
            target=args.target, max_seconds=args.seconds,
        )
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    for samples_done, metrics in run.history:
        print(f"samples {samples_done:>8}: {metrics}")
    print(json.dumps({"task": task.name, "steps": run.steps, "samples": run.samples, "train_s": round(run.seconds, 3),
                      "samples_to_target": run.samples_to_target, **run.metrics}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
