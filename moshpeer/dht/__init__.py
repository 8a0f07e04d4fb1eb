"""Swarm membership on hivemind's DHT: identities, signed and schema-checked peer records, key names.

This layer imports no other moshpeer layer. See docs/swarm.md for how membership works.

The names below load on first use (most of them import hivemind, and hivemind imports torch), so that
importing one light submodule (`moshpeer.dht.maddrs`, `moshpeer.dht.keys`) stays light: the CLI checks its
flags before anything heavy is loaded.
"""

from typing import Any

_NAMES = {
    "Admission": "admission",
    "Identity": "identity",
    "peer_id_from_owner_key": "identity",
    "peers_key": "keys",
    "relays_key": "keys",
    "state_offers_key": "keys",
    "RelayOfferRecord": "offers",
    "StateOfferRecord": "offers",
    "validate_run_id": "keys",
    "check_ports_free": "maddrs",
    "parse_initial_peers": "maddrs",
    "parse_listen_maddrs": "maddrs",
    "DEFAULT_HOST_MADDRS": "maddrs",
    "list_peers": "membership",
    "publish_record": "membership",
    "withdraw": "membership",
    "StartCancelled": "node",
    "SwarmDHT": "node",
    "start_dht": "node",
    "MUTABLE_FIELDS": "records",
    "ROLES": "records",
    "PeerRecord": "records",
    "Role": "records",
    "OwnedRecordValidator": "validation",
    "RecordRejected": "validation",
    "run_validator": "validation",
    "parse_owned_entry": "validation",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        import importlib

        value = getattr(importlib.import_module(f"moshpeer.dht.{_NAMES[name]}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'moshpeer.dht' has no attribute {name!r}")
