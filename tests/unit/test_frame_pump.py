"""The compiled frame pump (frame_pump.py, kernels/frames_cpu.cpp) speaks the Python frame path's wire format: same
MACs, same checks, same errors, and either end may use either path."""

from __future__ import annotations

import socket
import struct
import time

import pytest
import torch

from moshpeer.averaging import frame_pump, handshake, wire
from moshpeer.averaging.frame_pump import RunReader
from moshpeer.averaging.handshake import FrameAuth, FrameReader
from moshpeer.averaging.staging import BatchInbox
from moshpeer.errors import ProtocolError

TAG = b"roundtag"
KEY = bytes(range(32))
R, G = wire.PHASE_REDUCE, wire.PHASE_GATHER


@pytest.fixture(params=["compiled", "python"])
def path(request, monkeypatch):
    """Run a test over the compiled pump and over the Python fallback (MOSHPEER_KERNELS=torch turns it off)."""
    if request.param == "compiled":
        if frame_pump.compiled() is None:
            pytest.skip("the CPU extension is unavailable here")
    else:
        monkeypatch.setenv("MOSHPEER_KERNELS", "torch")
    return request.param


def reader(sock: socket.socket, capacity: int = 4, max_payload: int = 64) -> RunReader:
    wire.block_until(sock, time.monotonic() + 30)  # as a receiver does: every read has the round's deadline
    inbox = BatchInbox((max_payload + 3) & ~3, capacity)
    return RunReader(FrameReader(sock, FrameAuth(KEY), tag=TAG, max_payload=max_payload, inbox=inbox))


def payloads(count: int, size: int = 40):
    return [bytes((k * 7 + i) % 256 for i in range(size)) for k in range(count)]


def send_run(sock: socket.socket, auth: FrameAuth, phase: int, chunks) -> None:
    data = bytearray(b"".join(chunks))
    spans, offset = [], 0
    for chunk in chunks:
        spans.append((offset, len(chunk)))
        offset += len(chunk)
    headers = [wire.pack_header(phase, 0, c, len(chunk), TAG) for c, chunk in enumerate(chunks)]
    frame_pump.send_run(sock, auth, headers, data, spans)


def test_a_run_sent_by_one_path_reads_back_by_the_other(path):
    a, b = socket.socketpair()
    with a, b:
        sent = payloads(3)
        send_run(a, FrameAuth(KEY), R, sent)  # this test's path
        auth = FrameAuth(KEY)
        handshake.send_frame(a, auth, wire.pack_header(R, 0, 3, 40, TAG), sent[0])  # the Python path, in turn
        auth.sequence = 3  # (its numbers continue those of the run above)
        wire.block_until(b, time.monotonic() + 30)
        python_reader = FrameReader(b, FrameAuth(KEY), tag=TAG, max_payload=64, inbox=BatchInbox(64, 8))
        got = [python_reader.read() for _ in range(3)]
        assert [bytes(f.payload.numpy()) for f in got] == sent and [f.chunk for f in got] == [0, 1, 2]

    a, b = socket.socketpair()
    with a, b:
        auth = FrameAuth(KEY)
        for c, chunk in enumerate(payloads(2)):
            handshake.send_frame(a, auth, wire.pack_header(G, 1, c, len(chunk), TAG), chunk)
        handshake.send_frame(a, auth, wire.pack_header(wire.PHASE_END_GATHER, 0, 0, 0, TAG))
        runs, frames = reader(b), []  # this test's path reads what the Python path sent
        while not frames or frames[-1].payload is not None:
            frames += runs.read_run(idle_s=0.5)
        assert [(f.phase, f.part, f.chunk, f.payload_len) for f in frames] == [(G, 1, 0, 40), (G, 1, 1, 40),
                                                                               (wire.PHASE_END_GATHER, 0, 0, 0)]
        assert [bytes(f.payload.numpy()) for f in frames[:2]] == payloads(2)


