"""Built-in task `charlm`: a tiny character-level (byte-level) transformer language model trained
on the Python standard library's own sources.

Corpus: the `.py` files directly in `sysconfig.get_paths()["stdlib"]`, sorted by name. Every 10th
file (positions 9, 19, ...) is held out for validation, the others are training text; each side is
read in order and cut at its byte cap (`max_bytes` for training, a tenth of it for validation). The
text is modelled as UTF-8 bytes (vocabulary 256), which is character-level for Python source and
needs no vocabulary that could differ between machines. Different Python versions ship different
sources: `Task.fingerprint` hashes the corpus, so such peers can tell they must not train together.

A training example is a window of `context + 1` bytes (inputs and next-byte targets); epoch e
shifts all window starts by a seeded offset in [0, context) so every epoch sees new cut points.
The metric is validation perplexity per byte (lower is better).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
from typing import Callable, Iterable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from moshpeer.errors import UserError
from moshpeer.peer.tasks.batches import IndexedBatches, epoch_seed
from moshpeer.peer.tasks.protocol import Task

VOCAB_SIZE = 256
HELD_OUT_EVERY = 10


def stdlib_corpus(max_bytes: int = 2_000_000) -> tuple[bytes, bytes, list[str]]:
    """(training bytes, validation bytes, file names read) from the standard library's sources."""
    root = sysconfig.get_paths()["stdlib"]
    try:
        names = sorted(n for n in os.listdir(root) if n.endswith(".py") and os.path.isfile(os.path.join(root, n)))
    except OSError as exc:
        raise UserError(f"cannot list the standard library sources in {root!r}: {exc}") from exc
    caps = {"train": max_bytes, "val": max(max_bytes // HELD_OUT_EVERY, 1)}
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    used: list[str] = []
    for position, name in enumerate(names):
        split = "val" if position % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "train"
        room = caps[split] - sizes[split]
        if room <= 0:
            continue
        with open(os.path.join(root, name), "rb") as source:
            text = source.read(room)
        parts[split].append(text)
        sizes[split] += len(text)
        used.append(name)
    train, val = b"".join(parts["train"]), b"".join(parts["val"])
    if len(train) < 10_000 or len(val) < 1_000:
        raise UserError(f"too little standard library source in {root!r} for the charlm task")
    return train, val, used


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        if d_model % heads:
            raise UserError(f"charlm: d_model ({d_model}) must be divisible by heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-norm transformer block: attention then a 4x MLP, each with a residual."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """A GPT-style decoder over bytes: (batch, length) token ids -> (batch, length, 256) logits."""

    def __init__(self, context: int = 64, d_model: int = 64, layers: int = 2, heads: int = 4,
                 tie_weights: bool = False):
        super().__init__()
        self.context = context
        self.token = nn.Embedding(VOCAB_SIZE, d_model)
        self.position = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        if tie_weights:  # GPT-2: the output projection is the token embedding
            self.head.weight = self.token.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_task(
    seed: int = 0,
    context: int = 64,
    d_model: int = 64,
    layers: int = 2,
    heads: int = 4,
    lr: float = 3e-3,
    max_bytes: int = 2_000_000,
    eval_windows: int = 128,
    batch_size: int = 16,
    target_batch_size: int = 128,
) -> Task:
    """The stdlib character LM. `seed` fixes the initial weights (the same on every peer)."""
    torch.manual_seed(seed)
    model = CharTransformer(context, d_model, layers, heads)
    config = {"task": "charlm", "seed": seed, "context": context, "d_model": d_model, "layers": layers,
              "heads": heads, "lr": lr, "max_bytes": max_bytes, "eval_windows": eval_windows}
    return byte_lm_task("charlm", model, config, context=context, max_bytes=max_bytes, eval_windows=eval_windows,
                        make_optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
                        batch_size=batch_size, target_batch_size=target_batch_size)


def byte_lm_task(name: str, model: nn.Module, config: dict, *, context: int, max_bytes: int, eval_windows: int,
                 make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], batch_size: int,
                 target_batch_size: int, device: Optional[torch.device] = None) -> Task:
    """A next-byte prediction task on the stdlib corpus for `model` ((batch, length) ids -> logits over 256
    bytes); `config` (what peers must agree on) and the corpus make the fingerprint. With `device`, the model
    and the evaluation windows are put there once; batches are moved to the model's device in `loss_fn`."""
    train_bytes, val_bytes, _ = stdlib_corpus(max_bytes)
    train = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8)
    val = torch.frombuffer(bytearray(val_bytes), dtype=torch.uint8)
    window = context + 1
    # Room for a shift of up to context-1 bytes in every epoch (see train_batches).
    num_windows = (len(train) - window) // context
    eval_data = _evaluation_windows(val, window, eval_windows)
    if device is not None:
        model.to(device)
        eval_data = eval_data.to(device)

    def train_batches(batch_size: int, *, seed: int = 0, peer_index: int = 0, num_peers: int = 1) -> IndexedBatches:
        def make_batch(indices: torch.Tensor, epoch: int) -> torch.Tensor:
            # Depends on the epoch only, so a stream restored from a saved position cuts the same windows.
            shift = epoch_seed(0, epoch) % context
            starts = indices * context + shift
            return torch.stack([train[start : start + window] for start in starts.tolist()]).long()

        return IndexedBatches(
            num_windows, batch_size, make_batch, seed=seed, peer_index=peer_index, num_peers=num_peers
        )

    def loss_fn(model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        batch = batch.to(next(model.parameters()).device, non_blocking=True)
        return _next_byte_loss(model, batch), batch.shape[0]

    def evaluate(model: nn.Module) -> dict[str, float]:
        loss = _next_byte_loss(model, eval_data.to(next(model.parameters()).device)).item()
        return {"perplexity": math.exp(loss), "loss": loss, "bits_per_byte": loss / math.log(2)}

    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    digest.update(train_bytes)
    digest.update(val_bytes)
    return Task(
        model=model,
        train_batches=train_batches,
        loss_fn=loss_fn,
        make_optimizer=make_optimizer,
        evaluate=evaluate,
        metric="perplexity",
        higher_is_better=False,
        name=name,
        batch_size=batch_size,
        target_batch_size=target_batch_size,
        fingerprint=digest.hexdigest()[:16],
    )


def _next_byte_loss(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    logits = model(windows[:, :-1])
    # In fp32 whatever the model's dtype: a bf16 / fp16 log-softmax over 256 classes loses the loss's digits.
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE).float(), windows[:, 1:].reshape(-1))


def _evaluation_windows(val: torch.Tensor, window: int, count: int) -> torch.Tensor:
    """`count` fixed windows spread evenly over the validation text."""
    last_start = len(val) - window
    if last_start < 0:
        raise UserError("charlm: validation text is shorter than one context window")
    count = max(1, min(count, last_start + 1))
    starts = torch.linspace(0, last_start, count).long().tolist()
    return torch.stack([val[start : start + window] for start in starts]).long()
