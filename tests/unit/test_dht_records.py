"""Offline checks of the membership building blocks: identities, multiaddrs, peer records, the validator."""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID
from hivemind.utils import get_dht_time

from moshpeer.dht import (
    Identity,
    OwnedRecordValidator,
    PeerRecord,
    check_ports_free,
    parse_initial_peers,
    parse_listen_maddrs,
    peer_id_from_owner_key,
    peers_key,
    validate_run_id,
)
from moshpeer.dht.keys import relays_key, state_offers_key
from moshpeer.dht.validation import key_id, run_validator
from moshpeer.errors import UserError

pytestmark = pytest.mark.timeout(60)

RUN = "unit-run"
serialize = DHTProtocol.serializer.dumps


@pytest.fixture(scope="module")
def alice() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def mallory() -> Identity:
    return Identity.generate()


def make_record(identity: Identity, **fields) -> PeerRecord:
    now = get_dht_time()
    base = dict(
        peer_id=identity.peer_id,
        role="trainer",
        addresses=[f"/ip4/127.0.0.1/tcp/4000/p2p/{identity.peer_id}"],
        version="0.1.0",
        protocol=1,
        started_at=now,
        updated_at=now,
    )
    return PeerRecord(**{**base, **fields})


# ---- identities ---------------------------------------------------------------------------------


def test_identity_peer_id_matches_libp2p_rule(alice):
    # hivemind's PeerID.from_identity follows the libp2p spec (and matches p2pd): ours must agree.
    assert alice.peer_id == PeerID.from_identity(alice.to_file_bytes()).to_base58()
    assert peer_id_from_owner_key(alice.owner_subkey) == alice.peer_id


def test_identity_derived_values_are_computed_once_and_still_pickle(alice):
    # Every round reads them (the handshake's credentials): kept after the first read, as bytes and str only.
    assert alice.peer_id_bytes is alice.peer_id_bytes and alice.public_key_bytes is alice.public_key_bytes
    assert alice.public_key_bytes == alice.public_key.to_bytes()
    assert PeerID(alice.peer_id_bytes).to_base58() == alice.peer_id
    copy = pickle.loads(pickle.dumps(alice))
    assert (copy.peer_id, copy.peer_id_bytes, copy.owner_subkey) == (alice.peer_id, alice.peer_id_bytes,
                                                                      alice.owner_subkey)


def test_identity_file_persists_peer_id(tmp_path):
    path = tmp_path / "peer.key"
    first = Identity.load_or_create(str(path))
    assert path.exists() and (os.stat(path).st_mode & 0o077) == 0, "identity file must be private"
    second = Identity.load_or_create(str(path))
    assert second.peer_id == first.peer_id


@pytest.mark.parametrize(
    "contents, message",
    [(b"garbage", "not a valid private key"), (b"", "not a valid private key")],
)
def test_corrupt_identity_file_is_user_error(tmp_path, contents, message):
    path = tmp_path / "bad.key"
    path.write_bytes(contents)
    with pytest.raises(UserError, match=message):
        Identity.load_or_create(str(path))


def test_identity_path_problems_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="is a directory"):
        Identity.load_or_create(str(tmp_path))
    with pytest.raises(UserError, match="does not exist"):
        Identity.load_or_create(str(tmp_path / "missing-dir" / "peer.key"))


def test_owner_key_parser_rejects_anything_but_one_marker(alice, mallory):
    assert peer_id_from_owner_key(alice.owner_subkey + b"x") is None
    assert peer_id_from_owner_key(alice.owner_subkey + mallory.owner_subkey) is None
    assert peer_id_from_owner_key(b"[owner:ssh-rsa AAAAnotakey]") is None


# ---- multiaddrs, ports, run ids -----------------------------------------------------------------


def test_initial_peers_are_checked(alice):
    good = f"/ip4/127.0.0.1/tcp/31337/p2p/{alice.peer_id}"
    assert parse_initial_peers([good]) == [good]
    with pytest.raises(UserError, match="malformed initial peer multiaddr '/ip4/999.0.0.1/tcp/1'"):
        parse_initial_peers(["/ip4/999.0.0.1/tcp/1"])
    with pytest.raises(UserError, match="malformed"):
        parse_initial_peers(["127.0.0.1:31337"])
    with pytest.raises(UserError, match=r"no /p2p/<peer id>"):
        parse_initial_peers(["/ip4/127.0.0.1/tcp/31337"])
    with pytest.raises(UserError, match="no /tcp/ or /udp/"):
        parse_initial_peers([f"/ip4/127.0.0.1/p2p/{alice.peer_id}"])


