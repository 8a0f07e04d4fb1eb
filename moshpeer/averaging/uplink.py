"""Measuring this peer's upload bandwidth from the all-reduce's own traffic (no probe traffic).

During reduce-scatter every chunk a member sends is ready at once, so its uplink is saturated for a
while; the kernel counts the bytes of each TCP connection the receiver acknowledged
(`tcpi_bytes_acked`). A meter samples the sum over the round's outgoing connections and keeps the
highest rate seen over any `window`-second span: the rate the uplink (or the slowest of CPU,
receivers' downloads, and the uplink) delivers. Acknowledged, not sent, bytes: while TCP's window
grows (one doubling per round trip, and the round trip includes the queue in front of the uplink),
what leaves the socket runs seconds ahead of what the link carries. Acknowledgements come back
through the receivers' own uplinks, whose queues bunch them; a one-second window keeps that error
small. A round too short for one window reports its average rate (an underestimate). Connections
relayed over libp2p (local socket pairs) are not counted.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import deque
from typing import List, Optional

# struct tcp_info (linux/tcp.h): 8 one-byte fields, 24 u32, then u64 pacing_rate, max_pacing_rate, bytes_acked.
_BYTES_ACKED = struct.Struct("=Q")
_BYTES_ACKED_OFFSET = 8 + 24 * 4 + 2 * 8
_TCP_INFO_LEN = _BYTES_ACKED_OFFSET + _BYTES_ACKED.size
SAMPLE_S = 0.02
WINDOW_S = 1.0
# A round that moved less than this over the uplink says little about it (slow start, latency).
MIN_MEASURED_BYTES = 1 << 20


def bytes_acked(sock: socket.socket) -> Optional[int]:
    """Bytes of `sock` the other end has acknowledged (Linux TCP only; None elsewhere or once closed)."""
    if not hasattr(socket, "TCP_INFO") or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return None
    if len(info) < _TCP_INFO_LEN:
        return None
    return _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_OFFSET)[0]


class UplinkMeter:
    """Samples the acknowledged bytes of the sockets `add`ed to it on a thread of its own until `stop()`."""

    def __init__(self, window: float = WINDOW_S, interval: float = SAMPLE_S):
        self.window, self.interval = window, interval
        self._sockets: List[socket.socket] = []
        self._base: List[int] = []  # each socket's count when added
        self._last: List[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._samples: deque = deque()  # (time, total acknowledged bytes) within the last window
        self.peak_rate = 0.0  # bytes/s
        self.total_bytes = 0
        self._started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="moshpeer-uplink-meter", daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket) -> None:
        """Count what `sock` sends from now on (a connection kept from an earlier round has counted bytes already)."""
        acked = bytes_acked(sock)
        if acked is None:
            return
        with self._lock:
            self._sockets.append(sock)
            self._base.append(acked)
            self._last.append(0)

    def _sample(self) -> None:
        with self._lock:
            for k, sock in enumerate(self._sockets):
                acked = bytes_acked(sock)
                if acked is not None:  # a closed socket keeps its last count
                    self._last[k] = acked - self._base[k]
            total = sum(self._last)
        now = time.monotonic()
        self.total_bytes = total
        self._samples.append((now, total))
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.window:
            self._samples.popleft()
        start, before = self._samples[0]
        if now - start >= self.window:
            self.peak_rate = max(self.peak_rate, (total - before) / (now - start))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def stop(self) -> Optional[float]:
        """Stop sampling; -> the peak upload rate in bytes/s, or None if too little was sent to tell."""
        self._sample()
        self._stop.set()
        self._thread.join(timeout=1.0)
        if self.total_bytes < MIN_MEASURED_BYTES:
            return None
        if self.peak_rate <= 0:  # too short for a full window: the average (an underestimate)
            elapsed = time.monotonic() - self._started_at
            return self.total_bytes / elapsed if elapsed > 0 else None
        return self.peak_rate


# Weight of the newest measurement in a peer's upload estimate (exponential average over rounds).
UPLOAD_ESTIMATE_ALPHA = 0.5


class UploadEstimate:
    """This peer's upload in bytes/s, for "bandwidth" partitioning: the declared one if any, else an
    exponential average of the rounds' measurements (`UplinkMeter.stop()`); None while unknown."""

    def __init__(self, declared: Optional[float] = None):
        self.declared = declared
        self.measured: Optional[float] = None

    @property
    def current(self) -> Optional[float]:
        return self.declared if self.declared is not None else self.measured

    def note(self, measured: Optional[float]) -> None:
        """A round measured `measured` bytes/s (None: it could not tell)."""
        if measured is None:
            return
        old = self.measured
        self.measured = measured if old is None else old + UPLOAD_ESTIMATE_ALPHA * (measured - old)
