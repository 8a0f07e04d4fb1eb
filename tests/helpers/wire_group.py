"""`WireGroup`: an in-process all-reduce (mean) between coroutines, for the sparsifier and error-feedback tests."""

from __future__ import annotations

import asyncio

import torch


class WireGroup:
    """An all-reduce (mean) between `size` coroutines that sends what the codec would: each contribution after
    the given Compression's round trip (default: float32)."""

    def __init__(self, size: int):
        self.size, self.pending, self.result = size, [], None

    async def allreduce(self, tensor: torch.Tensor, compression=None) -> torch.Tensor:
        if compression is not None:
            codec = compression.reduce_codec
            decoded = torch.empty_like(tensor)
            codec.decode_into(codec.encode(tensor.contiguous()), decoded)
            tensor = decoded
        if self.result is None:
            self.result = asyncio.get_running_loop().create_future()
        result = self.result
        self.pending.append(tensor.clone())
        if len(self.pending) == self.size:
            result.set_result(torch.stack(self.pending).mean(0))
            self.pending, self.result = [], None
        return (await result).clone()
