"""Point-in-time copies of a training state, so a checkpoint can be written while training goes on.

Taking a snapshot is a memcpy per tensor storage into CPU buffers that are kept and reused from
one snapshot to the next (allocating fresh ones would add a page fault per 4 KiB). Everything
else in the state (dicts, lists, numbers) is rebuilt or deep-copied, so the caller may mutate
its objects as soon as `take` returns.

Details that keep the snapshot faithful to what `torch.save` of the originals would store:
- tensors that share a storage (views, tied weights) share one copied storage in the snapshot;
- a state_dict's `_metadata` attribute is carried over;
- CUDA tensors are copied into pinned memory without a device sync; the returned `ready` events
  must be waited on before the snapshot is read (the writer thread does). Later in-place updates
  issued on the same CUDA stream run after the copy, so the training loop need not wait.
- With `defer_copies=True`, `take` only builds the snapshot's structure and buffers and returns the
  CPU copies still to do (`PendingCopies`), which another thread runs while the caller goes on with
  work that reads but does not change the tensors (a forward and backward pass leave parameters and
  optimizer state alone). The caller must not change them until the copies are done.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict, defaultdict
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

_IMMUTABLE_LEAVES = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


class PendingCopies:
    """The CPU copies of a deferred snapshot, to run on another thread: `run()` once, `done` after."""

    def __init__(self, copies: List[Tuple[torch.Tensor, torch.Tensor]]):
        self._copies = copies
        self.done = threading.Event()
        self.nbytes = sum(source.nbytes for _, source in copies)

    def run(self) -> None:
        """Do the copies (each a memcpy that releases the GIL), then set `done`, even on failure."""
        try:
            for destination, source in self._copies:
                destination.copy_(source)
        finally:
            self._copies = []
            self.done.set()


class SnapshotBuffers:
    """Takes snapshots of a state into reusable CPU buffers.

    Not thread-safe, and a snapshot's buffers are reused by the next `take`: the caller (the
    `CheckpointStore`) takes a new snapshot only after the previous one has been written.
    """

    def __init__(self, reuse: bool = True):
        self._reuse = reuse
        # Buffers of the previous snapshot, by (nbytes, pinned): candidates for the next one.
        self._spare: Dict[Tuple[int, bool], List[torch.Tensor]] = defaultdict(list)
        self._used: Dict[Tuple[int, bool], List[torch.Tensor]] = defaultdict(list)
        self._copied: Dict[Tuple[torch.device, int], torch.Tensor] = {}
        self._events: List[Any] = []
        self._deferred: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None

    def take_deferred(self, state: Any) -> Tuple[Any, List[Any], PendingCopies]:
        """Like `take`, but the CPU tensors' bytes are copied later, by `PendingCopies.run()`."""
        self._deferred = []
        try:
            snapshot, events = self.take(state)
            return snapshot, events, PendingCopies(self._deferred)
        finally:
            self._deferred = None

    def take(self, state: Any) -> Tuple[Any, List[Any]]:
        """A copy of `state` whose tensors live in CPU memory owned by this object.

        Returns `(snapshot, ready_events)`; `ready_events` is empty unless CUDA tensors were copied.
        """
        if self._reuse:
            for key, buffers in self._used.items():
                self._spare[key].extend(buffers)
        self._used = defaultdict(list)
        self._copied = {}
        self._events = []
        try:
            snapshot = self._copy(state)
            if any(device.type == "cuda" for device, _ in self._copied):
                self._record_cuda_events()
            return snapshot, self._events
        finally:
            # Buffers that no tensor of this state needed any more are released.
            self._spare = defaultdict(list)
            self._copied = {}

    def release(self) -> None:
        """Drop every kept buffer (the next snapshot allocates again)."""
        self._spare = defaultdict(list)
        self._used = defaultdict(list)

    def _copy(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj)
        if isinstance(obj, _IMMUTABLE_LEAVES):
            return obj
        if isinstance(obj, dict):
            items = [(key, self._copy(value)) for key, value in obj.items()]
            if type(obj) is dict:
                return dict(items)
            if isinstance(obj, OrderedDict):
                result = type(obj)(items)
                result.__dict__.update(copy.deepcopy(obj.__dict__))  # e.g. state_dict()._metadata
                return result
            return dict(items)
        if isinstance(obj, tuple):
            items = [self._copy(value) for value in obj]
            return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
        if isinstance(obj, list):
            return [self._copy(value) for value in obj]
        if isinstance(obj, np.ndarray):
            return obj.copy()
        return copy.deepcopy(obj)

    def _copy_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        plain = type(tensor) in (torch.Tensor, torch.nn.Parameter)
        if not plain or tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
            # Rare kinds (sparse, quantized, subclasses): an ordinary copy, without buffer reuse.
            return tensor.detach().to("cpu", copy=True)
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        copied = self._copied.get(key)
        if copied is None:
            copied = self._buffer(storage.nbytes(), pinned=tensor.device.type == "cuda")
            source = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            if self._deferred is not None and tensor.device.type == "cpu":
                self._deferred.append((copied, source))
            else:  # CUDA copies are already asynchronous (ordered on the stream, see the module docstring)
                copied.copy_(source, non_blocking=tensor.device.type == "cuda")
            self._copied[key] = copied
        view = torch.empty(0, dtype=tensor.dtype).set_(
            copied.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride()
        )
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(view, requires_grad=tensor.requires_grad)
        return view

    def _buffer(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        key = (nbytes, pinned)
        spare = self._spare.get(key)
        buffer = spare.pop() if spare else torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        if self._reuse:
            self._used[key].append(buffer)
        return buffer

    def _record_cuda_events(self) -> None:
        for device in {device for device, _ in self._copied if device.type == "cuda"}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events.append(event)


def wait_until_ready(events: List[Any]) -> None:
    """Block until the asynchronous device-to-host copies of a snapshot have finished."""
    for event in events:
        event.synchronize()
