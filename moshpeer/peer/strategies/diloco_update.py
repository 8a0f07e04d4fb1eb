"""`OuterUpdate`: the averaged pseudo-gradient Δ̄ a DiLoCo group applied in one round, kept to hand to a peer
that missed that round, so that the peer rejoins the swarm's θ_outer for one round's bytes, not a download.

Every member of a round holds the same Δ̄ (the all-reduce leaves every member the owners' decoded parts). A
member keeps the latest Δ̄ of each fragment, encoded with the run's gather codec (what Δ̄ crossed the wire
as in the round: one round's bytes, an eighth of fp32 with int4). A peer whose round failed while the others
averaged fetches it (peer/state/updates.py) and takes the same outer step on it that the group took. Its own
Δ of that round is dropped, as a full download drops it: its θ_outer is then the group's again.

What makes an update fit (`check_fits`, ValueError otherwise): it is the round of this epoch and fragment,
taken from the same outer step count (the same place in the schedule), of this fragment's size, finite once
decoded, and no larger than UPDATE_NORM_BOUND x this peer's own Δ of the round (an average of the members'
Δ is never larger than the largest of them: a donor cannot push this peer far). Within those checks a donor
is trusted as a state donor is (signed, one donor).

Phase: a donor also says how far into which epoch it is when it serves (`phase`). A peer that missed a round
was late by more than the matchmaking window; were it to compute all H inner steps of the next epoch, it would
be as late for the next round, and miss every round after. It starts the next epoch that many steps in instead,
as a peer that downloaded a state does (the state carries its donor's steps). A donor already past that epoch
(this peer learned of its miss late, e.g. after a slow first micro-batch) has it start at the epoch's last step.

Exactness: with codec `none` the fetched Δ̄ is the group's, bit for bit. With a quantizer it is Δ̄
re-encoded: within the codec's error of one update, once (measured in tests/unit/test_diloco_update.py).

Sparse Δ̄ (a sparsifying codec: ARC-Top-K rows, zero elsewhere): only the blocks of UPDATE_BLOCK values that hold a
non-zero value travel, with their indices (`blocks`), whenever fewer than half of them do. Encoded densely, the Δ̄ of
a `topk-int2:0.0156` round took 33 times that round's bytes (5.2 MB for a 5.2M-value model, against 159 KB), so a
missed round cost 33 rounds (bench_diloco's sparse arm: 7 missed rounds sent ~36 MB, and set its peak upload).
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
UPDATE_NORM_BOUND = 4.0  # the largest ||Δ̄|| accepted, in units of this peer's own ||Δ|| of the round
FALLBACK_CODEC = "int8"  # for sparsifying schemes, whose gather codec carries sparse rows


def update_codec(compression: str) -> Codec:
    """The codec an update travels in for a run of `compression`: its gather codec (int8 for sparse schemes)."""
    scheme = get_compression(compression)
    return get_compression(FALLBACK_CODEC).gather_codec if scheme.sparsifier is not None else scheme.gather_codec


@dataclass(frozen=True)
class OuterUpdate:
    """Δ̄ of the round of `epoch` over `fragment`, applied on top of `outer_steps` outer steps, encoded in chunks
    of UPDATE_CHUNK_NUMEL values with `codec` (a `get_compression` name)."""

    epoch: int
    fragment: int
    outer_steps: int
    numel: int
    codec: str
    payloads: List[torch.Tensor]
    phase: Optional[Tuple[int, int]] = None  # (epoch, inner steps into it) of the donor when it served this
    blocks: Optional[torch.Tensor] = None  # sparse: the indices (int32, increasing) of the blocks in `payloads`

    @classmethod
    def encode(cls, delta: torch.Tensor, *, epoch: int, fragment: int, outer_steps: int,
               compression: str) -> "OuterUpdate":
        """Encode the flat fp32 Δ̄ `delta` with the update codec of a run of `compression` (its non-zero blocks
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
        return cls(epoch=epoch, fragment=fragment, outer_steps=outer_steps, numel=numel, codec=codec.name,
                   payloads=payloads, blocks=blocks)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.payloads) + (4 * self.blocks.numel() if self.blocks is not None else 0)

    def decode(self) -> torch.Tensor:
        """Δ̄ as a flat fp32 tensor; ValueError for a malformed or non-finite payload or block list."""
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

    def check_fits(self, *, epoch: int, fragment: int, outer_steps: int, own_delta: torch.Tensor) -> torch.Tensor:
        """The decoded Δ̄, if this update is the one a peer at (`epoch`, `fragment`, `outer_steps`) whose own Δ
        of the round was `own_delta` (flat) may apply; ValueError saying why not otherwise."""
        if (self.epoch, self.fragment) != (epoch, fragment):
            raise ValueError(f"update of epoch {self.epoch}, fragment {self.fragment}; "
                             f"wanted epoch {epoch}, fragment {fragment}")
        if self.outer_steps != outer_steps:
            raise ValueError(f"update on top of {self.outer_steps} outer steps; this peer took {outer_steps}")
        if self.numel != own_delta.numel():
            raise ValueError(f"update of {self.numel} values for a fragment of {own_delta.numel()}")
        delta = self.decode()
        bound = UPDATE_NORM_BOUND * float(own_delta.float().norm())
        if float(delta.norm()) > bound:
            raise ValueError(f"update norm {float(delta.norm()):.4g} over {UPDATE_NORM_BOUND:g}x this peer's own "
                             f"Δ ({bound:.4g})")
        return delta

    def to_state(self, phase: Optional[Tuple[int, int]] = None) -> Dict[str, Any]:
        """A dict of plain values and tensors (peer/state/framing.py's `serialize_state`), with the server's
        `phase` (epoch, inner steps into it)."""
        state = {"format": UPDATE_FORMAT, "epoch": self.epoch, "fragment": self.fragment,
                 "outer_steps": self.outer_steps, "numel": self.numel, "codec": self.codec,
                 "payloads": list(self.payloads), "phase": None if phase is None else list(phase)}
        if self.blocks is not None:
            state.update(format=SPARSE_UPDATE_FORMAT, blocks=self.blocks)
        return state

    @classmethod
    def from_state(cls, state: Dict[str, Any]) -> "OuterUpdate":
        """Inverse of `to_state` for a stranger's dict; ValueError unless every field has its type."""
        if not isinstance(state, dict) or state.get("format") not in (UPDATE_FORMAT, SPARSE_UPDATE_FORMAT):
            raise ValueError("unknown outer update format")
        blocks = state.get("blocks") if state["format"] == SPARSE_UPDATE_FORMAT else None
        if state["format"] == SPARSE_UPDATE_FORMAT and not (
                isinstance(blocks, torch.Tensor) and blocks.dtype == torch.int32 and blocks.dim() == 1):
            raise ValueError("outer update: bad blocks")
        ints = [state.get(name) for name in ("epoch", "fragment", "outer_steps", "numel")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            raise ValueError("outer update: bad counters")
        payloads, codec = state.get("payloads"), state.get("codec")
        if not isinstance(codec, str) or not isinstance(payloads, list) or not all(
                isinstance(p, torch.Tensor) and p.dtype == torch.uint8 and p.dim() == 1 for p in payloads):
            raise ValueError("outer update: bad codec or payloads")
        try:
            get_compression(codec)
        except Exception:
            raise ValueError(f"outer update in an unknown codec {codec!r:.40}") from None
        phase = state.get("phase")
        if phase is not None and not (isinstance(phase, list) and len(phase) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in phase)):
            raise ValueError("outer update: bad phase")
        epoch, fragment, outer_steps, numel = ints
        return cls(epoch=epoch, fragment=fragment, outer_steps=outer_steps, numel=numel, codec=codec,
                   payloads=payloads, phase=None if phase is None else (phase[0], phase[1]), blocks=blocks)
