"""What one averaging round did: `RoundResult`, one typed value from where the round happens to its readers.

`MoshpitAverager.step()` makes it once, when the round is over (`step(wait=False)` returns a future of
it). The same object reaches `CollaborativeOptimizer` (held unchanged in its `CollaborativeRound`),
the `moshpeer join` event line (serialised once, by `to_dict()`, at the edge), the metrics and the
benchmarks. `GroupAllReduce` fills one `DataPlaneStats` (with a `PhaseStats` per phase); the round
result embeds it as `data` and reads its counters through properties, not a copy. A round that runs
several all-reduces (ARC-Top-K) adds their stats up with `+`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from moshpeer.averaging.suspects import MemberEvidence

if TYPE_CHECKING:
    import torch


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

    def __add__(self, other: "PhaseStats") -> "PhaseStats":
        """Every counter summed (two all-reduces of one round, one after the other)."""
        return PhaseStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def _sum_by_index(a: List[Any], b: List[Any]) -> List[Any]:
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return [x + shorter[i] if i < len(shorter) else x for i, x in enumerate(longer)]


@dataclass
class DataPlaneStats:
    """What the data plane (`GroupAllReduce`) did in one all-reduce, or in all of a round's all-reduces
    added up with `+`. Members are named by their index in the group here; `RoundResult` names the
    flagged ones by peer id."""

    reduce: PhaseStats = field(default_factory=PhaseStats)
    gather: PhaseStats = field(default_factory=PhaseStats)
    departed: List[int] = field(default_factory=list)  # group indices that sent nothing in the round
    # Group indices with a chunk that reached its owner here after the owner stopped waiting (so, if they had sent
    # nothing before, also in `departed`): alive, but slower than the round's deadline.
    late: List[int] = field(default_factory=list)
    # Group indices that were not in the round at all: they refused our authenticated hello (matchmaking
    # disagreed: they never learned of this group), failed to prove the group secret, or were unreachable.
    absent: List[int] = field(default_factory=list)
    # Members our chunks reached through a relay: a circuit through a public peer (tcp_relay/), or, in
    # `over_libp2p` too, a libp2p stream. Every other member that got our chunks, got them directly.
    relayed: List[int] = field(default_factory=list)
    over_libp2p: List[int] = field(default_factory=list)
    missing_chunks: List[Tuple[int, int]] = field(default_factory=list)  # (part, chunk) averages not received
    rejected_connections: int = 0  # strangers / failed authentication during the round
    connections_kept: int = 0  # our connections to members kept from an earlier all-reduce (kept_links.py), not new
    rejected_messages: int = 0  # malformed headers, bad sizes, non-finite payloads, duplicates
    staged_bytes: int = 0  # encoded bytes copied between a device and pinned host memory (0 on a CPU peer)
    reduce_scatter_s: float = 0.0
    all_gather_s: float = 0.0
    total_s: float = 0.0  # data plane only (matchmaking excluded)
    upload_bps: Optional[float] = None  # this peer's upload rate measured on its direct connections (uplink.py)
    nonfinite_averages: int = 0  # chunks of our part whose average was not finite (our own value was sent)
    # chunks of our part a robust mode ("clipped", "trimmed") kept our own value for: fewer than
    # aggregation.MIN_ROBUST_CONTRIBUTIONS contributions, ours included, to outvote a hostile one
    robust_too_few: int = 0
    # Per member index: what robust aggregation saw of its contributions to our part (suspects.py's evidence).
    evidence_by_index: List[MemberEvidence] = field(default_factory=list)
    # A robust owner's copy of one sampled member's contribution to our part (NaN where it did not arrive), and
    # where our part starts in the all-reduce's vector: a spot check's input (PartReducer.member_contribution).
    member_sample: Optional[torch.Tensor] = field(default=None, repr=False)
    member_sample_start: int = 0

    def __add__(self, other: "DataPlaneStats") -> "DataPlaneStats":
        """Two all-reduces of one round, one after the other: counters and times add up, member sets unite,
        the upload rate is the better measurement (max)."""
        uploads = [u for u in (self.upload_bps, other.upload_bps) if u is not None]
        return DataPlaneStats(
            reduce=self.reduce + other.reduce,
            gather=self.gather + other.gather,
            departed=sorted(set(self.departed) | set(other.departed)),
            late=sorted(set(self.late) | set(other.late)),
            absent=sorted(set(self.absent) | set(other.absent)),
            relayed=sorted(set(self.relayed) | set(other.relayed)),
            over_libp2p=sorted(set(self.over_libp2p) | set(other.over_libp2p)),
            missing_chunks=self.missing_chunks + other.missing_chunks,
            rejected_connections=self.rejected_connections + other.rejected_connections,
            connections_kept=self.connections_kept + other.connections_kept,
            rejected_messages=self.rejected_messages + other.rejected_messages,
            staged_bytes=self.staged_bytes + other.staged_bytes,
            reduce_scatter_s=self.reduce_scatter_s + other.reduce_scatter_s,
            all_gather_s=self.all_gather_s + other.all_gather_s,
            total_s=self.total_s + other.total_s,
            upload_bps=max(uploads) if uploads else None,
            nonfinite_averages=self.nonfinite_averages + other.nonfinite_averages,
            robust_too_few=self.robust_too_few + other.robust_too_few,
            evidence_by_index=_sum_by_index(self.evidence_by_index, other.evidence_by_index),
            member_sample=self.member_sample if self.member_sample is not None else other.member_sample,
            member_sample_start=self.member_sample_start if self.member_sample is not None
            else other.member_sample_start,
        )

    @property
    def chunks_lost(self) -> int:
        return self.reduce.chunks_lost + self.gather.chunks_lost


# DataPlaneStats fields that RoundResult reads through and `to_dict()` spreads out at its top level, in the
# order its keys always had. The per-index counters are left out: a round's readers get `flagged` by peer id.
_DATA_FIELDS = ("reduce", "gather", "departed", "absent", "relayed", "missing_chunks", "rejected_connections",
                "rejected_messages", "staged_bytes", "reduce_scatter_s", "all_gather_s", "total_s", "upload_bps")
_LAST_DATA_FIELDS = ("nonfinite_averages", "robust_too_few", "over_libp2p", "connections_kept", "late")


def _data_fact(name: str) -> property:
    return property(lambda result: getattr(result.data, name), doc=f"`data.{name}` (see `DataPlaneStats`)")


@dataclass(frozen=True)
class ContributionSample:
    """What one member of the group contributed to the part this peer owned, as it arrived: the input of a spot
    check (moshpeer/peer/accountability/), which recomputes it from the work the member declared."""

    peer_id: str  # base58
    work: Optional[Tuple[int, int]]  # (epoch, micro-batch size) it declared in matchmaking; None: it declared none
    weight: float  # the weight it declared (samples, for gradients), before any cap
    start: int  # where our part starts in the round's flat vector
    values: "torch.Tensor"  # fp32 on the CPU, NaN where its chunk did not arrive


@dataclass(frozen=True)
class RoundResult:
    """Outcome of one `MoshpitAverager.step()`, as this peer saw it.

    `ok` is False when no group was found (tensors unchanged) or the round failed before the data plane
    started (`error` says why). A round that lost data is still ok=True: see `lost_fraction` and the
    counters. Frozen: nobody downstream rewrites it. The data plane's counters (`reduce`, `gather`,
    `departed`, `absent`, `total_s`, ...) are read from the embedded `data`.
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
    upload_paced_s: float = 0.0  # the span the group spread its upload over (pacing.py; 0: not paced)
    # ---- data plane (GroupAllReduce; summed over the all-reduces of the round) ----
    data: DataPlaneStats = field(default_factory=DataPlaneStats)
    part_sizes: List[int] = field(default_factory=list)  # values per member's part if sized by bandwidth, else []
    # ---- robust aggregation (aggregation.py) ----
    aggregation: str = "mean"
    # Per member peer id (base58): chunks of our part in which robust aggregation clipped or trimmed it.
    flagged: Dict[str, int] = field(default_factory=dict)
    # Peer ids whose contributions our "clipped" aggregation weighed at zero in this round (suspects.py).
    distrusted: List[str] = field(default_factory=list)
    # Peer ids (not ours) whose contributions to our part reached us: the members we saw average (witnesses.py).
    contributors: List[str] = field(default_factory=list)
    # The training epochs the members declared in matchmaking, ours included (those that declared one), in group
    # order: a member that joined a later epoch's round learns so (moshpeer/peer/optimizer/epoch_agreement.py).
    member_epochs: List[int] = field(default_factory=list)
    # The members declared different digests of values they should already hold alike (RoundPlan.digest in
    # moshpeer/peer/strategies/base.py): their copies drifted apart, and the strategy adopts the group's mean.
    members_diverged: bool = False
    # A robust owner's copy of one member's contribution to our part, for a spot check; not in `to_dict()`.
    sample: Optional["ContributionSample"] = field(default=None, repr=False)

    reduce = _data_fact("reduce")
    gather = _data_fact("gather")
    departed = _data_fact("departed")
    absent = _data_fact("absent")
    relayed = _data_fact("relayed")
    missing_chunks = _data_fact("missing_chunks")
    rejected_connections = _data_fact("rejected_connections")
    rejected_messages = _data_fact("rejected_messages")
    staged_bytes = _data_fact("staged_bytes")
    reduce_scatter_s = _data_fact("reduce_scatter_s")
    all_gather_s = _data_fact("all_gather_s")
    total_s = _data_fact("total_s")
    upload_bps = _data_fact("upload_bps")
    nonfinite_averages = _data_fact("nonfinite_averages")  # (a to_dict() key after `contributors`)
    robust_too_few = _data_fact("robust_too_few")  # (likewise)
    over_libp2p = _data_fact("over_libp2p")  # (likewise)
    connections_kept = _data_fact("connections_kept")  # (likewise)
    late = _data_fact("late")  # (likewise)

    @property
    def chunks_lost(self) -> int:
        return self.data.chunks_lost

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
        """Plain values (for JSON): the fields with the data plane's counters at the top level (no "data"
        key), plus chunks_lost, lost_fraction, bytes_sent, bytes_received."""
        plain = asdict(replace(self, sample=None, data=replace(self.data, member_sample=None)))
        plain.pop("sample")
        out: Dict[str, Any] = {}
        for name, value in plain.items():
            if name == "data":
                out.update((key, value[key]) for key in _DATA_FIELDS)
            else:
                out[name] = value
        out.update((key, plain["data"][key]) for key in _LAST_DATA_FIELDS)
        return {**out, "averaged": list(self.averaged), "chunks_lost": self.chunks_lost,
                "lost_fraction": self.lost_fraction, "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


RoundReport = RoundResult  # the name before the round result was one type; kept for existing imports
