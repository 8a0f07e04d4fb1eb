"""The run's relay directory in the DHT: public peers offer their relays, peers behind NAT look them up.

One dictionary per run (`keys.relays_key`): subkey = the offering peer's `[owner:...]` marker, value =
{peer_id, host, port, tag} (`dht.offers.RelayOfferRecord`, checked by every DHT node), signed by hivemind's
RSASignatureValidator, so an entry names its owner's relay and nobody else's. Entries expire unless
re-published (`RelayPublisher`).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, List, Tuple

from hivemind.utils import get_dht_time

from moshpeer.dht.keys import relays_key
from moshpeer.dht.offers import RelayOfferRecord
from moshpeer.dht.validation import RecordRejected, parse_owned_entry

logger = logging.getLogger(__name__)

OFFER_TTL_S = 120.0
REPUBLISH_S = 40.0


def offer_relay(dht, run_id: str, address: Tuple[str, int], *, timeout: float = 5.0) -> bool:
    """Publish (or refresh) this peer's relay for OFFER_TTL_S; True if some node stored it."""
    peer_id = dht.identity.peer_id
    offer = {"peer_id": peer_id, "host": address[0], "port": int(address[1]),
             "tag": dht.admission.tag(peer_id) if getattr(dht, "admission", None) is not None else b""}
    try:
        return bool(dht.store(relays_key(run_id), offer, expiration_time=get_dht_time() + OFFER_TTL_S,
                              subkey=dht.owner_subkey, return_future=True).result(timeout=timeout))
    except Exception as e:  # the DHT timed out or is stopping: the next refresh tries again
        logger.debug(f"could not offer our relay: {type(e).__name__}: {e}")
        return False


def list_relays(dht, run_id: str, *, timeout: float = 5.0) -> List[Tuple[str, int]]:
    """The run's relays (host, port), except our own. Malformed or misattributed entries are dropped, and in a
    private run those of peers this node does not admit."""
    found = dht.get(relays_key(run_id), latest=True, return_future=True).result(timeout=timeout)
    if found is None or not isinstance(found.value, dict):
        return []
    admission = getattr(dht, "admission", None)
    relays = []
    for subkey, entry in found.value.items():
        try:
            offer = parse_owned_entry(subkey, entry.value, RelayOfferRecord)
        except RecordRejected as e:
            logger.debug(f"ignoring a relay offer: {e.reason}")
            continue
        if offer.peer_id == dht.identity.peer_id:
            continue
        if admission is not None and admission.private and not admission.check("records", offer.peer_id, offer.tag,
                                                                               once=True):
            continue
        relays.append((offer.host, offer.port))
    return sorted(relays)


class RelayPublisher:
    """Keeps this peer's relay offer fresh in the directory, on a thread of its own, until `stop`; `address()` says
    where the relay is at each refresh (the machine's address may change: moshpeer.dht.local_address)."""

    def __init__(self, dht, run_id: str, address: Callable[[], Tuple[str, int]]):
        self._dht, self._run_id, self._address = dht, run_id, address
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moshpeer-relay-offer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            offer_relay(self._dht, self._run_id, self._address())
            self._stop.wait(REPUBLISH_S)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=6.0)
