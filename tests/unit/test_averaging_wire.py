"""The data plane against bad input, in-process over real TCP: one real member, one adversarial member.

The adversary is a genuine group mate (its own libp2p identity, a buggy or malicious member) and sends
malformed chunks; a stranger has an identity that is not in the group. Every bad message or
connection must be rejected and counted, must not change the owner's values, and the round must still
finish with everything valid averaged. The handshake is mutual: a receiver that cannot prove it is the
member matchmaking named (another identity, or a stolen certificate without its key) gets no chunks,
and a member that is not in the round is noticed at once. Attacks on identity and frame integrity
(impersonation, an on-path proxy rewriting payloads) are in test_averaging_trust.py.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from local_group import credentials, identities, members as group_members

from moshpeer.averaging import DataPlane, GroupAllReduce, handshake, wire
from moshpeer.averaging.handshake import RoundCredentials
from moshpeer.compression import get_compression

pytestmark = pytest.mark.timeout(60)

CHUNK, NUMEL = 64, 512  # 2 parts of 256 values, 4 chunks each


class Adversary:
    """Member 1 played by hand: a listener that answers member 0's hello and drains what it sends, and a raw
    outgoing connection.

    :param answer: how the listener answers: "valid" (member 1's real identity), "other-identity" (a key that is
        not member 1's), "stolen" (member 1's real, signed round key, but without its private half), "close"
        (hangs up)
    """

    def __init__(self, answer: str = "valid"):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.answer, self.secret, self.tag = answer, None, None
        self.got_chunk_bytes = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _session(self, creds: RoundCredentials):
        return SimpleNamespace(credentials=creds, group_size=2, secret=self.secret,
                               peer_id_of=lambda i: identities(2)[i].peer_id_bytes)

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        deadline = time.monotonic() + 10
        if self.answer == "close":
            wire.recv_exactly_by(conn, handshake.HELLO.size, deadline)
            conn.close()
            return
        creds = credentials(self.tag, 1)
        if self.answer == "other-identity":  # a third identity claiming index 1
            creds = RoundCredentials.create(identities(3)[2], wire.tag_group(self.tag), 1)
        elif self.answer == "stolen":  # member 1's signed key, with another X25519 private key behind it
            forged = RoundCredentials.create(identities(2)[1], wire.tag_group(self.tag), 1)
            creds = RoundCredentials(creds.group_prefix, 1, creds.peer_id, creds.public_key, creds.signature,
                                     forged.x25519, creds.x25519_public)
        try:
            handshake.accept(conn, deadline, lambda tag: self._session(creds))
        except (ConnectionError, OSError, handshake.ProtocolError):
            return
        while True:
            data = conn.recv(1 << 16)
            if not data:
                return
            self.got_chunk_bytes += len(data)

    def connect(self, plane: DataPlane, secret: bytes, tag: bytes):
        """A valid connection as member 1 -> (socket, the MACs of its frames)."""
        sock = socket.create_connection(plane.address, timeout=10)
        auth = handshake.connect(sock, time.monotonic() + 10, credentials=credentials(tag, 1), tag=tag, receiver=0,
                                 receiver_peer=identities(1)[0].peer_id_bytes, group_secret=secret)
        sock.settimeout(10)
        return sock, auth


def _chunk(link, tag, phase, part, chunk, values: torch.Tensor) -> None:
    sock, auth = link
    payload = values.contiguous().view(torch.uint8).numpy().tobytes()
    handshake.send_frame(sock, auth, wire.pack_header(phase, part, chunk, len(payload), tag), payload)


def _marker(link, tag, phase) -> None:
    sock, auth = link
    handshake.send_frame(sock, auth, wire.pack_header(phase, 0, 0, 0, tag))


def _start_round(own: torch.Tensor, adversary: Adversary, plane: DataPlane = None):
    plane = plane or DataPlane()
    group_id = os.urandom(20)
    secret = wire.group_secret(group_id, [b"a" * 16, b"b" * 16])
    tag = wire.allreduce_tag(group_id, 0)
    adversary.secret, adversary.tag = secret, tag
    allreduce = GroupAllReduce(
        plane, own, members=group_members([plane.address, adversary.address]),
        my_index=0, tag=tag, secret=secret, credentials=credentials(tag, 0), compression=get_compression("none"),
        chunk_numel=CHUNK, deadline=time.monotonic() + 6.0,
    )
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", allreduce.run()))
    thread.start()
    return plane, secret, tag, thread, box


def _stranger_hello(address, tag) -> socket.socket:
    """A hello as member 1 from an identity that is not member 1's."""
    sock = socket.create_connection(address, timeout=10)
    stranger = RoundCredentials.create(identities(3)[2], wire.tag_group(tag), 1)
    sock.sendall(handshake.pack_hello(stranger, tag, 0, os.urandom(32)))
    return sock


