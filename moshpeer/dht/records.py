"""The peer record: what each peer says about itself in the run's membership dictionary.

Records arrive from the network, so the schema is strict and bounded: exact types (no coercion of
"3" to 3), finite numbers, short strings, short lists, no unknown fields. `PeerRecord.from_wire`
is the one way to turn untrusted data into a record.
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from moshpeer.dht.credentials import MAX_CREDENTIAL_BYTES, MAX_REVOCATIONS_BYTES, PEER_ID

Role = Literal["trainer", "aux", "bootstrap"]
ROLES = ("trainer", "aux", "bootstrap")

# Bounds that keep a record small (it is re-published every heartbeat and fetched by every peer).
MAX_ADDRESSES = 16
MAX_ADDRESS_CHARS = 256
MAX_GRID_DIMS = 32
MAX_GRID_COORD = 1 << 16
MAX_GROUP_BITS = 64
MAX_FLAGGED_PEERS = 16
MAX_HEALTH_ROUNDS = 1000
MAX_WITNESSED = 64
WITNESS_TAG_BYTES = 8

_PeerIdStr = Annotated[str, StringConstraints(pattern=PEER_ID.pattern)]  # base58
_Address = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ADDRESS_CHARS)]
_Count = Annotated[int, Field(ge=0, le=2**62)]
_Seconds = Annotated[float, Field(ge=0.0)]

# Fields the owning peer may change while it runs; the rest are fixed when it starts.
MUTABLE_FIELDS = frozenset(
    {"addresses", "grid", "group_bits", "epoch", "step", "samples_accumulated", "samples_per_second", "flagged",
     "round_health", "target_batch_size", "upload_bps", "training", "samples_counted_at", "witnessed",
     "apart_since"}
)


class RoundHealth(BaseModel):
    """How a peer's recent collaborative rounds went (its last `rounds`, at most MAX_HEALTH_ROUNDS):
    shown by `moshpeer status`. Five numbers, so the record stays small."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    rounds: Annotated[int, Field(ge=0, le=MAX_HEALTH_ROUNDS)]
    averaged: Annotated[int, Field(ge=0, le=MAX_HEALTH_ROUNDS)]  # of them, with a group
    lost_fraction: Annotated[float, Field(ge=0.0, le=1.0)]  # chunks lost / expected, over the averaged ones
    seconds: _Seconds  # mean seconds per averaged round (matchmaking + data plane)
    # Of its connections to group members in those rounds, the share that went through a relay (ours or libp2p's)
    # because no direct TCP connection could be opened (NAT, firewall): `moshpeer status` shows the path.
    relayed_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0

    @model_validator(mode="after")
    def _averaged_within_rounds(self) -> "RoundHealth":
        if self.averaged > self.rounds:
            raise ValueError(f"averaged ({self.averaged}) exceeds rounds ({self.rounds})")
        return self


class PeerRecord(BaseModel):
    """One peer's entry in the run's membership dictionary (`keys.peers_key(run_id)`).

    Stored under the owner's `[owner:<public key>]` subkey and signed with that key; `peer_id` must be
    the libp2p peer id of that same key (see `validation.PeerRecordValidator`).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    peer_id: _PeerIdStr
    role: Role
    addresses: List[_Address] = Field(default_factory=list, max_length=MAX_ADDRESSES)
    # Moshpit grid coordinates and/or hivemind-style group bits, filled in by the averaging layer.
    grid: List[Annotated[int, Field(ge=0, lt=MAX_GRID_COORD)]] = Field(default_factory=list, max_length=MAX_GRID_DIMS)
    group_bits: Annotated[str, StringConstraints(pattern=rf"^[01]{{0,{MAX_GROUP_BITS}}}$")] = ""
    epoch: _Count = 0
    step: _Count = 0
    # Samples this peer has processed toward the current collaborative epoch (swarm progress).
    samples_accumulated: _Count = 0
    samples_per_second: _Seconds = 0.0
    # Unix time `samples_accumulated` was counted, by the owner's clock (0: at `updated_at`). Heartbeats re-publish
    # the record without counting anything: readers extrapolate a peer's progress from here, not from them.
    samples_counted_at: _Seconds = 0.0
    # Upload bandwidth in bytes/s the peer measured on its averaging traffic (or declared); 0 = unknown.
    upload_bps: Annotated[float, Field(ge=0.0, le=1e12)] = 0.0
    version: Annotated[str, StringConstraints(max_length=64)]
    protocol: Annotated[int, Field(ge=0, le=2**31)]
    started_at: _Seconds  # unix time the peer started, by its own clock
    updated_at: _Seconds  # unix time of this publication, by the owner's clock: "last seen"
    leaving: bool = False  # set by a peer that withdraws; readers drop it at once
    # A trainer past its startup (task, model, optimizer): it trains, or waits for its peers to. A record is
    # published when the peer's DHT starts, seconds earlier under load: `--min-peers` counts only these.
    training: bool = False
    # Peers whose contributions this peer's robust aggregation clipped or trimmed, and in how many chunks
    # (the most flagged ones; `moshpeer status` adds up what every record says about each peer).
    flagged: Dict[_PeerIdStr, _Count] = Field(default_factory=dict, max_length=MAX_FLAGGED_PEERS)
    # What a training peer says about its recent rounds (None: a bootstrap node, or no round yet), and the
    # samples the run gathers per collaborative epoch (0: unknown): `moshpeer status` shows both.
    round_health: Optional[RoundHealth] = None
    # Trainers whose contributions reached this peer in its recent rounds, as short tags (witnesses.py): the
    # evidence by which the peers that averaged with this one count the samples of the peers it names.
    witnessed: List[Annotated[bytes, Field(min_length=WITNESS_TAG_BYTES, max_length=WITNESS_TAG_BYTES)]] = Field(
        default_factory=list, max_length=MAX_WITNESSED)
    target_batch_size: _Count = 0
    # A trainer back from an outage, until it took the swarm's state: the epoch since which it trained apart (after
    # its last round with a group). Readers do not let its later epochs move the swarm epoch (trained_apart.py).
    apart_since: Optional[_Count] = None
    # In a private run: proof that this peer is a member, a swarm-key tag or the run owner's credential
    # (admission.py; b"" in open runs). In a run with an owner, the newest revocation list this peer knows: every
    # member passes it on (credentials.py).
    member_tag: Annotated[bytes, Field(max_length=MAX_CREDENTIAL_BYTES)] = b""
    revocations: Annotated[bytes, Field(max_length=MAX_REVOCATIONS_BYTES)] = b""

    @classmethod
    def from_wire(cls, value: Any) -> "PeerRecord":
        """Validate an untrusted value from the DHT: strict types, no conversions. Raises ValueError."""
        if not isinstance(value, Mapping):
            raise ValueError(f"a peer record must be a map, got {type(value).__name__}")
        return cls.model_validate(value, strict=True)

    def to_wire(self) -> dict:
        """The msgpack-friendly dict stored in the DHT (floats stay floats, lists stay lists)."""
        return self.model_dump(mode="python")

    def updated(self, **fields: Any) -> "PeerRecord":
        """A copy with `fields` changed, validated again (unlike `model_copy`)."""
        data = self.model_dump(mode="python")
        data.update(fields)
        return PeerRecord.model_validate(data)
