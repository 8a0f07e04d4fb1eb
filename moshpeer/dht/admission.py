"""Private runs: which peers this node admits (a pre-shared swarm key, an allow-list of peer ids, both, or the
credentials of a run owner).

An open run (the default) admits everyone. A private run admits a peer only if
- with an allow-list (`--allow-peers FILE`, `allow_peers=`): its libp2p peer id is on the list;
- with a swarm key (`--swarm-key FILE`, `swarm_key=`): it proves that it holds the key. The proof is a
  membership tag, BLAKE2b keyed with the swarm key over the peer id. It travels in the peer's signed DHT
  record and in its matchmaking metadata. A tag names one peer id, and that id's records are signed by,
  and its connections authenticated with, the id's own key: an outsider who reads a member's tag cannot
  use it for itself. The key is also mixed into every data-plane connection key (`connection_secret`),
  so a connection with a peer that lacks it fails its MACs.
- with a run owner (`--run-owner PEER_ID --credential FILE`, `owner=`): it shows a credential the owner signed for
  its peer id, not expired and not revoked (credentials.py). The credential travels where a swarm-key tag does;
  revocation lists travel in every member's record, the newest one wins, and a revoked peer is refused from the
  next check on (its proof is forgotten). The owner's own peer id is always admitted.

The checks, one `Admission` per DHT node (`SwarmDHT.admission`), shared by every layer above:
- "records": `list_peers` ignores the records of peers it does not admit (progress, status, group size);
- "matchmaking": a leader refuses join requests from them, a follower does not ask them to lead and
  leaves a group that contains one;
- "dataplane": the handshake refuses a hello signed by a key it does not admit;
- "state": a donor refuses their requests, and a downloader ignores their offers.
Each refusal is counted per point (`refused`; "records" and leader entries count each peer once, since
the same record is read again at every refresh) and logged at most a few times per interval.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import stat
import threading
import time
from collections import OrderedDict
from typing import Callable, Dict, FrozenSet, Iterable, Optional, Tuple

from moshpeer.bounded_memory import remember
from moshpeer.dht import credentials
from moshpeer.errors import UserError
from moshpeer.ratelimited_log import RateLimitedLog

logger = logging.getLogger(__name__)

POINTS = ("records", "matchmaking", "dataplane", "state")
MIN_SWARM_KEY_BYTES = 16
MAX_SWARM_KEY_BYTES = 4096
MAX_ALLOWED_PEERS = 100_000
MAX_REMEMBERED_REFUSALS = 4096  # refused peer ids kept for `known_outsider` and once-only counting
TAG_BYTES = 16
MAX_PROOF_BYTES = credentials.MAX_CREDENTIAL_BYTES  # a proof on the wire: a swarm-key tag or a credential


class Admission:
    """Who this node admits; see the module docstring. `Admission()` admits everyone.

    :param swarm_key: the run's pre-shared secret (at least MIN_SWARM_KEY_BYTES bytes)
    :param allowed: base58 peer ids admitted (this node's own id is always admitted)
    :param owner: the run owner's peer id: admit peers by the credentials it signed (not with the two above)
    :param credential: this node's own credential from the owner (checked when a DHT node installs the policy)
    :param revocations: a revocation list the owner signed, to start from (members' records bring newer ones)
    :param clock: UNIX time, for credentials' expiry (a test passes a fake one)
    :raises UserError: a key of the wrong size, a bad peer id, an empty allow-list, an owner with a swarm key or an
        allow-list, or revocations the owner did not sign
    """

    def __init__(self, swarm_key: Optional[bytes] = None, allowed: Optional[Iterable[str]] = None, *,
                 owner: Optional[str] = None, credential: Optional[bytes] = None, revocations: Optional[bytes] = None,
                 clock: Callable[[], float] = time.time):
        if swarm_key is not None and not MIN_SWARM_KEY_BYTES <= len(swarm_key) <= MAX_SWARM_KEY_BYTES:
            raise UserError(f"a swarm key must have {MIN_SWARM_KEY_BYTES} to {MAX_SWARM_KEY_BYTES} bytes, "
                            f"got {len(swarm_key)}")
        self._key = None if swarm_key is None else hashlib.blake2b(swarm_key, digest_size=32,
                                                                   person=b"moshpeer-swarm").digest()
        self.allowed: Optional[FrozenSet[str]] = None
        if allowed is not None:
            self.allowed = frozenset(allowed)
            bad = [peer for peer in self.allowed if not credentials.PEER_ID.match(peer)]
            if bad:
                raise UserError(f"not a peer id: {bad[0]!r:.80}")
            if not self.allowed:
                raise UserError("the allow-list names no peer")
        if owner is not None:
            if not credentials.PEER_ID.match(owner):
                raise UserError(f"the run owner {owner!r:.80} is not a peer id")
            if swarm_key is not None or allowed is not None:
                raise UserError("a run with an owner admits members by their credentials: give no swarm key or "
                                "allow-list with it")
        elif credential is not None or revocations is not None:
            raise UserError("a credential or revocation list needs the run owner's peer id (--run-owner)")
        self.owner, self.credential, self._clock = owner, credential, clock
        self.own_peer_id: Optional[str] = None  # always admitted (set by the DHT node that uses this policy)
        self._lock = threading.Lock()
        self._proven: Dict[str, float] = {}  # peer id -> until when its checked proof holds (UNIX seconds)
        # Credentials (peer id, digest) and revocation lists ("revocations", digest) already checked, good (-> not_after,
        # issued_at) or bad (-> None): a signature check takes ~1 ms, and the same records and requests come back at
        # every refresh. Bounded like the refusals.
        self._verified: "OrderedDict[Tuple[str, bytes], Optional[float]]" = OrderedDict()
        self._revocations: Optional[credentials.Revocations] = None
        self._revoked_file: Optional[Tuple[str, float]] = None  # --revoked FILE and its mtime when last read
        # Bounded (MAX_REMEMBERED_REFUSALS, oldest forgotten first): made-up peer ids cost an attacker nothing.
        self._counted: "OrderedDict[Tuple[str, str], None]" = OrderedDict()  # (point, peer id) counted once
        self._outsiders: "OrderedDict[str, None]" = OrderedDict()  # peer ids refused anywhere
        self._refused: Dict[str, int] = {point: 0 for point in POINTS}
        self._log = RateLimitedLog(logger)
        if revocations is not None and not self.note_revocations(revocations):
            raise UserError(f"the revocation list is not signed by the run owner {owner}")

    @classmethod
    def from_files(cls, swarm_key_path: Optional[str] = None, allow_peers_path: Optional[str] = None, *,
                   owner: Optional[str] = None, credential_path: Optional[str] = None,
                   revoked_path: Optional[str] = None) -> "Admission":
        """Read `--swarm-key FILE` (its bytes, whitespace at the ends stripped), `--allow-peers FILE` (one peer id per
        line; blank lines and `#` comments ignored), `--credential FILE` and `--revoked FILE` (as `moshpeer member`
        writes them). Raises UserError naming the file."""
        key = None
        if swarm_key_path is not None:
            key = _read(swarm_key_path, "--swarm-key", MAX_SWARM_KEY_BYTES + 1024).strip()
            _warn_if_readable_by_others(swarm_key_path)
            if len(key) < MIN_SWARM_KEY_BYTES:
                raise UserError(f"--swarm-key {swarm_key_path}: the key has {len(key)} bytes, at least "
                                f"{MIN_SWARM_KEY_BYTES} are needed (e.g. `openssl rand -hex 32 > {swarm_key_path}`)")
        allowed = None
        if allow_peers_path is not None:
            text = _read(allow_peers_path, "--allow-peers", 128 * MAX_ALLOWED_PEERS)
            try:
                lines = text.decode("utf-8").splitlines()
            except UnicodeDecodeError:
                raise UserError(f"--allow-peers {allow_peers_path}: not a text file") from None
            allowed = [line.split("#", 1)[0].strip() for line in lines]
            allowed = [peer for peer in allowed if peer]
            for peer in allowed:
                if not credentials.PEER_ID.match(peer):
                    raise UserError(f"--allow-peers {allow_peers_path}: {peer!r:.80} is not a peer id")
            if not allowed:
                raise UserError(f"--allow-peers {allow_peers_path}: the file names no peer id")
        credential = None if credential_path is None else _read(credential_path, "--credential",
                                                                credentials.MAX_CREDENTIAL_BYTES)
        revoked_at = None if revoked_path is None else _mtime(revoked_path)  # before reading: a rewrite is seen
        revocations = None if revoked_path is None else _read(revoked_path, "--revoked",
                                                              credentials.MAX_REVOCATIONS_BYTES)
        try:
            admission = cls(key, allowed, owner=owner, credential=credential, revocations=revocations)
        except UserError as e:
            named = f"--swarm-key {swarm_key_path}" if swarm_key_path else f"--revoked {revoked_path}" \
                if revoked_path else None
            raise UserError(f"{named}: {e}" if named else str(e)) from None
        if revoked_path is not None:
            admission._revoked_file = (revoked_path, revoked_at)
        return admission

    @property
    def private(self) -> bool:
        """Does this node admit only some peers?"""
        return self._key is not None or self.allowed is not None or self.owner is not None

    def same_policy(self, other: "Admission") -> bool:
        return self._key == other._key and self.allowed == other.allowed and self.owner == other.owner

    def tag(self, peer_id: str) -> bytes:
        """The membership proof `peer_id` shows: its tag under the swarm key, or in a run with an owner this node's
        credential (for its own id); b"" in an open run."""
        if self.owner is not None:
            return (self.credential or b"") if peer_id == self.own_peer_id else b""
        if self._key is None:
            return b""
        return hashlib.blake2b(peer_id.encode(), key=self._key, digest_size=TAG_BYTES,
                               person=b"moshpeer-member").digest()

    def bind(self, own_peer_id: str) -> None:
        """Make this the policy of the node `own_peer_id` (always admitted). In a run with an owner, refuse
        (UserError) a credential that is not for this peer id, has expired, or was revoked. A node without a credential
        only reads (`moshpeer status`): the others refuse it."""
        self.own_peer_id = own_peer_id
        if self.owner is None or own_peer_id == self.owner or self.credential is None:
            return
        if self._revoked(own_peer_id):
            raise UserError(f"the run owner revoked this peer ({own_peer_id})")
        if credentials.verify_credential(self.credential or b"", self.owner, own_peer_id, self._clock()) is None:
            raise UserError(f"--credential is not a valid credential for this peer ({own_peer_id}) from the run "
                            f"owner {self.owner}: signed for another peer id or owner, or expired")

    def connection_secret(self, group_secret: bytes) -> bytes:
        """The group secret that data-plane connection keys derive from: bound to the swarm key, if any."""
        if self._key is None:
            return group_secret
        return hashlib.blake2b(group_secret, key=self._key, digest_size=32, person=b"moshpeer-conn").digest()

    def admits(self, peer_id: str, tag: Optional[bytes] = None) -> bool:
        """Is `peer_id` admitted? With a swarm key or an owner, `tag` proves it (remembered while it holds); without
        a tag, only a peer whose proof was checked before is. Counts nothing (see `check`)."""
        if peer_id == self.own_peer_id or (self.owner is not None and peer_id == self.owner):
            return True
        if self.allowed is not None and peer_id not in self.allowed:
            return False
        if self._key is None and self.owner is None:
            return True
        now = self._clock()
        if self.owner is not None:
            if self._revoked(peer_id):
                return False
            until = self._credential_until(peer_id, bytes(tag), now) if tag else None
        else:
            until = math.inf if tag is not None and hmac.compare_digest(bytes(tag), self.tag(peer_id)) else None
        with self._lock:
            if until is not None:
                self._proven[peer_id] = until
            return self._proven.get(peer_id, 0.0) > now

    def check(self, point: str, peer_id: str, tag: Optional[bytes] = None, *, once: bool = False) -> bool:
        """`admits`, counting and logging a refusal at `point` (one of POINTS); with `once`, a peer's refusals
        at this point count once (a record read again at every refresh is one refusal)."""
        if self.admits(peer_id, tag):
            return True
        self.refuse(point, peer_id, once=once)
        return False

    def excluded(self, peer_id: str) -> bool:
        """Is `peer_id` known not to be admitted (not on the allow-list, revoked, or refused before and unproven
        since)? Unlike `admits`, a peer not yet seen with a proof is not excluded."""
        if peer_id == self.own_peer_id:
            return False
        return (self.allowed is not None and peer_id not in self.allowed) or self._revoked(peer_id) \
            or self.known_outsider(peer_id)

    def refuse(self, point: str, peer_id: str, *, once: bool = False) -> None:
        """Count (and log, rate-limited) a refusal of `peer_id` at `point`; see `check`."""
        with self._lock:
            _remember(self._outsiders, peer_id)
            if once:
                if (point, peer_id) in self._counted:
                    return
                _remember(self._counted, (point, peer_id))
            self._refused[point] += 1
        if self.allowed is not None and peer_id not in self.allowed:
            why = "not on the allow-list"
        elif self.owner is not None:
            why = "revoked by the run owner" if self._revoked(peer_id) else "no valid credential from the run owner"
        else:
            why = "no valid swarm-key tag"
        self._log.warning(f"private run: refused {peer_id[-12:]} at {point} ({why})")

    def known_outsider(self, peer_id: str) -> bool:
        """Was `peer_id` refused somewhere, and has it not proven itself since?"""
        with self._lock:
            if peer_id not in self._outsiders:
                return False
        return not self.admits(peer_id)

    @property
    def refused(self) -> Dict[str, int]:
        """Refusals so far, per point."""
        with self._lock:
            return dict(self._refused)

    @property
    def revocations(self) -> bytes:
        """The newest revocation list this node knows (the owner-signed bytes, for its record), b"" if none."""
        with self._lock:
            return b"" if self._revocations is None else self._revocations.blob

    def note_revocations(self, blob: bytes) -> bool:
        """Adopt `blob` (from a record or a file) if the run owner signed it and it is newer than the list this node
        holds: the peers it names are refused from now on. True if `blob` is a valid list, adopted or not."""
        if self.owner is None or not blob:
            return False
        key = ("revocations", hashlib.blake2b(blob, digest_size=16).digest())
        with self._lock:
            if self._revocations is not None and blob == self._revocations.blob:
                return True
            if key in self._verified:  # checked before (a record carrying an older or a forged list, every refresh)
                return self._verified[key] is not None
        parsed = credentials.parse_revocations(blob, self.owner)
        with self._lock:
            _remember(self._verified, key, None if parsed is None else parsed.issued_at)
        if parsed is None:
            return False
        with self._lock:
            if self._revocations is not None and parsed.issued_at <= self._revocations.issued_at:
                return True
            self._revocations = parsed
            for peer_id in parsed.peer_ids:
                self._proven.pop(peer_id, None)
        logger.info(f"private run: the run owner's revocation list of {parsed.issued_at:.0f} revokes "
                    f"{len(parsed.peer_ids)} peer(s)")
        return True

    def reload_revoked_file(self) -> None:
        """Adopt the --revoked file again if it changed since it was read (the owner's `moshpeer member revoke`
        rewrites it in place; its node passes the new list on with its next record). A file that went missing or
        does not verify is logged and skipped: the list held so far stays."""
        if self._revoked_file is None:
            return
        path, read_at = self._revoked_file
        changed = _mtime(path)
        if changed == read_at:
            return
        self._revoked_file = (path, changed)
        try:
            adopted = self.note_revocations(_read(path, "--revoked", credentials.MAX_REVOCATIONS_BYTES))
        except UserError as e:
            adopted, why = False, str(e)
        else:
            why = f"--revoked {path}: not a revocation list signed by the run owner"
        if not adopted:
            logger.warning(why)

    def _credential_until(self, peer_id: str, credential: bytes, now: float) -> Optional[float]:
        """Until when `credential` admits `peer_id` (None: it does not), verified once per distinct credential."""
        key = (peer_id, hashlib.blake2b(credential, digest_size=16).digest())
        with self._lock:
            known = self._verified.get(key, False)
        if known is False:
            checked = credentials.verify_credential(credential, self.owner, peer_id, now)
            known = None if checked is None else checked.not_after
            with self._lock:
                _remember(self._verified, key, known)
        return known if known is not None and known > now else None

    def _revoked(self, peer_id: str) -> bool:
        with self._lock:
            return self._revocations is not None and peer_id in self._revocations.peer_ids


def _warn_if_readable_by_others(path: str) -> None:
    """One warning if users other than the owner may read the key file: anyone who reads it is a member."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & 0o077:
        logger.warning(f"--swarm-key {path} can be read by other users (mode {stat.S_IMODE(mode):o}); anyone "
                       f"who reads it can join the run: chmod 600 {path}")


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return -1.0


def _remember(memory: "OrderedDict", key, value=None) -> None:
    """Add `key` (with `value`) as the newest entry, forgetting the oldest beyond MAX_REMEMBERED_REFUSALS."""
    remember(memory, key, value, limit=MAX_REMEMBERED_REFUSALS)


def _read(path: str, flag: str, limit: int) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise UserError(f"{flag} {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise UserError(f"{flag} {path}: the file is larger than {limit} bytes")
    return data


def install(dht, admission: Optional[Admission]) -> None:
    """Make `admission` the policy of `dht` (a `SwarmDHT`) unless it is None. A DHT that already admits by
    another private policy raises UserError (one node, one policy)."""
    if admission is None or not admission.private:
        return
    current: Admission = dht.admission
    if current.private:
        if not current.same_policy(admission):
            raise UserError("this DHT node already admits peers by another swarm key, allow-list or run owner")
        return
    admission.bind(dht.identity.peer_id)
    dht.admission = admission
