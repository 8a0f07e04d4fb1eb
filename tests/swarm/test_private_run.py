"""Private runs (issue 14): `--swarm-key` / `--allow-peers` / `--run-owner` admit only known peers. Two members and
an outsider run `moshpeer join` in one run; the members refuse the outsider's records, its matchmaking, its data-plane
hello and its state request (each counted in their epoch lines), ignore its state offer, and still train together.
With a run owner (issue 26) the outsider holds a valid credential that the owner revoked: the revocation list
reaches the members only through the owner's bootstrap node's record."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil
import pytest

from moshpeer.averaging import handshake, wire
from moshpeer.dht import Admission, Identity, credentials
from moshpeer.errors import UserError
from moshpeer.peer.state import sync as state_sync
from swarm import Proc, ProcessFailed
from training_swarm import events, start_trainers, wait_event

pytestmark = pytest.mark.timeout(300)

TRAINING = ("--group-size", "2", "--min-peers", "2", "--max-epochs", "400", "--eval-every", "50")


def _identity(tmp_path: Path, name: str) -> tuple:
    identity = Identity.generate()
    path = tmp_path / f"{name}.key"
    path.write_bytes(identity.to_file_bytes())
    return identity, str(path)


def _refused(proc: Proc) -> Dict[str, int]:
    found = events(proc, "epoch")
    return found[-1].get("refused", {}) if found else {}


def _send_hello(proc: Proc, identity: Identity) -> None:
    """Say a data-plane hello, signed by `identity`, to every TCP port `proc` listens on (its data plane is one)."""
    credentials = handshake.RoundCredentials.create(identity, wire.group_tag_prefix(b"g" * 16), 1)
    hello = handshake.pack_hello(credentials, wire.allreduce_tag(b"g" * 16, 0), 0, b"c" * 32)
    ports = {c.laddr.port for c in psutil.Process(proc.pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    for port in ports:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(hello)
            sock.settimeout(5)
            try:
                sock.recv(1)
            except OSError:
                pass


def _private_swarm(swarm, dht_node, run: str, keys: Dict[str, tuple], member_flags: Dict[str, List[str]],
                   outsider_flags: List[str], admission: Admission, boot_flags: Sequence[str] = (),
                   status_flags: Optional[List[str]] = None) -> None:
    """Members "a" and "b" (`member_flags` by name) and outsider "c" (`outsider_flags`); `keys`: name -> (identity,
    file); `admission`: the members' policy, as this test process reads it; `boot_flags`: the bootstrap node's
    (with `--identity` of "owner" in `keys`, it is the run owner's node, which the members admit)."""
    boot = swarm.bootstrap(run, "--heartbeat", "1", *boot_flags)
    (a_id, _), (b_id, _), (c_id, c_key) = keys["a"], keys["b"], keys["c"]
    member_ids = {a_id.peer_id, b_id.peer_id}
    members = [start_trainers(swarm, 1, run, boot.maddrs, "--identity", keys[name][1], *member_flags[name],
                              *TRAINING)[0] for name in "ab"]
    (outsider,) = start_trainers(swarm, 1, run, boot.maddrs, "--identity", c_key, *outsider_flags, *TRAINING)
    try:
        for member in members:
            # The members average together (group of 2), and refuse the outsider's records and matchmaking.
            wait_event(member, "epoch", timeout=180, predicate=lambda e: e.get("group_size") == 2 and e.get("ok"))
            wait_event(member, "epoch", timeout=120, predicate=lambda e: e.get("refused", {}).get("records", 0) >= 1
                       and e["refused"].get("matchmaking", 0) >= 1)
    except ProcessFailed as e:
        refused = [_refused(member) for member in members]
        raise AssertionError(f"{e}\nmembers refused: {refused}\n{outsider.describe(30)}") from None
    for event in events(outsider, "epoch"):
        assert event.get("group_size", 1) < 2 or not event.get("ok"), event  # never averaged with a member

    # `moshpeer status` with the members' flags shows the members only; without them, every record.
    listed = {}
    for flags in (member_flags["a"] if status_flags is None else status_flags, []):
        shown = swarm.run("status", "--initial-peers", *boot.maddrs, "--run-id", run, "--json", *flags)
        assert shown.returncode == 0, shown.stderr
        listed[bool(flags)] = {peer["peer_id"] for peer in json.loads(shown.stdout)["peers"]}
    owner_node = {boot.peer_id} if "owner" in keys else set()
    assert listed[True] == member_ids | owner_node
    assert listed[False] >= member_ids | {c_id.peer_id, boot.peer_id}

    # The outsider's data-plane hello and state request are refused and counted.
    probe = dht_node(initial_peers=boot.maddrs, run_ids=[run])
    deadline = time.monotonic() + 60
    offers = []
    while len(offers) < 3 and time.monotonic() < deadline:
        offers = state_sync.list_state_offers(probe, run)
        time.sleep(0.5)
    assert {o.peer_id for o in offers} == member_ids | {c_id.peer_id}, offers
    member_offer = next(o for o in offers if o.peer_id == a_id.peer_id)
    _send_hello(members[0], c_id)
    with pytest.raises((ConnectionError, OSError, state_sync.ProtocolError)):
        state_sync.fetch_state_from(member_offer, run, timeout=10, identity=c_id)
    wait_event(members[0], "epoch", timeout=120, predicate=lambda e: e.get("refused", {}).get("dataplane", 0) >= 1
               and e["refused"].get("state", 0) >= 1)

    # With the members' policy, the outsider's state offer is ignored (counted at "state").
    probe.admission = admission
    admission.own_peer_id = probe.identity.peer_id
    assert {o.peer_id for o in state_sync.list_state_offers(probe, run)} == member_ids
    assert admission.refused["state"] == 1
    for proc in (*members, outsider):
        assert proc.terminate() == 0, proc.describe(30)
        assert "Traceback" not in proc.stderr, proc.describe(60)


@pytest.mark.swarm
def test_swarm_key_admits_only_peers_holding_it(swarm, dht_node, tmp_path):
    key, wrong = tmp_path / "swarm.key", tmp_path / "wrong.key"  # the outsider runs an open peer (no key)
    key.write_text("0123456789abcdef0123456789abcdef\n")
    wrong.write_text("fedcba9876543210fedcba9876543210\n")
    keys = {name: _identity(tmp_path, name) for name in "abc"}
    flags = ["--swarm-key", str(key)]
    _private_swarm(swarm, dht_node, "private-key", keys, {"a": flags, "b": flags}, [], Admission.from_files(str(key)))
    # A peer holding another key is no member either: its tag does not verify under ours.
    outsider = Admission.from_files(str(wrong))
    assert not Admission.from_files(str(key)).admits(keys["c"][0].peer_id, outsider.tag(keys["c"][0].peer_id))


@pytest.mark.slow
def test_allow_list_admits_only_listed_peers(swarm, dht_node, tmp_path):
    keys = {name: _identity(tmp_path, name) for name in "abc"}
    allowed = tmp_path / "allowed.txt"
    allowed.write_text("# members\n" + "".join(f"{keys[name][0].peer_id}  # {name}\n" for name in "ab"))
    flags = ["--allow-peers", str(allowed)]
    _private_swarm(swarm, dht_node, "private-list", keys, {"a": flags, "b": flags}, [],
                   Admission.from_files(None, str(allowed)))


@pytest.mark.swarm
def test_run_owner_credentials_admit_members_and_a_revoked_one_is_refused(swarm, dht_node, tmp_path):
    keys = {name: _identity(tmp_path, name) for name in ("owner", "a", "b", "c")}
    owner = keys["owner"][0].peer_id
    issued = {}
    for name in "abc":
        issued[name] = tmp_path / f"{name}.cred"
        swarm_ran = swarm.run("member", "issue", "--owner-identity", keys["owner"][1], "--peer-id",
                              keys[name][0].peer_id, "--out", str(issued[name]))
        assert swarm_ran.returncode == 0, swarm_ran.stderr
    revoked = tmp_path / "revoked.list"
    revoked.write_bytes(credentials.issue_revocations(keys["owner"][0], [keys["c"][0].peer_id], time.time()))
    flags = {name: ["--run-owner", owner, "--credential", str(issued[name])] for name in "ab"}
    _private_swarm(swarm, dht_node, "private-owner", keys, flags, ["--run-owner", owner, "--credential",
                   str(issued["c"])], Admission.from_files(owner=owner, revoked_path=str(revoked)),
                   boot_flags=["--identity", keys["owner"][1], "--run-owner", owner, "--revoked", str(revoked)],
                   status_flags=["--run-owner", owner])


def test_admission_files_and_tags(tmp_path):
    """Bad files are one clear UserError; a tag proves one peer id only; the allow-list is exact."""
    missing = tmp_path / "missing.key"
    with pytest.raises(UserError, match="--swarm-key .*missing.key"):
        Admission.from_files(str(missing))
    short = tmp_path / "short.key"
    short.write_text("tooshort\n")
    with pytest.raises(UserError, match="at least 16"):
        Admission.from_files(str(short))
    empty = tmp_path / "empty.txt"
    empty.write_text("# nobody\n\n")
    with pytest.raises(UserError, match="names no peer id"):
        Admission.from_files(None, str(empty))
    key = tmp_path / "swarm.key"
    key.write_text("0123456789abcdef0123456789abcdef")
    member, other = Identity.generate().peer_id, Identity.generate().peer_id
    admission = Admission.from_files(str(key))
    assert admission.private and admission.check("records", member, admission.tag(member))
    assert not admission.check("records", other, admission.tag(member))  # someone else's tag
    assert not admission.check("records", other, None, once=True) and admission.refused["records"] == 2
    assert admission.excluded(other) and not admission.excluded(member)
    listed = Admission(allowed=[member])
    assert listed.admits(member) and not listed.admits(other) and listed.excluded(other)
    assert not Admission().private and Admission().admits(other)
