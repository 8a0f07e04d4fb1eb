"""`MemberConnector`'s choice of path (direct TCP, then the libp2p relay) and its fallback, without a peer at
the other end: the decision is a pure function, and the fallback is exercised against a closed port and a
relay that records what it was asked for."""

from __future__ import annotations

import os
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from local_group import credentials, identities

from moshpeer.averaging import handshake, wire
from moshpeer.averaging.handshake import PeerRefused
from moshpeer.averaging.member_connector import (DIRECT, LIBP2P, RELAY, RELAY_ATTEMPTS, GroupMember, MemberConnector,
                                                 connection_paths, peer_closed)

PEER = b"\x01" * 34


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed: connections are refused at once


def test_paths_direct_first_then_relay():
    member = GroupMember("127.0.0.1", 9, 1.0, PEER)
    assert connection_paths(member, has_relay=True, force_relay=False) == (DIRECT, LIBP2P)
    assert connection_paths(member, has_relay=False, force_relay=False) == (DIRECT,)
    assert connection_paths(member, has_relay=True, force_relay=True) == (LIBP2P,)
    no_address = GroupMember("", 0, 1.0, PEER)
    assert connection_paths(no_address, has_relay=True, force_relay=False) == (LIBP2P,)
    assert connection_paths(no_address, has_relay=False, force_relay=False) == ()
    behind_nat = GroupMember("", 0, 1.0, PEER, relay=("127.0.0.1", 9))
    assert connection_paths(behind_nat, has_relay=True, force_relay=False) == (RELAY, LIBP2P)
    assert connection_paths(behind_nat, has_relay=False, force_relay=False) == (RELAY,)
    assert connection_paths(behind_nat, has_relay=True, force_relay=True) == (LIBP2P,)


def connector(members, relay=None, deadline_s: float = 5.0, **kwargs) -> MemberConnector:
    return MemberConnector(members, tag=b"t" * 8, secret=b"s" * 32, credentials=None,
                           deadline=time.monotonic() + deadline_s, relay=relay, **kwargs)


class RecordingRelay:
    def __init__(self):
        self.asked = []

    def __call__(self, peer_id: bytes, deadline: float) -> socket.socket:
        self.asked.append(peer_id)
        raise TimeoutError("no libp2p stream in this test")


def test_an_unreachable_address_falls_back_to_the_relay():
    relay = RecordingRelay()
    members = [GroupMember("127.0.0.1", 1, 1.0), GroupMember("127.0.0.1", closed_port(), 1.0, PEER)]
    assert connector(members, relay).connect(1) is None  # the relay failed too: no path
    assert relay.asked == [PEER]


def test_without_a_relay_an_unreachable_member_is_given_up():
    members = [GroupMember("127.0.0.1", 1, 1.0), GroupMember("127.0.0.1", closed_port(), 1.0, PEER)]
    assert connector(members).connect(1) is None
    assert connector(members).reach(1) is None


def test_force_relay_never_tries_the_address_and_needs_a_relay():
    relay = RecordingRelay()
    members = [GroupMember("127.0.0.1", 1, 1.0), GroupMember("127.0.0.1", closed_port(), 1.0, PEER)]
    assert connector(members, relay, force_relay=True).connect(1) is None and relay.asked == [PEER]
    with pytest.raises(ValueError):
        connector(members, force_relay=True)


def test_a_passed_deadline_or_closing_tries_no_other_path():
    relay = RecordingRelay()
    members = [GroupMember("127.0.0.1", 1, 1.0), GroupMember("127.0.0.1", closed_port(), 1.0, PEER)]
    assert connector(members, relay, deadline_s=-1.0).connect(1) is None
    assert connector(members, relay, closing=lambda: True).connect(1) is None
    assert relay.asked == []


class FlakyRelay:
    """A relay whose first `dying` streams read our hello and close (as a libp2p stream does whose relayed
    connection is replaced as it opens); the streams after them are member 1 answering the handshake."""

    def __init__(self, tag: bytes, secret: bytes, dying: int):
        self.tag, self.secret, self.dying, self.opened = tag, secret, dying, 0

    def __call__(self, peer_id: bytes, deadline: float) -> socket.socket:
        ours, theirs = socket.socketpair()
        self.opened += 1
        threading.Thread(target=self._member, args=(theirs, self.opened <= self.dying), daemon=True).start()
        return ours

    def _member(self, sock: socket.socket, dies: bool) -> None:
        deadline = time.monotonic() + 10
        with sock:
            if dies:
                wire.recv_exactly_by(sock, handshake.HELLO.size, deadline)
                return
            session = SimpleNamespace(credentials=credentials(self.tag, 1), group_size=2, secret=self.secret,
                                      peer_id_of=lambda i: identities(2)[i].peer_id_bytes)
            handshake.accept(sock, deadline, lambda tag: session)
            sock.settimeout(10)
            sock.recv(1)  # hold the stream open until our end closes (or 10 s)


def relayed_pair(dying: int):
    """(a connector for member 0 of a 2-group whose member 1 has no address, its FlakyRelay)."""
    tag, secret = wire.allreduce_tag(os.urandom(20), 0), os.urandom(32)
    relay = FlakyRelay(tag, secret, dying)
    members = [GroupMember("", 0, 1.0, identities(2)[0].peer_id_bytes),
               GroupMember("", 0, 1.0, identities(2)[1].peer_id_bytes)]
    connector = MemberConnector(members, tag=tag, secret=secret, credentials=credentials(tag, 0),
                                deadline=time.monotonic() + 10, relay=relay)
    return connector, relay


def test_a_relayed_stream_that_closes_after_our_hello_is_opened_once_more():
    connector, relay = relayed_pair(dying=1)
    link = connector.connect(1)
    try:
        assert link is not None and link.path == LIBP2P and relay.opened == 2
    finally:
        link.sock.close()


def test_relayed_streams_that_keep_closing_are_a_refusal_after_relay_attempts():
    connector, relay = relayed_pair(dying=RELAY_ATTEMPTS)
    with pytest.raises(PeerRefused):
        connector.connect(1)
    assert relay.opened == RELAY_ATTEMPTS
    connector, relay = relayed_pair(dying=RELAY_ATTEMPTS)
    assert connector.reach(1) is None and relay.opened == RELAY_ATTEMPTS


def test_peer_closed_sees_the_other_end_hang_up():
    a, b = socket.socketpair()
    try:
        assert not peer_closed(a)
        b.close()
        assert peer_closed(a)
    finally:
        a.close()
