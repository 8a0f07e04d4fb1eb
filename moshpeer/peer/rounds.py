"""`CollaborativeRound`: the record of one collaborative epoch, as one peer saw it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional, Tuple

from moshpeer.averaging.report import RoundReport


@dataclass
class CollaborativeRound:
    """What one collaborative epoch did, as seen by this peer (also printed as JSON by the trainer)."""

    epoch: int  # the epoch this round finished (the peer is at epoch + 1 afterwards)
    samples: int  # samples this peer contributed
    ok: bool  # averaged with a group (False: stepped alone)
    group_size: int = 1
    chunks_lost: int = 0
    lost_fraction: float = 0.0
    matchmaking_s: float = 0.0
    averaging_s: float = 0.0
    bytes_sent: int = 0  # this peer, both phases of the round
    averaged: Tuple[str, ...] = ()  # what the round averaged, e.g. ("gradients",) or ("gradients", "parameters")
    param_spread: Optional[float] = None  # ||params - group mean|| / ||group mean|| before the round
    stopped_by_budget: bool = False
    dropped_samples: int = 0  # computed, but the swarm averaged without them (this peer was late)
    group_target: int = 0  # the group size this round aimed for (live peers, capped at group_size)
    swarm_samples: int = 0
    num_trainers: int = 0
    error: Optional[str] = None
    # Loss budget (DBLP): the phase and budget P this round ran with (lost_fraction: what it lost), and
    # the gradient norm of this epoch, the signal that sets the next round's phase.
    loss_phase: Optional[str] = None
    loss_budget: Optional[float] = None
    grad_norm: Optional[float] = None
    # The averaging strategy's settings (e.g. DiLoCo: inner_steps, outer_optimizer, delta_codec, overlap).
    settings: Dict[str, Any] = field(default_factory=dict)
    # How long training waited for this round: all of it, unless the strategy overlaps rounds with compute.
    wait_s: Optional[float] = None
    result: Optional[RoundReport] = None  # the averaging round's own report, unchanged (None: no round ran)

    def to_dict(self) -> dict:
        return asdict(self)
