"""Attacks on the data plane's identities, frames and resources (issue 14), in-process over real TCP.

Members run the real `GroupAllReduce` in threads, each with its own libp2p identity; attackers are
hand-played with the real wire formats. Each test is an attack that succeeded before connections
were bound to identities and frames carried MACs.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import struct
import threading
import time

import pytest
import torch
from local_group import credentials, identities, members as group_members

from moshpeer.averaging import DataPlane, GroupAllReduce, Partition, dataplane, handshake, wire
from moshpeer.averaging.member_connector import peer_closed as _peer_closed
from moshpeer.averaging.handshake import RoundCredentials
from moshpeer.compression import get_compression
from moshpeer.ratelimited_log import REJECTION_LOGS_PER_INTERVAL
from moshpeer.version import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(90)

CHUNK, NUMEL = 64, 768  # 3 parts of 256 values, 4 chunks each


def _run_member(plane, tensor, members, k, tag, secret, results, deadline_s=10.0):
    results[k] = GroupAllReduce(
        plane, tensor, members=members, my_index=k, tag=tag, secret=secret, credentials=credentials(tag, k),
        compression=get_compression("none"), chunk_numel=CHUNK, deadline=time.monotonic() + deadline_s,
    ).run()


def _run_round(planes, addresses, tensors) -> list:
    """One round of len(planes) members, each in a thread, member k reached at addresses[k]: their results."""
    members = group_members(addresses)
    group_id = os.urandom(20)
    tag = wire.allreduce_tag(group_id, 0)
    secret = wire.group_secret(group_id, [bytes([97 + k]) * 16 for k in range(len(planes))])
    results = [None] * len(planes)
    threads = [threading.Thread(target=_run_member, args=(planes[k], tensors[k], members, k, tag, secret, results))
               for k in range(len(planes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def _closed_by_peer(sock: socket.socket) -> bool:
    """Drain `sock` until EOF (True) or 10 s of silence (False)."""
    sock.settimeout(10)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except socket.timeout:
        return False
    except ConnectionError:  # reset: closed too
        return True


def test_member_cannot_pose_as_another():
    """Member 2 (who knows the group secret and member 1's public, signed round key) tries to connect to
    member 0 as member 1 before member 1 does: with its own key, with member 1's key and signature over its own
    X25519 key, and with member 1's whole certificate. Each is refused; the real member 1 then gets in and the
    round is exact."""
    planes = [DataPlane() for _ in range(3)]
    members = group_members([p.address for p in planes])
    group_id = os.urandom(20)
    tag, secret = wire.allreduce_tag(group_id, 0), wire.group_secret(group_id, [b"a" * 16, b"b" * 16, b"c" * 16])
    tensors = [torch.randn(NUMEL) + k for k in range(3)]
    exact = sum(tensors) / 3
    results = [None] * 3
    threads = {k: threading.Thread(target=_run_member, args=(planes[k], tensors[k], members, k, tag, secret, results))
               for k in range(3)}
    threads[0].start()
    threads[2].start()

    prefix = wire.tag_group(tag)
    real_1 = credentials(tag, 1)  # what member 2 learns from member 1's reply when it connects to it
    own_key_as_1 = RoundCredentials.create(identities(3)[2], prefix, 1)
    mine = RoundCredentials.create(identities(3)[2], prefix, 1)
    signature_reused = RoundCredentials(prefix, 1, real_1.peer_id, real_1.public_key, real_1.signature, mine.x25519,
                                        mine.x25519_public)
    certificate_reused = RoundCredentials(prefix, 1, real_1.peer_id, real_1.public_key, real_1.signature, mine.x25519,
                                          real_1.x25519_public)
    for attempt in (own_key_as_1, signature_reused, certificate_reused):
        sock = socket.create_connection(planes[0].address, timeout=10)
        sock.sendall(handshake.pack_hello(attempt, tag, 0, os.urandom(32)))
        if attempt is certificate_reused:  # the hello passes; the confirmation needs the key only member 1 has
            wire.recv_exactly_by(sock, handshake.REPLY.size, time.monotonic() + 10)
            sock.sendall(handshake.CONFIRM.pack(handshake.CONFIRM_MAGIC, PROTOCOL_VERSION, os.urandom(16)))
        assert _closed_by_peer(sock)
        sock.close()
    assert planes[0].rejected_connections == 3

    threads[1].start()
    for t in threads.values():
        t.join(30)
    for result in results:
        assert result is not None and not result.departed and not result.absent and result.rejected_messages == 0
        assert result.reduce.chunks_lost == 0 and result.gather.chunks_lost == 0
    for t in tensors:
        assert torch.allclose(t, exact, atol=1e-5)
    for p in planes:
        p.close()


class RewritingProxy:
    """An on-path attacker in front of `target`: forwards the handshake untouched, then rewrites every chunk
    payload to 1e30 (keeping the frame's MAC, which it cannot recompute)."""

    def __init__(self, target):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.rewritten = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump_raw, args=(server, client), daemon=True).start()
            threading.Thread(target=self._rewrite, args=(client, server), daemon=True).start()

    @staticmethod
    def _pump_raw(src, dst) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass

    def _rewrite(self, src, dst) -> None:
        far = time.monotonic() + 60

        def forward(n: int) -> bytes:
            data = wire.recv_exactly_by(src, n, far)
            dst.sendall(data)
            return data

        try:
            hello = forward(handshake.HELLO.size)
            key_len, sig_len = handshake.HELLO.unpack(hello)[-2:]
            forward(key_len + sig_len)
            forward(handshake.CONFIRM.size)
            while True:
                header = forward(wire.HEADER.size)
                payload_len = wire.parse_header(header)[3]
                payload = wire.recv_exactly_by(src, payload_len, far)
                if payload_len:
                    payload = struct.pack(f"{payload_len // 4}f", *[1e30] * (payload_len // 4))
                    self.rewritten += 1
                dst.sendall(payload)
                forward(handshake.MAC_BYTES)
        except (OSError, ConnectionError, handshake.ProtocolError):
            pass
        finally:
            dst.close()


def test_on_path_proxy_rewriting_payloads_is_rejected():
    """Everything sent to member 0 passes a proxy that rewrites payloads to 1e30. Member 0 rejects the first
    rewritten frame of each connection and counts what they would have carried as lost; no member ever holds a
    rewritten value: each value is the exact average or, where an averaged chunk never arrived, the member's
    own value, and part 0 (averaged by member 0 from what it could trust) is identical everywhere."""
    planes = [DataPlane() for _ in range(3)]
    proxy = RewritingProxy(planes[0].address)
    originals = [torch.randn(NUMEL) + k for k in range(3)]
    tensors = [t.clone() for t in originals]
    exact = sum(originals) / 3
    results = _run_round(planes, [proxy.address, planes[1].address, planes[2].address], tensors)
    assert proxy.rewritten >= 2
    r0 = results[0]
    assert r0.rejected_messages == 2  # one bad frame per connection: then the connection is dropped
    assert r0.reduce.chunks_received == 0 and r0.reduce.chunks_lost == r0.reduce.chunks_expected
    assert r0.gather.chunks_lost == r0.gather.chunks_expected
    partition = Partition(NUMEL, 3, CHUNK)
    for k, (t, result) in enumerate(zip(tensors, results)):
        assert torch.isfinite(t).all() and t.abs().max() < 100
        missing = set(result.missing_chunks)
        for part in range(3):
            for c in range(partition.num_chunks(part)):
                lo, hi = partition.chunk_range(part, c)
                if part == 0:
                    assert torch.equal(t[lo:hi], tensors[0][lo:hi])  # identical everywhere
                elif (part, c) in missing:
                    assert torch.equal(t[lo:hi], originals[k][lo:hi])
                else:
                    assert torch.allclose(t[lo:hi], exact[lo:hi], atol=1e-5)
    for p in planes:
        p.close()


def test_connection_flood_is_bounded(monkeypatch, caplog):
    """500 silent connections to the data port: at most MAX_HANDSHAKES handshake at once (the rest are closed
    at once, or take the slot of an older silent one, which is closed; all counted), and the log holds a few lines,
    not 500."""
    monkeypatch.setattr(dataplane, "HANDSHAKE_TIMEOUT", 2.0)
    monkeypatch.setattr(dataplane, "MAX_PER_ADDRESS", 1000)  # this test is about the handshake cap
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    plane = DataPlane()
    threads_before = threading.active_count()
    caplog.set_level(logging.WARNING, logger="moshpeer.averaging.dataplane")
    socks = [socket.create_connection(plane.address, timeout=10) for _ in range(500)]
    deadline = time.monotonic() + 10
    while plane.rejected_connections < 500 - dataplane.MAX_HANDSHAKES and time.monotonic() < deadline:
        time.sleep(0.02)
    assert plane.rejected_connections >= 500 - dataplane.MAX_HANDSHAKES
    # Newer silent connections took older ones' slots; an evicted one's thread ends as its socket closes.
    assert threading.active_count() - threads_before <= dataplane.MAX_HANDSHAKES + dataplane.MAX_EVICTING
    deadline = time.monotonic() + 10  # the silent ones hit the handshake deadline
    while plane.rejected_connections < 500 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert plane.rejected_connections == 500
    assert len([r for r in caplog.records if "rejected connection" in r.getMessage()]) <= 2 * REJECTION_LOGS_PER_INTERVAL
    for s in socks:
        s.close()
    plane.close()


def test_per_address_cap(monkeypatch):
    monkeypatch.setattr(dataplane, "MAX_PER_ADDRESS", 4)
    plane = DataPlane()
    socks = [socket.create_connection(plane.address, timeout=10) for _ in range(6)]
    deadline = time.monotonic() + 5
    while plane.rejected_connections < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert plane.rejected_connections == 2
    for s in socks:
        s.close()
    plane.close()


def test_silent_sockets_holding_the_address_slots_do_not_keep_a_member_out(monkeypatch):
    """An attacker behind the same address as member 1 (a shared NAT; here both are 127.0.0.1) fills member 0's
    per-address slots with connections that never speak. Member 1's connections take their slots (the silent
    ones are evicted, counted), and the round averages every part; before, member 1 was refused and its part of
    the vector was not averaged."""
    monkeypatch.setattr(dataplane, "MAX_PER_ADDRESS", 4)
    planes = [DataPlane() for _ in range(2)]
    silent = [socket.create_connection(planes[0].address, timeout=10) for _ in range(4)]
    deadline = time.monotonic() + 5
    while planes[0]._per_address.get("127.0.0.1", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    tensors = [torch.randn(NUMEL) + k for k in range(2)]
    exact = sum(tensors) / 2
    results = _run_round(planes, [p.address for p in planes], tensors)
    for result in results:
        assert result is not None and not result.departed and not result.absent
        assert result.reduce.chunks_lost == 0 and result.gather.chunks_lost == 0
    for t in tensors:
        assert torch.allclose(t, exact, atol=1e-5)
    assert 1 <= planes[0].rejected_connections <= 4  # the evicted silent ones
    assert sum(_closed_by_peer(sock) for sock in silent) == planes[0].rejected_connections
    for sock in silent:
        sock.close()
    for p in planes:
        p.close()


def test_a_connection_that_never_speaks_is_closed_at_the_first_bytes_deadline(monkeypatch):
    monkeypatch.setattr(dataplane, "FIRST_BYTES_TIMEOUT", 0.3)
    plane = DataPlane()
    sock = socket.create_connection(plane.address, timeout=10)
    started = time.monotonic()
    assert _closed_by_peer(sock)
    assert time.monotonic() - started < dataplane.HANDSHAKE_TIMEOUT / 2
    deadline = time.monotonic() + 5  # the handler counts the rejection, then gives its slots back
    while (plane.rejected_connections < 1 or plane._per_address) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert plane.rejected_connections == 1 and not plane._pending and not plane._per_address
    sock.close()
    plane.close()


def test_handshake_has_one_deadline_not_one_per_read(monkeypatch):
    """A sender that drips its hello one byte at a time, each well within any per-read timeout, is cut off
    when the handshake's single deadline passes."""
    monkeypatch.setattr(dataplane, "HANDSHAKE_TIMEOUT", 1.0)
    plane = DataPlane()
    sock = socket.create_connection(plane.address, timeout=10)
    hello = handshake.pack_hello(credentials(wire.allreduce_tag(b"g" * 20, 0), 1), wire.allreduce_tag(b"g" * 20, 0),
                                 0, os.urandom(32))
    started = time.monotonic()
    try:
        for byte in hello:
            sock.sendall(bytes([byte]))
            time.sleep(0.1)
    except OSError:
        pass  # the plane hung up
    assert time.monotonic() - started < 3.0
    assert plane.rejected_connections == 1
    sock.close()
    plane.close()


def test_live_member_on_a_high_descriptor_is_not_taken_for_gone():
    """select() cannot watch descriptors >= 1024; the check that a member closed its connection must work there."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1100:
        pytest.skip("cannot open descriptors >= 1024 here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    a, b = socket.socketpair()
    high = os.dup2(a.fileno(), 1050)
    sock = socket.socket(fileno=high)
    try:
        assert not _peer_closed(sock)
        b.close()
        assert _peer_closed(sock)
    finally:
        sock.close()
        a.close()
