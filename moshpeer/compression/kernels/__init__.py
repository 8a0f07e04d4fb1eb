"""Quantization kernels: C++ (CPU) and CUDA extensions built on first use, and the pure-torch reference."""

from moshpeer.compression.kernels.loader import (
    BACKENDS,
    ENV_BACKEND,
    Backend,
    KernelUnavailable,
    backend_for,
    load_backend,
    load_kernels,
)

__all__ = ["BACKENDS", "ENV_BACKEND", "Backend", "KernelUnavailable", "backend_for", "load_backend", "load_kernels"]
