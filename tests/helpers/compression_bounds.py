"""Test helper: the documented per-value error bound of a group all-reduce with a codec (docs/compression.md).

The data plane encodes each chunk of each member's part separately (chunks of `chunk_numel` values from the
start of the part, `moshpeer.averaging.partition.Partition`), and a block quantizer's blocks start at the chunk's
start. So the bound of value t is computed from the absmax of t's block *within its chunk*:

    reduce phase:  sum_i (w_i / W) * step_r(absmax_b(x_i))     each member's contribution quantized once
    gather phase:  step_g(absmax_b(mean) + reduce error)       the averaged part quantized once more

with step(a) = a / (2 qmax) for rounding to nearest and a / qmax for stochastic rounding; fp16 / bf16 round each
value to 11 / 8 significant bits (relative 2^-11 / 2^-8 per phase). Every bound gets a float32 slack.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from moshpeer.averaging.partition import Partition
from moshpeer.compression import get_compression
from moshpeer.compression.codec import Codec, HalfPrecision, NoCompression
from moshpeer.compression.quantization import BlockQuantizer

FLOAT32_SLACK = 1e-5  # relative to the magnitudes involved: summation order and float32 products


def chunked_block_absmax(x: torch.Tensor, partition: Partition, block: int) -> torch.Tensor:
    """Per value: the absmax of its quantization block (blocks restart at every chunk of every part)."""
    out = torch.empty_like(x)
    for part in range(partition.group_size):
        for chunk in range(partition.num_chunks(part)):
            start, end = partition.chunk_range(part, chunk)
            piece = x[start:end].abs()
            blocks = math.ceil(piece.numel() / block)
            padded = torch.nn.functional.pad(piece, (0, blocks * block - piece.numel())).view(blocks, block)
            out[start:end] = padded.amax(dim=1).repeat_interleave(block)[: piece.numel()]
    return out


def phase_error(codec: Codec, x: torch.Tensor, partition: Partition) -> torch.Tensor:
    """Per-value bound of |decode(encode(x)) - x| for one phase of `codec` (x: float64 or float32)."""
    if isinstance(codec, NoCompression):
        return torch.zeros_like(x)
    if isinstance(codec, HalfPrecision):
        relative = 2.0**-11 if codec.dtype == torch.float16 else 2.0**-8
        return x.abs() * relative
    if isinstance(codec, BlockQuantizer):
        qmax = 127 if codec.bits == 8 else 7
        step = 1.0 / qmax if codec.stochastic else 0.5 / qmax
        return chunked_block_absmax(x, partition, codec.block) * step
    raise TypeError(f"no documented bound for {codec!r}")


def allreduce_error_bound(spec: str, inputs: Sequence[torch.Tensor], weights: Sequence[float],
                          chunk_numel: int) -> torch.Tensor:
    """Per-value bound of |result - exact weighted mean| after one group all-reduce of `inputs` with `spec`."""
    compression = get_compression(spec)
    partition = Partition(inputs[0].numel(), len(inputs), chunk_numel)
    total = float(sum(weights))
    xs = [x.double() for x in inputs]
    mean = sum(w * x for w, x in zip(weights, xs)) / total
    reduce_error = sum((w / total) * phase_error(compression.reduce_codec, x, partition) for w, x in zip(weights, xs))
    # The gather codec sees the averaged part, off from the mean by at most reduce_error per value; a block's
    # absmax grows by at most the block's largest reduce error, which is at most the largest of the whole vector.
    gather_input = mean.abs() + reduce_error.max()
    gather_error = phase_error(compression.gather_codec, gather_input, partition)
    magnitude = torch.stack([x.abs() for x in xs]).amax(dim=0)
    return reduce_error + gather_error + FLOAT32_SLACK * (magnitude + 1.0)


def exact_mean(inputs: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    total = float(sum(weights))
    return sum(w * x.double() for w, x in zip(weights, inputs)) / total
