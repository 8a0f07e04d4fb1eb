"""The codec interface and registry.

A codec turns one contiguous 1-D float32 chunk into a self-checking uint8 payload and back. The
group all-reduce encodes what it sends in the reduce-scatter with `Compression.reduce_codec` and
the averaged part it sends back in the all-gather with `Compression.gather_codec` (they differ for
two-step schemes such as `int4-int8`). Decoding is fused with accumulation because the receiver
always sums weighted contributions in fp32.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from moshpeer.compression.kernels import backend_for, reference
from moshpeer.errors import ProtocolError, UserError


def all_finite(values: torch.Tensor) -> bool:
    """Exact "no NaN/Inf" check. A sum is non-finite whenever an input is, and summing is one fast pass
    (isfinite().all() is ~50x slower on CPU); only when the sum overflows do we look value by value."""
    if bool(torch.isfinite(values.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(values).all())


def _checked_values(payload: torch.Tensor, out: torch.Tensor, dtype: torch.dtype, label: str) -> torch.Tensor:
    """`payload` viewed as `out.numel()` finite values of `dtype` (the raw codecs); ProtocolError otherwise."""
    if payload.numel() != out.numel() * dtype.itemsize:
        raise ProtocolError(f"{label} payload of {payload.numel()} bytes for {out.numel()} values")
    values = payload.view(dtype)
    if not all_finite(values):
        raise ProtocolError("non-finite values in payload")
    return values


class Codec(abc.ABC):
    """Encodes float32 chunks into uint8 payloads; every decode validates what it reads."""

    name: str

    @abc.abstractmethod
    def encode(self, chunk: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
        """Encode a contiguous 1-D float32 tensor into a 1-D uint8 tensor (may alias `chunk`)."""

    @abc.abstractmethod
    def decode_accumulate(self, payload: torch.Tensor, out: torch.Tensor, weight: float = 1.0) -> None:
        """`out += weight * decode(payload)`; raises ProtocolError if the payload does not match `out`."""

    @abc.abstractmethod
    def max_encoded_nbytes(self, numel: int) -> int:
        """Upper bound of the payload size for `numel` values: receivers check it before allocating."""

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, weight: float = 1.0) -> None:
        """`out = weight * decode(payload)`; `out` is untouched when the payload is rejected (ProtocolError).

        Codecs override it with a single pass; this default decodes into a temporary first.
        """
        decoded = torch.zeros(out.numel(), dtype=torch.float32, device=out.device)
        self.decode_accumulate(payload, decoded, weight)
        out.copy_(decoded)

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        out = torch.zeros(numel, dtype=torch.float32)
        self.decode_accumulate(payload, out, 1.0)
        return out


def accepted_runs(ok: Sequence[bool], modes: Sequence[Optional[str]], count: int) -> List[Tuple[int, int]]:
    """[start, end) of each run of consecutive rows below `count` that are `ok` and share one mode: what a batched
    `decode_chunks` handles with one operation."""
    runs: List[Tuple[int, int]] = []
    r = 0
    while r < count:
        if not ok[r]:
            r += 1
            continue
        end = r + 1
        while end < count and ok[end] and modes[end] == modes[r]:
            end += 1
        runs.append((r, end))
        r = end
    return runs


class NoCompression(Codec):
    """Raw float32: zero-copy encode (the payload is a byte view of the chunk).

    Batched like the quantizers (`decode_chunks`), so that a receiver takes a pipeline slice of chunks in with one
    backend call instead of a few tensor operations per chunk: on the CPU the C++ kernel checks each row and writes
    it while it is still in cache; elsewhere the reference needs one read-back per batch. Senders need no
    `encode_chunks`: a run of chunks is a stretch of the vector itself (`raw = True`).
    """

    name = "none"
    batched = True
    raw = True

    def row_stride(self, chunk_numel: int) -> int:
        return 4 * chunk_numel

    def decode_chunks(self, payloads: torch.Tensor, nbytes: Sequence[int], out: torch.Tensor, chunk_numel: int,
                      modes: Sequence[Optional[str]], weight: float = 1.0) -> List[Optional[str]]:
        """Row r of `payloads` (2-D uint8 on out's device, `nbytes[r]` of it meaningful, 4-byte aligned rows) holds
        values [r * n, min((r + 1) * n, out.numel())) of `out` (n = chunk_numel); `modes[r]`: "into" (out = weight
        * values), "add" (out += weight * values) or None (skip the row). A row of the wrong size or with a
        non-finite value is rejected alone, before anything is written: -> per row, why, or None."""
        rows = payloads.shape[0]
        numel, n = out.numel(), chunk_numel
        errors: List[Optional[str]] = [None] * rows
        if rows == 0:
            return errors
        if (rows - 1) * n >= numel or rows * n < numel:
            raise ValueError(f"{rows} chunks of {n} values do not cover {numel} values")
        ok = [modes[r] is not None for r in range(rows)]
        for r in range(rows):
            expected = 4 * (min(numel, (r + 1) * n) - r * n)
            if ok[r] and nbytes[r] != expected:
                errors[r], ok[r] = f"float32 payload of {nbytes[r]} bytes for {expected // 4} values", False
        full = min(rows, numel // n)  # rows holding n values each; a short last row is checked on its own
        if full and any(ok[:full]):
            # One backend call checks each row whole and writes only finite ones (kernels.reference has the contract).
            wanted = [reference.MODE_SKIP if not ok[r] else reference.MODE_ADD if modes[r] == "add"
                      else reference.MODE_INTO for r in range(full)]
            values = payloads[:full, :4 * n].view(torch.float32)
            refused = backend_for(out.device).take_float_rows(values, out[:full * n], wanted, weight)
            for r in range(full):
                if refused[r]:
                    errors[r] = "non-finite values in payload"
        for r in range(full, rows):
            if ok[r]:
                target = out[r * n:]
                try:
                    (self.decode_into if modes[r] == "into" else self.decode_accumulate)(
                        payloads[r, :nbytes[r]], target, weight)
                except ProtocolError as e:
                    errors[r] = str(e)
        return errors

    def encode(self, chunk: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
        return chunk.contiguous().view(torch.uint8)

    def decode_accumulate(self, payload: torch.Tensor, out: torch.Tensor, weight: float = 1.0) -> None:
        out.add_(_checked_values(payload, out, torch.float32, "float32"), alpha=weight)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, weight: float = 1.0) -> None:
        values = _checked_values(payload, out, torch.float32, "float32")
        out.copy_(values) if weight == 1.0 else torch.mul(values, weight, out=out)

    def max_encoded_nbytes(self, numel: int) -> int:
        return numel * 4


class HalfPrecision(Codec):
    """fp16 or bf16: values cast to 16 bits; fp16 saturates at +-65504 rather than overflowing to inf."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def encode(self, chunk: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
        if self.dtype == torch.float16:
            chunk = chunk.clamp(-65504.0, 65504.0)
        return chunk.to(self.dtype).contiguous().view(torch.uint8)

    def decode_accumulate(self, payload: torch.Tensor, out: torch.Tensor, weight: float = 1.0) -> None:
        out.add_(_checked_values(payload, out, self.dtype, self.name).float(), alpha=weight)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, weight: float = 1.0) -> None:
        values = _checked_values(payload, out, self.dtype, self.name)
        out.copy_(values) if weight == 1.0 else torch.mul(values.float(), weight, out=out)

    def max_encoded_nbytes(self, numel: int) -> int:
        return numel * 2


