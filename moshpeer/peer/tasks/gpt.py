"""Built-in task `gpt`: a GPT-2-style byte-level language model of configurable size, in fp32, bf16 or fp16,
on any device.

The same corpus, batches and metric as `charlm` (the Python standard library's sources as UTF-8 bytes;
validation perplexity per byte), with GPT-2's shape: pre-norm blocks, learned positions, a 4x GELU MLP,
heads of 64 channels (at least one), and the output projection tied to the token embedding. The defaults
are small enough for CPU tests; a GPU peer scales it up, e.g.

    moshpeer join --device cuda --task gpt --task-arg d_model=512 --task-arg layers=8 --task-arg context=256

(~25M parameters). `dtype=bfloat16|float16` trains the parameters themselves in that precision (no fp32
master copy; averaging still sums in fp32). Pure fp16 Adam needs a larger epsilon: squares of small
gradients underflow, and 1e-8 is below fp16's smallest subnormal, so fp16 uses `eps=1e-4` unless given.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from moshpeer.errors import UserError
from moshpeer.peer.tasks.charlm import CharTransformer, byte_lm_task
from moshpeer.peer.tasks.protocol import Task

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
HEAD_CHANNELS = 64


def parse_dtype(name: str) -> torch.dtype:
    """`float32`/`fp32`, `bfloat16`/`bf16` or `float16`/`fp16`; UserError otherwise."""
    dtype = DTYPES.get(str(name).strip().lower())
    if dtype is None:
        raise UserError(f"gpt: unknown dtype {name!r}; choose from float32, bfloat16, float16")
    return dtype


def make_task(
    seed: int = 0,
    context: int = 64,
    d_model: int = 64,
    layers: int = 2,
    heads: Optional[int] = None,
    lr: float = 2e-3,
    eps: Optional[float] = None,
    dtype: str = "float32",
    max_bytes: int = 2_000_000,
    eval_windows: int = 128,
    batch_size: int = 16,
    target_batch_size: int = 128,
    device: Optional[torch.device] = None,
) -> Task:
    """The GPT-style byte LM. `seed` fixes the initial weights (the same on every peer, whatever the device:
    they are drawn on the CPU in fp32, then cast and moved)."""
    if context < 2 or d_model < 1 or layers < 1:
        raise UserError("gpt: context must be at least 2, d_model and layers at least 1")
    heads = heads if heads is not None else max(1, d_model // HEAD_CHANNELS)
    torch_dtype = parse_dtype(dtype)
    eps = eps if eps is not None else (1e-4 if torch_dtype == torch.float16 else 1e-8)
    torch.manual_seed(seed)
    model = CharTransformer(context, d_model, layers, heads, tie_weights=True).to(torch_dtype)

    def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=0.01)

    config = {"task": "gpt", "seed": seed, "context": context, "d_model": d_model, "layers": layers, "heads": heads,
              "lr": lr, "eps": eps, "dtype": str(torch_dtype), "max_bytes": max_bytes, "eval_windows": eval_windows}
    return byte_lm_task("gpt", model, config, context=context, max_bytes=max_bytes, eval_windows=eval_windows,
                        make_optimizer=make_optimizer, batch_size=batch_size, target_batch_size=target_batch_size,
                        device=device)
