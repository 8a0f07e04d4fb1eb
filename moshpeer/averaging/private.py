"""Private runs in the averaging layer: who may join our groups, lead them, and connect to our data plane.

The policy is the DHT node's `Admission` (moshpeer/dht/admission.py); this module applies it at the
averager's three doors (refusals counted there, at "matchmaking" and "dataplane"):
- a join request whose sender (libp2p-authenticated `remote_id`) is not admitted is refused
  (`admits_follower`: allow-list, and the swarm-key tag in its gathered metadata);
- a peer looking for a leader skips leaders that are not admitted (`excluded_leader`: not on the
  allow-list, or known to lack the swarm key), and leaves an assembled group with a member that is not
  admitted (`outsider_in_group`: every member's tag is checked, the leader's included);
- the data plane refuses a hello signed by a key it excludes (`dataplane_check`), and with a swarm key
  the connection keys derive from it (`Admission.connection_secret`): a peer without it fails the MACs.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

from moshpeer.dht.admission import Admission
from moshpeer.dht.identity import load_public_key, peer_id_from_public_key
from moshpeer.errors import ProtocolError

logger = logging.getLogger(__name__)


def admits_follower(admission: Admission, peer_id: str, tag: Optional[bytes]) -> bool:
    """May `peer_id` (whose gathered metadata carries `tag`; None: unreadable) join a group we lead?"""
    return not admission.private or admission.check("matchmaking", peer_id, tag)


def excluded_leader(admission: Admission, peer_id: str) -> bool:
    """Should a peer looking for a leader skip `peer_id`'s group-key entry? Yes if we exclude it: not on the
    allow-list, or refused before (with a swarm key, a leader's tag is checked once the group is assembled: a
    peer's first entry cannot be judged by its id alone). Counted once per peer (the entry is read at every
    refresh)."""
    if admission.private and admission.excluded(peer_id):
        admission.refuse("matchmaking", peer_id, once=True)
        return True
    return False


def outsider_in_group(admission: Admission, peer_ids: Sequence[str], tags: Sequence[bytes]) -> Optional[str]:
    """The first member of an assembled group that we do not admit (None: all are admitted)."""
    if not admission.private:
        return None
    for peer_id, tag in zip(peer_ids, tags):
        if not admission.check("matchmaking", peer_id, tag):
            return peer_id
    return None


def dataplane_check(admission: Admission) -> Optional[Callable[[bytes], None]]:
    """For `handshake.accept`: raises ProtocolError if the hello's public key belongs to a peer we exclude (not
    on the allow-list; with a swarm key, refused before, e.g. for its records). None in an open run. A peer
    not yet judged gets through to the handshake, whose keys derive from the swarm key."""
    if not admission.private:
        return None

    def check(public_key: bytes) -> None:
        peer_id = peer_id_from_public_key(load_public_key(public_key))
        if admission.excluded(peer_id):
            admission.refuse("dataplane", peer_id)
            raise ProtocolError(f"peer {peer_id[-12:]} is not admitted to this private run")

    return check
