"""Names of every DHT key moshpeer uses, in one place.

A run's keys all start with its run id, so runs that share a DHT (one bootstrap node can serve
several) never see each other's records. Other layers add their keys here (progress, averaging),
so a reader can see at a glance what a run stores in the DHT. Every key moshpeer writes is an owned
dictionary whose entries every node checks (`validation.run_validator`); the averaging group keys are hivemind's
matchmaking's, which writes them unsigned (peer id -> expiration), checked by hivemind's own rules only.
"""

from __future__ import annotations

import re

from moshpeer.errors import UserError

# Run ids appear in keys, logs and file names: keep them short and shell-safe.
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def validate_run_id(run_id: str) -> str:
    """Return `run_id` unchanged if it is a usable run id, else raise `UserError`."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise UserError(
            f"invalid run id {run_id!r}: use 1-64 characters from letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    return run_id


def peers_key(run_id: str) -> str:
    """Key of the run's membership dictionary: one signed `PeerRecord` per peer, subkey = owner's public key."""
    return f"{run_id}_peers"


def averaging_prefix(run_id: str) -> str:
    """Prefix of the run's averaging group keys (`{prefix}.0b{group bits}`); hivemind forbids '.' in it."""
    return f"{run_id.replace('.', '-')}_averaging"


def relays_key(run_id: str) -> str:
    """Key of the run's relay directory: public peers' data-plane relays for peers behind NAT (one signed entry
    per offering peer, subkey = its public key)."""
    return f"{run_id}_relays"


def state_offers_key(run_id: str) -> str:
    """Key of the run's state offers: one signed `StateOfferRecord` per donor (subkey = owner marker)."""
    return f"{run_id}_state_offers"
