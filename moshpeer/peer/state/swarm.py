"""One state pulled from several donors at once, piece by piece (pieces.py), surviving donors that die.

The donors offering one epoch are asked for their signed manifests in parallel. The manifest held by the most
donors wins (the first offer's on a tie: offers come most trusted first); its donors then fetch ranges of
pieces work-stealing from one shared queue, one connection per range. A donor that goes away, times out
or moved on to a newer state gives its range back to the queue and is not asked again; one that sends a
piece whose hash does not match the manifest is dropped the same way and counted as corrupt. The download
fails when no donor of the chosen manifest is left with pieces missing, or at the one deadline.
Memory grows only with verified pieces, at most the manifest's size (checked against `max_bytes`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Tuple

from moshpeer.dht.identity import Identity
from moshpeer.errors import ProtocolError
from moshpeer.peer.state.pieces import CorruptPiece, Manifest, fetch_manifest, fetch_pieces
from moshpeer.peer.state.framing import StateOffer

logger = logging.getLogger(__name__)

MAX_DONORS = 4  # parallel donors per download: more adds connections, not bandwidth, on most links
RANGES_PER_DONOR = 4  # a dying donor costs at most about 1/(4 x donors) of the state again
MANIFEST_TIMEOUT = 5.0  # a manifest is small: a donor that cannot send it in this long is not waited for


@dataclass
class SwarmedState:
    """The verified bytes of one state and who served them."""

    manifest: Manifest
    data: bytes
    agreeing: Tuple[str, ...]  # peer ids of every donor that signed this exact manifest
    served_by: Tuple[str, ...]  # those of them that delivered pieces, those that did not fail first


def download_swarmed(offers: List[StateOffer], run_id: str, *, timeout: float, max_bytes: int,
                     failed: List[Tuple[str, str]], identity: Optional[Identity] = None, tag: bytes = b"",
                     progress: Optional[Callable[[int, int], None]] = None, min_epoch: int = 0) -> SwarmedState:
    """Download one state from up to MAX_DONORS of `offers` in parallel by `timeout` seconds from now.

    A donor whose signed manifest is of an epoch below `min_epoch`, or more than one epoch below what it
    offered (`manifest_epoch_ok`), is failed like one that sent no manifest: an offer's epoch is only a claim.
    Donors that fail are appended to `failed` as (peer id, why). Raises ProtocolError when no donor sent a
    valid manifest or the pieces do not add up to the signed digest, ConnectionError when every donor of
    the chosen manifest failed with pieces missing, TimeoutError past the deadline."""
    deadline = time.monotonic() + timeout
    offers = offers[:MAX_DONORS]
    if not offers:
        raise ProtocolError("no donor to download from")
    manifests = _manifests(offers, run_id, deadline=deadline, max_bytes=max_bytes, failed=failed,
                           identity=identity, tag=tag, min_epoch=min_epoch)
    if not manifests:
        raise ProtocolError("no donor sent a valid manifest")
    groups: Dict[tuple, List[StateOffer]] = {}
    for offer in offers:
        if offer.peer_id in manifests:
            groups.setdefault(manifests[offer.peer_id].key, []).append(offer)
    donors = max(groups.values(), key=len)  # max keeps the first of equals: the most trusted offer's group
    manifest = manifests[donors[0].peer_id]
    pieces = _PieceQueue(manifest, len(donors), progress)
    for donor in donors:
        threading.Thread(target=pieces.work, args=(donor, run_id, deadline, identity, tag, failed),
                         name=f"moshpeer-state-piece-{donor.peer_id[-8:]}", daemon=True).start()
    # Not a join: a worker stuck on a stalled donor (one in its shutdown grace, say) is left to its socket's
    # deadline once the others have every piece.
    pieces.wait(deadline)
    data = pieces.assemble()  # raises when pieces are missing; a straggling worker no longer reports progress
    if hashlib.sha256(data).hexdigest() != manifest.sha256:
        raise ProtocolError("pieces do not add up to the signed state digest")
    # Donors that served and stayed first: the first one is the download's `donor`.
    served = sorted(pieces.served_by, key=lambda peer_id: peer_id in pieces.dropped)
    return SwarmedState(manifest, data, tuple(o.peer_id for o in donors), tuple(served))


def manifest_epoch_ok(manifest_epoch: int, offered_epoch: int, min_epoch: int) -> bool:
    """Whether a donor's manifest may be downloaded: of `min_epoch` or later, and at most one epoch below the
    epoch its offer claims (a donor mid-way through an epoch's end serves the previous epoch's snapshot)."""
    return manifest_epoch >= max(min_epoch, offered_epoch - 1)


def _manifests(offers: List[StateOffer], run_id: str, *, deadline: float, max_bytes: int,
               failed: List[Tuple[str, str]], identity: Optional[Identity], tag: bytes,
               min_epoch: int = 0) -> Dict[str, Manifest]:
    """Every offer's manifest, asked in parallel; donors that fail, or whose manifest fails
    `manifest_epoch_ok`, are appended to `failed`."""
    deadline = min(deadline, time.monotonic() + MANIFEST_TIMEOUT)
    with ThreadPoolExecutor(max_workers=len(offers), thread_name_prefix="moshpeer-state-manifest") as pool:
        futures = {offer.peer_id: pool.submit(fetch_manifest, offer, run_id, deadline=deadline, max_bytes=max_bytes,
                                              identity=identity, tag=tag) for offer in offers}
    manifests: Dict[str, Manifest] = {}
    offered = {offer.peer_id: offer.epoch for offer in offers}
    for peer_id, future in futures.items():
        try:
            manifest = future.result()
        except Exception as e:
            logger.warning(f"no state manifest from {peer_id[-8:]}: {type(e).__name__}: {e}")
            failed.append((peer_id, f"{type(e).__name__}: {e}"))
            continue
        if not manifest_epoch_ok(manifest.epoch, offered[peer_id], min_epoch):
            why = f"offered epoch {offered[peer_id]} but serves epoch {manifest.epoch} (needed >= {min_epoch})"
            logger.warning(f"state donor {peer_id[-8:]} {why}")
            failed.append((peer_id, why))
            continue
        manifests[peer_id] = manifest
    return manifests


class _PieceQueue:
    """Ranges of pieces still to fetch, shared by one worker per donor; verified pieces by index.

    Endgame (as BitTorrent's): once every range is handed out, an idle worker also fetches a range another
    donor still holds and has not delivered, so one stalled donor does not hold the download to its deadline;
    whichever copy arrives first is kept."""

    def __init__(self, manifest: Manifest, donors: int, progress: Optional[Callable[[int, int], None]]):
        self.manifest, self.progress = manifest, progress
        count = len(manifest.piece_hashes)
        step = max(1, -(-count // (donors * RANGES_PER_DONOR)))
        self.ranges: Deque[Tuple[int, int]] = deque((first, min(step, count - first)) for first in range(0, count, step))
        self.in_flight: Dict[Tuple[int, int], int] = {}  # range -> workers fetching it
        self.pieces: Dict[int, bytes] = {}
        self.served_by: List[str] = []
        self.dropped: set = set()  # donors that failed
        self.received = 0
        self.working = donors  # workers that have not failed
        self.running = donors  # workers that have not returned
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)

    def work(self, donor: StateOffer, run_id: str, deadline: float, identity: Optional[Identity], tag: bytes,
             failed: List[Tuple[str, str]]) -> None:
        """Fetch ranges from `donor` until every piece is in or it fails (then its range goes back, one log line)."""
        try:
            self._work(donor, run_id, deadline, identity, tag, failed)
        finally:
            with self.lock:
                self.running -= 1
                self.changed.notify_all()

    def _work(self, donor: StateOffer, run_id: str, deadline: float, identity: Optional[Identity], tag: bytes,
              failed: List[Tuple[str, str]]) -> None:
        tried: set = set()
        while time.monotonic() < deadline:
            with self.lock:
                taken = self._next_range(tried)
                if taken is None:
                    return
                tried.add(taken)
                self.in_flight[taken] = self.in_flight.get(taken, 0) + 1
            first, count = taken
            try:
                fetched = fetch_pieces(donor, run_id, self.manifest, first, count, deadline=deadline,
                                       identity=identity, tag=tag, on_bytes=self._count)
            except Exception as e:
                with self.lock:
                    self._release(taken)
                    if not self._has(taken) and not self.in_flight.get(taken):
                        self.ranges.appendleft(taken)
                    self.working -= 1
                    self.dropped.add(donor.peer_id)
                    failed.append((donor.peer_id, f"{type(e).__name__}: {e}"))
                    self.changed.notify_all()
                what = "sent a corrupt piece" if isinstance(e, CorruptPiece) else "stopped serving"
                logger.warning(f"state donor {donor.peer_id[-8:]} {what} ({type(e).__name__}: {e}); "
                               f"its pieces go to the other donors")
                return
            with self.lock:
                self._release(taken)
                self.pieces.update(zip(range(first, first + count), fetched))
                if donor.peer_id not in self.served_by:
                    self.served_by.append(donor.peer_id)
                self.changed.notify_all()

    def _next_range(self, tried: set) -> Optional[Tuple[int, int]]:
        """(Under the lock) the next range for a worker that already fetched `tried`; None when there is none."""
        if self.complete:
            return None
        if self.ranges:
            return self.ranges.popleft()
        return next((r for r in self.in_flight if r not in tried and not self._has(r)), None)  # endgame

    def _release(self, taken: Tuple[int, int]) -> None:
        self.in_flight[taken] -= 1
        if not self.in_flight[taken]:
            del self.in_flight[taken]

    def _has(self, taken: Tuple[int, int]) -> bool:
        return taken[0] in self.pieces  # a range's pieces arrive together

    @property
    def complete(self) -> bool:
        return len(self.pieces) == len(self.manifest.piece_hashes)

    def wait(self, deadline: float) -> None:
        """Until every piece is in, every worker has returned, or `deadline` (time.monotonic())."""
        with self.lock:
            while not self.complete and self.running > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self.changed.wait(remaining)

    def _count(self, nbytes: int) -> None:
        with self.lock:
            self.received += nbytes
            received = min(self.received, self.manifest.total_bytes)  # endgame copies count once
            progress = self.progress
        if progress is not None:
            progress(received, self.manifest.total_bytes)

    def assemble(self) -> bytes:
        """The state's bytes; TimeoutError or ConnectionError (no donor left) when pieces are missing. Workers
        still running (stuck on a stalled donor) report no progress after this: the caller's bar is gone."""
        with self.lock:
            self.progress = None
            missing = len(self.manifest.piece_hashes) - len(self.pieces)
            if missing:
                if self.working == 0:
                    raise ConnectionError(f"every donor failed with {missing} pieces missing")
                raise TimeoutError(f"state download deadline passed with {missing} pieces missing")
            return b"".join(self.pieces[i] for i in range(len(self.manifest.piece_hashes)))
