"""`wire.recv_exactly` / `recv_exactly_by`: the one "read exactly N bytes (by a deadline)" of the data plane."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from moshpeer.averaging import wire


def test_bytes_that_trickle_in_are_read_whole():
    a, b = socket.socketpair()
    with a, b:
        def trickle():
            for byte in b"hello":
                b.sendall(bytes([byte]))
                time.sleep(0.01)

        threading.Thread(target=trickle).start()
        assert wire.recv_exactly_by(a, 5, time.monotonic() + 5) == b"hello"


def test_one_deadline_for_the_whole_read():
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"ab")
        started = time.monotonic()
        with pytest.raises(socket.timeout):
            wire.recv_exactly_by(a, 4, started + 0.1)
        assert time.monotonic() - started < 1.0


def test_eof_is_a_connection_error():
    a, b = socket.socketpair()
    with a:
        b.sendall(b"abc")
        b.close()
        with pytest.raises(ConnectionError, match="3 of 4"):
            wire.recv_exactly_by(a, 4, time.monotonic() + 5)


def test_without_a_deadline_the_socket_timeouts_bound_it():
    a, b = socket.socketpair()
    with a, b:
        wire.block_until(a, time.monotonic() + 5)
        b.sendall(b"wxyz")
        buffer = bytearray(4)
        wire.recv_exactly(a, memoryview(buffer))
        assert buffer == b"wxyz"


def test_readable_within_works_on_a_descriptor_past_select_limit():
    """A receiver asks whether its sender paused (wire.readable_within) on every frame: it must work on
    descriptors >= 1024, where select() raises."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1100:
        pytest.skip("cannot open descriptors >= 1024 here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    a, b = socket.socketpair()
    sock = socket.socket(fileno=os.dup2(a.fileno(), 1051))
    try:
        assert not wire.readable_within(sock, 0.01)
        b.sendall(b"x")
        assert wire.readable_within(sock, 1.0)
        assert sock.recv(1) == b"x"
        b.close()
        assert wire.readable_within(sock, 1.0)  # the end counts as readable
    finally:
        sock.close()
        a.close()


def test_readable_within_a_socket_closed_by_another_thread_is_its_end_not_an_error():
    """The round's end closes a receiver's socket from another thread while the receiver asks whether its sender
    paused: that is the connection's end (the next read raises OSError), not a ValueError in a thread."""
    a, b = socket.socketpair()
    try:
        a.close()
        assert wire.readable_within(a, 0.01)
        with pytest.raises(OSError):
            a.recv(1)
    finally:
        b.close()


def test_buffers_are_set_only_where_the_kernel_grants_them():
    """On a stock kernel (ceilings of 212992 bytes) a set buffer would be capped and lose autotuning: leave both
    to the kernel; where the ceilings allow SOCKET_BUFFER_BYTES, set both."""
    stock = {"wmem_max": 212992, "rmem_max": 212992}
    tuned = {"wmem_max": wire.SOCKET_BUFFER_BYTES, "rmem_max": 8 * wire.SOCKET_BUFFER_BYTES}
    assert wire.buffer_options(stock.get) == ()
    assert wire.buffer_options(tuned.get) == (socket.SO_SNDBUF, socket.SO_RCVBUF)
    assert wire.buffer_options({**tuned, "rmem_max": 212992}.get) == (socket.SO_SNDBUF,)


def test_the_peek_leaves_the_bytes_for_the_next_read():
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"MP")
        threading.Timer(0.05, lambda: b.sendall(b"RYrest")).start()
        assert wire.peek_exactly(a, 4, time.monotonic() + 5) == b"MPRY"
        assert wire.recv_exactly_by(a, 8, time.monotonic() + 5) == b"MPRYrest"
