"""Encoded bytes between the device a round's tensors live on and the sockets that carry them.

A round's vector stays where the parameters are. Codecs encode and decode there (`backend_for(device)`
picks the kernels), so only encoded bytes cross PCIe:

- sending, `Outbox`: `prepare(payload)` starts copying a device payload into a pinned host slot on a side
  stream (after the encoding kernels, which ran on the current stream); `host_bytes(staged)` waits for that
  copy and returns the slot's bytes for the socket. A sender prepares chunk c+1 before it sends chunk c, so
  the next copy runs while the current chunk is on the wire.
- receiving, `Inbox`: `buffer(n)` is a pinned host slot to receive into (once the copy out of it, one round
  of the ring earlier, is done); `payload(n)` copies it to a device slot on a side stream and makes the
  current stream wait for that copy, so the decode kernels that follow read complete bytes.

On the CPU both are pass-through (`staging_for` returns `HostStaging`): the payload's own memory is sent,
and received bytes are decoded where they landed, so a CPU peer's data path is what it was without staging.

Every slot is reused only after the copy that used it finished (events); `bytes_copied` counts what crossed
PCIe, in both directions.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

RING_DEPTH = 2  # slots per sender / receiver: one on the wire (or being decoded), one being copied


class Outbox:
    """Pass-through (CPU): the payload's memory is what the socket sends.

    `lookahead`: whether senders encode and prepare the next chunk before sending the current one (on a device
    that overlaps its copy with the send; on the CPU there is nothing to overlap, so by default they do not)."""

    def __init__(self, lookahead: bool = False):
        self.lookahead = lookahead
        self._ahead: Dict[int, Any] = {}  # chunks already encoded and on their way to host memory

    def next_bytes(self, chunk: int, encode: Callable[[int], torch.Tensor], lookahead: Optional[int] = None
                   ) -> memoryview:
        """Host bytes of `chunk` (`encode(chunk)`, unless it was prepared ahead). With `lookahead` (and an outbox
        that looks ahead), chunk `lookahead` is encoded and prepared now, before this one is sent, so that its
        copy overlaps with this send. Chunks are numbered within one stream: one outbox per stream."""
        ready = self._ahead.pop(chunk, None)
        if ready is None:
            ready = self.prepare(encode(chunk))
        if self.lookahead and lookahead is not None and lookahead not in self._ahead:
            self._ahead[lookahead] = self.prepare(encode(lookahead))
        return self.host_bytes(ready)

    def prepare(self, payload: torch.Tensor) -> Any:
        return payload

    def host_bytes(self, staged: Any) -> memoryview:
        return memoryview(staged.numpy())

    def payload_of(self, staged: Any) -> torch.Tensor:
        return staged


class Inbox:
    """Pass-through (CPU): bytes are received into one host buffer and decoded from it."""

    def __init__(self, max_payload: int):
        self._buffer = torch.empty(max_payload, dtype=torch.uint8)
        self._view = memoryview(self._buffer.numpy())

    def buffer(self, nbytes: int) -> memoryview:
        return self._view[:nbytes]

    def payload(self, nbytes: int) -> torch.Tensor:
        return self._buffer[:nbytes]


class BatchInbox:
    """Host: the payloads of one connection received into consecutive rows of one buffer (`stride` bytes apart, at
    most `capacity` of them), so that a batch of chunks is validated and decoded together (one pipeline slice).

    `buffer(n)` / `payload(n)` as `Inbox` (the frame reader's interface): each frame takes the next row.
    `rows()` -> the rows received so far as a 2-D uint8 tensor on the round's device; `reset()` starts a new batch.
    """

    def __init__(self, stride: int, capacity: int, buffer: Optional[torch.Tensor] = None):
        self.stride, self.capacity = stride, capacity
        self._buffer = buffer if buffer is not None else torch.empty(stride * capacity, dtype=torch.uint8)
        self._view = memoryview(self._buffer.numpy())
        self.count = 0

    @property
    def full(self) -> bool:
        return self.count >= self.capacity

    def buffer(self, nbytes: int) -> memoryview:
        self._before_receiving()
        offset = self.count * self.stride
        return self._view[offset: offset + nbytes]

    def receive_into(self) -> Tuple[torch.Tensor, int, int]:
        """For a reader that fills rows itself (frame_pump.py), then takes each with `payload`: (the host buffer,
        the next row, the rows left)."""
        self._before_receiving()
        return self._buffer, self.count, self.capacity - self.count

    def _before_receiving(self) -> None:
        """Wait until the rows may be written (a device inbox: the previous batch's copy is done)."""

    def payload(self, nbytes: int) -> torch.Tensor:
        offset = self.count * self.stride
        self.count += 1
        return self._buffer[offset: offset + nbytes]

    def host_rows(self) -> torch.Tensor:
        return self._buffer[: self.count * self.stride].view(self.count, self.stride)

    def rows(self) -> torch.Tensor:
        return self.host_rows()

    def reset(self) -> None:
        self.count = 0

    def restart_with(self, row: int) -> None:
        """Start a new batch whose first row is row `row` of this one (a frame that belongs to the next batch)."""
        rows = self._buffer.view(self.capacity, self.stride)
        if row:
            rows[0].copy_(rows[row])
        self.count = 1


class HostStaging:
    """Staging for tensors in host memory: nothing to copy. `lookahead=True` makes senders prepare one chunk
    ahead as they do on a device (the same code path, exercised on machines without one)."""

    device = torch.device("cpu")
    bytes_copied = 0

    def __init__(self, lookahead: bool = False):
        self.lookahead = lookahead

    def outbox(self, max_payload: int) -> Outbox:
        return Outbox(self.lookahead)

    def inbox(self, max_payload: int) -> Inbox:
        return Inbox(max_payload)

    def batch_inbox(self, stride: int, capacity: int, take: Optional[Callable[[int], torch.Tensor]] = None
                    ) -> BatchInbox:
        """Rows for `capacity` payloads `stride` bytes apart; in a buffer from `take(nbytes)` (a round's lent bytes,
        scratch.py) if given."""
        return BatchInbox(stride, capacity, take(stride * capacity) if take is not None else None)


class _Slot:
    def __init__(self, host: torch.Tensor, device: Optional[torch.Tensor] = None):
        self.host = host
        self.device = device
        self.event: Optional[torch.cuda.Event] = None  # the last copy that used this slot
        self.payload: Optional[torch.Tensor] = None  # keeps a device payload alive until its copy is done

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        self.payload = None


class _CudaStaged:
    __slots__ = ("slot", "nbytes", "payload")

    def __init__(self, slot: _Slot, nbytes: int, payload: torch.Tensor):
        self.slot, self.nbytes, self.payload = slot, nbytes, payload


class CudaOutbox(Outbox):
    """Device payloads to pinned host slots on a side stream; see the module docstring."""

    def __init__(self, staging: "CudaStaging", max_payload: int):
        super().__init__(lookahead=True)
        self._staging = staging
        self._stream = torch.cuda.Stream(device=staging.device)
        self._slots = [_Slot(staging.pinned(max_payload)) for _ in range(RING_DEPTH)]
        self._next = 0

    def prepare(self, payload: torch.Tensor) -> _CudaStaged:
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        slot.wait()  # sent RING_DEPTH prepares ago: its bytes have left
        nbytes = payload.numel()
        if nbytes > slot.host.numel():
            slot.host = self._staging.pinned(nbytes)
        device = self._staging.device
        with torch.cuda.device(device):
            self._stream.wait_stream(torch.cuda.current_stream(device))  # after the encoding kernels
            with torch.cuda.stream(self._stream):
                slot.host[:nbytes].copy_(payload, non_blocking=True)
            slot.event = torch.cuda.Event()
            slot.event.record(self._stream)
        slot.payload = payload
        self._staging.count(nbytes)
        return _CudaStaged(slot, nbytes, payload)

    def host_bytes(self, staged: _CudaStaged) -> memoryview:
        if staged.slot.event is not None:
            staged.slot.event.synchronize()
        return memoryview(staged.slot.host[: staged.nbytes].numpy())

    def payload_of(self, staged: _CudaStaged) -> torch.Tensor:
        return staged.payload


class CudaInbox(Inbox):
    """Pinned host slots received into, copied to device slots on a side stream; see the module docstring."""

    def __init__(self, staging: "CudaStaging", max_payload: int):
        self._staging = staging
        self._stream = torch.cuda.Stream(device=staging.device)
        self._slots = [_Slot(staging.pinned(max_payload),
                             torch.empty(max_payload, dtype=torch.uint8, device=staging.device))
                       for _ in range(RING_DEPTH)]
        self._next = 0
        self._current: Optional[_Slot] = None

    def buffer(self, nbytes: int) -> memoryview:
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        slot.wait()  # its previous bytes are on the device already
        self._current = slot
        return memoryview(slot.host[:nbytes].numpy())

    def payload(self, nbytes: int) -> torch.Tensor:
        slot = self._current
        device = self._staging.device
        with torch.cuda.device(device):
            current = torch.cuda.current_stream(device)
            self._stream.wait_stream(current)  # the last decode that read this device slot is done
            with torch.cuda.stream(self._stream):
                slot.device[:nbytes].copy_(slot.host[:nbytes], non_blocking=True)
            slot.event = torch.cuda.Event()
            slot.event.record(self._stream)
            current.wait_event(slot.event)  # decode kernels start once the bytes are there
        self._staging.count(nbytes)
        return slot.device[:nbytes]


class CudaBatchInbox(BatchInbox):
    """Pinned host rows received into; `rows()` copies the batch to a device buffer on a side stream in one copy
    and makes the current stream wait for it; the next batch's first receive waits for that copy (one host
    sync per batch)."""

    def __init__(self, staging: "CudaStaging", stride: int, capacity: int):
        self._staging = staging
        self.stride, self.capacity = stride, capacity
        self._buffer = staging.pinned(stride * capacity)
        self._view = memoryview(self._buffer.numpy())
        self._device_rows = torch.empty(stride * capacity, dtype=torch.uint8, device=staging.device)
        self._stream = torch.cuda.Stream(device=staging.device)
        self._event: Optional[torch.cuda.Event] = None
        self.count = 0

    def _before_receiving(self) -> None:
        if self.count == 0 and self._event is not None:
            self._event.synchronize()  # the previous batch's bytes are on the device: the rows may be reused
            self._event = None

    def rows(self) -> torch.Tensor:
        nbytes = self.count * self.stride
        device = self._staging.device
        with torch.cuda.device(device):
            current = torch.cuda.current_stream(device)
            self._stream.wait_stream(current)  # the last decode that read the device rows is done
            with torch.cuda.stream(self._stream):
                self._device_rows[:nbytes].copy_(self._buffer[:nbytes], non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
            current.wait_event(self._event)
        self._staging.count(nbytes)
        return self._device_rows[:nbytes].view(self.count, self.stride)

    def restart_with(self, row: int) -> None:
        if self._event is not None:
            self._event.synchronize()  # the copy to the device read the row being moved
            self._event = None
        super().restart_with(row)


class CudaStaging(HostStaging):
    """Staging for tensors on one CUDA device."""

    def __init__(self, device: torch.device):
        super().__init__(lookahead=True)
        self.device = device
        self.bytes_copied = 0
        self._lock = threading.Lock()

    def pinned(self, nbytes: int) -> torch.Tensor:
        # torch's caching host allocator: after the first round, pinned slots come from its cache.
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)

    def count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_copied += nbytes

    def outbox(self, max_payload: int) -> Outbox:
        return CudaOutbox(self, max_payload)

    def inbox(self, max_payload: int) -> Inbox:
        return CudaInbox(self, max_payload)

    def batch_inbox(self, stride: int, capacity: int, take: Optional[Callable[[int], torch.Tensor]] = None
                    ) -> BatchInbox:
        return CudaBatchInbox(self, stride, capacity)  # pinned host rows: not the round's device bytes (`take`)


def staging_for(device: torch.device) -> HostStaging:
    """The staging of a round whose vector lives on `device`: pass-through in host memory, pinned slots and a
    side stream per sender and receiver on a CUDA device."""
    if device.type == "cuda":
        return CudaStaging(device)
    return HostStaging()


__all__: List[str] = ["BatchInbox", "HostStaging", "CudaStaging", "Inbox", "Outbox", "staging_for"]