@dataclass(frozen=True)
class Compression:
    """What a group all-reduce uses: one codec per phase, and an optional sparsifier (ARC-Top-K)."""

    name: str
    reduce_codec: Codec
    gather_codec: Codec
    sparsifier: Optional[object] = None  # set by sparsifying schemes; averaging runs them around the all-reduce


# name -> factory(argument or None). Other modules register here (quantization, ARC-Top-K).
_REGISTRY: Dict[str, Callable[[Optional[str]], Compression]] = {}


def register(name: str, factory: Callable[[Optional[str]], Compression]) -> None:
    _REGISTRY[name] = factory


def _single(codec: Codec) -> Callable[[Optional[str]], Compression]:
    def factory(arg: Optional[str]) -> Compression:
        if arg is not None:
            raise UserError(f"compression {codec.name!r} takes no argument")
        return Compression(codec.name, codec, codec)

    return factory


register("none", _single(NoCompression()))
register("fp16", _single(HalfPrecision(torch.float16)))
register("bf16", _single(HalfPrecision(torch.bfloat16)))


def get_compression(spec: str) -> Compression:
    """Look up a compression scheme by name, e.g. `none`, `int8`, `int4-int8`, `arc-topk:0.01`."""
    _load_builtin_codecs()
    name, _, arg = spec.partition(":")
    if name not in _REGISTRY:
        raise UserError(f"unknown compression {spec!r}; choose from {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](arg or None)


def available() -> list:
    _load_builtin_codecs()
    return sorted(_REGISTRY)


def _load_builtin_codecs() -> None:
    # Imported lazily so that `codec` stays importable on its own; modules register on import.
    import importlib

    for module in ("moshpeer.compression.quantization", "moshpeer.compression.arc_topk"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
