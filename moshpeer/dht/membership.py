"""Swarm membership: publish, list and withdraw peer records under the run's key.

Each peer owns one entry of the run's dictionary `peers_key(run_id)`: subkey = its `[owner:...]`
public-key marker, value = its `PeerRecord`, signed by hivemind's RSASignatureValidator. An entry
lives until its expiration time; the owner re-publishes it every heartbeat with a later one. A
peer that leaves on purpose publishes `leaving=True` (it cannot delete: a DHT entry only yields to
one that expires later), and readers drop leaving records at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Dict, List, Optional, Tuple

from hivemind.utils import get_dht_time

from moshpeer.dht.keys import peers_key
from moshpeer.dht.node import SwarmDHT
from moshpeer.dht.records import ROLES, PeerRecord
from moshpeer.bounded_memory import remember
from moshpeer.dht.validation import RecordRejected, parse_owned_entry
from moshpeer.ratelimited_log import RateLimitedLog
from moshpeer.version import PROTOCOL_VERSION, __version__

logger = logging.getLogger(__name__)


def publish_record(
    dht: SwarmDHT, run_id: str, record: PeerRecord, expiration: float, *, timeout: Optional[float] = None
) -> bool:
    """Store or refresh this peer's record for `expiration` seconds from now; True if some node accepted it.

    The record must be about this DHT's own identity: it is stored under, and signed with, that key.
    """
    if record.peer_id != dht.identity.peer_id:
        raise ValueError(f"record is about {record.peer_id}, but this DHT's identity is {dht.identity.peer_id}")
    admission = getattr(dht, "admission", None)
    if admission is not None and admission.private:  # a private run's proof, and the owner's revocations passed on
        admission.reload_revoked_file()
        record = record.model_copy(update={"member_tag": admission.tag(record.peer_id),
                                           "revocations": admission.revocations})
    future = dht.store(
        peers_key(run_id),
        record.to_wire(),
        expiration_time=get_dht_time() + expiration,
        subkey=dht.owner_subkey,
        return_future=True,
    )
    try:
        return bool(future.result(timeout=timeout))
    except concurrent.futures.TimeoutError:
        # Not cancelled: hivemind sets the result of an MPFuture when it arrives, and on a cancelled one
        # that logs an InvalidStateError traceback. The DHT call ends by its own timeout; we ignore it.
        return False


def withdraw(
    dht: SwarmDHT, run_id: str, record: PeerRecord, expiration: float, *, timeout: Optional[float] = None
) -> bool:
    """Mark this peer's record as leaving, so readers stop counting it immediately.

    Pass the same `expiration` as the heartbeats: the DHT keeps whichever version of an entry
    expires last, so the leaving version must not expire earlier than the last live one.
    """
    leaving = record.updated(leaving=True, updated_at=get_dht_time())
    return publish_record(dht, run_id, leaving, expiration, timeout=timeout)


def list_peers(
    dht: SwarmDHT,
    run_id: str,
    *,
    include_leaving: bool = False,
    any_protocol: bool = False,
    timeout: Optional[float] = None,
) -> List[PeerRecord]:
    """Live peers of the run, as the swarm reports them now, sorted by role then peer id.

    Entries that fail validation are dropped (everything from the network is untrusted), as are
    leaving peers and peers of another protocol generation unless asked for, and in a private run the
    records of peers this node does not admit (`dht.admission`, counted at "records"). In a run with an owner, the
    newest revocation list any record carries is adopted first, so a revoked peer's own record is dropped too.
    """
    future = dht.get(peers_key(run_id), latest=True, return_future=True)
    try:
        found = future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:  # not cancelled: see publish_record
        raise TimeoutError(f"listing peers of run {run_id!r} took longer than {timeout} s") from None
    if found is None or not isinstance(found.value, dict):
        return []
    now = get_dht_time()
    admission = getattr(dht, "admission", None)
    parsed = []
    for subkey, entry in found.value.items():
        try:
            record = parse_owned_entry(subkey, entry.value, PeerRecord)
        except RecordRejected as e:
            logger.debug(f"ignoring an invalid peer record in run {run_id!r}: {e.reason}")
            continue
        if entry.expiration_time > now:
            parsed.append(record)
    if admission is not None and admission.owner is not None:
        for record in parsed:
            admission.note_revocations(record.revocations)
    records, other_protocols = [], []
    for record in parsed:
        if record.leaving and not include_leaving:
            continue
        if record.protocol != PROTOCOL_VERSION and not any_protocol:
            if not record.leaving:
                other_protocols.append(record)
            continue
        if admission is not None and admission.private \
                and not admission.check("records", record.peer_id, record.member_tag, once=True):
            continue
        records.append(record)
    records.sort(key=lambda r: (ROLES.index(r.role), r.peer_id))
    _warn_of_other_protocols(run_id, other_protocols)
    return records


# (run, the other protocol generations) already warned of. Records are strangers' and their protocol any number, so
# the memory is bounded and the warnings rate-limited: churning generations cannot grow one or flood the other.
_warned_of: Dict[Tuple[str, Tuple[int, ...]], None] = {}
MAX_WARNED_GENERATIONS = 64
_other_protocols_log = RateLimitedLog(logger)


def _warn_of_other_protocols(run_id: str, others: List[PeerRecord]) -> None:
    """One warning per run and set of other protocol generations seen: their peers are left out of every list, and
    no group ever mixes generations (the group key hashes the protocol), so a peer among them would only ever
    find itself alone, and say nothing. Versions are strangers' strings: quoted, and at most three named."""
    protocols = tuple(sorted({record.protocol for record in others}))
    if not protocols or (run_id, protocols) in _warned_of:
        return
    remember(_warned_of, (run_id, protocols), limit=MAX_WARNED_GENERATIONS)
    versions = sorted({(record.protocol, record.version) for record in others})
    theirs = ", ".join(f"protocol {protocol} (moshpeer {version!r})" for protocol, version in versions[:3])
    more = f" and {len(versions) - 3} more" if len(versions) > 3 else ""
    _other_protocols_log.warning(
        f"run {run_id!r}: {len(others)} peer(s) speak {theirs}{more}, this one protocol {PROTOCOL_VERSION} (moshpeer "
        f"{__version__}): peers of different protocols never average together; run one moshpeer version across the "
        "swarm")
