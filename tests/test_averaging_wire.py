"""The data plane against bad input, in-process over real TCP: one real member, one adversarial member.

The adversary knows the group secret (a buggy or malicious group mate) and sends malformed chunks;
a stranger does not know it. Every bad message or connection must be rejected and counted, must not
change the owner's values, and the round must still finish with everything valid averaged. The
handshake is mutual: a receiver that cannot prove the secret (an impostor at a member's address, a
reflected or replayed proof) gets no chunks, and a member that is not in the round is noticed at once.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest
import torch

from moshpeer.averaging import DataPlane, GroupAllReduce, GroupMember, wire
from moshpeer.compression import get_compression

pytestmark = pytest.mark.timeout(60)

CHUNK, NUMEL = 64, 512  # 2 parts of 256 values, 4 chunks each
PEERS = (b"peer-0", b"peer-1")


class Adversary:
    """Member 1 played by hand: a listener that answers member 0's hello and drains what it sends, and a raw
    outgoing connection.

    :param welcome: how the listener answers: "valid" (knows the secret), "wrong-secret", "reflect" (echoes the
        hello's own MAC), "replay" (a welcome recorded from an earlier, valid connection), "close" (hangs up)
    """

    def __init__(self, welcome: str = "valid"):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.welcome, self.secret, self.tag = welcome, None, None
        self.got_chunk_bytes = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        challenge_msg = wire.new_challenge()
        conn.sendall(challenge_msg)
        challenge_r = wire.parse_challenge(challenge_msg)
        tag, sender, receiver, challenge_s, mac = wire.parse_hello(_recv(conn, wire.HELLO.size))
        if self.welcome == "close":
            conn.close()
            return
        if self.welcome == "reflect":
            answer = mac
        elif self.welcome == "replay":  # a valid welcome, but for another connection's challenges
            answer = wire.welcome_mac(self.secret, os.urandom(32), os.urandom(32), tag, sender, receiver, *PEERS)
        else:
            secret = self.secret if self.welcome == "valid" else b"not the group secret"
            answer = wire.welcome_mac(secret, challenge_r, challenge_s, tag, sender, receiver, *PEERS)
        conn.sendall(wire.pack_welcome(answer))
        while True:
            data = conn.recv(1 << 16)
            if not data:
                return
            self.got_chunk_bytes += len(data)

    def connect(self, plane: DataPlane, secret: bytes, tag: bytes) -> socket.socket:
        sock = socket.create_connection(plane.address, timeout=10)
        challenge = wire.parse_challenge(_recv(sock, wire.CHALLENGE.size))
        challenge_s = os.urandom(32)
        sock.sendall(wire.pack_hello(secret, challenge, tag, 1, 0, PEERS[1], PEERS[0], challenge_s=challenge_s))
        welcome = wire.parse_welcome(_recv(sock, wire.WELCOME.size))
        # Mutual: the data plane proved the secret too.
        assert welcome == wire.welcome_mac(secret, challenge, challenge_s, tag, 1, 0, PEERS[1], PEERS[0])
        return sock


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise ConnectionError("closed")
        data += more
    return data


def _chunk(sock, tag, phase, part, chunk, values: torch.Tensor) -> None:
    payload = values.contiguous().view(torch.uint8).numpy().tobytes()
    sock.sendall(wire.pack_header(phase, part, chunk, len(payload), tag) + payload)


def _start_round(own: torch.Tensor, adversary: Adversary, plane: DataPlane = None):
    plane = plane or DataPlane()
    group_id = os.urandom(20)
    secret = wire.group_secret(group_id, [b"a" * 16, b"b" * 16])
    tag = wire.allreduce_tag(group_id, 0)
    adversary.secret, adversary.tag = secret, tag
    allreduce = GroupAllReduce(
        plane, own, members=[GroupMember(*plane.address, 1.0, PEERS[0]), GroupMember(*adversary.address, 1.0, PEERS[1])],
        my_index=0, tag=tag, secret=secret, compression=get_compression("none"), chunk_numel=CHUNK,
        deadline=time.monotonic() + 6.0,
    )
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", allreduce.run()))
    thread.start()
    return plane, secret, tag, thread, box


def test_malformed_chunks_are_rejected_counted_and_harmless():
    own = torch.randn(NUMEL)
    original = own.clone()
    theirs = torch.randn(NUMEL)
    adversary = Adversary()
    plane, secret, tag, thread, box = _start_round(own, adversary)

    # A stranger with the right tag but without the secret.
    stranger = socket.create_connection(plane.address, timeout=10)
    challenge = wire.parse_challenge(_recv(stranger, wire.CHALLENGE.size))
    stranger.sendall(wire.pack_hello(b"wrong secret", challenge, tag, 1, 0, PEERS[1], PEERS[0]))
    # A stranger who speaks no protocol at all.
    garbage = socket.create_connection(plane.address, timeout=10)
    garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100)

    sock = adversary.connect(plane, secret, tag)
    R = wire.PHASE_REDUCE
    nan = theirs[0:64].clone()
    nan[5] = float("nan")
    _chunk(sock, tag, R, 0, 0, nan)                               # NaN payload
    _chunk(sock, tag, R, 0, 1, theirs[64:96])                     # too short for the chunk
    _chunk(sock, tag, R, 0, 7, theirs[0:64])                      # chunk index out of range
    _chunk(sock, tag, R, 0, 2, theirs[128:192])                   # valid
    _chunk(sock, tag, R, 0, 2, theirs[128:192])                   # duplicate
    _chunk(sock, tag, R, 1, 0, theirs[256:320])                   # a part that is not the receiver's
    inf = theirs[192:256].clone()
    inf[0] = float("inf")
    _chunk(sock, tag, R, 0, 3, inf)                               # Inf payload
    sock.sendall(wire.pack_header(wire.PHASE_END_REDUCE, 0, 0, 0, tag))
    sock.sendall(wire.pack_header(wire.PHASE_END_GATHER, 0, 0, 0, tag))
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
    for s in (sock, stranger, garbage):
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
    sock = adversary.connect(plane, secret, tag)
    if bad_header == "huge":
        bad_header = wire.pack_header(wire.PHASE_REDUCE, 0, 0, 1 << 31, tag)
    elif bad_header == "other-round":
        bad_header = wire.pack_header(wire.PHASE_REDUCE, 0, 0, 256, b"\1" * 8)
    started = time.monotonic()
    sock.sendall(bad_header)
    thread.join(10)
    assert not thread.is_alive()
    assert time.monotonic() - started < 3.0  # the dropped connection ends the wait, not the deadline
    result = box["result"]
    assert result.rejected_messages == 1
    assert result.departed == [1]  # it sent nothing valid: it leaves the weights
    assert torch.equal(own, original)
    plane.close()
    sock.close()


@pytest.mark.parametrize("welcome", ["wrong-secret", "reflect", "replay"])
def test_sender_sends_nothing_to_a_receiver_that_cannot_prove_the_secret(welcome):
    """An impostor at a member's address (or one that reflects or replays a proof) gets no chunk; the round
    goes on without that member, counts the rejection and reports the member absent."""
    own = torch.randn(NUMEL)
    original = own.clone()
    impostor = Adversary(welcome=welcome)
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


def test_inbound_hello_replayed_or_meant_for_another_member_is_rejected():
    """A hello recorded from a valid connection fails on a new one (fresh challenge); a valid proof for
    another pair of peer ids fails too."""
    own = torch.randn(NUMEL)
    adversary = Adversary()
    plane, secret, tag, thread, box = _start_round(own, adversary)
    recorded = socket.create_connection(plane.address, timeout=10)
    challenge = wire.parse_challenge(_recv(recorded, wire.CHALLENGE.size))
    valid_hello = wire.pack_hello(secret, challenge, tag, 1, 0, PEERS[1], PEERS[0])
    recorded.close()  # the eavesdropper's copy of a hello is now replayed on new connections
    replay = socket.create_connection(plane.address, timeout=10)
    _recv(replay, wire.CHALLENGE.size)
    replay.sendall(valid_hello)
    wrong_peers = socket.create_connection(plane.address, timeout=10)
    challenge = wire.parse_challenge(_recv(wrong_peers, wire.CHALLENGE.size))
    wrong_peers.sendall(wire.pack_hello(secret, challenge, tag, 1, 0, b"someone-else", PEERS[0]))
    for sock in (replay, wrong_peers):
        with pytest.raises(ConnectionError):
            _recv(sock, wire.WELCOME.size)  # no welcome: the data plane hangs up
    sock = adversary.connect(plane, secret, tag)  # the genuine member still gets in
    sock.sendall(wire.pack_header(wire.PHASE_END_REDUCE, 0, 0, 0, tag))
    sock.sendall(wire.pack_header(wire.PHASE_END_GATHER, 0, 0, 0, tag))
    thread.join(10)
    assert not thread.is_alive()
    assert box["result"].rejected_connections == 3  # the closed recording, the replay, the wrong peer ids
    plane.close()
    sock.close()


def test_member_not_in_the_round_is_reported_absent_at_once():
    """Matchmaking disagreed: member 1 never learned of this group. Its strict data plane refuses the
    connection at once (it is not matchmaking), so member 0 finishes fast and reports it absent."""
    own = torch.randn(NUMEL)
    original = own.clone()
    outsider = DataPlane(strict=True)
    plane = DataPlane()
    group_id = os.urandom(20)
    allreduce = GroupAllReduce(
        plane, own, members=[GroupMember(*plane.address, 1.0, PEERS[0]), GroupMember(*outsider.address, 1.0, PEERS[1])],
        my_index=0, tag=wire.allreduce_tag(group_id, 0), secret=os.urandom(32), compression=get_compression("none"),
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
        challenge = wire.parse_challenge(_recv(sock, wire.CHALLENGE.size))
        sock.sendall(wire.pack_hello(os.urandom(32), challenge, tag, 1, 0, PEERS[1], PEERS[0]))
        time.sleep(0.3)  # a wait that must NOT end the connection: it is what is being tested
        assert outsider.rejected_connections == 0
    started = time.monotonic()
    with pytest.raises(ConnectionError):
        _recv(sock, wire.WELCOME.size)
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
    members = [GroupMember(*planes[0].address, 1.0, PEERS[0]), GroupMember("127.0.0.1", dead_port, 1.0, PEERS[1])]
    by_peer = {PEERS[0]: planes[0], PEERS[1]: planes[1]}
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
        results[k] = GroupAllReduce(
            planes[k], tensors[k], members=members, my_index=k, tag=wire.allreduce_tag(group_id, 0),
            secret=b"s" * 32, compression=get_compression("none"), chunk_numel=CHUNK,
            deadline=time.monotonic() + 10.0, relay=relay,
        ).run()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert relayed_to == [PEERS[1]]
    assert results[0].relayed == [1] and results[1].relayed == []
    for result in results:
        assert not result.absent and result.reduce.chunks_lost == 0 and result.gather.chunks_lost == 0
    for t in tensors:
        assert torch.allclose(t, exact, rtol=0, atol=1e-6)
    for plane in planes:
        plane.close()
