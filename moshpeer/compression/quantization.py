"""Blockwise low-bit quantization codecs: `int8`, `int4` and the two-step `int4-int8` (Flash Communication).

Spec: `int8`, `int4`, `int4-int8` or `int2` (ternary codes -1, 0, 1), optionally followed by `:BLOCK` (a multiple
of 16 from 64 to 1024, default 128) and/or `:sr` (stochastic rounding, unbiased), e.g. `int8:256`, `int4:64:sr`,
`int4-int8:sr`.

Payload (little-endian), validated in full before anything is accumulated:

    offset 0   2 bytes  magic b"MQ"
    offset 2   1 byte   format version (1)
    offset 3   1 byte   bits (8, 4 or 2)
    offset 4   2 bytes  block size
    offset 6   1 byte   flags (bit 0: stochastic rounding; other bits 0)
    offset 7   1 byte   reserved (0)
    offset 8   8 bytes  numel
    offset 16  4 * ceil(numel / block) bytes: float32 scale per block (absmax / qmax)
    then       numel bytes (int8), ceil(numel / 2) bytes (int4, two's complement nibbles, low nibble first) or
               ceil(numel / 4) bytes (int2, two's complement pairs of bits, lowest first)

The math (identical bits on every backend) is specified in kernels/reference.py; docs/compression.md has the
error bounds.
"""

from __future__ import annotations

import struct
import threading
from typing import List, Optional, Sequence

import numpy as np
import torch

