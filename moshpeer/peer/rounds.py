"""`CollaborativeRound`: the record of one collaborative epoch, as one peer saw it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional, Tuple

from moshpeer.averaging.report import RoundResult


@dataclass(frozen=True)
class CollaborativeRound:
    """What one collaborative epoch did, as seen by this peer: the epoch's own facts, and the averaging
    round's `RoundResult` unchanged (None when no round ran: alone, or caught up from a donor)."""

    epoch: int  # the epoch this round finished (the peer is at epoch + 1 afterwards)
    samples: int  # samples this peer contributed
    result: Optional[RoundResult] = None
    error: Optional[str] = None  # why the epoch did not average with a group ("alone", "caught up", ...)
    param_spread: Optional[float] = None  # ||params - group mean|| / ||group mean|| before adopting it
    stopped_by_budget: bool = False
    dropped_samples: int = 0  # computed, but the swarm averaged without them (this peer was late)
    group_target: int = 0  # the group size this round aimed for (live peers, capped at group_size)
    swarm_samples: int = 0
    num_trainers: int = 0
    # Loss budget (DBLP): the phase and budget P this round ran with, and the gradient norm of this epoch,
    # the signal that sets the next round's phase.
    loss_phase: Optional[str] = None
    loss_budget: Optional[float] = None
    grad_norm: Optional[float] = None
    # The averaging strategy's settings (e.g. DiLoCo: inner_steps, outer_optimizer, delta_codec, overlap).
    settings: Dict[str, Any] = field(default_factory=dict)
    # How long training waited for this round: all of it, unless the strategy overlaps rounds with compute.
    wait_s: Optional[float] = None

    @property
    def ok(self) -> bool:
        """Averaged with a group (False: stepped alone, or caught up)."""
        return self.result is not None and self.result.ok

    @property
    def group_size(self) -> int:
        return self.result.group_size if self.ok else 1

    @property
    def chunks_lost(self) -> int:
        return self.result.chunks_lost if self.ok else 0

    @property
    def lost_fraction(self) -> float:
        return self.result.lost_fraction if self.ok else 0.0

    @property
    def matchmaking_s(self) -> float:
        return self.result.matchmaking_s if self.result is not None else 0.0

    @property
    def averaging_s(self) -> float:
        return self.result.total_s if self.ok else 0.0

    @property
    def bytes_sent(self) -> int:
        return self.result.bytes_sent if self.ok else 0

    @property
    def averaged(self) -> Tuple[str, ...]:
        """What the round averaged, e.g. ("gradients",) or ("gradients", "parameters"); () if none."""
        return self.result.averaged if self.ok else ()

    def to_dict(self) -> Dict[str, Any]:
        """Plain values for an event line: the epoch's facts (`epoch` as "round_epoch", the strategy's
        settings spread out), the round's summary (ok, group_size, chunks_lost, lost_fraction,
        matchmaking_s, averaging_s, bytes_sent, averaged) and, under "round", the whole `RoundResult`."""
        facts = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("result", "epoch", "settings")}
        facts.update(round_epoch=self.epoch, **self.settings)
        summary = {name: getattr(self, name) for name in ("ok", "group_size", "chunks_lost", "lost_fraction",
                                                          "matchmaking_s", "averaging_s", "bytes_sent")}
        return {**facts, **summary, "averaged": list(self.averaged),
                "round": self.result.to_dict() if self.result is not None else None}
