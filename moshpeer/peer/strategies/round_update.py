"""`RoundUpdate`: the averaged update a group applied in one round, kept to hand to a peer that missed that
round, so that the peer takes the group's step for one round's bytes instead of stepping alone or downloading
a whole state. Two strategies keep one (`AveragingStrategy.rejoins_by_update`): DiLoCo its averaged
pseudo-gradient Δ̄ (the late peer rejoins the swarm's θ_outer), gradients mode its averaged gradient (the late
peer's parameters stay the group's, where a lone step would leave them apart until the next parameters round).

Every member of a round holds the same average (the all-reduce leaves every member the owners' decoded parts).
The update travels encoded with the run's gather codec (what the average crossed the wire as in the round: one
round's bytes, an eighth of fp32 with int4). A peer whose round failed while the others averaged fetches it
(peer/state/updates.py) and takes the same step on it that the group took; how its own work of that round is
carried into its next contribution is its strategy's (diloco.py, gradients.py).

What makes an update fit (`check_fits`, ValueError otherwise): it is the round of this epoch and fragment,
taken at the same step count where the strategy keeps one (DiLoCo's outer steps: the same place in the
schedule), of this fragment's size, finite once decoded, and no larger than UPDATE_NORM_BOUND x this peer's own
contribution to the round (an average of the members' contributions is never larger than the largest of them:
a donor cannot push this peer far). Within those checks a donor is trusted as a state donor is (signed, one
donor).

Phase (DiLoCo): a donor also says how far into which epoch it is when it serves (`phase`). A peer that missed a
round was late by more than the matchmaking window; were it to compute all H inner steps of the next epoch, it
would be as late for the next round, and miss every round after. It starts the next epoch that many steps in
instead, as a peer that downloaded a state does (the state carries its donor's steps). A donor already past
that epoch (this peer learned of its miss late, e.g. after a slow first micro-batch) has it start at the epoch's
last step.

Exactness: with codec `none` the fetched update is the group's, bit for bit. With a quantizer it is the average
re-encoded: within the codec's error of one update, once (measured in tests/unit/test_round_update.py).

Sparse updates (a sparsifying codec: ARC-Top-K rows, zero elsewhere): only the blocks of UPDATE_BLOCK values that
hold a non-zero value travel, with their indices (`blocks`), whenever fewer than half of them do. Encoded densely,
the Δ̄ of a `topk-int2:0.0156` round took 33 times that round's bytes (5.2 MB for a 5.2M-value model, against
159 KB), so a missed round cost 33 rounds (bench_diloco's sparse arm: 7 missed rounds sent ~36 MB, and set its
peak upload).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from moshpeer.compression import get_compression
from moshpeer.compression.codec import Codec
from moshpeer.errors import ProtocolError

UPDATE_FORMAT = 1
SPARSE_UPDATE_FORMAT = 2  # with `blocks` (a peer of an earlier version refuses it, and downloads the state instead)
UPDATE_CHUNK_NUMEL = 1 << 20  # values per encoded chunk (the codecs' scratch is sized per chunk)
UPDATE_BLOCK = 256  # values per block of a sparse update (ARC-Top-K's default row)
UPDATE_NORM_BOUND = 4.0  # the largest update norm accepted, in units of this peer's own contribution's norm
FALLBACK_CODEC = "int8"  # for sparsifying schemes, whose gather codec carries sparse rows


def update_codec(compression: str) -> Codec:
    """The codec an update travels in for a run of `compression`: its gather codec (int8 for sparse schemes)."""
    scheme = get_compression(compression)
    return get_compression(FALLBACK_CODEC).gather_codec if scheme.sparsifier is not None else scheme.gather_codec


@dataclass(frozen=True)
class RoundUpdate:
    """The average the round of `epoch` over `fragment` applied, on top of `steps` steps of the strategy's own
    count (DiLoCo's outer steps; 0 for a strategy that keeps none), encoded in chunks of UPDATE_CHUNK_NUMEL values
    with `codec` (a `get_compression` name)."""

    epoch: int
    fragment: int
    steps: int
    numel: int
    codec: str
    payloads: List[torch.Tensor]
    phase: Optional[Tuple[int, int]] = None  # (epoch, inner steps into it) of the donor when it served this
    blocks: Optional[torch.Tensor] = None  # sparse: the indices (int32, increasing) of the blocks in `payloads`

    @classmethod
    def encode(cls, delta: torch.Tensor, *, epoch: int, fragment: int, steps: int,
               compression: str) -> "RoundUpdate":
        """Encode the flat fp32 average `delta` with the update codec of a run of `compression` (its non-zero blocks
        only, when fewer than half of them hold a value)."""
        codec = update_codec(compression)
        flat = delta.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
        numel, blocks = flat.numel(), None
        padded = torch.nn.functional.pad(flat, (0, -numel % UPDATE_BLOCK)).view(-1, UPDATE_BLOCK)
        nonzero = padded.ne(0).any(dim=1)
        if 2 * int(nonzero.sum()) < nonzero.numel():
            blocks = torch.nonzero(nonzero).reshape(-1).to(torch.int32)
            flat = padded[nonzero].reshape(-1)
        payloads = [codec.encode(flat[start:start + UPDATE_CHUNK_NUMEL].contiguous()).clone()
                    for start in range(0, flat.numel(), UPDATE_CHUNK_NUMEL)]
        return cls(epoch=epoch, fragment=fragment, steps=steps, numel=numel, codec=codec.name,
                   payloads=payloads, blocks=blocks)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.payloads) + (4 * self.blocks.numel() if self.blocks is not None else 0)

    def decode(self) -> torch.Tensor:
        """The average as a flat fp32 tensor; ValueError for a malformed or non-finite payload or block list."""
        codec = get_compression(self.codec).gather_codec
        encoded = self.numel if self.blocks is None else self._checked_blocks().numel() * UPDATE_BLOCK
        chunks = range(0, encoded, UPDATE_CHUNK_NUMEL)
        if len(self.payloads) != len(chunks):
            raise ValueError(f"update of {encoded} values in {len(self.payloads)} chunks")
        values = torch.empty(encoded, dtype=torch.float32)
        for payload, start in zip(self.payloads, chunks):
            target = values[start:start + UPDATE_CHUNK_NUMEL]
            if payload.numel() > codec.max_encoded_nbytes(target.numel()):
                raise ValueError("update chunk larger than its values can encode to")
            try:
                codec.decode_into(payload, target)
            except ProtocolError as e:
                raise ValueError(f"update chunk does not decode: {e}") from None
        if self.blocks is None:
            return values
        padded = torch.zeros(-(-self.numel // UPDATE_BLOCK), UPDATE_BLOCK)
        padded[self.blocks.long()] = values.view(-1, UPDATE_BLOCK)
        return padded.reshape(-1)[:self.numel]

    def _checked_blocks(self) -> torch.Tensor:
        """`blocks`, if they are strictly increasing indices of this update's blocks; ValueError otherwise."""
        blocks, count = self.blocks, -(-self.numel // UPDATE_BLOCK)
        if blocks.numel() and (int(blocks[0]) < 0 or int(blocks[-1]) >= count or
                               (blocks.numel() > 1 and not bool((blocks[1:] > blocks[:-1]).all()))):
            raise ValueError(f"update blocks are not increasing indices below {count}")
        return blocks

    def check_fits(self, *, epoch: int, fragment: int, steps: int, own: torch.Tensor) -> torch.Tensor:
        """The decoded average, if this update is the one a peer at (`epoch`, `fragment`, `steps`) whose own
        contribution to the round was `own` (flat) may apply; ValueError saying why not otherwise."""
        if (self.epoch, self.fragment) != (epoch, fragment):
            raise ValueError(f"update of epoch {self.epoch}, fragment {self.fragment}; "
                             f"wanted epoch {epoch}, fragment {fragment}")
        if self.steps != steps:
            raise ValueError(f"update on top of {self.steps} steps; this peer took {steps}")
        if self.numel != own.numel():
            raise ValueError(f"update of {self.numel} values for a fragment of {own.numel()}")
        average = self.decode()
        bound = UPDATE_NORM_BOUND * float(own.float().norm())
        if float(average.norm()) > bound:
            raise ValueError(f"update norm {float(average.norm()):.4g} over {UPDATE_NORM_BOUND:g}x this peer's own "
                             f"contribution's ({bound:.4g})")
        return average

    def to_state(self, phase: Optional[Tuple[int, int]] = None) -> Dict[str, Any]:
        """A dict of plain values and tensors (peer/state/framing.py's `serialize_state`), with the server's
        `phase` (epoch, inner steps into it)."""
        # "outer_steps": the name the key had when only DiLoCo kept updates; peers of earlier versions use it.
        state = {"format": UPDATE_FORMAT, "epoch": self.epoch, "fragment": self.fragment,
                 "outer_steps": self.steps, "numel": self.numel, "codec": self.codec,
                 "payloads": list(self.payloads), "phase": None if phase is None else list(phase)}
        if self.blocks is not None:
            state.update(format=SPARSE_UPDATE_FORMAT, blocks=self.blocks)
        return state

    @classmethod
    def from_state(cls, state: Dict[str, Any]) -> "RoundUpdate":
        """Inverse of `to_state` for a stranger's dict; ValueError unless every field has its type."""
        if not isinstance(state, dict) or state.get("format") not in (UPDATE_FORMAT, SPARSE_UPDATE_FORMAT):
            raise ValueError("unknown round update format")
        blocks = state.get("blocks") if state["format"] == SPARSE_UPDATE_FORMAT else None
        if state["format"] == SPARSE_UPDATE_FORMAT and not (
                isinstance(blocks, torch.Tensor) and blocks.dtype == torch.int32 and blocks.dim() == 1):
            raise ValueError("round update: bad blocks")
        ints = [state.get(name) for name in ("epoch", "fragment", "outer_steps", "numel")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            raise ValueError("round update: bad counters")
        payloads, codec = state.get("payloads"), state.get("codec")
        if not isinstance(codec, str) or not isinstance(payloads, list) or not all(
                isinstance(p, torch.Tensor) and p.dtype == torch.uint8 and p.dim() == 1 for p in payloads):
            raise ValueError("round update: bad codec or payloads")
        try:
            get_compression(codec)
        except Exception:
            raise ValueError(f"round update in an unknown codec {codec!r:.40}") from None
        phase = state.get("phase")
        if phase is not None and not (isinstance(phase, list) and len(phase) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in phase)):
            raise ValueError("round update: bad phase")
        epoch, fragment, steps, numel = ints
        return cls(epoch=epoch, fragment=fragment, steps=steps, numel=numel, codec=codec,
                   payloads=payloads, phase=None if phase is None else (phase[0], phase[1]), blocks=blocks)
