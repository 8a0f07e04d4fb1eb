"""Runs with an owner (issue 26): per-member credentials the owner signs, and revocation lists that every member's
record passes on. Issue 26's audit: "a swarm key gives no per-member accountability or revocation"."""

from __future__ import annotations

import concurrent.futures
import os
from types import SimpleNamespace

import msgpack
import pytest
from hivemind.utils import get_dht_time

from moshpeer.cli.main import main
from moshpeer.dht import credentials
from moshpeer.dht.admission import Admission
from moshpeer.dht.identity import Identity
from moshpeer.dht.membership import list_peers, publish_record
from moshpeer.dht.records import PeerRecord
from moshpeer.errors import UserError
from moshpeer.version import PROTOCOL_VERSION

NOW = 1_800_000_000.0
DAY = 86400.0


@pytest.fixture(scope="module")
def people():
    return SimpleNamespace(owner=Identity.generate(), alice=Identity.generate(), bob=Identity.generate(),
                           mallory=Identity.generate())


class _Clock:
    def __init__(self, now: float = NOW):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _member(people, who: Identity, clock=None, **kwargs) -> Admission:
    credential = credentials.issue_credential(people.owner, who.peer_id, NOW + DAY)
    admission = Admission(owner=people.owner.peer_id, credential=credential, clock=clock or _Clock(), **kwargs)
    admission.bind(who.peer_id)
    return admission


def test_a_credential_admits_only_the_peer_it_names_until_it_expires(people):
    clock = _Clock()
    gate = _member(people, people.alice, clock)
    bobs = credentials.issue_credential(people.owner, people.bob.peer_id, NOW + DAY)
    assert gate.check("matchmaking", people.bob.peer_id, bobs)
    assert gate.admits(people.bob.peer_id)  # remembered: the data plane's hello carries no proof
    assert not gate.admits(people.mallory.peer_id, bobs)  # bob's credential names bob only
    forged = credentials.issue_credential(people.mallory, people.mallory.peer_id, NOW + DAY)
    assert not gate.admits(people.mallory.peer_id, forged)  # signed by someone who is not the owner
    assert gate.refused == {"records": 0, "matchmaking": 0, "dataplane": 0, "state": 0}
    assert gate.admits(people.owner.peer_id) and gate.tag(people.alice.peer_id) == gate.credential
    clock.now = NOW + DAY + 1
    assert not gate.admits(people.bob.peer_id) and not gate.admits(people.bob.peer_id, bobs)  # expired


def test_each_credential_is_verified_once(people, monkeypatch):
    """A signature check takes about a millisecond, and every refresh reads every record again."""
    gate = _member(people, people.alice)
    calls = []
    verify = credentials.verify_credential
    monkeypatch.setattr(credentials, "verify_credential", lambda *args: calls.append(args) or verify(*args))
    bobs = credentials.issue_credential(people.owner, people.bob.peer_id, NOW + DAY)
    forged = credentials.issue_credential(people.mallory, people.mallory.peer_id, NOW + DAY)
    for _ in range(5):
        assert gate.check("records", people.bob.peer_id, bobs, once=True)
        assert not gate.check("records", people.mallory.peer_id, forged, once=True)
    assert len(calls) == 2
    parsed = []
    parse = credentials.parse_revocations
    monkeypatch.setattr(credentials, "parse_revocations", lambda *args: parsed.append(args) or parse(*args))
    newer = credentials.issue_revocations(people.owner, [people.mallory.peer_id], NOW + 2)
    older = credentials.issue_revocations(people.owner, [], NOW + 1)
    for _ in range(5):  # a record carrying an older list, read at every refresh
        assert gate.note_revocations(newer) and gate.note_revocations(older) and gate.revocations == newer
    assert len(parsed) == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "junk", "empty", "not_a_pair"])
def test_damaged_credentials_are_refused_without_raising(people, damage):
    good = credentials.issue_credential(people.owner, people.bob.peer_id, NOW + DAY)
    blob = {"flip": good[:-20] + bytes([good[-20] ^ 1]) + good[-19:], "truncate": good[:300],
            "junk": os.urandom(700), "empty": b"", "not_a_pair": msgpack.packb([1, 2, 3])}[damage]
    assert credentials.verify_credential(blob, people.owner.peer_id, people.bob.peer_id, NOW) is None
    assert credentials.parse_revocations(blob, people.owner.peer_id) is None


def test_the_newest_revocation_list_wins_and_forgets_proofs(people):
    gate = _member(people, people.alice)
    bobs = credentials.issue_credential(people.owner, people.bob.peer_id, NOW + DAY)
    assert gate.admits(people.bob.peer_id, bobs)
    older = credentials.issue_revocations(people.owner, [], NOW)
    newer = credentials.issue_revocations(people.owner, [people.bob.peer_id], NOW + 5)
    assert gate.note_revocations(newer) and gate.revocations == newer
    assert not gate.admits(people.bob.peer_id) and not gate.admits(people.bob.peer_id, bobs)
    assert gate.excluded(people.bob.peer_id)
    assert gate.note_revocations(older) and gate.revocations == newer  # an older list is replayed: ignored
    mallorys = credentials.issue_revocations(people.mallory, [people.alice.peer_id], NOW + 9)
    assert not gate.note_revocations(mallorys) and gate.revocations == newer
    assert not gate.check("records", people.bob.peer_id, bobs) and gate.refused["records"] == 1