def test_listen_and_announce_maddrs_are_checked():
    assert parse_listen_maddrs(["/ip4/0.0.0.0/tcp/0"]) == ["/ip4/0.0.0.0/tcp/0"]
    with pytest.raises(UserError, match="explicit port"):
        parse_listen_maddrs(["/ip4/1.2.3.4/tcp/0"], announce=True)
    with pytest.raises(UserError, match="no /tcp/ or /udp/"):
        parse_listen_maddrs(["/ip4/1.2.3.4"])


def test_port_in_use_is_detected():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_ports_free([f"/ip4/127.0.0.1/tcp/{port}"])
        with pytest.raises(UserError, match="already in use"):
            check_ports_free([f"/ip4/0.0.0.0/tcp/{port}"])  # wildcard overlaps the loopback listener
    check_ports_free([f"/ip4/127.0.0.1/tcp/{port}", "/ip4/127.0.0.1/tcp/0"])  # free again; port 0 never probed


@pytest.mark.parametrize("run_id", ["", "a b", "-leading-dash", "x" * 65, "semi;colon"])
def test_bad_run_ids_are_user_errors(run_id):
    with pytest.raises(UserError, match="invalid run id"):
        validate_run_id(run_id)


# ---- records ------------------------------------------------------------------------------------


def test_record_round_trips_through_msgpack(alice):
    record = make_record(alice, grid=[1, 0, 3], group_bits="0110", step=7, samples_per_second=12.5)
    wire = DHTProtocol.serializer.loads(serialize(record.to_wire()))
    assert PeerRecord.from_wire(wire) == record


@pytest.mark.parametrize(
    "change",
    [
        {"role": "admin"},
        {"step": -1},
        {"step": "7"},  # no silent conversion of strings to numbers
        {"step": 7.0},  # nor of floats to ints
        {"samples_per_second": float("nan")},
        {"samples_per_second": float("inf")},
        {"group_bits": "012"},
        {"grid": [1, -2]},
        {"grid": list(range(100))},
        {"addresses": ["x" * 1000]},
        {"leaving": "yes"},
        {"surprise": 1},
    ],
)
def test_record_schema_rejects_bad_values(alice, change):
    wire = {**make_record(alice).to_wire(), **change}
    with pytest.raises(ValueError):
        PeerRecord.from_wire(wire)


def test_record_updates_are_validated(alice):
    record = make_record(alice)
    assert record.updated(step=3).step == 3
    with pytest.raises(ValueError):
        record.updated(step=-3)


# ---- the validator, as hivemind's DHT runs it ---------------------------------------------------


def signed_record(identity: Identity, value, subkey: bytes, run_id: str = RUN, expiration: float = 30.0,
                  key: str = "") -> DHTRecord:
    """What a peer using `identity` would send under `key` (default: the run's peer records): validators sign,
    then the DHT ships the record."""
    composite = CompositeValidator([identity.signature_validator(), run_validator([run_id])])
    record = DHTRecord(key_id(key or peers_key(run_id)), serialize(subkey), serialize(value),
                       get_dht_time() + expiration)
    return dataclasses.replace(record, value=composite.sign_value(record))


@pytest.fixture
def receiver() -> CompositeValidator:
    """A third peer's validators: the ones every moshpeer DHT node runs."""
    return CompositeValidator([Identity.generate().signature_validator(), run_validator([RUN])])


def test_genuine_record_is_accepted(alice, receiver):
    assert receiver.validate(signed_record(alice, make_record(alice).to_wire(), alice.owner_subkey))


def test_record_under_someone_elses_key_is_rejected(alice, mallory, receiver):
    forged = make_record(alice, step=999).to_wire()
    # Mallory writes under Alice's subkey: Mallory's signer leaves it unsigned, and she cannot sign for Alice.
    unsigned = signed_record(mallory, forged, alice.owner_subkey)
    assert not receiver.validate(unsigned)
    signed_by_mallory = dataclasses.replace(
        unsigned, value=unsigned.value + b"[signature:" + mallory.private_key.sign(b"anything") + b"]"
    )
    assert not receiver.validate(signed_by_mallory)


