"""The offers peers publish in a run's DHT, as they arrive from the network: a state donor's
(`StateOfferRecord`, under `keys.state_offers_key`) and a public peer's data-plane relay (`RelayOfferRecord`,
under `keys.relays_key`).

Each is one entry of an owned dictionary (subkey = the offering peer's `[owner:...]` marker, value signed by
it), so every DHT node checks them as it checks peer records (`validation.run_validator`): unsigned, oversized,
misattributed, long-lived or ill-typed entries are not stored, and a listing never pulls junk a stranger wrote.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from moshpeer.dht.admission import MAX_PROOF_BYTES
from moshpeer.dht.credentials import PEER_ID

_PeerIdStr = Annotated[str, StringConstraints(pattern=PEER_ID.pattern)]
_Host = Annotated[str, StringConstraints(min_length=1, max_length=255)]
_Port = Annotated[int, Field(gt=0, lt=65536)]
_Proof = Annotated[bytes, Field(max_length=MAX_PROOF_BYTES)]


class StateOfferRecord(BaseModel):
    """A donor's state server: where it listens, the epoch of the state it serves, its state protocol."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    peer_id: _PeerIdStr  # must be the signing owner's (parse_owned_entry)
    host: _Host
    port: _Port
    epoch: Annotated[int, Field(ge=0, le=2**62)]
    protocol: Annotated[int, Field(ge=0, le=2**31)]
    tag: _Proof = b""  # its membership proof in a private run


class RelayOfferRecord(BaseModel):
    """A public peer's data-plane relay for peers behind NAT."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    peer_id: _PeerIdStr  # must be the signing owner's (parse_owned_entry)
    host: _Host
    port: _Port
    tag: _Proof = b""
