"""State download: a newcomer (or a peer that fell behind) fetches the training state from a donor.

Donors run a small TCP `StateServer` and advertise it in the DHT under `state_offers_key(run_id)`:
one signed entry per donor (subkey = its owner marker) holding its address and epoch. A peer that
needs state lists the offers, tries first the most advanced epoch two donors hold (`donors.cross_checkable_first`),
and falls back to the next one
if a donor is unreachable, cannot prove its identity, dies mid-transfer, sends more than it
announced or more than `max_bytes`, misses the deadline, or sends bytes whose SHA-256 does not match
its signed header, or a state that fails validation. Where a second donor is available, the
download is cross-checked: two donors' states must agree on a sample of the tensors honest donors hold alike
(`validation.disagreeing_tensors`; the parameters, or what the caller's `agreed` names), else both are set aside and
the next donors are tried.

Wire protocol (version 3), every message framed as a 4-byte big-endian length + body:
  client -> server  msgpack {"op": "get_state", "protocol": 3, "run_id": str, "challenge": 32 random bytes,
                             "public_key": the client's, "signature": over the run id and challenge,
                             "tag": its membership proof in a private run}
  server -> client  msgpack {"ok": true, "epoch": int, "total_bytes": int, "sha256": hex, "chunk_bytes": int,
                             "public_key": OpenSSH RSA key, "signature": over the challenge and those fields}
                    then raw chunks, each framed, each at most chunk_bytes, summing to total_bytes
The donor's public key must hash to the peer id of its offer (the same identity check as the data plane's), and its
signature binds the state's digest to the client's fresh challenge, so a connection cannot be answered by anyone but
the advertised donor. The state itself is `torch.save` of a dict of tensors and plain values, read back with
`torch.load(weights_only=True)`, so a malicious donor cannot run code here. The receive loop enforces one deadline
for the whole download (every recv gets the time left), and memory grows only as bytes arrive (never from the
announced size), up to `max_bytes`.

In a private run (`dht.admission`, moshpeer/dht/admission.py) a donor serves only clients whose signed request names
an admitted peer, and a downloader ignores offers of peers it does not admit (an offer carries the donor's
membership proof); both refusals are counted at "state".

Why TCP and not a libp2p stream: the transfer is bulk, one-shot and pull-based; a plain socket is simpler to bound
in time and to throttle for tests. Peers behind NAT cannot donate (they offer nothing: wiring.py), but download.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Tuple

import msgpack
from hivemind.utils import get_dht_time

from moshpeer.dht import Admission, SwarmDHT
from moshpeer.dht.identity import Identity
from moshpeer.dht.keys import state_offers_key
from moshpeer.dht.offers import StateOfferRecord
from moshpeer.dht.validation import RecordRejected, parse_owned_entry
from moshpeer.errors import ProtocolError
from moshpeer.peer.state.framing import (OPS, STATE_KIND, STATE_PROTOCOL, StateOffer, check_donor, client_peer,
                                         deserialize_state, parse_header, recv_frame_length, recv_msgpack, remaining,
                                         send_frame, signed_fields, signed_request)
from moshpeer.peer.state.pieces import serve_piece_request
from moshpeer.peer.state.progress_bar import DownloadProgressBar
from moshpeer.peer.state.swarm import SwarmedState, download_swarmed
from moshpeer.peer.state.donors import cross_checkable_first, dissenters
from moshpeer.peer.state.validation import disagreeing_tensors

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_STATE_BYTES, RECEIVE_SCRATCH_BYTES = 8 << 30, 1 << 20
# Requests a donor serves at once. A downloader opens one connection per donor, so this is newcomers at once; a
# donor's upload is shared among them anyway. More are refused (closed at once) rather than given a thread each.
MAX_CONCURRENT_REQUESTS = 16
# A downloader sends its request the moment it connects: a connection silent for longer frees its slot.
REQUEST_DEADLINE_S = 5.0

StateSource = Callable[[], Tuple[int, bytes]]  # -> (epoch, serialized state)
OpHandler = Callable[["StateServer", socket.socket, Dict[str, Any], bytes], None]

# ---- serving ------------------------------------------------------------------------------------


class StateServer:
    """Serves this peer's state to downloaders over TCP and advertises it in the DHT.

    :param source: returns (epoch, serialized state); called once per request (cache inside it)
    :param identity: this peer's identity: signs each transfer's header (see the module docstring)
    :param admission: a private run's policy: serve only admitted clients (None: everyone)
    :param handlers: more ops, {op: handler(server, sock, request, challenge)} (e.g. updates.py's "get_update")
    :param bytes_per_second: throttle each transfer (tests use it to kill a donor mid-download)
    :param max_concurrent: requests served at once; a connection beyond them is closed at once (`refused_busy`)
    :param request_deadline: seconds a connection may take to send its request
    """

    def __init__(
        self,
        source: StateSource,
        *,
        run_id: str,
        identity: Identity,
        host: str = "127.0.0.1",
        port: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        bytes_per_second: Optional[float] = None,
        on_served: Optional[Callable[[Dict[str, Any]], None]] = None,
        handlers: Optional[Dict[str, OpHandler]] = None,
        admission: Optional[Admission] = None,
        max_concurrent: int = MAX_CONCURRENT_REQUESTS,
        request_deadline: float = REQUEST_DEADLINE_S,
    ):
        self.source, self.run_id, self.identity, self.admission = source, run_id, identity, admission
        self.handlers = dict(handlers or {})
        # A throttled transfer sends small chunks (about 20 per second), so the rate holds within a second.
        self.chunk_bytes = chunk_bytes if not bytes_per_second else min(chunk_bytes, max(4096, int(bytes_per_second / 20)))
        self.bytes_per_second = bytes_per_second
        self.on_served = on_served
        self.served = 0
        self.refused_busy = 0  # connections closed because `max_concurrent` requests were being served
        self.in_flight = 0  # requests being served now
        self.request_deadline = request_deadline
        self.manifest_cache: Dict[str, list] = {}  # pieces.py: digest -> [bytes, manifest, last asked]
        self.manifest_lock = threading.Lock()
        server_self = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server_self._serve(self.request)

        slots, counting = threading.BoundedSemaphore(max_concurrent), threading.Lock()

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

            def process_request(self, request, client_address) -> None:
                if not slots.acquire(blocking=False):  # busy: no thread for a stranger's flood of connections
                    server_self.refused_busy += 1
                    self.shutdown_request(request)
                    return
                with counting:
                    server_self.in_flight += 1
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    self.release_slot()
                    raise

            def process_request_thread(self, request, client_address) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    self.release_slot()

            def release_slot(self) -> None:
                with counting:
                    server_self.in_flight -= 1
                slots.release()

        self._server = Server((host, port), Handler)
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="moshpeer-state-server", daemon=True)
        self._thread.start()

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(30.0)
        try:
            request = recv_msgpack(sock, time.monotonic() + self.request_deadline)
            op = request.get("op")
            if not (op in OPS or op in self.handlers) or request.get("protocol") != STATE_PROTOCOL:
                raise ProtocolError(f"unsupported request {request!r:.200}")
            if request.get("run_id") != self.run_id:
                raise ProtocolError("request for another run")
            challenge = request.get("challenge")
            if not isinstance(challenge, bytes) or len(challenge) != 32:
                raise ProtocolError("request without a 32-byte challenge")
            if self.admission is not None and self.admission.private:
                client = client_peer(request, self.run_id, challenge)
                tag = request.get("tag") if isinstance(request.get("tag"), bytes) else None
                if client is None:
                    self.admission.refuse("state", "(unsigned request)")
                if client is None or not self.admission.check("state", client, tag):
                    raise ProtocolError(f"client {client or '(unsigned)'} is not admitted to this private run")
            if op in self.handlers:
                self.handlers[op](self, sock, request, challenge)
                return
            epoch, data = self.source()
            if op != "get_state":
                serve_piece_request(self, sock, request, challenge, epoch, data)
                return
            logger.info(f"serving state of epoch {epoch} ({len(data)} bytes) to {sock.getpeername()[0]}")
            self.count_served(int(epoch), self.send_signed(sock, challenge, int(epoch), data), len(data))
        except (OSError, ProtocolError, ConnectionError) as e:
            logger.info(f"state request not served: {e}")
        except Exception:
            logger.exception("state server failed on a request")

    def send_signed(self, sock: socket.socket, challenge: bytes, epoch: int, data: bytes,
                    kind: bytes = STATE_KIND) -> str:
        """A header signed over the client's `challenge` and what it announces (`kind`), then `data`; -> its sha256."""
        digest = hashlib.sha256(data).hexdigest()
        signature = self.identity.private_key.sign(signed_fields(self.run_id, challenge, epoch, len(data), digest, kind))
        send_frame(sock, msgpack.packb({"ok": True, "epoch": epoch, "total_bytes": len(data), "sha256": digest,
                                        "chunk_bytes": self.chunk_bytes, "signature": signature,
                                        "public_key": self.identity.public_key.to_bytes()}))
        self.send_range(sock, data, 0, len(data))
        return digest

    def count_served(self, epoch: int, digest: str, nbytes: int) -> None:
        """Count one transfer: a whole state sent, or a manifest (the start of a multi-donor download)."""
        self.served += 1
        if self.on_served is not None:
            self.on_served({"epoch": epoch, "sha256": digest, "bytes": nbytes})

    def send_range(self, sock: socket.socket, data: bytes, start: int, end: int,
                   frame_bytes: Optional[int] = None) -> None:
        """Send data[start:end] as frames of `frame_bytes` (default `chunk_bytes`), never faster than
        `bytes_per_second`. OSError when the client goes away."""
        view = memoryview(data)
        started = time.monotonic()
        frame_bytes = frame_bytes or self.chunk_bytes
        for offset in range(start, end, frame_bytes):
            if self.bytes_per_second:
                # Throttle: never run ahead of the configured rate.
                ahead = (offset - start) / self.bytes_per_second - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
            send_frame(sock, self.piece(view, offset, min(end, offset + frame_bytes)))

    def piece(self, view: memoryview, start: int, end: int) -> bytes:
        """The bytes sent for data[start:end] (a test's corrupt donor overrides it)."""
        return bytes(view[start:end])

    def advertise(self, dht: SwarmDHT, epoch: int, *, expiration: float = 15.0, host: Optional[str] = None) -> bool:
        """Publish (or refresh) this donor's offer at `host` (default: its own); re-call every `expiration`/2."""
        offer = {"peer_id": dht.identity.peer_id, "host": host or self.host, "port": int(self.port),
                 "epoch": int(epoch), "protocol": STATE_PROTOCOL, "tag": dht.admission.tag(dht.identity.peer_id)}
        try:
            return bool(dht.store(state_offers_key(self.run_id), offer, expiration_time=get_dht_time() + expiration,
                                  subkey=dht.owner_subkey, return_future=True).result(timeout=2.0))
        except Exception as e:
            logger.debug(f"could not advertise state: {e}")
            return False

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# ---- downloading --------------------------------------------------------------------------------


@dataclass
class DownloadedState:
    """A verified state from `donor` at `epoch`."""

    epoch: int
    state: Dict[str, Any]
    donor: str
    sha256: str
    nbytes: int
    seconds: float
    failed_donors: List[Tuple[str, str]]  # (peer id, why) of donors that failed or were set aside
    donors: Tuple[str, ...] = ()  # every donor that served pieces of this state
    # "cross-checked" (another donor's state agreed), "same bytes" (donors signed these bytes, none at that epoch
    # offered other ones) or "unconfirmed" (nobody to compare it with).
    confirmation: str = "unconfirmed"


class StateDownloadFailed(Exception):
    """No donor delivered a verified state in time. `misfits`: donor -> why its state did not fit this peer's model
    (`validate` refused it): a peer configured unlike the swarm (another --task-arg) gets nothing from them, ever."""

    def __init__(self, message: str, misfits: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.misfits = dict(misfits or {})


def list_state_offers(dht: SwarmDHT, run_id: str, *, timeout: float = 5.0) -> List[StateOffer]:
    """Valid offers of the run, most advanced first. Malformed or misattributed entries are dropped, and in a
    private run those of peers this node does not admit (counted once per peer at "state")."""
    admission: Optional[Admission] = getattr(dht, "admission", None)
    found = dht.get(state_offers_key(run_id), latest=True, return_future=True).result(timeout=timeout)
    if found is None or not isinstance(found.value, dict):
        return []
    offers = []
    for subkey, entry in found.value.items():
        try:  # untrusted input (the DHT's nodes check it too): drop it, never crash
            offer = parse_owned_entry(subkey, entry.value, StateOfferRecord)
        except RecordRejected as e:
            logger.debug(f"ignoring a state offer: {e.reason}")
            continue
        if offer.protocol != STATE_PROTOCOL:
            logger.debug(f"ignoring a state offer of protocol {offer.protocol} (ours: {STATE_PROTOCOL})")
            continue
        if admission is not None and admission.private and not admission.check("state", offer.peer_id, offer.tag,
                                                                               once=True):
            continue
        offers.append(StateOffer(offer.peer_id, offer.host, offer.port, offer.epoch))
    offers.sort(key=lambda offer: (-offer.epoch, offer.peer_id))
    return offers


def fetch_state_from(
    offer: StateOffer,
    run_id: str,
    *,
    timeout: float,
    max_bytes: int = DEFAULT_MAX_STATE_BYTES,
    progress: Optional[Callable[[int, int], None]] = None,
    identity: Optional[Identity] = None,
    tag: bytes = b"",
    op: str = "get_state", fields: Optional[Dict[str, Any]] = None, kind: bytes = STATE_KIND,
) -> Tuple[int, bytes, str]:
    """Download and verify one donor's state (or, with `op`, `fields` and the header's signed `kind`, another
    single-donor transfer: updates.py) by `timeout` seconds from now; returns (epoch, bytes, sha256).

    Raises TimeoutError past the deadline (checked inside every receive), ProtocolError when the donor
    cannot prove it is the offer's peer, announces more than `max_bytes`, sends more than it announced
    or bytes that do not match its signed digest; OSError / ConnectionError when the connection fails
    (a donor of a private run closes it on a client it does not admit). With `identity`, the request is
    signed by it (and carries `tag`, this peer's membership tag), as a private run's donors require.
    """
    deadline = time.monotonic() + timeout
    challenge = os.urandom(32)
    with socket.create_connection((offer.host, offer.port), timeout=min(remaining(deadline), 5.0)) as sock:
        sock.settimeout(remaining(deadline))
        send_frame(sock, msgpack.packb(signed_request(op, run_id, challenge, identity, tag, **(fields or {}))))
        header = recv_msgpack(sock, deadline)
        epoch, total, digest, chunk_limit = parse_header(header, max_bytes, "chunk_bytes")
        check_donor(header, offer.peer_id, signed_fields(run_id, challenge, epoch, total, digest, kind))
        # Memory follows the bytes that actually arrive, read through a small scratch buffer: a donor that
        # announces gigabytes and sends nothing costs nothing.
        data = bytearray()
        scratch = memoryview(bytearray(min(RECEIVE_SCRATCH_BYTES, total)))
        hasher = hashlib.sha256()
        while len(data) < total:
            length = recv_frame_length(sock, chunk_limit, deadline)
            if len(data) + length > total:
                raise ProtocolError("donor sent more bytes than it announced")
            while length:
                sock.settimeout(remaining(deadline))
                n = sock.recv_into(scratch, min(length, len(scratch)))
                if n == 0:
                    raise ConnectionError(f"donor closed the connection after {len(data)} of {total} bytes")
                data += scratch[:n]
                hasher.update(scratch[:n])
                length -= n
            if progress is not None:
                progress(len(data), total)
        if hasher.hexdigest() != digest:
            raise ProtocolError("state checksum mismatch")
        return epoch, bytes(data), digest


def download_state(
    dht: SwarmDHT,
    run_id: str,
    *,
    exclude: Tuple[str, ...] = (),
    min_epoch: int = 0,
    max_epoch: Optional[int] = None,
    timeout: float = 60.0,
    per_donor_timeout: float = 30.0,
    max_bytes: int = DEFAULT_MAX_STATE_BYTES,
    show_progress: bool = True,
    validate: Optional[Callable[[Dict[str, Any]], None]] = None,
    prefer: Optional[Collection[str]] = None,
    offer_wait_s: Optional[float] = None,
    agreed: Callable[[Dict[str, Any]], Mapping[str, Any]] = lambda state: state.get("model", {}),
) -> DownloadedState:
    """Download a verified state from the most advanced donor, trying the next one on failure.

    When more than one donor offers a state within one epoch of the first valid one, a second one is downloaded
    too (one of the same epoch when there is one) and the two must agree on a sample of parameters drawn from a
    secret seed (`disagreeing_tensors`); a disagreeing pair is set aside and the next donors are tried. Donors that
    signed the very same bytes count as one such confirmation only when no other donor at that epoch offers
    something else. Donors are asked in `donors.cross_checkable_first` order. A lone donor's validated state is
    taken as is. Once every donor on offer was tried, the download fails at once rather than at `timeout`.

    :param exclude: peer ids not to ask (this peer)
    :param min_epoch: ignore donors behind this epoch; max_epoch: ignore donors claiming more (what the
        swarm's robust progress view does not confirm)
    :param max_bytes: refuse a state larger than this (set it near this peer's own state size)
    :param validate: raises if a decoded state does not fit this peer's model (then the next donor)
    :param prefer: peers with evidence that they average (witnesses.py): while one offers a state in range, no other
        donor is asked, so Sybil donors that never average cannot contradict or outvote them
    :param offer_wait_s: how long to wait for a donor in range to be on offer (default: `timeout`)
    :param agreed: the tensors of a decoded (and validated) state that two honest donors hold alike, which the
        cross-check compares; default: its parameters (`state["model"]`). DiLoCo's donors differ there by their own
        inner steps since the last outer step and agree on θ_outer (`AveragingStrategy.agreed_tensors`)
    :raises StateDownloadFailed: no donor delivered before `timeout`, or every donor on offer failed or was set
        aside, or every donor on offer is past `max_epoch` (at once), or none was in range for `offer_wait_s`; its
        `misfits` name the donors whose state `validate` refused, and why
    """

    deadline = time.monotonic() + timeout
    failed: List[Tuple[str, str]] = []
    misfits: Dict[str, str] = {}  # donor -> why `validate` refused its state
    tried: set = set()
    candidate: Optional[DownloadedState] = None  # validated, waiting for a second donor to confirm it
    started = time.monotonic()
    while time.monotonic() < deadline:
        try:
            listing_s = min(5.0, max(0.5, deadline - time.monotonic()))
            on_offer = [o for o in list_state_offers(dht, run_id, timeout=listing_s) if o.peer_id not in exclude]
        except Exception as e:
            logger.debug(f"listing state offers failed: {e}")
            on_offer = []
        listed = [o for o in on_offer if o.epoch >= min_epoch and (max_epoch is None or o.epoch <= max_epoch)]
        if prefer is not None and any(o.peer_id in prefer for o in listed):
            listed = [o for o in listed if o.peer_id in prefer]
        if on_offer and candidate is None and all(max_epoch is not None and o.epoch > max_epoch for o in on_offer):
            # Every donor is past what the swarm view confirms, and donors never go back: waiting cannot help.
            # The caller trains on and asks again with a fresher view.
            raise StateDownloadFailed(f"every donor offers an epoch above {max_epoch}, what the swarm view "
                                      f"confirms ({sorted(o.epoch for o in on_offer)[:8]})")
        offers = cross_checkable_first([o for o in listed if o.peer_id not in tried])
        if candidate is not None:
            # Like with like first: two honest donors one epoch apart differ by a whole optimizer step, which
            # can exceed the agreement tolerance (an Adam step on a small bias is several percent of it).
            confirming = ([o for o in offers if o.epoch == candidate.epoch]
                          or [o for o in offers if abs(o.epoch - candidate.epoch) <= 1])
            if not confirming:
                logger.warning(f"no second donor near epoch {candidate.epoch} to cross-check "
                               f"{candidate.donor[-8:]}'s state; taking it unconfirmed, as validated")
                return candidate
            offers = confirming
        if not offers and listed:
            # Every donor on offer was tried (failed or set aside): waiting out the timeout only delays the
            # caller, who trains on and asks again later, when donors may be at one epoch.
            break
        if not offers:
            if offer_wait_s is not None and time.monotonic() - started >= offer_wait_s:
                raise StateDownloadFailed(f"no donor offers epochs {min_epoch}..{max_epoch} (on offer: "
                                          f"{sorted(o.epoch for o in on_offer)[:8]})")
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            continue
        offer = offers[0]
        same_epoch = [o for o in offers if o.epoch == offer.epoch]
        attempt_failed: List[Tuple[str, str]] = []
        swarmed: Optional[SwarmedState] = None
        decoded = False
        try:
            with DownloadProgressBar(show_progress, offer, len(same_epoch)) as update:
                swarmed = download_swarmed(
                    same_epoch, run_id, timeout=min(per_donor_timeout, max(0.5, deadline - time.monotonic())),
                    max_bytes=max_bytes, failed=attempt_failed, progress=update, identity=dht.identity,
                    tag=dht.admission.tag(dht.identity.peer_id), min_epoch=min_epoch)
            state = deserialize_state(swarmed.data)
            decoded = True
            if validate is not None:
                validate(state)
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            # A state that fails to decode or validate is every signer's fault; a failed transfer is the fault
            # of the donors already named (or of the first one, when none was).
            named = {peer_id for peer_id, _ in attempt_failed}
            blamed = swarmed.agreeing if swarmed is not None else (() if named else (offer.peer_id,))
            logger.warning(f"state download of epoch {offer.epoch} failed ({reason}); trying other donors")
            attempt_failed.extend((peer_id, reason) for peer_id in blamed)
            if decoded:  # `validate` refused it: a state of another model
                misfits.update(dict.fromkeys(blamed, reason))
            continue
        finally:
            failed.extend(attempt_failed)
            # Donors that served or failed are done; those that signed another manifest stay for a cross-check.
            tried.update(peer_id for peer_id, _ in attempt_failed)
            tried.update(swarmed.agreeing if swarmed is not None else ())
        manifest = swarmed.manifest
        downloaded = DownloadedState(epoch=manifest.epoch, state=state, donor=swarmed.served_by[0],
                                     sha256=manifest.sha256, nbytes=manifest.total_bytes,
                                     seconds=time.monotonic() - started, failed_donors=failed,
                                     donors=swarmed.served_by)
        if candidate is None and len(swarmed.agreeing) >= 2 and not dissenters(listed, tried, manifest.epoch):
            # Donors signed the very same bytes and no other donor at that epoch offers something else. With a
            # dissenter, identical signatures prove nothing (identities are cheap: two Sybils sign one forgery):
            # the state is compared with the dissenter's like any other candidate.
            return replace(downloaded, confirmation="same bytes")
        if candidate is None:
            candidate = downloaded
            continue
        disagree = disagreeing_tensors(agreed(candidate.state), agreed(state))
        if not disagree:
            best = candidate if candidate.epoch >= downloaded.epoch else downloaded
            return replace(best, seconds=time.monotonic() - started, confirmation="cross-checked")
        reason = f"states of {candidate.donor[-8:]} and {offer.peer_id[-8:]} disagree on {disagree[:3]}"
        logger.warning(f"state cross-check failed: {reason}; trying other donors")
        failed.extend([(candidate.donor, reason), (offer.peer_id, reason)])
        candidate = None
    raise StateDownloadFailed(f"no donor delivered the state within {time.monotonic() - started:.1f} s "
                              f"(failed: {failed})", misfits)

