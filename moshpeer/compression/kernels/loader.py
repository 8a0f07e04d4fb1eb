"""Pick and load the quantization kernels: C++ (CPU), CUDA, or the pure-torch reference.

The C++ and CUDA extensions are compiled on first use with `torch.utils.cpp_extension.load` into
`$MOSHPEER_KERNEL_CACHE` (default `~/.cache/moshpeer/kernels`), one directory per hash of the sources, the
compiler flags and the torch / CUDA / Python versions, so a later process loads the built library in
milliseconds. If a build fails, moshpeer warns once and uses the reference, which computes the same bits.

`MOSHPEER_KERNELS=torch|cpp|cuda` forces a backend: `torch` uses the reference everywhere; `cpp` (CPU tensors)
and `cuda` (CUDA tensors) must then load or raise `KernelUnavailable`; tensors on the other device keep the
automatic choice.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Protocol

import torch

from moshpeer.compression.kernels import reference

ENV_BACKEND = "MOSHPEER_KERNELS"
ENV_CACHE = "MOSHPEER_KERNEL_CACHE"
BACKENDS = ("torch", "cpp", "cuda")

SOURCE_DIR = Path(__file__).resolve().parent
CPU_SOURCES = ["binding_cpu.cpp", "quant_cpu.cpp", "raw_cpu.cpp", "frames_cpu.cpp"]
CPU_HEADERS = ["quant_cpu.h", "quant_math.h", "raw_cpu.h", "float_bits.h"]
CUDA_SOURCES = ["binding_cuda.cpp", "quant_cuda.cu"]
CUDA_HEADERS = ["quant_cuda.h", "quant_math.h"]
# -ffp-contract=off / --fmad=false: a fused multiply-add would round differently from the reference.
COMMON_CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno"]
CUDA_CFLAGS = ["-O3", "--fmad=false"]


class KernelUnavailable(RuntimeError):
    """A backend that was asked for explicitly could not be built or loaded."""


class Backend(Protocol):
    name: str

    def quantize(self, x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, bits: int, block: int,
                 stochastic: bool, key: int) -> bool:
        """Fill `scales` and `codes` from `x`; False if `x` holds a non-finite value."""

    def dequantize_accumulate(self, scales: torch.Tensor, codes: torch.Tensor, out: torch.Tensor, bits: int,
                              block: int, weight: float) -> None:
        """out += decoded values * weight."""

    def dequantize(self, scales: torch.Tensor, codes: torch.Tensor, out: torch.Tensor, bits: int, block: int,
                   weight: float) -> None:
        """out = decoded values * weight (the bits of dequantize_accumulate onto zeros)."""

    def quantize_rows(self, x: torch.Tensor, rows: torch.Tensor, header: bytes, status: torch.Tensor, bits: int,
                      block: int, max_scale: float) -> None:
        """Encode rows.shape[0] chunks of `x` straight into payload rows; per-row status, no host sync
        (reference.quantize_rows has the contract)."""

    def dequantize_rows(self, rows: torch.Tensor, out: torch.Tensor, bits: int, block: int, weight: float,
                        overwrite: bool) -> bool:
        """Decode validated payload rows straight into `out` (reference.dequantize_rows has the contract); False if
        this backend has no such kernel (the caller then gathers scales and codes and calls `dequantize`)."""

    def take_float_rows(self, values: torch.Tensor, out: torch.Tensor, modes: List[int], weight: float) -> List[int]:
        """Check raw float32 rows and write the finite ones into `out` (reference.take_float_rows has the contract);
        -> per row, 1 if refused."""

    def estimate_chunks(self, total: torch.Tensor, own: torch.Tensor, chunk_numel: int, k1: float,
                        k2: float) -> List[int]:
        """Blend the arrived sum with our own values, chunk by chunk, keeping only finite results
        (reference.estimate_chunks has the contract); -> per chunk, 1 if not finite."""

    def bad_scale_rows(self, rows: torch.Tensor, nb: int, max_scale: float) -> List[int]:
        """Per payload row, 1 if one of its scales would make the decoder refuse it (reference.bad_scale_rows)."""


class TorchBackend:
    """The reference implementation (kernels/reference.py)."""

    name = "torch"

    def quantize(self, x, scales, codes, bits, block, stochastic, key) -> bool:
        return reference.quantize(x, scales, codes, bits, block, stochastic, key)

    def dequantize_accumulate(self, scales, codes, out, bits, block, weight) -> None:
        reference.dequantize_accumulate(scales, codes, out, bits, block, weight)

    def dequantize(self, scales, codes, out, bits, block, weight) -> None:
        reference.dequantize(scales, codes, out, bits, block, weight)

    def quantize_rows(self, x, rows, header, status, bits, block, max_scale) -> None:
        reference.quantize_rows(x, rows, header, status, bits, block, max_scale)

    def dequantize_rows(self, rows, out, bits, block, weight, overwrite) -> bool:
        reference.dequantize_rows(rows, out, bits, block, weight, overwrite)
        return True

    def take_float_rows(self, values, out, modes, weight) -> List[int]:
        return reference.take_float_rows(values, out, modes, weight)

    def estimate_chunks(self, total, own, chunk_numel, k1, k2) -> List[int]:
        return reference.estimate_chunks(total, own, chunk_numel, k1, k2)

    def bad_scale_rows(self, rows, nb, max_scale) -> List[int]:
        return reference.bad_scale_rows(rows, nb, max_scale)


class OpsBackend:
    """A compiled extension registered as torch ops under `torch.ops.<namespace>`."""

    def __init__(self, name: str, namespace: str):
        self.name = name
        self._ops = getattr(torch.ops, namespace)

    def quantize(self, x, scales, codes, bits, block, stochastic, key) -> bool:
        return bool(self._ops.quantize(x, scales, codes, bits, block, stochastic, key))

    def dequantize_accumulate(self, scales, codes, out, bits, block, weight) -> None:
        self._ops.dequantize_accumulate(scales, codes, out, bits, block, float(weight))

    def dequantize(self, scales, codes, out, bits, block, weight) -> None:
        if hasattr(self._ops, "dequantize"):  # fused overwrite (CPU); the CUDA extension accumulates onto zeros
            self._ops.dequantize(scales, codes, out, bits, block, float(weight))
        else:
            out.zero_()
            self._ops.dequantize_accumulate(scales, codes, out, bits, block, float(weight))

    def quantize_rows(self, x, rows, header, status, bits, block, max_scale) -> None:
        self._ops.quantize_rows(x, rows, list(header), status, bits, block, float(max_scale))

    def dequantize_rows(self, rows, out, bits, block, weight, overwrite) -> bool:
        if not hasattr(self._ops, "dequantize_rows"):  # both extensions have it; a stale build may not
            return False
        self._ops.dequantize_rows(rows, out, bits, block, float(weight), bool(overwrite))
        return True

    def _op_or_reference(self, name: str):
        """The extension's op `name`, or the reference's function of that name. The CUDA extension has none of the
        data path's small kernels (raw rows, the estimate, the scale check): torch's own batched ops with one
        read-back per batch serve there."""
        return getattr(self._ops, name) if hasattr(self._ops, name) else getattr(reference, name)

    def take_float_rows(self, values, out, modes, weight) -> List[int]:
        return self._op_or_reference("take_float_rows")(values, out, list(modes), float(weight))

    def estimate_chunks(self, total, own, chunk_numel, k1, k2) -> List[int]:
        return self._op_or_reference("estimate_chunks")(total, own, int(chunk_numel), float(k1), float(k2))

    def bad_scale_rows(self, rows, nb, max_scale) -> List[int]:
        return self._op_or_reference("bad_scale_rows")(rows, int(nb), float(max_scale))


def cpu_isa_flags() -> List[str]:
    """Vector ISA flags for the CPU this process runs on (the cache is per machine, the hash includes them)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return ["-mavx2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    if capability == "AVX2":
        return ["-mavx2"]
    return []


def cache_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moshpeer" / "kernels"
    return Path(os.environ.get(ENV_CACHE, default))


def build_hash(files: List[str], flags: List[str]) -> str:
    digest = hashlib.sha256()
    for part in (torch.__version__, str(torch.version.cuda), sys.version, platform.machine(), " ".join(flags)):
        digest.update(part.encode() + b"\0")
    for name in files:
        digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
    return digest.hexdigest()[:16]


def _build(kind: str) -> Backend:
    from torch.utils import cpp_extension

    if kind == "cpp":
        sources, headers, cflags, cuda_cflags = CPU_SOURCES, CPU_HEADERS, COMMON_CFLAGS + cpu_isa_flags(), []
    else:
        if not torch.cuda.is_available():
            raise KernelUnavailable("CUDA kernels need a CUDA device and a CUDA build of torch")
        sources, headers, cflags, cuda_cflags = CUDA_SOURCES, CUDA_HEADERS, COMMON_CFLAGS, CUDA_CFLAGS
    namespace = f"moshpeer_{kind if kind == 'cuda' else 'cpu'}"
    digest = build_hash(sources + headers, cflags + cuda_cflags)
    build_dir = cache_root() / f"{namespace}-{digest}"
    library = build_dir / f"{namespace}.so"
    done_marker = build_dir / "built.ok"
    if done_marker.exists() and library.exists():
        torch.ops.load_library(str(library))  # built earlier: skip ninja entirely
    else:
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=namespace,
            sources=[str(SOURCE_DIR / s) for s in sources],
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_cflags,
            extra_include_paths=[str(SOURCE_DIR)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=os.environ.get("MOSHPEER_KERNELS_VERBOSE") == "1",
        )
        done_marker.write_text(digest)
    return OpsBackend(kind, namespace)


_lock = threading.Lock()
_loaded: Dict[str, Backend] = {"torch": TorchBackend()}
_failed: Dict[str, str] = {}


def load_backend(kind: str) -> Backend:
    """Load backend `kind` ('torch', 'cpp', 'cuda'), building it if needed; raises KernelUnavailable."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown kernel backend {kind!r}; choose from {', '.join(BACKENDS)}")
    with _lock:
        if kind in _loaded:
            return _loaded[kind]
        if kind in _failed:
            raise KernelUnavailable(_failed[kind])
        try:
            backend = _build(kind)
        except Exception as e:  # compiler missing, compile error, no CUDA: all mean "not available"
            last_line = (str(e).strip().splitlines() or [""])[-1]
            _failed[kind] = f"{kind} kernels unavailable: {type(e).__name__}: {last_line}"
            raise KernelUnavailable(_failed[kind]) from e
        _loaded[kind] = backend
        return backend


def forced_backend() -> Optional[str]:
    value = os.environ.get(ENV_BACKEND, "").strip().lower()
    if value and value not in BACKENDS:
        raise KernelUnavailable(f"{ENV_BACKEND}={value!r}; choose from {', '.join(BACKENDS)}")
    return value or None


_warned = set()


def load_kernels(tensors) -> None:
    """Load (building if needed) the backend of every device among `tensors`, and the CPU's (the data plane's frame
    pump is in it: frames_cpu.cpp), now, so that a first use does not pay for it. Never raises: a backend that
    cannot load falls back as in `backend_for`, warning once."""
    for device in {t.device for t in tensors} | {torch.device("cpu")}:
        try:
            backend_for(device)
        except KernelUnavailable:
            pass  # forced and unavailable: the first use raises it where it matters


def backend_for(device: torch.device) -> Backend:
    """The backend for tensors on `device`: forced by MOSHPEER_KERNELS, else the compiled one, else the reference."""
    kind = "cuda" if device.type == "cuda" else "cpp" if device.type == "cpu" else None
    forced = forced_backend()
    if forced == "torch" or kind is None:
        return _loaded["torch"]
    if forced == kind:
        return load_backend(kind)  # forced: failures raise
    try:
        return load_backend(kind)
    except KernelUnavailable as e:
        if kind not in _warned:
            _warned.add(kind)
            warnings.warn(f"{e}; using the pure-torch reference (same results, slower)", RuntimeWarning,
                          stacklevel=2)
        return _loaded["torch"]
