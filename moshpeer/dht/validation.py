"""Validating owned, schema-checked DHT records, as a hivemind record validator.

hivemind 1.1.12's `SchemaValidator` is written against `pydantic.v1` models, while moshpeer's
records are pydantic 2 models, so we follow its design (a `RecordValidatorBase` that knows which
key ids carry which schema, merged across instances) with pydantic 2's strict validation.

Every key this validator knows is a dictionary of *owned* entries: the subkey is exactly one
`[owner:<RSA public key>]` marker. hivemind's `RSASignatureValidator` (priority 10, so it runs
first on validation) checks that the value is signed by that key and strips the signature; this
validator then checks the rest: the subkey is an owner marker (so unsigned writes are impossible),
the value fits the schema, a `peer_id` field names the owner's own peer id (so nobody can publish
a record about another peer), and the expiration is not absurdly far in the future (so a record
cannot outlive its owner by more than `max_ttl`). Keys this validator does not know pass through,
so other layers can add their own validators for their own keys.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Dict, Iterable, Mapping, Optional, Type, TypeVar

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ValidationError

from moshpeer.dht.identity import peer_id_from_owner_key
from moshpeer.dht.keys import peers_key, relays_key, state_offers_key
from moshpeer.dht.offers import RelayOfferRecord, StateOfferRecord
from moshpeer.dht.records import PeerRecord

logger = logging.getLogger(__name__)
ModelT = TypeVar("ModelT", bound=BaseModel)

# Records are small maps; a value far larger than this is junk and is dropped before decoding.
DEFAULT_MAX_VALUE_BYTES = 16 * 1024
# No owned record may claim to live longer than this from now.
DEFAULT_MAX_TTL = 3600.0


def key_id(raw_key: str) -> bytes:
    """The DHT's id of a key, as hivemind computes it when storing or getting `raw_key`."""
    return DHTID.generate(source=raw_key).to_bytes()


class OwnedRecordValidator(RecordValidatorBase):
    """Checks owner-marked subkeys, pydantic 2 schemas and owner binding for a set of DHT keys.

    :param schemas: raw DHT key (e.g. `peers_key(run_id)`) -> pydantic model of each entry's value
    :param peer_id_field: if a schema has this field, its value must be the owner's peer id
    """

    def __init__(
        self,
        schemas: Mapping[str, Type[BaseModel]],
        *,
        peer_id_field: str = "peer_id",
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_ttl: float = DEFAULT_MAX_TTL,
    ):
        self._schemas: Dict[bytes, Type[BaseModel]] = {key_id(raw): schema for raw, schema in schemas.items()}
        self._key_names: Dict[bytes, str] = {key_id(raw): raw for raw in schemas}
        self.peer_id_field = peer_id_field
        self.max_value_bytes = max_value_bytes
        self.max_ttl = max_ttl
        self.rejected: collections.Counter = collections.Counter()  # reason -> count, in the validating process

    def parse(self, record: DHTRecord) -> Optional[BaseModel]:
        """The validated model of `record` (signature already stripped), or None if it is invalid or not ours."""
        schema = self._schemas.get(record.key)
        if schema is None:
            return None
        try:
            return self._parse_owned(record, schema)
        except RecordRejected as e:
            self.rejected[e.reason] += 1
            logger.debug(f"rejected a record under {self._key_names[record.key]!r}: {e.reason}")
            return None

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self._schemas:
            return True  # someone else's key: not our business
        return self.parse(record) is not None

    def _parse_owned(self, record: DHTRecord, schema: Type[BaseModel]) -> BaseModel:
        if len(record.value) > self.max_value_bytes:
            raise RecordRejected("value too large")
        if record.expiration_time > get_dht_time() + self.max_ttl:
            raise RecordRejected("expiration too far in the future")
        try:
            subkey = DHTProtocol.serializer.loads(record.subkey)
            value = DHTProtocol.serializer.loads(record.value)
        except Exception:  # msgpack raises many unrelated exception types on junk
            raise RecordRejected("undecodable subkey or value") from None
        return parse_owned_entry(subkey, value, schema, peer_id_field=self.peer_id_field)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        # One instance serves all keys, so a CompositeValidator runs the checks once per record.
        if not isinstance(other, OwnedRecordValidator) or other.peer_id_field != self.peer_id_field:
            return False
        self._schemas.update(other._schemas)
        self._key_names.update(other._key_names)
        self.max_value_bytes = max(self.max_value_bytes, other.max_value_bytes)
        self.max_ttl = max(self.max_ttl, other.max_ttl)
        return True


def run_validator(run_ids: Iterable[str]) -> "OwnedRecordValidator":
    """The validator every moshpeer DHT node runs for these runs: each owned dictionary a run writes (its peer
    records, relay offers and state offers) with the schema of its entries."""
    schemas: Dict[str, Type[BaseModel]] = {}
    for run_id in run_ids:
        schemas.update({peers_key(run_id): PeerRecord, relays_key(run_id): RelayOfferRecord,
                        state_offers_key(run_id): StateOfferRecord})
    return OwnedRecordValidator(schemas)


class RecordRejected(ValueError):
    """An owned record failed validation; `reason` says why (short, for logs and counters)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def parse_owned_entry(
    subkey: Any, value: Any, schema: Type[ModelT], *, peer_id_field: str = "peer_id"
) -> ModelT:
    """Check one decoded dictionary entry (subkey, value) of an owned key; return the parsed model.

    The signature is not checked here (hivemind's RSASignatureValidator does that before us).

    :raises RecordRejected: the subkey is not an owner marker, the value breaks the schema, or its
        `peer_id_field` names someone other than the owner
    """
    if not isinstance(subkey, bytes):
        raise RecordRejected("subkey is not an owner key")  # also catches regular (non-dictionary) values
    owner_peer_id = peer_id_from_owner_key(subkey)
    if owner_peer_id is None:
        raise RecordRejected("subkey is not exactly one [owner:<RSA key>] marker")
    if not isinstance(value, Mapping):
        raise RecordRejected("value is not a map")
    try:
        parsed = schema.model_validate(value, strict=True)
    except ValidationError as e:
        first = e.errors()[0]
        raise RecordRejected(f"schema: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    if peer_id_field in schema.model_fields and getattr(parsed, peer_id_field) != owner_peer_id:
        raise RecordRejected("peer_id does not belong to the signing key")
    return parsed
