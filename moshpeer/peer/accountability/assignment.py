"""The data a peer's contribution must be computed on, which any peer can rebuild: `AssignedBatches`.

A peer's micro-batches of epoch e are the first ones of the task's own batch stream opened with the seed
`assignment_seed(run, peer id, e)`: its epoch's data follows from public facts alone. A group member that
declares (epoch, micro-batch size) in matchmaking and a weight of W samples claims that its contribution is the
mean gradient of the first W samples of that stream at the epoch's parameters; an owner can recompute exactly that
(spot_checks.py). A peer cannot pick its data: the seed is not its choice, and another epoch's, or another
peer's, batches give another gradient.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterator, Mapping, Optional

from moshpeer.errors import UserError
from moshpeer.peer.tasks.protocol import Task


def assignment_seed(run_id: str, peer_id: str, epoch: int) -> int:
    """The batch-stream seed of `peer_id`'s epoch `epoch` in run `run_id` (63 bits)."""
    digest = hashlib.blake2b(f"{run_id}\0{peer_id}\0{int(epoch)}".encode(), digest_size=8,
                             person=b"moshpeer-assign").digest()
    return int.from_bytes(digest, "big") >> 1


def assigned_batches(task: Task, run_id: str, peer_id: str, epoch: int, batch_size: int) -> Iterator[Any]:
    """`peer_id`'s micro-batches of `epoch`, from the first (UserError for a batch size the task refuses)."""
    return task.open_batches(batch_size, seed=assignment_seed(run_id, peer_id, epoch))


class AssignedBatches(Iterator[Any]):
    """This peer's endless micro-batch stream under a data assignment: at each batch it asks `epoch_of()` (the
    optimizer's epoch) and starts that epoch's assigned stream when the epoch changed. Its position (epoch, batches
    taken) is saved in checkpoints and restored exactly."""

    def __init__(self, task: Task, batch_size: int, run_id: str, peer_id: str, epoch_of: Callable[[], int]):
        self.task, self.batch_size, self.run_id, self.peer_id = task, batch_size, run_id, peer_id
        self.epoch_of = epoch_of
        self.epoch: Optional[int] = None
        self.index = 0  # batches of `epoch` handed out
        self._stream: Optional[Iterator[Any]] = None

    def __iter__(self) -> "AssignedBatches":
        return self

    def __next__(self) -> Any:
        epoch = self.epoch_of()
        if epoch != self.epoch or self._stream is None:
            self._open(epoch, 0)
        batch = next(self._stream)
        self.index += 1
        return batch

    def _open(self, epoch: int, index: int) -> None:
        self._stream = assigned_batches(self.task, self.run_id, self.peer_id, epoch, self.batch_size)
        for _ in range(index):
            next(self._stream)
        self.epoch, self.index = epoch, index

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        epoch, index = state.get("epoch"), state.get("index")
        if epoch is None:
            self.epoch, self.index, self._stream = None, 0, None
            return
        if type(epoch) is not int or type(index) is not int or epoch < 0 or index < 0:
            raise UserError(f"bad saved data position for assigned data: {dict(state)!r}")
        self._open(epoch, index)