def test_malformed_chunks_are_rejected_counted_and_harmless():
    own = torch.randn(NUMEL)
    original = own.clone()
    theirs = torch.randn(NUMEL)
    adversary = Adversary()
    plane, secret, tag, thread, box = _start_round(own, adversary)

    # A stranger with the right tag but an identity that is not in the group.
    stranger = _stranger_hello(plane.address, tag)
    # A stranger who speaks no protocol at all.
    garbage = socket.create_connection(plane.address, timeout=10)
    garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100)

    link = adversary.connect(plane, secret, tag)
    R = wire.PHASE_REDUCE
    nan = theirs[0:64].clone()
    nan[5] = float("nan")
    _chunk(link, tag, R, 0, 0, nan)                               # NaN payload
    _chunk(link, tag, R, 0, 1, theirs[64:96])                     # too short for the chunk
    _chunk(link, tag, R, 0, 7, theirs[0:64])                      # chunk index out of range
    _chunk(link, tag, R, 0, 2, theirs[128:192])                   # valid
    _chunk(link, tag, R, 0, 2, theirs[128:192])                   # duplicate
    _chunk(link, tag, R, 1, 0, theirs[256:320])                   # a part that is not the receiver's
    inf = theirs[192:256].clone()
    inf[0] = float("inf")
    _chunk(link, tag, R, 0, 3, inf)                               # Inf payload
    _marker(link, tag, wire.PHASE_END_REDUCE)
    _marker(link, tag, wire.PHASE_END_GATHER)
    thread.join(10)
    assert not thread.is_alive()
    result = box["result"]
    assert result.rejected_messages == 6
    assert result.rejected_connections == 2
    assert result.reduce.chunks_received == 1
    assert torch.allclose(own[128:192], (original[128:192] + theirs[128:192]) / 2)
    # Chunks whose only foreign contribution was rejected keep the owner's own value, untouched.
    for lo, hi in ((0, 128), (192, 256)):
        assert torch.equal(own[lo:hi], original[lo:hi])
    assert torch.equal(own[256:], original[256:])  # part 1's average never came: own value kept
    assert torch.isfinite(own).all()
    plane.close()
    for s in (link[0], stranger, garbage):
        s.close()


@pytest.mark.parametrize("bad_header", [
    b"XXXX" + bytes(wire.HEADER.size - 4),                                 # bad magic
    struct.pack("!4sBBHII8s", b"MSHP", 99, 1, 0, 0, 0, b"\0" * 8),         # another protocol version
    "huge",                                                                # payload length over the limit
    "other-round",                                                         # tag of another round
])
def test_bad_header_drops_the_connection_and_the_round_goes_on(bad_header):
    own = torch.randn(NUMEL)
    original = own.clone()
    adversary = Adversary()
    plane, secret, tag, thread, box = _start_round(own, adversary)
    sock, auth = adversary.connect(plane, secret, tag)
    if bad_header == "huge":
        bad_header = wire.pack_header(wire.PHASE_REDUCE, 0, 0, 1 << 31, tag)
    elif bad_header == "other-round":
        bad_header = wire.pack_header(wire.PHASE_REDUCE, 0, 0, 256, b"\1" * 8)
    started = time.monotonic()
    sock.sendall(bad_header + auth.tag(bad_header))  # a valid MAC: the header itself must be refused
    thread.join(10)
    assert not thread.is_alive()
    assert time.monotonic() - started < 3.0  # the dropped connection ends the wait, not the deadline
    result = box["result"]
    assert result.rejected_messages == 1
    assert result.departed == [1]  # it sent nothing valid: it leaves the weights
    assert torch.equal(own, original)
    plane.close()
    sock.close()


