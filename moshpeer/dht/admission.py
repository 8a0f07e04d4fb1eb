"""Private runs: which peers this node admits (a pre-shared swarm key, an allow-list of peer ids, or both).

An open run (the default) admits everyone. A private run admits a peer only if
- with an allow-list (`--allow-peers FILE`, `allow_peers=`): its libp2p peer id is on the list;
- with a swarm key (`--swarm-key FILE`, `swarm_key=`): it proves that it holds the key. The proof is a
  membership tag, BLAKE2b keyed with the swarm key over the peer id. It travels in the peer's signed DHT
  record and in its matchmaking metadata. A tag names one peer id, and that id's records are signed by,
  and its connections authenticated with, the id's own key: an outsider who reads a member's tag cannot
  use it for itself. The key is also mixed into every data-plane connection key (`connection_secret`),
  so a connection with a peer that lacks it fails its MACs.

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
import os
import re
import stat
import threading
from collections import OrderedDict
from typing import Dict, FrozenSet, Iterable, Optional, Set, Tuple

from moshpeer.errors import UserError
from moshpeer.ratelimited_log import RateLimitedLog

logger = logging.getLogger(__name__)

POINTS = ("records", "matchmaking", "dataplane", "state")
MIN_SWARM_KEY_BYTES = 16
MAX_SWARM_KEY_BYTES = 4096
MAX_ALLOWED_PEERS = 100_000
MAX_REMEMBERED_REFUSALS = 4096  # refused peer ids kept for `known_outsider` and once-only counting
TAG_BYTES = 16
_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{16,128}$")  # base58, as in PeerRecord


class Admission:
    """Who this node admits; see the module docstring. `Admission()` admits everyone.

    :param swarm_key: the run's pre-shared secret (at least MIN_SWARM_KEY_BYTES bytes)
    :param allowed: base58 peer ids admitted (this node's own id is always admitted)
    """

    def __init__(self, swarm_key: Optional[bytes] = None, allowed: Optional[Iterable[str]] = None):
        if swarm_key is not None and not MIN_SWARM_KEY_BYTES <= len(swarm_key) <= MAX_SWARM_KEY_BYTES:
            raise UserError(f"a swarm key must have {MIN_SWARM_KEY_BYTES} to {MAX_SWARM_KEY_BYTES} bytes, "
                            f"got {len(swarm_key)}")
        self._key = None if swarm_key is None else hashlib.blake2b(swarm_key, digest_size=32,
                                                                   person=b"moshpeer-swarm").digest()
        self.allowed: Optional[FrozenSet[str]] = None
        if allowed is not None:
            self.allowed = frozenset(allowed)
            bad = [peer for peer in self.allowed if not _PEER_ID.match(peer)]
            if bad:
                raise UserError(f"not a peer id: {bad[0]!r:.80}")
            if not self.allowed:
                raise UserError("the allow-list names no peer")
        self.own_peer_id: Optional[str] = None  # always admitted (set by the DHT node that uses this policy)
        self._lock = threading.Lock()
        self._proven: Set[str] = set()  # peer ids whose tags we checked (swarm key)
        # Bounded (MAX_REMEMBERED_REFUSALS, oldest forgotten first): made-up peer ids cost an attacker nothing.
        self._counted: "OrderedDict[Tuple[str, str], None]" = OrderedDict()  # (point, peer id) counted once
        self._outsiders: "OrderedDict[str, None]" = OrderedDict()  # peer ids refused anywhere
        self._refused: Dict[str, int] = {point: 0 for point in POINTS}
        self._log = RateLimitedLog(logger)

    @classmethod
    def from_files(cls, swarm_key_path: Optional[str] = None, allow_peers_path: Optional[str] = None) -> "Admission":
        """Read `--swarm-key FILE` (its bytes, whitespace at the ends stripped) and `--allow-peers FILE` (one
        peer id per line; blank lines and `#` comments ignored). Raises UserError naming the file."""
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
                if not _PEER_ID.match(peer):
                    raise UserError(f"--allow-peers {allow_peers_path}: {peer!r:.80} is not a peer id")
            if not allowed:
                raise UserError(f"--allow-peers {allow_peers_path}: the file names no peer id")
        try:
            return cls(key, allowed)
        except UserError as e:
            raise UserError(f"--swarm-key {swarm_key_path}: {e}") from None

    @property
    def private(self) -> bool:
        """Does this node admit only some peers?"""
        return self._key is not None or self.allowed is not None

    def same_policy(self, other: "Admission") -> bool:
        return self._key == other._key and self.allowed == other.allowed

    def tag(self, peer_id: str) -> bytes:
        """`peer_id`'s membership tag under the swarm key (b"" without one)."""
        if self._key is None:
            return b""
        return hashlib.blake2b(peer_id.encode(), key=self._key, digest_size=TAG_BYTES,
                               person=b"moshpeer-member").digest()

    def connection_secret(self, group_secret: bytes) -> bytes:
        """The group secret that data-plane connection keys derive from: bound to the swarm key, if any."""
        if self._key is None:
            return group_secret
        return hashlib.blake2b(group_secret, key=self._key, digest_size=32, person=b"moshpeer-conn").digest()

    def admits(self, peer_id: str, tag: Optional[bytes] = None) -> bool:
        """Is `peer_id` admitted? With a swarm key, `tag` proves it (remembered); without a tag, only a peer
        whose tag was checked before is. Counts nothing (see `check`)."""
        if peer_id == self.own_peer_id:
            return True
        if self.allowed is not None and peer_id not in self.allowed:
            return False
        if self._key is None:
            return True
        if tag is not None and hmac.compare_digest(bytes(tag), self.tag(peer_id)):
            with self._lock:
                self._proven.add(peer_id)
            return True
        with self._lock:
            return peer_id in self._proven

    def check(self, point: str, peer_id: str, tag: Optional[bytes] = None, *, once: bool = False) -> bool:
        """`admits`, counting and logging a refusal at `point` (one of POINTS); with `once`, a peer's refusals
        at this point count once (a record read again at every refresh is one refusal)."""
        if self.admits(peer_id, tag):
            return True
        self.refuse(point, peer_id, once=once)
        return False

    def excluded(self, peer_id: str) -> bool:
        """Is `peer_id` known not to be admitted (not on the allow-list, or refused before and unproven since)?
        Unlike `admits`, a peer not yet seen with a swarm-key tag is not excluded."""
        if peer_id == self.own_peer_id:
            return False
        return (self.allowed is not None and peer_id not in self.allowed) or self.known_outsider(peer_id)

    def refuse(self, point: str, peer_id: str, *, once: bool = False) -> None:
        """Count (and log, rate-limited) a refusal of `peer_id` at `point`; see `check`."""
        with self._lock:
            _remember(self._outsiders, peer_id)
            if once:
                if (point, peer_id) in self._counted:
                    return
                _remember(self._counted, (point, peer_id))
            self._refused[point] += 1
        listed = self.allowed is None or peer_id in self.allowed
        self._log.warning(f"private run: refused {peer_id[-12:]} at {point} "
                          f"({'no valid swarm-key tag' if listed else 'not on the allow-list'})")

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


def _warn_if_readable_by_others(path: str) -> None:
    """One warning if users other than the owner may read the key file: anyone who reads it is a member."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & 0o077:
        logger.warning(f"--swarm-key {path} can be read by other users (mode {stat.S_IMODE(mode):o}); anyone "
                       f"who reads it can join the run: chmod 600 {path}")


def _remember(memory: "OrderedDict", key) -> None:
    """Add `key` as the newest entry, forgetting the oldest beyond MAX_REMEMBERED_REFUSALS."""
    memory[key] = None
    memory.move_to_end(key)
    while len(memory) > MAX_REMEMBERED_REFUSALS:
        memory.popitem(last=False)


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
            raise UserError("this DHT node already admits peers by another swarm key or allow-list")
        return
    admission.own_peer_id = dht.identity.peer_id
    dht.admission = admission