def test_record_claiming_another_peer_id_is_rejected(alice, mallory, receiver):
    impersonation = make_record(mallory).updated().to_wire() | {"peer_id": alice.peer_id}
    assert not receiver.validate(signed_record(mallory, impersonation, mallory.owner_subkey))


def test_tampered_or_replayed_record_is_rejected(alice, receiver):
    record = signed_record(alice, make_record(alice).to_wire(), alice.owner_subkey)
    tampered = dataclasses.replace(record, value=record.value.replace(b"0.1.0", b"9.9.9"))
    assert tampered.value != record.value
    assert PeerRecord.from_wire(DHTProtocol.serializer.loads(receiver.strip_value(tampered))).version == "9.9.9"
    assert not receiver.validate(tampered), "schema-valid but altered: only the signature can catch it"
    longer_lived = dataclasses.replace(record, expiration_time=record.expiration_time + 1000)
    assert not receiver.validate(longer_lived), "the signature covers the expiration time"


def test_unowned_and_malformed_entries_are_rejected(alice, receiver):
    good = make_record(alice).to_wire()
    assert not receiver.validate(signed_record(alice, good, b"no-owner-marker"))  # subkey without a key
    regular = DHTRecord(key_id(peers_key(RUN)), DHTProtocol.IS_REGULAR_VALUE, serialize(good), get_dht_time() + 30)
    assert not receiver.validate(regular)  # a plain value would replace the whole dictionary
    assert not receiver.validate(signed_record(alice, good | {"role": "admin"}, alice.owner_subkey))
    assert not receiver.validate(signed_record(alice, "not a map", alice.owner_subkey))
    assert not receiver.validate(signed_record(alice, good | {"version": "v" * 20000}, alice.owner_subkey))
    assert not receiver.validate(signed_record(alice, good, alice.owner_subkey, expiration=10 * 86400))


@pytest.mark.parametrize("key", [state_offers_key(RUN), relays_key(RUN)])
def test_every_offer_a_run_writes_is_owned_signed_schema_checked_and_bounded(alice, mallory, receiver, key):
    offer = {"peer_id": alice.peer_id, "host": "203.0.113.7", "port": 4100}
    if key == state_offers_key(RUN):
        offer |= {"epoch": 12, "protocol": 3}
    assert receiver.validate(signed_record(alice, offer, alice.owner_subkey, key=key))
    assert receiver.validate(signed_record(alice, offer | {"tag": b"t" * 16}, alice.owner_subkey, key=key))
    # Unsigned junk under a plain subkey, or a plain value that would replace the dictionary (the 3,000
    # entries of 4 KB): refused by every node, so no listing pulls it.
    assert not receiver.validate(signed_record(mallory, {"junk": "x" * 4096}, b"junk-0001", key=key))
    plain = DHTRecord(key_id(key), DHTProtocol.IS_REGULAR_VALUE, serialize(offer), get_dht_time() + 30)
    assert not receiver.validate(plain)
    # Signed, but not an offer: unknown fields, wrong types, another peer's id, oversized, a 30-day expiry.
    for bad in (offer | {"extra": 1}, offer | {"port": "4100"}, offer | {"port": 0}, offer | {"host": "h" * 300},
                offer | {"peer_id": mallory.peer_id}, offer | {"tag": b"t" * 20000}):
        assert not receiver.validate(signed_record(alice, bad, alice.owner_subkey, key=key)), bad
    assert not receiver.validate(signed_record(alice, offer, alice.owner_subkey, key=key, expiration=30 * 86400))


def test_validator_ignores_other_keys_and_merges(alice):
    validator = OwnedRecordValidator({peers_key("run-a"): PeerRecord})
    other = DHTRecord(key_id("someone_elses_key"), DHTProtocol.IS_REGULAR_VALUE, serialize(123), get_dht_time() + 30)
    assert validator.validate(other)
    assert validator.merge_with(OwnedRecordValidator({peers_key("run-b"): PeerRecord}))
    bad_for_b = signed_record(alice, {"peer_id": alice.peer_id}, alice.owner_subkey, run_id="run-b")
    assert not validator.validate(dataclasses.replace(bad_for_b, value=RSASignatureValidator().strip_value(bad_for_b)))
    assert validator.rejected, "rejections are counted"