@pytest.mark.parametrize("answer", ["other-identity", "stolen"])
def test_sender_sends_nothing_to_a_receiver_that_cannot_prove_its_identity(answer):
    """An impostor at a member's address (another key, or the member's own signed round key without its
    private half) gets no chunk; the round goes on without that member, counts the rejection and reports the
    member absent."""
    own = torch.randn(NUMEL)
    original = own.clone()
    impostor = Adversary(answer=answer)
    plane, secret, tag, thread, box = _start_round(own, impostor)
    started = time.monotonic()
    thread.join(10)
    assert not thread.is_alive()
    assert time.monotonic() - started < 3.0  # no deadline wait: the failed proof ends it
    result = box["result"]
    assert result.absent == [1]
    assert result.rejected_connections == 1
    assert result.reduce.chunks_sent == 0 and impostor.got_chunk_bytes == 0
    assert torch.equal(own, original)
    plane.close()


def test_inbound_hello_replayed_is_rejected(caplog):
    """A hello and confirmation recorded from a valid connection fail on a new one: the data plane's
    challenge and X25519 key are fresh, so the recorded confirmation proves nothing."""
    own = torch.randn(NUMEL)
    adversary = Adversary()
    plane, secret, tag, thread, box = _start_round(own, adversary)
    sent = []

    class Recording(socket.socket):
        def sendall(self, data, *args):
            sent.append(bytes(data))
            return super().sendall(data, *args)

    recorded = Recording(socket.AF_INET, socket.SOCK_STREAM)
    recorded.connect(plane.address)
    handshake.connect(recorded, time.monotonic() + 10, credentials=credentials(tag, 1), tag=tag, receiver=0,
                      receiver_peer=identities(1)[0].peer_id_bytes, group_secret=secret)
    hello, confirm = sent
    replay = socket.create_connection(plane.address, timeout=10)
    replay.sendall(hello)
    wire.recv_exactly_by(replay, handshake.REPLY.size, time.monotonic() + 10)  # the plane answers a fresh challenge
    replay.sendall(confirm)
    while replay.recv(1 << 16):  # the rest of the reply, then EOF: the plane hangs up (a timeout would raise)
        pass
    _marker((recorded, handshake.FrameAuth(b"x")), tag, wire.PHASE_END_REDUCE)  # not even the recorder's MACs
    thread.join(10)
    assert not thread.is_alive()
    result = box["result"]
    assert result.rejected_connections == 1 and result.rejected_messages == 1
    assert any("did not prove its round key" in r.getMessage() for r in caplog.records)
    plane.close()
    for s in (recorded, replay):
        s.close()


def test_member_not_in_the_round_is_reported_absent_at_once():
    """Matchmaking disagreed: member 1 never learned of this group. Its strict data plane refuses the
    connection at once (it is not matchmaking), so member 0 finishes fast and reports it absent."""
    own = torch.randn(NUMEL)
    original = own.clone()
    outsider = DataPlane(strict=True)
    plane = DataPlane()
    group_id = os.urandom(20)
    allreduce = GroupAllReduce(
        plane, own, members=group_members([plane.address, outsider.address]),
        my_index=0, tag=wire.allreduce_tag(group_id, 0), secret=os.urandom(32),
        credentials=credentials(wire.allreduce_tag(group_id, 0), 0), compression=get_compression("none"),
        chunk_numel=CHUNK, deadline=time.monotonic() + 20.0,
    )
    started = time.monotonic()
    result = allreduce.run()
    assert time.monotonic() - started < 2.0
    assert result.absent == [1] and result.reduce.chunks_sent == 0
    assert outsider.rejected_connections == 1
    assert torch.equal(own, original)
    plane.close()
    outsider.close()


