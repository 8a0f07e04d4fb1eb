"""Swarm membership on hivemind's DHT: identities, signed and schema-checked peer records, key names.

This layer imports no other moshpeer layer. See docs/swarm.md for how membership works.
"""

from moshpeer.dht.admission import Admission
from moshpeer.dht.identity import Identity, peer_id_from_owner_key
from moshpeer.dht.keys import peers_key, validate_run_id
from moshpeer.dht.maddrs import check_ports_free, parse_initial_peers, parse_listen_maddrs
from moshpeer.dht.membership import list_peers, publish_record, withdraw
from moshpeer.dht.node import DEFAULT_HOST_MADDRS, StartCancelled, SwarmDHT, start_dht
from moshpeer.dht.records import MUTABLE_FIELDS, ROLES, PeerRecord, Role
from moshpeer.dht.validation import OwnedRecordValidator, RecordRejected, parse_owned_entry

__all__ = [
    "Admission",
    "DEFAULT_HOST_MADDRS",
    "Identity",
    "MUTABLE_FIELDS",
    "OwnedRecordValidator",
    "PeerRecord",
    "ROLES",
    "RecordRejected",
    "Role",
    "StartCancelled",
    "SwarmDHT",
    "check_ports_free",
    "list_peers",
    "parse_initial_peers",
    "parse_listen_maddrs",
    "parse_owned_entry",
    "peer_id_from_owner_key",
    "peers_key",
    "publish_record",
    "start_dht",
    "validate_run_id",
    "withdraw",
]
