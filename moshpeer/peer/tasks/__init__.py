"""Tasks: the user code a training peer runs (model, data, loss, optimizer, evaluation).

    from moshpeer.peer.tasks import load_task, train_locally
    task = load_task("digits")                        # or "package.module:make_task", "path/task.py:make_task"
    run = train_locally(task, num_samples=16384)      # single-process reference loop
    print(run.metrics)                                # {"accuracy": 0.97, "loss": ...}

See docs/tasks.md for the protocol and the built-in tasks.
"""

from moshpeer.peer.tasks.batches import IndexedBatches
from moshpeer.peer.tasks.loading import (
    BUILTIN_TASKS,
    DEFAULT_TASK,
    check_task,
    load_task,
    parse_task_kwargs,
    resolve_task_factory,
)
from moshpeer.peer.tasks.local import LocalRun, train_locally
from moshpeer.peer.tasks.protocol import BatchStream, Task, restore_stream_position, stream_position

__all__ = [
    "BUILTIN_TASKS",
    "DEFAULT_TASK",
    "BatchStream",
    "IndexedBatches",
    "LocalRun",
    "Task",
    "check_task",
    "load_task",
    "parse_task_kwargs",
    "resolve_task_factory",
    "restore_stream_position",
    "stream_position",
    "train_locally",
]
