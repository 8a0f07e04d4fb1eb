"""Connections kept between all-reduces (kept_links.py): the rebind handshake, the sender's pool, and real all-reduces
on in-process data planes that rebind their connections, or open new ones when a kept one is gone."""

from __future__ import annotations

import gc
import os
import socket
import threading
import time
import weakref
from types import SimpleNamespace

import pytest
import torch
from local_group import credentials, identities, members as group_members
from waiting import holds_within

from moshpeer.averaging import DataPlane, GroupAllReduce, dataplane, handshake, kept_links, wire
from moshpeer.averaging.handshake import FrameAuth, PeerRefused
from moshpeer.averaging.kept_links import KeptLinks
from moshpeer.averaging.member_connector import OutboundLink
from moshpeer.compression import get_compression
from moshpeer.errors import ProtocolError

pytestmark = pytest.mark.timeout(60)

SECRET = b"s" * 32


def session(tag: bytes, index: int, peers, me: int = 0) -> SimpleNamespace:
    """What `handshake.accept` / `accept_rebind` need of a round: identity `me` as member `index` of a group whose
    members are `peers`."""
    creds = handshake.RoundCredentials.create(identities(me + 1)[me], wire.tag_group(tag), index)
    return SimpleNamespace(credentials=creds, group_size=len(peers), secret=SECRET, peer_id_of=lambda i: peers[i])


def connected_pair(tag: bytes):
    """A fresh authenticated connection, member 1 -> member 0: (sender socket, its MACs, receiver socket, its MACs)."""
    a, b = socket.socketpair()
    peers = [ident.peer_id_bytes for ident in identities(2)]
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("accepted", handshake.accept(
        b, time.monotonic() + 10, lambda t: session(tag, 0, peers))))
    thread.start()
    sender_auth = handshake.connect(a, time.monotonic() + 10, credentials=credentials(tag, 1), tag=tag, receiver=0,
                                    receiver_peer=peers[0], group_secret=SECRET)
    thread.join(10)
    return a, sender_auth, b, box["accepted"][2]


def rebind_in_thread(b: socket.socket, auth: FrameAuth, new_session) -> dict:
    box = {}

    def run():
        try:
            box["accepted"] = handshake.accept_rebind(b, auth, time.monotonic() + 10, lambda t: new_session)
        except (ProtocolError, OSError) as e:
            box["error"] = e
            b.close()

    box["thread"] = threading.Thread(target=run)
    box["thread"].start()
    return box


def test_a_kept_connection_is_rebound_to_another_round_with_a_new_key():
    a, sender_auth, b, receiver_auth = connected_pair(os.urandom(8))
    assert sender_auth.peer == identities(1)[0].peer_id_bytes and receiver_auth.peer == identities(2)[1].peer_id_bytes
    new_tag = os.urandom(8)
    peers = [identities(2)[1].peer_id_bytes, identities(2)[0].peer_id_bytes]  # the next round swapped the indices
    box = rebind_in_thread(b, receiver_auth, session(new_tag, 1, peers))
    new_sender = handshake.rebind(a, sender_auth, time.monotonic() + 10, tag=new_tag, sender=0, receiver=1,
                                  sender_peer=peers[0], group_secret=SECRET)
    box["thread"].join(10)
    _, sender_index, new_receiver = box["accepted"]
    assert sender_index == 0 and new_receiver.key == new_sender.key != sender_auth.key
    handshake.send_frame(a, new_sender, b"header", b"payload")  # frames start over under the new key
    frame = wire.recv_exactly_by(b, 6 + 7 + handshake.MAC_BYTES, time.monotonic() + 10)
    new_receiver.check(frame[:6], frame[6:13], frame[13:])


def test_a_rebind_to_a_round_where_that_index_is_another_peer_is_refused():
    a, sender_auth, b, receiver_auth = connected_pair(os.urandom(8))
    new_tag = os.urandom(8)
    peers = [identities(3)[2].peer_id_bytes, identities(1)[0].peer_id_bytes]  # member 0 is someone else now
    box = rebind_in_thread(b, receiver_auth, session(new_tag, 1, peers))
    with pytest.raises(PeerRefused):
        handshake.rebind(a, sender_auth, time.monotonic() + 10, tag=new_tag, sender=0, receiver=1,
                         sender_peer=identities(2)[1].peer_id_bytes, group_secret=SECRET)
    box["thread"].join(10)
    assert "not member 0" in str(box["error"])


def test_a_rebind_without_the_old_connections_key_is_refused():
    a, _, b, receiver_auth = connected_pair(os.urandom(8))
    new_tag = os.urandom(8)
    box = rebind_in_thread(b, receiver_auth, session(new_tag, 0, [p.peer_id_bytes for p in identities(2)]))
    with pytest.raises(PeerRefused):
        handshake.rebind(a, FrameAuth(b"k" * 32), time.monotonic() + 10, tag=new_tag, sender=1, receiver=0,
                         sender_peer=identities(2)[1].peer_id_bytes, group_secret=SECRET)
    box["thread"].join(10)
    assert "MAC mismatch" in str(box["error"])


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def idle_link() -> OutboundLink:
    a, b = socket.socketpair()
    link = OutboundLink(a, FrameAuth(b"k" * 32))
    link.other_end = b  # kept open: the link is alive
    return link


