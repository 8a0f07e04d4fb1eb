"""What one averaging round did: `RoundResult`, one typed value from where the round happens to its readers.

`MoshpitAverager.step()` makes it once, when the round is over (`step(wait=False)` returns a future of
it). The same object reaches `CollaborativeOptimizer` (held unchanged in its `CollaborativeRound`),
the `moshpeer join` event line (serialised once, by `to_dict()`, at the edge), the metrics and the
benchmarks. `GroupAllReduce` fills the data-plane counters (`PhaseStats`, `DataPlaneResult`); they are
part of the result, not copied into a second report.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass
class PhaseStats:
    """Counters of one phase (reduce-scatter or all-gather) seen from one peer; the data plane counts into
    it while the phase runs and leaves it alone afterwards."""

    chunks_sent: int = 0
    chunks_received: int = 0
    chunks_expected: int = 0  # chunks this peer should have received in this phase
    chunks_lost: int = 0  # expected but never usable (not sent, late, rejected)
    chunks_dropped_by_faults: int = 0  # injected: this peer did not send them
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class RoundResult:
    """Outcome of one `MoshpitAverager.step()`, as this peer saw it.

    `ok` is False when no group was found (tensors unchanged) or the round failed before the data plane
    started (`error` says why). A round that lost data is still ok=True: see `lost_fraction` and the
    counters. Frozen: nobody downstream rewrites it.
    """

    ok: bool
    averaged: Tuple[str, ...] = ()  # what the caller said the round's tensors hold, e.g. ("gradients",)
    group_id: str = ""  # hex
    group_size: int = 1
    my_index: int = -1
    group_bits: str = ""  # after the round (the next round's group key)
    coordinates: Tuple[int, ...] = ()
    weight: float = 1.0
    matchmaking_s: float = 0.0
    compression: str = "none"
    error: Optional[str] = None
    loss_budget: Optional[float] = None  # DBLP budget P the group applied
    loss_phase: Optional[str] = None
    # ---- the deadlines in force (adaptive: see moshpeer/averaging/adaptive_deadlines.py) ----
    matchmaking_window_s: float = 0.0  # how long the group was given to fill
    round_deadline_s: float = 0.0  # the whole round's budget: search, assembly grace and data plane
    data_deadline_s: float = 0.0  # the data plane's budget from the group's assembly (0 without a group)
    # ---- data plane (GroupAllReduce; summed over the all-reduces of the round) ----
    reduce: PhaseStats = field(default_factory=PhaseStats)
    gather: PhaseStats = field(default_factory=PhaseStats)
    departed: List[int] = field(default_factory=list)  # group indices that sent nothing in the round
    # Group indices that were not in the round at all: they refused our authenticated hello (matchmaking
    # disagreed: they never learned of this group), failed to prove the group secret, or were unreachable.
    absent: List[int] = field(default_factory=list)
    relayed: List[int] = field(default_factory=list)  # members our chunks reached over libp2p streams
    missing_chunks: List[Tuple[int, int]] = field(default_factory=list)  # (part, chunk) averages not received
    rejected_connections: int = 0  # strangers / failed authentication during the round
    rejected_messages: int = 0  # malformed headers, bad sizes, non-finite payloads, duplicates
    staged_bytes: int = 0  # encoded bytes copied between a device and pinned host memory (0 on a CPU peer)
    reduce_scatter_s: float = 0.0
    all_gather_s: float = 0.0
    total_s: float = 0.0  # data plane only (matchmaking excluded)
    upload_bps: Optional[float] = None  # this peer's upload rate measured in this round (averaging/uplink.py)
    part_sizes: List[int] = field(default_factory=list)  # values per member's part if sized by bandwidth, else []
    # ---- robust aggregation (aggregation.py) ----
    aggregation: str = "mean"
    # Per member peer id (base58): chunks of our part in which robust aggregation clipped or trimmed it.
    flagged: Dict[str, int] = field(default_factory=dict)
    # Peer ids whose contributions our "clipped" aggregation weighed at zero in this round (suspects.py).
    distrusted: List[str] = field(default_factory=list)
    nonfinite_averages: int = 0  # chunks of our part whose average was not finite (our own value was sent)

    @property
    def chunks_lost(self) -> int:
        return self.reduce.chunks_lost + self.gather.chunks_lost

    @property
    def lost_fraction(self) -> float:
        """Lost / expected chunks, both phases together."""
        expected = self.reduce.chunks_expected + self.gather.chunks_expected
        return self.chunks_lost / expected if expected else 0.0

    @property
    def bytes_sent(self) -> int:
        return self.reduce.bytes_sent + self.gather.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.reduce.bytes_received + self.gather.bytes_received

    def to_dict(self) -> Dict[str, Any]:
        """Plain values (for JSON): the fields, plus chunks_lost, lost_fraction, bytes_sent, bytes_received."""
        return {**asdict(self), "averaged": list(self.averaged), "chunks_lost": self.chunks_lost,
                "lost_fraction": self.lost_fraction, "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


RoundReport = RoundResult  # the name before the round result was one type; kept for existing imports
