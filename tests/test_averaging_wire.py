"""The data plane against bad input, in-process over real TCP: one real member, one adversarial member.

The adversary knows the group secret (a buggy or malicious group mate) and sends malformed chunks;
a stranger does not know it. Every bad message or connection must be rejected and counted, must not
change the owner's values, and the round must still finish with everything valid averaged.
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


class Adversary:
    """Member 1 played by hand: a listener that drains what member 0 sends, and a raw outgoing connection."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        conn, _ = self.listener.accept()
        conn.sendall(wire.new_challenge())
        while conn.recv(1 << 16):
            pass

    def connect(self, plane: DataPlane, secret: bytes, tag: bytes) -> socket.socket:
        sock = socket.create_connection(plane.address, timeout=10)
        challenge = wire.parse_challenge(_recv(sock, wire.CHALLENGE.size))
        sock.sendall(wire.pack_hello(secret, challenge, tag, 1, 0))
        return sock


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += sock.recv(n - len(data))
    return data


def _chunk(sock, tag, phase, part, chunk, values: torch.Tensor) -> None:
    payload = values.contiguous().view(torch.uint8).numpy().tobytes()
    sock.sendall(wire.pack_header(phase, part, chunk, len(payload), tag) + payload)


def _start_round(own: torch.Tensor, adversary: Adversary):
    plane = DataPlane()
    group_id = os.urandom(20)
    secret = wire.group_secret(group_id, [b"a" * 16, b"b" * 16])
    tag = wire.allreduce_tag(group_id, 0)
    allreduce = GroupAllReduce(
        plane, own, members=[GroupMember(*plane.address, 1.0), GroupMember(*adversary.address, 1.0)],
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
    stranger.sendall(wire.pack_hello(b"wrong secret", challenge, tag, 1, 0))
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
