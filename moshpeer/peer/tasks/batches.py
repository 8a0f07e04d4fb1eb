"""`IndexedBatches`: an endless, resumable, shardable micro-batch stream over an indexed dataset.

Each epoch is one seeded permutation of the example indices. A peer reads its shard of that
permutation (`peer_index::num_peers`) in consecutive slices of `batch_size`; a tail shorter than a
batch is skipped so every micro-batch has the same size. The position is just (epoch, offset into
the shard), so a saved position resumes on exactly the next batch.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from moshpeer.errors import UserError

# make_batch(indices, epoch) -> batch. `epoch` lets a task vary per-epoch details (e.g. crop offsets).
MakeBatch = Callable[[torch.Tensor, int], Any]

_STATE_VERSION = 1


class IndexedBatches(Iterator[Any]):
    """Micro-batches of `batch_size` examples drawn from `num_examples` indexed examples.

    Args:
        num_examples: dataset size; indices are 0..num_examples-1.
        batch_size: examples per micro-batch.
        make_batch: builds a batch from a 1-D LongTensor of indices and the epoch number.
        seed: shuffling seed; epoch e uses a permutation derived from (seed, e).
        peer_index, num_peers: read only this shard of each epoch's permutation.
    """

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        make_batch: MakeBatch,
        *,
        seed: int = 0,
        peer_index: int = 0,
        num_peers: int = 1,
    ):
        if num_peers < 1 or not 0 <= peer_index < num_peers:
            raise UserError(f"peer_index must be in [0, num_peers), got {peer_index} of {num_peers}")
        shard_size = len(range(peer_index, num_examples, num_peers))
        if batch_size < 1 or shard_size < batch_size:
            raise UserError(
                f"micro-batch size {batch_size} does not fit this peer's shard of {shard_size} examples "
                f"({num_examples} examples split over {num_peers} peers)"
            )
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.make_batch = make_batch
        self.seed = int(seed)
        self.peer_index = peer_index
        self.num_peers = num_peers
        self.epoch = 0
        self.offset = 0  # examples of this epoch's shard already handed out
        self._shard_epoch: Optional[int] = None
        self._shard: Optional[torch.Tensor] = None

    def __iter__(self) -> "IndexedBatches":
        return self

    def __next__(self) -> Any:
        if self.offset + self.batch_size > self._shard_size():
            self.epoch += 1
            self.offset = 0
        shard = self._epoch_shard()
        indices = shard[self.offset : self.offset + self.batch_size]
        self.offset += self.batch_size
        return self.make_batch(indices, self.epoch)

    def _shard_size(self) -> int:
        return len(range(self.peer_index, self.num_examples, self.num_peers))

    def _epoch_shard(self) -> torch.Tensor:
        if self._shard_epoch != self.epoch:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
            permutation = torch.randperm(self.num_examples, generator=generator)
            self._shard = permutation[self.peer_index :: self.num_peers]
            self._shard_epoch = self.epoch
        assert self._shard is not None
        return self._shard

    def state_dict(self) -> dict[str, Any]:
        """The position: JSON-compatible, enough to resume on exactly the next batch."""
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "peer_index": self.peer_index,
            "num_peers": self.num_peers,
            "num_examples": self.num_examples,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved position. The seed and shard come from `state` (they define the order).

        A state taken with another micro-batch size still resumes at the same example, because the
        offset counts examples, not batches.
        """
        try:
            version, epoch, offset = int(state["version"]), int(state["epoch"]), int(state["offset"])
            seed, num_examples = int(state["seed"]), int(state["num_examples"])
            peer_index, num_peers = int(state["peer_index"]), int(state["num_peers"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"bad data position in checkpoint: {exc!r}") from exc
        if version != _STATE_VERSION:
            raise UserError(f"data position has version {version}, this moshpeer reads version {_STATE_VERSION}")
        if num_examples != self.num_examples:
            raise UserError(
                f"data position was saved for a dataset of {num_examples} examples, this one has {self.num_examples}"
            )
        if num_peers < 1 or not 0 <= peer_index < num_peers or epoch < 0 or offset < 0:
            raise UserError(f"bad data position in checkpoint: {dict(state)}")
        self.seed, self.peer_index, self.num_peers = seed, peer_index, num_peers
        self.epoch, self.offset = epoch, offset
        self._shard_epoch = None


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed for one epoch, distinct for distinct (seed, epoch) pairs in practice."""
    return (int(seed) * 1_000_003 + int(epoch) * 7_919 + 0x5EED) % (2**63 - 1)