def test_a_run_ends_at_a_full_inbox_an_end_marker_or_another_phase(path):
    a, b = socket.socketpair()
    with a, b:
        auth = FrameAuth(KEY)
        send_run(a, auth, R, payloads(5))
        send_run(a, auth, G, payloads(1))
        handshake.send_frame(a, auth, wire.pack_header(wire.PHASE_END_REDUCE, 0, 0, 0, TAG))
        runs = reader(b, capacity=4)
        seen = []
        while not seen or seen[-1] != wire.PHASE_END_REDUCE:
            run = runs.read_run(phase=R, idle_s=0.5)
            if len(run) > 1:
                assert all(f.phase == R for f in run[:-1])  # a run changes phase only at its last frame
            seen += [f.phase for f in run]
            runs.inbox.reset()
        assert seen == [R] * 5 + [G, wire.PHASE_END_REDUCE]


@pytest.mark.parametrize("fault", ["mac", "other-round", "oversized", "bad-magic", "closed"])
def test_a_bad_frame_fails_the_run_after_the_good_ones(path, fault):
    a, b = socket.socketpair()
    with a, b:
        auth = FrameAuth(KEY)
        good = payloads(2)
        send_run(a, auth, R, good)
        header = wire.pack_header(R, 0, 2, 40, TAG)
        payload = payloads(3)[2]
        mac = auth.tag(header, payload)
        if fault == "mac":
            payload = bytes([payload[0] ^ 1]) + payload[1:]
        elif fault == "other-round":
            header = wire.pack_header(R, 0, 2, 40, b"another!")
        elif fault == "oversized":
            header = wire.pack_header(R, 0, 2, 1 << 20, TAG)
        elif fault == "bad-magic":
            header = b"XXXX" + header[4:]
        a.sendall(header + payload + mac if fault != "closed" else header + payload[:10])
        if fault == "mac":  # a valid frame after the forged one, in the same run: never handed out either
            later = wire.pack_header(R, 0, 3, 40, TAG)
            a.sendall(later + good[0] + auth.tag(later, good[0]))
        a.shutdown(socket.SHUT_WR)
        runs = reader(b, capacity=8)
        frames = []
        expected = ConnectionError if fault == "closed" else ProtocolError
        with pytest.raises(expected):
            while True:
                frames += runs.read_run(idle_s=0.5)
        assert [bytes(f.payload.numpy()) for f in frames] == good  # taken in before the failure was raised
        assert runs.inbox.count == len(good)  # no row of the failed frame or after it was taken


def test_the_compiled_writer_lays_out_frames_as_send_frame_does():
    if frame_pump.compiled() is None:
        pytest.skip("the CPU extension is unavailable here")
    a, b = socket.socketpair()
    with a, b:
        chunks = [bytes(300), payloads(1, 1000)[0], b"x"]
        send_run(a, FrameAuth(KEY), R, chunks)
        auth = FrameAuth(KEY)
        b.settimeout(30)
        for c, chunk in enumerate(chunks):
            header = wire.pack_header(R, 0, c, len(chunk), TAG)
            wire_frame = b.recv(len(header) + len(chunk) + handshake.MAC_BYTES, socket.MSG_WAITALL)
            assert wire_frame == header + chunk + auth.tag(header, chunk)
    assert struct.calcsize("!4sBBHII8s") == wire.HEADER.size == 24  # the compiled reader's layout


def test_send_run_raises_os_error_on_a_closed_connection(path):
    a, b = socket.socketpair()
    b.close()
    with a, pytest.raises(OSError):
        send_run(a, FrameAuth(KEY), R, payloads(2))


def test_rows_of_a_run_are_not_shared(path):
    """Each data frame of a run has its own row of the inbox (the batch is decoded from consecutive rows)."""
    a, b = socket.socketpair()
    with a, b:
        send_run(a, FrameAuth(KEY), R, payloads(3))
        runs = reader(b, capacity=3)
        frames = []
        while len(frames) < 3:
            frames += runs.read_run(idle_s=0.5)
        rows = runs.inbox.rows()
        assert rows.shape[0] == 3
        for k, frame in enumerate(frames):
            assert torch.equal(rows[k, :40], frame.payload)