def test_strict_plane_holds_a_connection_while_matchmaking_and_refuses_it_after():
    """While its peer is matchmaking, a strict data plane keeps an unknown group's connection waiting (the
    peer may be about to join that group); when matchmaking ends without it, the connection is refused."""
    outsider = DataPlane(strict=True)
    tag = wire.allreduce_tag(os.urandom(20), 0)
    with outsider.matchmaking():
        sock = socket.create_connection(outsider.address, timeout=10)
        sock.sendall(handshake.pack_hello(credentials(tag, 1), tag, 0, os.urandom(32)))
        time.sleep(0.3)  # a wait that must NOT end the connection: it is what is being tested
        assert outsider.rejected_connections == 0
    started = time.monotonic()
    with pytest.raises(ConnectionError):
        wire.recv_exactly_by(sock, handshake.REPLY.size, time.monotonic() + 10)
    assert time.monotonic() - started < 1.0
    assert outsider.rejected_connections == 1
    outsider.close()
    sock.close()


def test_unreachable_address_falls_back_to_the_relay_and_stays_exact():
    """Member 1 announces an address that refuses connections (NAT'ed, or a stale port forward): member 0's
    sender falls back to the relay (here: a local socket pair into member 1's data plane, the same interface
    as the libp2p StreamRelay) and the round is exact, with member 1 listed as relayed."""
    with socket.create_server(("127.0.0.1", 0)) as closed:
        dead_port = closed.getsockname()[1]  # closed when the block ends: connections are refused
    planes = [DataPlane(), DataPlane()]
    members = group_members([planes[0].address, ("127.0.0.1", dead_port)])
    peers = [m.peer_id for m in members]
    by_peer = {peers[0]: planes[0], peers[1]: planes[1]}
    relayed_to = []

    def relay(peer_id: bytes, deadline: float) -> socket.socket:
        ours, theirs = socket.socketpair()
        relayed_to.append(peer_id)
        by_peer[peer_id].accept_socket(theirs, f"relay:{peer_id!r}")
        return ours

    tensors = [torch.randn(NUMEL), torch.randn(NUMEL)]
    exact = (tensors[0] + tensors[1]) / 2
    group_id = os.urandom(20)
    results = [None, None]

    def run(k: int) -> None:
        tag = wire.allreduce_tag(group_id, 0)
        results[k] = GroupAllReduce(
            planes[k], tensors[k], members=members, my_index=k, tag=tag,
            secret=b"s" * 32, credentials=credentials(tag, k), compression=get_compression("none"), chunk_numel=CHUNK,
            deadline=time.monotonic() + 10.0, relay=relay,
        ).run()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert relayed_to == [peers[1]]
    assert results[0].relayed == [1] and results[1].relayed == []
    for result in results:
        assert not result.absent and result.reduce.chunks_lost == 0 and result.gather.chunks_lost == 0
    for t in tensors:
        assert torch.allclose(t, exact, rtol=0, atol=1e-6)
    for plane in planes:
        plane.close()


def test_member_info_carries_the_configured_group_size_and_checks_it():
    import msgpack

    from moshpeer.averaging.member_info import pack_member_info, parse_member_info
    from moshpeer.errors import ProtocolError

    packed = pack_member_info("127.0.0.1", 4000, 1.0, b"n" * 16, group_size=4)
    assert parse_member_info(packed).group_size == 4
    assert parse_member_info(pack_member_info("127.0.0.1", 4000, 1.0, b"n" * 16)).group_size == 0  # not said
    for bad in (-1, 1 << 20, "4", 2.5):
        info = msgpack.unpackb(packed)
        info["gs"] = bad
        with pytest.raises(ProtocolError, match="group size"):
            parse_member_info(msgpack.packb(info))