from moshpeer.compression.codec import Codec, Compression, accepted_runs, register
from moshpeer.compression.kernels import backend_for, load_backend, reference
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
            raise ValueError(f"bits must be 8, 4 or 2, got {bits}")
        self.bits = bits
        self.block = check_block(block)
        self.stochastic = stochastic
        self.name = f"int{bits}" + (f":{block}" if block != DEFAULT_BLOCK else "") + (":sr" if stochastic else "")
        self._headers: dict = {}  # chunk size -> its rows' payload header (`encode_chunks`)

    def __repr__(self) -> str:
        return f"BlockQuantizer({self.name})"

    def code_nbytes(self, numel: int) -> int:
        return reference.code_nbytes(numel, self.bits)

    def max_encoded_nbytes(self, numel: int) -> int:
        return HEADER_NBYTES + 4 * reference.num_blocks(numel, self.block) + self.code_nbytes(numel)

    # ---- a part is the unit of work: many chunks per backend call ----------------------------------

    batched = True  # encode_chunks / decode_chunks below (the group all-reduce checks for it)

    _scratch = threading.local()  # per thread: reused working buffers (a fresh large CPU allocation page-faults)

    @classmethod
    def _scratch_tensor(cls, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A working tensor of this thread, reused across calls (contents irrelevant)."""
        key = (name, dtype, str(device))
        cache = cls._scratch.__dict__.setdefault("tensors", {})
        held = cache.get(key)
        if held is None or held.numel() < numel:
            held = cache[key] = torch.empty(max(numel, 1), dtype=dtype, device=device)
        return held[:numel]

    def _backend(self, device):
        """The kernels for `device`; int2 has no compiled kernel and runs the reference everywhere (same bits)."""
        return backend_for(device) if self.bits in reference.COMPILED_BITS else load_backend("torch")

    def row_stride(self, chunk_numel: int) -> int:
        """Bytes between two chunks' payloads in the buffer of `encode_chunks` (4-aligned: scales are viewed)."""
        return (self.max_encoded_nbytes(chunk_numel) + 3) & ~3

    def encode_chunks(self, x: torch.Tensor, chunk_numel: int, seeds: Sequence[int],
                      out: Optional[torch.Tensor] = None) -> "EncodedChunks":
        """Encode consecutive chunks of `chunk_numel` values of `x` (1-D contiguous float32; the last chunk may be
        short) into one buffer, row r holding chunk r's payload (the bytes `encode(chunk r, seed=seeds[r])` makes).

        Backend calls: one `quantize_rows` for every full chunk together (header, scales and codes written in
        place, validation on the device: nothing waits for the device here), one per short chunk (at most one),
        and, with stochastic rounding (one RNG stream per chunk), one per chunk. `errors[r]` says why chunk r
        cannot be encoded (a non-finite value, or one above the scale bound: its row is then garbage), else
        None; the full chunks' verdicts are read back once, on first access (after the bytes are staged).
        """
        numel, n = x.numel(), chunk_numel
        rows = (numel + n - 1) // n
        if len(seeds) != rows:
            raise ValueError(f"{rows} chunks need {rows} seeds, got {len(seeds)}")
        stride = self.row_stride(n)
        if out is None or out.numel() < rows * stride or out.device != x.device:
            buffer = torch.empty(rows * stride, dtype=torch.uint8, device=x.device)
        else:
            buffer = out[: rows * stride]
        buffer = buffer.view(rows, stride)
        errors: List[Optional[str]] = [None] * rows
        nbytes = [self.max_encoded_nbytes(n)] * (numel // n)  # one size for every full chunk (no per-chunk work)
        if numel % n:
            nbytes.append(self.max_encoded_nbytes(numel % n))
        full = numel // n if (n % self.block == 0 and not self.stochastic and rows) else 0
        status = None
        if full:
            # Host work per call is what bounds a GPU's part encode (a 64 MB slice's kernel runs ~30 us on an
            # H200): no view that is not needed, the header packed once per chunk size.
            status = RowStatus(full, x.device)
            self._backend(x.device).quantize_rows(x if full == rows else x[: full * n],
                                                  buffer if full == rows else buffer[:full], self._header(n),
                                                  status.device_tensor, self.bits, self.block, MAX_SCALE)
            status.start_read()
        for r in range(full, rows):  # a short last chunk, or stochastic rounding: chunk by chunk
            try:
                self.encode(x[r * n: min(numel, (r + 1) * n)], seed=seeds[r], out=buffer[r])
            except ValueError as e:
                errors[r] = str(e)
        return EncodedChunks(buffer, nbytes, errors, status, self._row_error)

    def _header(self, n: int) -> bytes:
        """The payload header of a full chunk of n values (`encode_chunks`' rows), packed once per n."""
        header = self._headers.get(n)
        if header is None:
            header = self._headers[n] = HEADER.pack(MAGIC, VERSION, self.bits, self.block, 0, 0, n)
        return header

    def _row_error(self, status: int) -> str:
        if status & reference.ROW_NONFINITE:
            return f"{self.name}: cannot encode non-finite values (NaN or inf)"
        return f"{self.name}: cannot encode values above {MAX_SCALE * reference.QMAX[self.bits]:.3g}"

    def decode_chunks(self, payloads: torch.Tensor, nbytes: Sequence[int], out: torch.Tensor, chunk_numel: int,
                      modes: Sequence[Optional[str]], weight: float = 1.0) -> List[Optional[str]]:
        """Decode consecutive chunks at once: row r of `payloads` (2-D uint8 on out's device, `nbytes[r]` of the row
        meaningful) is the payload of values [r * n, min((r + 1) * n, out.numel())) of `out` (n = chunk_numel).
        `modes[r]`: "into" (`decode_into`), "add" (`decode_accumulate`) or None (skip the row).

        Every row is validated as `decode_into` does (header, length, scales, padding) before anything is
        written; -> per row, why it was rejected (its values untouched) or None. Headers are compared on the
        host, scales by one backend call for the batch (one read-back on a device); then one backend call per run of
        consecutive accepted rows with the same mode (one in all, normally), and one per short chunk. A backend
        with `dequantize_rows` (the C++ and CUDA ones, and the reference) reads each run where it lies in the rows;
        a backend without it (a stale build) gets its codes gathered side by side first (one copy).
        """
        rows = payloads.shape[0]
        if out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous():
            raise ValueError("out must be a contiguous 1-D float32 tensor")
        weight = float(weight)
        if weight != weight or abs(weight) == float("inf"):
            raise ValueError(f"weight must be finite, got {weight}")
        errors: List[Optional[str]] = [None] * rows
        numel, n = out.numel(), chunk_numel
        if rows == 0:
            return errors
        if (rows - 1) * n >= numel or rows * n < numel:
            raise ValueError(f"{rows} chunks of {n} values do not cover {numel} values")
        full = min(rows, numel // n) if n % self.block == 0 else 0
        nb, cb = (n // self.block, self.code_nbytes(n)) if full else (0, 0)
        expected = self.max_encoded_nbytes(n) if full else 0
        ok = [modes[r] is not None for r in range(rows)]
        if full:
            heads = payloads[:full, :HEADER_NBYTES]
            heads = (heads if heads.device.type == "cpu" else heads.cpu()).numpy()
            want = np.frombuffer(HEADER.pack(MAGIC, VERSION, self.bits, self.block,
                                             FLAG_STOCHASTIC if self.stochastic else 0, 0, n), dtype=np.uint8)
            head_ok = (heads == want).all(axis=1).tolist()
            backend = self._backend(out.device)
            # Scales are read where they lie when rows keep them 4-byte aligned (the receive batches do).
            aligned = payloads.stride(0) % 4 == 0 and payloads.storage_offset() % 4 == 0
            bad = (backend.bad_scale_rows if aligned else reference.bad_scale_rows)(payloads[:full], nb, MAX_SCALE)
            for r in range(full):
                if not ok[r]:
                    continue
                if nbytes[r] != expected:
                    errors[r] = f"{self.name} payload of {nbytes[r]} bytes; {n} values need exactly {expected}"
                elif not head_ok[r]:
                    try:  # the exact reason (rare path)
                        self._checked_payload(payloads[r, :nbytes[r]], out[r * n:(r + 1) * n])
                        errors[r] = f"{self.name} payload has a bad header"
                    except ProtocolError as e:
                        errors[r] = str(e)
                elif bad[r]:
                    errors[r] = f"{self.name} payload has an invalid (non-finite, negative or huge) scale"
                ok[r] = errors[r] is None
            for r, end in accepted_runs(ok, modes, full):
                rows_of_run = payloads[r:end]
                if rows_of_run.is_contiguous() and backend.dequantize_rows(
                        rows_of_run, out[r * n:end * n], self.bits, self.block, weight, modes[r] == "into"):
                    continue  # decoded where the scales and codes lie in the rows: no copy
                codes = payloads[r:end, HEADER_NBYTES + 4 * nb:HEADER_NBYTES + 4 * nb + cb]
                if end - r > 1:  # the rows' codes side by side (one copy), as the backend reads them
                    packed = self._scratch_tensor("dec_codes", (end - r) * cb, torch.uint8, out.device)
                    packed.view(end - r, cb).copy_(codes)
                    codes = packed
                else:
                    codes = codes.reshape(-1)
                call = backend.dequantize if modes[r] == "into" else backend.dequantize_accumulate
                scales = payloads[r:end, HEADER_NBYTES:HEADER_NBYTES + 4 * nb].contiguous().view(torch.float32)
                call(scales.reshape(-1), codes, out[r * n:end * n], self.bits, self.block, weight)
        for r in range(full, rows):  # rows that do not batch (a short last chunk): chunk by chunk
            if not ok[r]:
                continue
            target = out[r * n: min(numel, (r + 1) * n)]
            try:
                (self.decode_into if modes[r] == "into" else self.decode_accumulate)(
                    payloads[r, :nbytes[r]], target, weight)
            except ProtocolError as e:
                errors[r] = str(e)
        return errors

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
        backend = self._backend(x.device)
        if not backend.quantize(x, scales, codes, self.bits, self.block, self.stochastic, reference.rng_key(seed)):
            raise ValueError(f"{self.name}: cannot encode non-finite values (NaN or inf)")
        if scales.numel() and float(scales.max()) > MAX_SCALE:
            raise ValueError(f"{self.name}: cannot encode values above {MAX_SCALE * reference.QMAX[self.bits]:.3g}")
        return payload

    def decode_accumulate(self, payload: torch.Tensor, out: torch.Tensor, weight: float = 1.0) -> None:
        """`out += weight * decode(payload)`, after checking header, length and scales (ProtocolError if bad)."""
        scales, codes, weight = self._validated(payload, out, weight)
        self._backend(out.device).dequantize_accumulate(scales, codes, out, self.bits, self.block, weight)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, weight: float = 1.0) -> None:
        """`out = weight * decode(payload)` in one pass (the same bits as accumulating onto zeros); `out` is
        untouched if the payload is rejected."""
        scales, codes, weight = self._validated(payload, out, weight)
        self._backend(out.device).dequantize(scales, codes, out, self.bits, self.block, weight)

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
        if self.bits == 2 and numel % 4 and int(codes[-1]) >> (2 * (numel % 4)):
            raise ProtocolError(f"{self.name} payload has non-zero padding bits")
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


class RowStatus:
    """One int32 verdict per encoded row (0 = encoded), written by the encode kernel, and its way to the host.

    On a CUDA device `start_read` queues the copy into pinned host memory right behind the kernel and marks it with
    an event, so `values()` waits only for that copy: reading a device tensor with `tolist()` instead is a
    synchronous device-to-pageable copy, ~16 us of host time per call on an H200, which at one read per pipeline
    slice was a third of a 256 MB part's encode. Raises what CUDA raises if the device failed."""

    __slots__ = ("device_tensor", "_host", "_copied")

    def __init__(self, rows: int, device: torch.device):
        self.device_tensor = torch.empty(rows, dtype=torch.int32, device=device)
        self._host, self._copied = self.device_tensor, None

    def start_read(self) -> None:
        if self.device_tensor.is_cuda:
            self._host = torch.empty(self.device_tensor.shape, dtype=torch.int32, pin_memory=True)
            self._host.copy_(self.device_tensor, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def values(self) -> List[int]:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self._host.tolist()


class EncodedChunks:
    """What `encode_chunks` made: `buffer` (rows x stride uint8), `nbytes[r]` of row r are chunk r's payload;
    `errors[r]` is why chunk r could not be encoded (None: it was).

    The first rows' verdicts may still be on their way from the device (`status`, a `RowStatus`): they are taken
    the first time `errors` is read, by then normally long arrived (the sender reads them after the rows' bytes
    reached host memory)."""

    __slots__ = ("buffer", "nbytes", "_errors", "_status", "_explain")

    def __init__(self, buffer: torch.Tensor, nbytes: List[int], errors: List[Optional[str]],
                 status: Optional["RowStatus"] = None, explain=None):
        self.buffer, self.nbytes, self._errors = buffer, nbytes, errors
        self._status, self._explain = status, explain

    @property
    def errors(self) -> List[Optional[str]]:
        if self._status is not None:
            for r, flags in enumerate(self._status.values()):
                if flags:
                    self._errors[r] = self._explain(flags)
            self._status = None
        return self._errors

    def payload(self, r: int) -> torch.Tensor:
        if self.errors[r] is not None:
            raise ValueError(self.errors[r])
        return self.buffer[r, : self.nbytes[r]]


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
register("int2", _factory("int2", 2, 2))  # ternary codes: biased unless `:sr`; made for error feedback (topk-int2)