def test_a_node_refuses_to_start_with_a_credential_that_is_not_its_own_or_revoked(people):
    bobs = credentials.issue_credential(people.owner, people.bob.peer_id, NOW + DAY)
    with pytest.raises(UserError, match="not a valid credential for this peer"):
        Admission(owner=people.owner.peer_id, credential=bobs, clock=_Clock()).bind(people.alice.peer_id)
    revoked = credentials.issue_revocations(people.owner, [people.bob.peer_id], NOW)
    with pytest.raises(UserError, match="revoked this peer"):
        Admission(owner=people.owner.peer_id, credential=bobs, revocations=revoked,
                  clock=_Clock()).bind(people.bob.peer_id)
    Admission(owner=people.owner.peer_id).bind(people.owner.peer_id)  # the owner needs no credential
    with pytest.raises(UserError, match="no swarm key"):
        Admission(b"k" * 32, owner=people.owner.peer_id)
    with pytest.raises(UserError, match="not signed by the run owner"):
        Admission(owner=people.owner.peer_id, revocations=os.urandom(100))


def test_revocations_travel_in_records_and_reach_members_that_never_read_the_file(people, tmp_path):
    """The owner's node re-reads its --revoked file and passes the list on in its record; a member that reads the
    records adopts it before judging them, so the revoked peer's own record is dropped in the same read."""
    path = tmp_path / "revoked.list"
    path.write_bytes(credentials.issue_revocations(people.owner, [], NOW))
    owners_node = Admission.from_files(owner=people.owner.peer_id, revoked_path=str(path))
    owners_node.bind(people.owner.peer_id)
    path.write_bytes(credentials.issue_revocations(people.owner, [people.mallory.peer_id], NOW + 1))
    os.utime(path, (NOW + 1, NOW + 1))
    dht = _RecordsDHT(people.owner, owners_node)
    publish_record(dht, "run", _record(people.owner), expiration=30)
    assert owners_node.revocations == path.read_bytes()  # re-read on the heartbeat

    alice = _member(people, people.alice)
    mallorys = credentials.issue_credential(people.owner, people.mallory.peer_id, NOW + DAY)
    assert alice.admits(people.mallory.peer_id, mallorys)  # before the revocation reached alice
    dht.stored[people.mallory.owner_subkey] = _record(people.mallory, member_tag=mallorys).to_wire()
    reader = _RecordsDHT(people.alice, alice, stored=dht.stored)
    assert {r.peer_id for r in list_peers(reader, "run")} == {people.owner.peer_id}
    assert alice.revocations == owners_node.revocations and not alice.admits(people.mallory.peer_id)


def test_the_member_command_issues_and_revokes(people, tmp_path, capsys):
    owner_key, alice_key = tmp_path / "owner.key", tmp_path / "alice.key"
    owner_key.write_bytes(people.owner.to_file_bytes())
    assert main(["member", "id", "--identity", str(alice_key)]) == 0  # created
    alice_id = capsys.readouterr().out.strip()
    assert alice_id == Identity.load(str(alice_key)).peer_id
    cred, revoked = tmp_path / "alice.cred", tmp_path / "revoked.list"
    assert main(["member", "issue", "--owner-identity", str(owner_key), "--peer-id", alice_id, "--days", "2",
                 "--out", str(cred)]) == 0
    found = credentials.verify_credential(cred.read_bytes(), people.owner.peer_id, alice_id, get_dht_time())
    assert found is not None and found.not_after > get_dht_time() + DAY
    for who in (alice_id, people.bob.peer_id):
        assert main(["member", "revoke", "--owner-identity", str(owner_key), "--peer-id", who,
                     "--revoked", str(revoked)]) == 0
    listed = credentials.parse_revocations(revoked.read_bytes(), people.owner.peer_id)
    assert listed.peer_ids == {alice_id, people.bob.peer_id}  # cumulative
    assert main(["member", "revoke", "--owner-identity", str(alice_key), "--peer-id", alice_id,
                 "--revoked", str(revoked)]) == 2  # another owner's list: refused, one line
    assert "not a revocation list of run owner" in capsys.readouterr().err


def _record(identity: Identity, **fields) -> PeerRecord:
    now = get_dht_time()
    return PeerRecord(peer_id=identity.peer_id, role="trainer", addresses=["/ip4/127.0.0.1/tcp/1"], version="0",
                      protocol=PROTOCOL_VERSION, started_at=now, updated_at=now, **fields)


class _RecordsDHT:
    """The membership dictionary of one run, in memory: what `publish_record` stores, `list_peers` reads (values
    as the DHT hands them over once their signatures are checked)."""

    def __init__(self, identity: Identity, admission: Admission, stored=None):
        self.identity, self.admission, self.owner_subkey = identity, admission, identity.owner_subkey
        self.stored = {} if stored is None else stored

    def store(self, key, value, expiration_time, subkey, return_future):
        self.stored[subkey] = value
        return _done(True)

    def get(self, key, latest, return_future):
        entries = {subkey: SimpleNamespace(value=value, expiration_time=get_dht_time() + 30)
                   for subkey, value in self.stored.items()}
        return _done(SimpleNamespace(value=entries))


def _done(result):
    future = concurrent.futures.Future()
    future.set_result(result)
    return future
