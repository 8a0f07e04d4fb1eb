"""`MemberConnector`'s choice of path (direct TCP, then the libp2p relay) and its fallback, without a peer at
the other end: the decision is a pure function, and the fallback is exercised against a closed port and a
relay that records what it was asked for."""

from __future__ import annotations

import socket
import time

import pytest

from moshpeer.averaging.member_connector import (DIRECT, RELAYED, GroupMember, MemberConnector, connection_paths,
                                                 peer_closed)

PEER = b"\x01" * 34


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed: connections are refused at once


def test_paths_direct_first_then_relay():
    member = GroupMember("127.0.0.1", 9, 1.0, PEER)
    assert connection_paths(member, has_relay=True, force_relay=False) == (DIRECT, RELAYED)
    assert connection_paths(member, has_relay=False, force_relay=False) == (DIRECT,)
    assert connection_paths(member, has_relay=True, force_relay=True) == (RELAYED,)
    no_address = GroupMember("", 0, 1.0, PEER)
    assert connection_paths(no_address, has_relay=True, force_relay=False) == (RELAYED,)
    assert connection_paths(no_address, has_relay=False, force_relay=False) == ()


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


def test_peer_closed_sees_the_other_end_hang_up():
    a, b = socket.socketpair()
    try:
        assert not peer_closed(a)
        b.close()
        assert peer_closed(a)
    finally:
        a.close()
