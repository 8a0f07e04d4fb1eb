"""The task protocol: what user code hands to a moshpeer training peer.

A task is a `Task` dataclass built by a user factory, `make_task(**kwargs) -> Task`. It bundles the
model, a factory of resumable micro-batch streams, the loss, the local optimizer, and evaluation.
Everything else (averaging, progress, checkpoints, DropCompute) is moshpeer's job.

Rules a factory must follow (the swarm relies on them):
- Deterministic: the same kwargs give the same initial parameters and the same data on every
  machine, so peers start from one model and `fingerprint` can tell incompatible peers apart.
- `train_batches(batch_size, *, seed, peer_index, num_peers)` returns an endless iterator of
  micro-batches of `batch_size` samples. If it also has `state_dict()` / `load_state_dict()`
  (see `BatchStream`), the checkpoint layer saves the data position and training resumes on
  exactly the next batch; `IndexedBatches` gives this for free.
- `loss_fn(model, batch)` returns `(mean loss over the batch, number of samples in it)`; moshpeer
  weights gradients by samples (see `moshpeer.peer.optimizer.dropcompute`).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from moshpeer.errors import UserError

LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, int]]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
Evaluator = Callable[[nn.Module], Mapping[str, float]]
BatchFactory = Callable[..., Iterator[Any]]


@runtime_checkable
class BatchStream(Protocol):
    """An endless iterator of micro-batches whose position can be saved and restored.

    `state_dict()` returns plain JSON-compatible values (ints, strings, floats) so any checkpoint
    format can store it; `load_state_dict(state)` makes the next `next()` return the batch that
    would have followed when the state was taken.
    """

    def __iter__(self) -> Iterator[Any]: ...

    def __next__(self) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass
class Task:
    """Everything a training peer needs from user code.

    Attributes:
        model: the model to train; its initial parameters must be the same for the same kwargs.
        train_batches: `(batch_size, *, seed=0, peer_index=0, num_peers=1) -> Iterator` of
            micro-batches. Peers in a swarm either pass distinct seeds (independent shuffles) or
            the same seed with `peer_index`/`num_peers` (disjoint shards of one shuffle).
        loss_fn: `(model, batch) -> (loss, num_samples)`, loss averaged over the batch.
        make_optimizer: `(parameters) -> torch.optim.Optimizer`, the local optimizer.
        evaluate: `(model) -> {name: value}`; must contain `metric`.
        metric: the name of the headline metric in `evaluate`'s result, e.g. "accuracy".
        higher_is_better: whether a larger `metric` is better (accuracy) or worse (perplexity).
        name: short name for logs and the DHT.
        batch_size: suggested micro-batch size (samples per forward/backward pass).
        target_batch_size: suggested global batch (samples the swarm gathers per optimizer step).
        fingerprint: identifies model + data configuration; peers whose fingerprints differ must
            not train together. Empty when the task does not provide one.
    """

    model: nn.Module
    train_batches: BatchFactory
    loss_fn: LossFn
    make_optimizer: OptimizerFactory
    evaluate: Evaluator
    metric: str
    higher_is_better: bool
    name: str = "task"
    batch_size: int = 32
    target_batch_size: int = 256
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise UserError(f"Task.model must be a torch.nn.Module, got {type(self.model).__name__}")
        for field_name in ("train_batches", "loss_fn", "make_optimizer", "evaluate"):
            if not callable(getattr(self, field_name)):
                raise UserError(f"Task.{field_name} must be callable, got {type(getattr(self, field_name)).__name__}")
        if not isinstance(self.metric, str) or not self.metric:
            raise UserError("Task.metric must be a non-empty string naming a key of evaluate()'s result")
        if not isinstance(self.higher_is_better, bool):
            raise UserError("Task.higher_is_better must be True or False")
        for field_name in ("batch_size", "target_batch_size"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"Task.{field_name} must be a positive integer, got {value!r}")
        _check_batch_factory_signature(self.train_batches)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are (the CPU for a model without parameters)."""
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    def to(self, device: torch.device) -> "Task":
        """Move the model (parameters and buffers) to `device`; returns the task. `loss_fn` and `evaluate`
        must take batches to the model's device themselves (the built-in tasks do)."""
        self.model.to(device)
        return self

    def open_batches(
        self, batch_size: Optional[int] = None, *, seed: int = 0, peer_index: int = 0, num_peers: int = 1
    ) -> Iterator[Any]:
        """Start a micro-batch stream (`batch_size` defaults to `self.batch_size`)."""
        batch_size = self.batch_size if batch_size is None else batch_size
        if batch_size < 1:
            raise UserError(f"micro-batch size must be positive, got {batch_size}")
        if num_peers < 1 or not 0 <= peer_index < num_peers:
            raise UserError(f"peer_index must be in [0, num_peers), got {peer_index} of {num_peers}")
        stream = self.train_batches(batch_size, seed=seed, peer_index=peer_index, num_peers=num_peers)
        if not isinstance(stream, Iterator):
            raise UserError(f"Task.train_batches returned {type(stream).__name__}, expected an iterator")
        return stream

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        """Call `loss_fn` and check that it returned `(scalar tensor, sample count)`."""
        result = self.loss_fn(model, batch)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise UserError(f"Task.loss_fn must return (loss, num_samples), got {type(result).__name__}")
        loss, num_samples = result
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise UserError("Task.loss_fn must return a scalar tensor as the loss")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise UserError(f"Task.loss_fn must return a non-negative int sample count, got {num_samples!r}")
        return loss, num_samples

    def metrics(self, model: Optional[nn.Module] = None) -> dict[str, float]:
        """Evaluate `model` (default: `self.model`) and return its metrics as floats.

        The model is put in eval mode and gradients are off during evaluation; its previous
        training mode is restored afterwards.
        """
        model = self.model if model is None else model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                raw = self.evaluate(model)
        finally:
            model.train(was_training)
        if not isinstance(raw, Mapping):
            raise UserError(f"Task.evaluate must return a dict of metrics, got {type(raw).__name__}")
        try:
            result = {str(key): float(value) for key, value in raw.items()}
        except (TypeError, ValueError) as exc:
            raise UserError(f"Task.evaluate returned a metric that is not a number: {exc}") from exc
        if self.metric not in result:
            raise UserError(f"Task.evaluate's result has no {self.metric!r} (the task's metric); got {sorted(result)}")
        return result

    def is_better(self, value: float, than: float) -> bool:
        """Whether metric `value` is strictly better than `than` for this task."""
        if math.isnan(value):
            return False
        if math.isnan(than):
            return True
        return value > than if self.higher_is_better else value < than


def _check_batch_factory_signature(factory: BatchFactory) -> None:
    """Fail early, with one clear line, if `train_batches` cannot take the arguments peers pass."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # some builtins have no signature; open_batches will surface problems
    try:
        signature.bind(1, seed=0, peer_index=0, num_peers=1)
    except TypeError as exc:
        raise UserError(
            f"Task.train_batches must accept (batch_size, *, seed, peer_index, num_peers): {exc}"
        ) from exc


def stream_position(stream: Iterator[Any]) -> Optional[dict[str, Any]]:
    """The saved position of a batch stream, or None if the stream cannot save one."""
    if isinstance(stream, BatchStream):
        return dict(stream.state_dict())
    return None


def restore_stream_position(stream: Iterator[Any], state: Mapping[str, Any]) -> None:
    """Move `stream` to a position saved by `stream_position`."""
    if not isinstance(stream, BatchStream):
        raise UserError(
            f"cannot restore the data position: the task's batch stream ({type(stream).__name__}) "
            "has no load_state_dict()"
        )
    stream.load_state_dict(state)
