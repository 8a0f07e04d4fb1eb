"""Per-member credentials of a run with an owner: who may join, until when, and who was revoked.

A swarm key admits whoever holds it, and one leaked copy can only be withdrawn by re-keying every member. A run
with an owner (`--run-owner PEER_ID`) admits a peer instead by a credential that the owner's identity key signed
for that peer's id alone:

    credential  = msgpack([body, signature]),  body = msgpack(["moshpeer-credential-1", owner key, peer id,
                                                               not_after])
    revocations = msgpack([body, signature]),  body = msgpack(["moshpeer-revocations-1", owner key, issued_at,
                                                               [peer id, ...]])

`owner key` is the owner's RSA public key (OpenSSH bytes, at least MIN_RSA_BITS); a verifier checks that it hashes
to the run owner's peer id, then the signature (hivemind's RSA-PSS over SHA-256). A credential names one peer id:
a member that shows it to others cannot lend it, because that id's records are signed by, and its connections
authenticated with, the id's own key. A credential ends at `not_after` (UNIX seconds), so a member the owner
forgets to revoke still leaves in time.

A revocation list is cumulative: the newest one (by `issued_at`) replaces the older ones. It travels in every
member's DHT record (`PeerRecord.revocations`), so the owner only has to put it in one record (a node of its own,
`--revoked FILE`) for the run to learn it within a few heartbeats, and members that started later learn it from
the others. Everything here is pure (no I/O, no clock: `now` is passed in); parsing a stranger's bytes never
raises, it returns None.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import FrozenSet, Iterable, Optional

import msgpack
from cryptography.hazmat.primitives.asymmetric import rsa

from moshpeer.dht.identity import MIN_RSA_BITS, Identity, load_public_key, peer_id_from_public_key
from moshpeer.errors import ProtocolError

CREDENTIAL_KIND = "moshpeer-credential-1"
REVOCATIONS_KIND = "moshpeer-revocations-1"
# A credential is about 800 bytes with a 2048-bit owner key (its OpenSSH public key and a base64 signature).
MAX_CREDENTIAL_BYTES = 2048
MAX_REVOKED_PEERS = 128  # ~6 KB of peer ids; credentials expire, so an owner drops the ones past their not_after
MAX_REVOCATIONS_BYTES = 8192
PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{16,128}$")  # base58 libp2p peer ids (PeerRecord's too)


@dataclass(frozen=True)
class Credential:
    """A verified credential: `peer_id` is a member of the owner's run until `not_after` (UNIX seconds)."""

    peer_id: str
    not_after: float


@dataclass(frozen=True)
class Revocations:
    """A verified revocation list: the owner revoked `peer_ids` at `issued_at` (UNIX seconds)."""

    issued_at: float
    peer_ids: FrozenSet[str]
    blob: bytes  # the signed bytes, as they travel in records


def issue_credential(owner: Identity, peer_id: str, not_after: float) -> bytes:
    """The credential that admits `peer_id` to `owner`'s runs until `not_after`."""
    body = msgpack.packb([CREDENTIAL_KIND, owner.public_key.to_bytes(), peer_id, float(not_after)])
    return msgpack.packb([body, owner.private_key.sign(body)])


def issue_revocations(owner: Identity, peer_ids: Iterable[str], issued_at: float) -> bytes:
    """The revocation list of `owner`'s runs that revokes exactly `peer_ids` (sorted, deduplicated), issued at
    `issued_at`. Raises ValueError past MAX_REVOKED_PEERS."""
    revoked = sorted(set(peer_ids))
    if len(revoked) > MAX_REVOKED_PEERS:
        raise ValueError(f"a revocation list holds at most {MAX_REVOKED_PEERS} peer ids, got {len(revoked)}")
    body = msgpack.packb([REVOCATIONS_KIND, owner.public_key.to_bytes(), float(issued_at), revoked])
    return msgpack.packb([body, owner.private_key.sign(body)])


def verify_credential(blob: bytes, owner_peer_id: str, peer_id: str, now: float) -> Optional[Credential]:
    """The credential in `blob` if the run owner signed it for `peer_id` and it has not expired at `now`; else None."""
    fields = _signed_fields(blob, MAX_CREDENTIAL_BYTES, CREDENTIAL_KIND, owner_peer_id)
    if fields is None or len(fields) != 2:
        return None
    named, not_after = fields
    if named != peer_id or not isinstance(not_after, float) or not math.isfinite(not_after) or not_after <= now:
        return None
    return Credential(peer_id, not_after)


def parse_revocations(blob: bytes, owner_peer_id: str) -> Optional[Revocations]:
    """The revocation list in `blob` if the run owner signed it; else None."""
    fields = _signed_fields(blob, MAX_REVOCATIONS_BYTES, REVOCATIONS_KIND, owner_peer_id)
    if fields is None or len(fields) != 2:
        return None
    issued_at, revoked = fields
    if not isinstance(issued_at, float) or not math.isfinite(issued_at) or not isinstance(revoked, list) \
            or len(revoked) > MAX_REVOKED_PEERS \
            or not all(isinstance(p, str) and PEER_ID.match(p) for p in revoked):
        return None
    return Revocations(issued_at, frozenset(revoked), bytes(blob))


def _signed_fields(blob: bytes, limit: int, kind: str, owner_peer_id: str) -> Optional[list]:
    """The fields after (kind, owner key) of a signed blob of `kind` by the run owner, or None."""
    if not isinstance(blob, (bytes, bytearray)) or not 0 < len(blob) <= limit:
        return None
    try:
        body, signature = msgpack.unpackb(bytes(blob), raw=False, strict_map_key=True, max_bin_len=limit)
        fields = msgpack.unpackb(body, raw=False, max_bin_len=limit)
    except Exception:  # msgpack raises many unrelated types on junk, and unpacking a non-pair raises ValueError
        return None
    if not isinstance(body, bytes) or not isinstance(signature, bytes) or not isinstance(fields, list) \
            or len(fields) < 2 or fields[0] != kind or not isinstance(fields[1], bytes):
        return None
    try:
        owner_key = load_public_key(fields[1])
    except ProtocolError:
        return None
    key = getattr(owner_key, "_public_key", None)
    if not isinstance(key, rsa.RSAPublicKey) or key.key_size < MIN_RSA_BITS:
        return None
    if peer_id_from_public_key(owner_key) != owner_peer_id or not owner_key.verify(body, signature):
        return None
    return fields[2:]
