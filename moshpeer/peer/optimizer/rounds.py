"""`CollaborativeRound`: the record of one collaborative epoch, as one peer saw it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional

from moshpeer.averaging.report import RoundResult


def _averaged_fact(name: str, alone: Any, doc: str) -> property:
    """A property that reads `name` from the round's `RoundResult` if the round averaged, else `alone`."""
    return property(lambda round_: getattr(round_.result, name) if round_.ok else alone, doc=doc)


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
    carried_samples: int = 0  # computed, missed their round, and carried into this peer's next contribution
    samples_carried_in: int = 0  # of earlier missed rounds, held by this round's contribution and weighed with it
    # The group's round was of this later epoch (this peer ended its epoch after its mates' group closed and met
    # their next round): this peer took that count and is at joined_epoch + 1 afterwards (epoch_agreement.py).
    joined_epoch: Optional[int] = None
    group_target: int = 0  # the group size this round aimed for (live peers, capped at group_size)
    # How long the round waited for its group to fill, and how much of that was for trainers still computing
    # this epoch, by their records (round_timing.stragglers_eta_s).
    matchmaking_window_s: Optional[float] = None
    stragglers_eta_s: float = 0.0
    swarm_samples: int = 0
    swarm_samples_capped: int = 0  # claimed by other trainers beyond what this peer found credible
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

    group_size = _averaged_fact("group_size", 1, "the group this peer averaged with; 1 if it did not")
    chunks_lost = _averaged_fact("chunks_lost", 0, "chunks of the round that never arrived")
    lost_fraction = _averaged_fact("lost_fraction", 0.0, "chunks lost / chunks expected")
    averaging_s = _averaged_fact("total_s", 0.0, "seconds of the group all-reduce")
    bytes_sent = _averaged_fact("bytes_sent", 0, "bytes this peer sent in the round")
    averaged = _averaged_fact("averaged", (), 'what the round averaged, e.g. ("gradients",); () if none')

    @property
    def matchmaking_s(self) -> float:
        """Seconds spent looking for a group (also when none was found)."""
        return self.result.matchmaking_s if self.result is not None else 0.0

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
