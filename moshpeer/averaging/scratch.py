"""Working buffers lent to a peer's successive all-reduces instead of allocated for each.

An owner needs fp32 working memory the size of its part (the running sum of the contributions) or, with
robust aggregation, n times that (every member's contribution); its senders encode a pipeline slice at a time
into byte buffers, and its receivers take a slice's payloads into rows (`take_bytes`). Freshly allocated memory
costs the kernel a page fault and a zeroed page per 4 KiB on first touch: on a 2-core machine ~0.03 s of CPU
per peer for a 64 MB round averaged with CenteredClip, ~0.01 s with the mean, and ~3 ms for an int8 round's
slices. A pool keeps the buffers of finished all-reduces (at most `keep`, the largest: about one round's
working set) and lends each to one all-reduce at a time; concurrent all-reduces simply get fresh memory. Lent
memory is uninitialized, as `torch.empty`'s.
"""

from __future__ import annotations

import threading
from typing import List, Optional

import torch


class ScratchPool:
    """fp32 buffers reused across all-reduces (see the module docstring). Thread-safe."""

    def __init__(self, keep: int = 2):
        self._keep = keep
        self._free: List[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made fresh because none free fit (the rest were reused)

    def take(self, numel: int, device: torch.device) -> torch.Tensor:
        """A 1-D fp32 buffer of at least `numel` values on `device` (the smallest free one that fits, else new);
        hand it back with `give_back` once nothing reads or writes it any more."""
        with self._lock:
            fits = [k for k, b in enumerate(self._free) if b.device == torch.device(device) and b.numel() >= numel]
            if fits:
                return self._free.pop(min(fits, key=lambda k: self._free[k].numel()))
            self.allocated += 1
        return torch.empty(max(numel, 1), dtype=torch.float32, device=device)

    def give_back(self, buffer: Optional[torch.Tensor]) -> None:
        """Return a buffer from `take` for later all-reduces (only the `keep` largest free ones are kept)."""
        if buffer is None or self._keep <= 0:
            return
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            del self._free[self._keep:]


class ScratchLease:
    """The buffers one all-reduce takes: from `pool` if it has one, else freshly allocated on `device`."""

    def __init__(self, pool: Optional[ScratchPool], device: torch.device):
        self._pool, self._device = pool, device
        self._taken: List[torch.Tensor] = []

    def take(self, numel: int) -> torch.Tensor:
        """An uninitialized 1-D fp32 buffer of exactly `numel` values."""
        if self._pool is None:
            return torch.empty(numel, dtype=torch.float32, device=self._device)
        buffer = self._pool.take(numel, self._device)
        self._taken.append(buffer)
        return buffer[:numel]

    def take_bytes(self, nbytes: int) -> torch.Tensor:
        """An uninitialized 1-D uint8 buffer of exactly `nbytes` bytes (on the lease's device)."""
        return self.take((nbytes + 3) // 4).view(torch.uint8)[:nbytes]

    def end(self, reusable: bool) -> None:
        """The all-reduce is over: give its buffers back to the pool if `reusable` (no thread can still write
        them), else leave them to the garbage collector."""
        if self._pool is not None and reusable:
            for buffer in self._taken:
                self._pool.give_back(buffer)
        self._taken = []
