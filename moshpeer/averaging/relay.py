"""The data plane's libp2p-stream fallback: chunks to and from members without a direct TCP path.

A member behind NAT (no reachable TCP address announced, or a direct connection that does not open)
is reached through hivemind's P2P daemon instead: `connect` opens a binary libp2p stream to the
member's peer id (the daemon handles NAT traversal and relays), and the member's handler accepts it.
On both ends the stream is bridged into one end of a local socket pair by two copy tasks on the
averager's event loop; the other end is an ordinary blocking socket, so the relayed connection runs
exactly the same code as a direct one: the mutual handshake (`wire`), header and payload
validation, kernel timeouts bound to the round's deadline, EOF as "the member left". Closing either
end closes the stream, and closing the stream closes both local ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import time
from typing import Set

from hivemind.p2p import P2P, PeerID

from moshpeer.averaging.dataplane import DataPlane

logger = logging.getLogger(__name__)

COPY_BYTES = 1 << 18


class StreamRelay:
    """Serves and opens data-plane connections over libp2p streams named `name` on `p2p`.

    :param p2p: hivemind P2P (the averager's replica of the DHT's daemon)
    :param loop: the event loop `p2p` runs on (copy tasks run there too)
    :param plane: where inbound relayed connections are handed (`DataPlane.accept_socket`)
    :param name: the libp2p protocol name of the handler (one per run)
    """

    def __init__(self, p2p: P2P, loop: asyncio.AbstractEventLoop, plane: DataPlane, name: str):
        self._p2p, self._loop, self._plane, self.name = p2p, loop, plane, name
        self._bridges: Set[asyncio.Task] = set()
        self.streams_opened = self.streams_accepted = 0

    async def start(self) -> None:
        await self._p2p.add_binary_stream_handler(self.name, self._on_stream)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self._p2p.remove_binary_stream_handler(self.name)
        for task in list(self._bridges):
            task.cancel()

    def connect(self, peer_id: bytes, deadline: float) -> socket.socket:
        """(From any thread but the loop's.) A blocking socket carrying a new stream to `peer_id`.

        Raises TimeoutError past `deadline` (time.monotonic()), or the daemon's error if the stream fails.
        """
        if not peer_id:
            raise ConnectionError("member has no peer id to open a libp2p stream to")
        future = asyncio.run_coroutine_threadsafe(self._open(peer_id), self._loop)
        try:
            return future.result(timeout=max(deadline - time.monotonic(), 0.01))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError("libp2p stream did not open before the round's deadline") from None

    async def _open(self, peer_id: bytes) -> socket.socket:
        _, reader, writer = await self._p2p.call_binary_stream_handler(PeerID(peer_id), self.name)
        self.streams_opened += 1
        local, _ = await self._bridge(reader, writer)
        return local

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.streams_accepted += 1
        local, task = await self._bridge(reader, writer)
        self._plane.accept_socket(local, f"libp2p:{info.peer_id}")
        await asyncio.gather(task, return_exceptions=True)  # the daemon keeps the stream while we serve it

    async def _bridge(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        """-> (the blocking socket for the data plane, the copy task)."""
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        local_reader, local_writer = await asyncio.open_connection(sock=ours, limit=COPY_BYTES)
        task = asyncio.create_task(_copy_both_ways(reader, writer, local_reader, local_writer))
        self._bridges.add(task)
        task.add_done_callback(self._bridges.discard)
        return theirs, task


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        data = await reader.read(COPY_BYTES)
        if not data:
            return
        writer.write(data)
        await writer.drain()


async def _copy_both_ways(stream_reader, stream_writer, local_reader, local_writer) -> None:
    """Copy until either side ends, then close both (the protocol never half-closes a connection)."""
    tasks = [asyncio.create_task(_copy(stream_reader, local_writer)),
             asyncio.create_task(_copy(local_reader, stream_writer))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in (local_writer, stream_writer):
            with contextlib.suppress(Exception):
                writer.close()
        for writer in (local_writer, stream_writer):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)