def test_the_pool_hands_a_link_back_once_and_not_after_it_was_kept_too_long():
    clock = FakeClock()
    pool = KeptLinks(keep_s=60, clock=clock)
    first, second = idle_link(), idle_link()
    pool.put(b"peer", ("h", 1), first)
    assert pool.take(b"peer", ("h", 2)) is None  # another address
    assert pool.take(b"peer", ("h", 1)) is first and pool.take(b"peer", ("h", 1)) is None
    pool.put(b"peer", ("h", 1), second)
    clock.now = 61
    assert pool.take(b"peer", ("h", 1)) is None and second.sock.fileno() == -1  # closed


def test_the_pool_closes_a_link_whose_receiver_hung_up_and_the_least_recently_kept_past_its_cap():
    pool = KeptLinks(max_kept=2)
    links = [idle_link() for _ in range(3)]
    for k, link in enumerate(links):
        pool.put(b"peer%d" % k, ("h", 1), link)
    assert len(pool) == 2 and links[0].sock.fileno() == -1
    links[1].other_end.close()
    assert pool.take(b"peer1", ("h", 1)) is None and links[1].sock.fileno() == -1
    pool.close()
    assert links[2].sock.fileno() == -1 and len(pool) == 0


def run_allreduce(planes, pools, tensors, order, sessions=None):
    """One all-reduce of `tensors` (in place) by members on `planes`, the group listed in `order` (plane indices);
    `sessions` (a list) gets a weak reference to each member's `GroupAllReduce`."""
    group = group_members([planes[k].address for k in order])
    group = [m.__class__(m.host, m.port, m.weight, identities(len(planes))[k].peer_id_bytes)
             for m, k in zip(group, order)]
    tag = wire.allreduce_tag(os.urandom(20), 0)
    results = [None] * len(order)

    def member(index: int) -> None:
        k = order[index]
        creds = handshake.RoundCredentials.create(identities(len(planes))[k], wire.tag_group(tag), index)
        allreduce = GroupAllReduce(
            planes[k], tensors[k], members=group, my_index=index, tag=tag, secret=SECRET, credentials=creds,
            compression=get_compression("none"), chunk_numel=64, deadline=time.monotonic() + 20, kept=pools[k])
        if sessions is not None:
            sessions.append(weakref.ref(allreduce))
        results[index] = allreduce.run()

    threads = [threading.Thread(target=member, args=(index,)) for index in range(len(order))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


@pytest.fixture
def three_peers():
    planes, pools = [DataPlane() for _ in range(3)], [KeptLinks() for _ in range(3)]
    yield planes, pools
    for pool, plane in zip(pools, planes):
        pool.close()
        plane.close()


def test_the_next_allreduce_with_the_same_peers_rebinds_every_connection(three_peers):
    planes, pools = three_peers
    torch.manual_seed(0)
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):  # new indices each round: the rebind names them
        tensors = [torch.randn(1000) for _ in range(3)]
        mean = torch.stack(tensors).mean(0)
        results = run_allreduce(planes, pools, tensors, order)
        for t in tensors:
            torch.testing.assert_close(t, mean)
        assert [r.connections_kept for r in results] == ([0, 0, 0] if order == [0, 1, 2] else [2, 2, 2])
        assert all(r.chunks_lost == 0 and r.rejected_connections == 0 for r in results)
        assert [len(pool) for pool in pools] == [2, 2, 2]
        # the receivers' threads keep theirs once they have read the end markers
        assert holds_within(lambda: [plane.kept_connections for plane in planes] == [2, 2, 2], 10.0)


def test_a_kept_connection_its_receiver_closed_meanwhile_is_replaced_by_a_new_one(three_peers, monkeypatch):
    planes, pools = three_peers
    monkeypatch.setattr(dataplane, "KEEP_INBOUND_S", 0.2)  # receivers give kept connections up at once
    run_allreduce(planes, pools, [torch.randn(1000) for _ in range(3)], [0, 1, 2])
    # each receiver's thread closes them on its own
    assert holds_within(lambda: not any(plane.kept_connections for plane in planes), 10.0), \
        "the receivers kept their connections past KEEP_INBOUND_S"
    monkeypatch.setattr(kept_links, "peer_closed", lambda sock: False)  # as if the close crossed our rebind
    tensors = [torch.randn(1000) for _ in range(3)]
    mean = torch.stack(tensors).mean(0)
    results = run_allreduce(planes, pools, tensors, [0, 1, 2])
    for t in tensors:
        torch.testing.assert_close(t, mean)
    assert [r.connections_kept for r in results] == [0, 0, 0]
    assert all(r.chunks_lost == 0 and not r.absent for r in results)


def test_a_kept_connection_holds_nothing_of_its_last_round(three_peers):
    planes, pools = three_peers
    sessions = []
    run_allreduce(planes, pools, [torch.randn(1000) for _ in range(3)], [0, 1, 2], sessions)
    assert [len(pool) for pool in pools] == [2, 2, 2]  # every connection kept...
    gc.collect()
    assert [session() for session in sessions] == [None, None, None]  # ...and no round's buffers or tensors with it
