"""Missed-round updates over the state protocol: a peer whose round failed while the others averaged it asks
one of them for the update their group applied (`AveragingStrategy.kept_update`, DiLoCo's Δ̄: one round's
bytes), before it would download a whole state.

Wire (framing.py's frames and signatures, on a donor's `StateServer`):
  client -> server  `signed_request("get_update", ..., epoch=E)`
  server -> client  a header of get_state's shape, its signature over UPDATE_KIND and the same fields (so that
                    a state's header cannot stand for an update's, nor the reverse), then the serialized update
                    in frames; or {"ok": false, "error": ...} when the donor keeps no update of round E

Failure: a donor without the update, unreachable, slow or sending bytes that do not match its signed digest is
logged and the next donor is asked; `fetch_updates` yields nothing more once every donor was asked or its
deadline passed. What an update says is the strategy's to check (`fit_update`).
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any, Callable, Dict, Iterator, Optional

import msgpack

from moshpeer.errors import ProtocolError
from moshpeer.peer.state.framing import deserialize_state, send_frame
from moshpeer.peer.state.sync import StateServer, fetch_state_from, list_state_offers

logger = logging.getLogger(__name__)

UPDATE_OP = "get_update"
UPDATE_KIND = b"moshpeer-update"

UpdateSource = Callable[[int], Optional[bytes]]  # epoch -> the serialized update of that round, if kept


def update_handler(source: UpdateSource) -> Callable[[StateServer, socket.socket, Dict[str, Any], bytes], None]:
    """The "get_update" op for a `StateServer` (its `handlers`), serving what `source` returns."""

    def serve(server: StateServer, sock: socket.socket, request: Dict[str, Any], challenge: bytes) -> None:
        epoch = request.get("epoch")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ProtocolError(f"update request for epoch {epoch!r:.40}")
        data = source(epoch)
        if data is None:
            send_frame(sock, msgpack.packb({"ok": False, "error": f"no update of the round of epoch {epoch}"}))
            return
        server.send_signed(sock, challenge, epoch, data, UPDATE_KIND)
        logger.info(f"served the update of the round of epoch {epoch} ({len(data)} bytes)")

    return serve


def fetch_updates(dht: Any, run_id: str, epoch: int, *, timeout: float, max_bytes: int,
                  exclude: tuple = ()) -> Iterator[Dict[str, Any]]:
    """The updates of the round of `epoch` that donors past it deliver, one at a time (decoded, not yet
    checked), nearest donors first (a donor keeps only the latest round of each fragment): the caller takes the
    first that fits. Gives up once every donor was asked or `timeout` seconds passed."""
    deadline = time.monotonic() + timeout
    try:
        offers = list_state_offers(dht, run_id, timeout=min(5.0, timeout))
    except Exception as e:  # the DHT is unreachable: no update, the caller falls back
        logger.info(f"no update of the round of epoch {epoch}: listing donors failed ({e})")
        return
    asked = 0
    for offer in sorted((o for o in offers if o.epoch > epoch and o.peer_id not in exclude), key=lambda o: o.epoch):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        asked += 1
        try:
            got, data, _ = fetch_state_from(offer, run_id, timeout=left, max_bytes=max_bytes, identity=dht.identity,
                                            tag=dht.admission.tag(dht.identity.peer_id), op=UPDATE_OP,
                                            fields={"epoch": epoch}, kind=UPDATE_KIND)
            if got != epoch:
                raise ProtocolError(f"asked for the update of epoch {epoch}, got {got}")
            update = deserialize_state(data)
        except (OSError, ConnectionError, TimeoutError, ProtocolError) as e:
            logger.debug(f"no update of the round of epoch {epoch} from {offer.peer_id[-8:]}: {e}")
            continue
        logger.info(f"fetched the update of the round of epoch {epoch} from {offer.peer_id[-8:]} ({len(data)} bytes)")
        yield update
    logger.info(f"no update of the round of epoch {epoch} fits or came from {asked} donor(s)")
