"""Blockwise low-bit quantization codecs: `int8`, `int4` and the two-step `int4-int8` (Flash Communication).

Spec: `int8`, `int4` or `int4-int8`, optionally followed by `:BLOCK` (a multiple of 16 from 64 to 1024,
default 128) and/or `:sr` (stochastic rounding, unbiased), e.g. `int8:256`, `int4:64:sr`, `int4-int8:sr`.

Payload (little-endian), validated in full before anything is accumulated:

    offset 0   2 bytes  magic b"MQ"
    offset 2   1 byte   format version (1)
    offset 3   1 byte   bits (8 or 4)
    offset 4   2 bytes  block size
    offset 6   1 byte   flags (bit 0: stochastic rounding; other bits 0)
    offset 7   1 byte   reserved (0)
    offset 8   8 bytes  numel
    offset 16  4 * ceil(numel / block) bytes: float32 scale per block (absmax / qmax)
    then       numel bytes (int8) or ceil(numel / 2) bytes (int4, two's complement nibbles, low nibble first)

The math (identical bits on every backend) is specified in kernels/reference.py; docs/compression.md has the
error bounds.
"""

from __future__ import annotations

import struct
from typing import Optional

import torch

from moshpeer.compression.codec import Codec, Compression, register
from moshpeer.compression.kernels import backend_for, reference
from moshpeer.errors import ProtocolError, UserError

MAGIC = b"MQ"
VERSION = 1
HEADER = struct.Struct("<2sBBHBBQ")
HEADER_NBYTES = HEADER.size  # 16: keeps the float32 scales 4-byte aligned
FLAG_STOCHASTIC = 1
DEFAULT_BLOCK = 128
MIN_BLOCK, MAX_BLOCK = 64, 1024
MAX_NUMEL = (1 << 32) - 1  # the stochastic-rounding counter is 32 bits
# Largest scale a decoder accepts: |code| <= 128, so every decoded value stays below 2^127 < FLT_MAX.
MAX_SCALE = 2.0**120


def check_block(block: int) -> int:
    if not (MIN_BLOCK <= block <= MAX_BLOCK and block % 16 == 0):
        raise ValueError(f"block size must be a multiple of 16 from {MIN_BLOCK} to {MAX_BLOCK}, got {block}")
    return block