def test_identities_below_2048_bits_are_refused():
    """Issue 26: 1024-bit RSA keys (about 30 ms each to mint) were accepted as identities and record owners."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from moshpeer.dht.identity import crypto_pb2, peer_id_from_owner_key

    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    ssh = weak.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    assert peer_id_from_owner_key(b"[owner:" + ssh + b"]") is None
    strong = Identity.generate()
    assert peer_id_from_owner_key(strong.owner_subkey) == strong.peer_id
    der = weak.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption())
    with pytest.raises(ValueError, match="too weak"):
        Identity.from_file_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=der).SerializeToString())


def test_refused_peer_memory_is_bounded():
    """Issue 26: an allow-list run remembered every refused made-up peer id, without bound."""
    from moshpeer.dht import admission as admission_module

    allowed = Identity.generate().peer_id
    gate = admission_module.Admission(allowed=[allowed])
    made_up = [Identity.generate().peer_id for _ in range(3)]
    for k in range(admission_module.MAX_REMEMBERED_REFUSALS + 50):
        gate.refuse("records", made_up[k % 3][:-6] + f"{k:06d}"[-6:], once=True)
    assert len(gate._outsiders) <= admission_module.MAX_REMEMBERED_REFUSALS
    assert len(gate._counted) <= admission_module.MAX_REMEMBERED_REFUSALS


def test_a_swarm_key_file_others_can_read_is_warned_about(tmp_path, caplog):
    from moshpeer.dht.admission import Admission

    key = tmp_path / "swarm.key"
    key.write_text("k" * 64)
    key.chmod(0o600)
    with caplog.at_level("WARNING"):
        Admission.from_files(str(key))
    assert "chmod 600" not in caplog.text
    key.chmod(0o644)
    with caplog.at_level("WARNING"):
        Admission.from_files(str(key))
    assert "can be read by other users" in caplog.text and "chmod 600" in caplog.text


def test_status_counts_each_flagging_record_once(alice, mallory):
    """Issue 26: `status` showed a flagged count of 2^62 that one record claimed about an honest peer."""
    from moshpeer.cli.status import flagged_by

    honest = PeerRecord(peer_id=alice.peer_id, role="trainer", version="test", protocol=2, started_at=0.0,
                        updated_at=0.0)
    liar = honest.updated(peer_id=mallory.peer_id, flagged={alice.peer_id: 1 << 62, mallory.peer_id: 5})
    assert flagged_by([honest, liar]) == {alice.peer_id: 1}  # one reporter; claims about oneself ignored


def test_a_clock_or_firewall_refusal_at_start_is_a_user_error():
    from hivemind.dht.protocol import ValidationError

    from moshpeer.dht.node import _raise_user_error_unless_unreachable

    # hivemind's words when the initial peers' clocks differ from ours by more than it allows (its ping, at start)
    ahead = ValidationError("local time must be within 3 seconds  of others(local: 1796538386.50570, peer: "
                            "1796538376.51467)")
    with pytest.raises(UserError, match=r"clock is 10\.0 s ahead of the initial peers' \(they must agree within 3 s\)"):
        _raise_user_error_unless_unreachable(ahead, has_initial_peers=True)
    behind = ValidationError("local time must be within 3 seconds  of others(local: 100.0, peer: 104.5)")
    with pytest.raises(UserError, match=r"clock is 4\.5 s behind the initial peers'"):
        _raise_user_error_unless_unreachable(behind, has_initial_peers=True)
    firewall = ValidationError("Peer QmX can't access this node. Probably, libp2p has failed to bypass the firewall")
    with pytest.raises(UserError, match=r"cannot connect back to this machine \(a NAT or a firewall in the way\): "
                                        ".*--client-mode"):
        _raise_user_error_unless_unreachable(firewall, has_initial_peers=True)
    # With an identity file, a copy of it on another machine is the other cause seen (twins.py).
    with pytest.raises(UserError, match="firewall in the way, or another machine runs with a copy of this --identity"):
        _raise_user_error_unless_unreachable(firewall, has_initial_peers=True, persistent=True)
    with pytest.raises(ValidationError):  # anything else is not the user's to fix: raised as it is
        _raise_user_error_unless_unreachable(ValidationError("something new"), has_initial_peers=True)