class BlockQuantizer(Codec):
    """int8 or int4 codes with one float32 absmax scale per block of `block` values.

    Round to nearest (ties to even) by default; with `stochastic=True`, rounds up with probability equal to the
    fractional part, so E[decode(encode(x))] = x. Stochastic rounding draws from a counter-based RNG keyed by
    `seed`: use a seed that differs per sender and round so that the rounding noise of the members averages out.
    """

    def __init__(self, bits: int, block: int = DEFAULT_BLOCK, stochastic: bool = False):
        if bits not in reference.QMAX:
            raise ValueError(f"bits must be 8 or 4, got {bits}")
        self.bits = bits
        self.block = check_block(block)
        self.stochastic = stochastic
        self.name = f"int{bits}" + (f":{block}" if block != DEFAULT_BLOCK else "") + (":sr" if stochastic else "")

    def __repr__(self) -> str:
        return f"BlockQuantizer({self.name})"

    def code_nbytes(self, numel: int) -> int:
        return numel if self.bits == 8 else (numel + 1) // 2

    def max_encoded_nbytes(self, numel: int) -> int:
        return HEADER_NBYTES + 4 * reference.num_blocks(numel, self.block) + self.code_nbytes(numel)

    def encode(self, chunk: torch.Tensor, *, seed: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Quantize `chunk` (any float dtype and layout; read as a flat float32 vector) into a payload.

        `out` (an extension of the Codec interface): a contiguous 1-D uint8 buffer of at least
        `max_encoded_nbytes(numel)` bytes on the chunk's device to write into; the payload is then a view of its
        start. Reusing send buffers saves the page faults of a fresh allocation (about a third of the encode time
        for 64M values on a 2-core machine).

        Raises ValueError if the chunk holds NaN, inf, or a magnitude above 2^120 * qmax (about 1e37), which a
        decoder would refuse (see MAX_SCALE).
        """
        x = chunk.reshape(-1)
        x = (x if x.dtype == torch.float32 else x.to(torch.float32)).contiguous()
        numel = x.numel()
        if numel > MAX_NUMEL:
            raise ValueError(f"at most {MAX_NUMEL} values per payload, got {numel}")
        nbytes = self.max_encoded_nbytes(numel)
        if out is None:
            payload = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
        else:
            if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous() or out.numel() < nbytes:
                raise ValueError(f"out must be a contiguous 1-D uint8 tensor of at least {nbytes} bytes")
            if out.device != x.device or out.storage_offset() % 4:
                raise ValueError("out must be on the chunk's device and 4-byte aligned")
            payload = out[:nbytes]
        flags = FLAG_STOCHASTIC if self.stochastic else 0
        header = HEADER.pack(MAGIC, VERSION, self.bits, self.block, flags, 0, numel)
        payload[:HEADER_NBYTES].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        scales, codes = self._split(payload, numel)
        backend = backend_for(x.device)
        if not backend.quantize(x, scales, codes, self.bits, self.block, self.stochastic, reference.rng_key(seed)):
            raise ValueError(f"{self.name}: cannot encode non-finite values (NaN or inf)")
        if scales.numel() and float(scales.max()) > MAX_SCALE:
            raise ValueError(f"{self.name}: cannot encode values above {MAX_SCALE * reference.QMAX[self.bits]:.3g}")
        return payload

    def decode_accumulate(self, payload: torch.Tensor, out: torch.Tensor, weight: float = 1.0) -> None:
        """`out += weight * decode(payload)`, after checking header, length and scales (ProtocolError if bad)."""
        scales, codes, weight = self._validated(payload, out, weight)
        backend_for(out.device).dequantize_accumulate(scales, codes, out, self.bits, self.block, weight)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, weight: float = 1.0) -> None:
        """`out = weight * decode(payload)` in one pass (the same bits as accumulating onto zeros); `out` is
        untouched if the payload is rejected."""
        scales, codes, weight = self._validated(payload, out, weight)
        backend_for(out.device).dequantize(scales, codes, out, self.bits, self.block, weight)

    def _validated(self, payload: torch.Tensor, out: torch.Tensor, weight: float):
        """(scales, codes, weight) of a payload checked against `out`; raises ProtocolError before any write."""
        if out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous():
            raise ValueError("out must be a contiguous 1-D float32 tensor")
        weight = float(weight)
        if weight != weight or abs(weight) == float("inf"):
            raise ValueError(f"weight must be finite, got {weight}")
        payload = self._checked_payload(payload, out)
        numel = out.numel()
        scales, codes = self._split(payload, numel)
        if scales.numel():
            bad = ~torch.isfinite(scales) | (scales < 0) | (scales > MAX_SCALE)
            if bool(bad.any()):
                raise ProtocolError(f"{self.name} payload has an invalid (non-finite, negative or huge) scale")
        if self.bits == 4 and numel % 2 and int(codes[-1]) >> 4:
            raise ProtocolError(f"{self.name} payload has a non-zero padding nibble")
        return scales, codes, weight

    def _checked_payload(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ProtocolError(f"{self.name} payload must be a 1-D uint8 tensor")
        expected = self.max_encoded_nbytes(out.numel())
        if payload.numel() != expected:
            raise ProtocolError(
                f"{self.name} payload of {payload.numel()} bytes; {out.numel()} values need exactly {expected}")
        magic, version, bits, block, flags, reserved, numel = HEADER.unpack(
            payload[:HEADER_NBYTES].cpu().numpy().tobytes())
        if magic != MAGIC:
            raise ProtocolError(f"{self.name} payload has bad magic {magic!r}")
        if version != VERSION:
            raise ProtocolError(f"{self.name} payload has unknown format version {version}")
        if bits != self.bits or block != self.block:
            raise ProtocolError(f"payload is int{bits} with block {block}; expected {self.name} with block {self.block}")
        if flags & ~FLAG_STOCHASTIC or reserved:
            raise ProtocolError(f"{self.name} payload has unknown flags {flags:#x}/{reserved:#x}")
        if numel != out.numel():
            raise ProtocolError(f"{self.name} payload declares {numel} values; expected {out.numel()}")
        if payload.device != out.device:
            payload = payload.to(out.device)
        if payload.storage_offset() % 4:
            payload = payload.clone()  # the float32 scales must be 4-byte aligned to be viewed in place
        return payload

    def _split(self, payload: torch.Tensor, numel: int):
        scale_end = HEADER_NBYTES + 4 * reference.num_blocks(numel, self.block)
        return payload[HEADER_NBYTES:scale_end].view(torch.float32), payload[scale_end:]


def parse_options(name: str, arg: Optional[str]):
    """`BLOCK` and/or `sr` separated by ':' -> (block, stochastic)."""
    block, stochastic = DEFAULT_BLOCK, False
    for token in (arg.split(":") if arg else []):
        token = token.strip().lower()
        if token == "sr":
            stochastic = True
        elif token.isdigit():
            block = int(token)
            try:
                check_block(block)
            except ValueError as e:
                raise UserError(f"compression {name!r}: {e}") from None
        else:
            raise UserError(f"compression {name!r}: unknown option {token!r} (expected a block size or 'sr')")
    return block, stochastic


def _spec(name: str, block: int, stochastic: bool) -> str:
    return name + (f":{block}" if block != DEFAULT_BLOCK else "") + (":sr" if stochastic else "")


def _factory(name: str, reduce_bits: int, gather_bits: int):
    def factory(arg: Optional[str]) -> Compression:
        block, stochastic = parse_options(name, arg)
        reduce_codec = BlockQuantizer(reduce_bits, block, stochastic)
        gather_codec = reduce_codec if gather_bits == reduce_bits else BlockQuantizer(gather_bits, block, stochastic)
        return Compression(_spec(name, block, stochastic), reduce_codec, gather_codec)

    return factory


register("int8", _factory("int8", 8, 8))
register("int4", _factory("int4", 4, 4))
register("int4-int8", _factory("int4-int8", 4, 8))
