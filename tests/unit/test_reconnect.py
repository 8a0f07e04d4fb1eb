"""After an outage (moshpeer/dht/reconnect.py): when a node without neighbours asks its contacts again, what it
logs, and which peers of a listing become contacts."""

from __future__ import annotations

import concurrent.futures
import functools
import logging

from moshpeer.dht.identity import Identity
from moshpeer.dht.reconnect import Reconnector, SwarmReconnection, recent_contacts
from moshpeer.dht.records import PeerRecord


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_node_with_neighbours_never_retries():
    reconnector = Reconnector(retry_s=10, clock=FakeClock())
    assert not any(reconnector.observe(neighbours, contacts=3) for neighbours in (5, 1, 7, None))
    assert not reconnector.cut_off


def test_cut_off_it_tries_at_once_then_ever_more_rarely_and_says_so_once_each_way(caplog):
    clock = FakeClock()
    reconnector = Reconnector(retry_s=10, max_retry_s=30, clock=clock)
    with caplog.at_level(logging.INFO, logger="moshpeer.dht.reconnect"):
        assert reconnector.observe(0, contacts=3), "the first beat without neighbours tries"
        assert not reconnector.observe(0, contacts=3), "rejoin found nobody: not again before retry_s"
        clock.now += 5
        assert not reconnector.observe(0, contacts=3)
        assert reconnector.observe(None, contacts=3) is False, "unknown size: no verdict"
        clock.now += 5
        assert reconnector.observe(0, contacts=3)
        tries = []
        for _ in range(100):  # then 20 s, and 30 s (the cap) after each
            clock.now += 1
            if reconnector.observe(0, contacts=3):
                tries.append(clock.now)
        assert tries == [130.0, 160.0, 190.0]
        assert reconnector.cut_off
        clock.now += 2
        assert not reconnector.observe(4, contacts=3)
    assert not reconnector.cut_off
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2
    assert "no DHT neighbours left" in messages[0] and "asking 3 contacts again, every 10 s at first" in messages[0]
    assert "back in the swarm after 112 s cut off (4 DHT neighbours)" in messages[1]


def test_the_first_peer_of_a_swarm_alone_has_nobody_to_ask(caplog):
    with caplog.at_level(logging.INFO, logger="moshpeer.dht.reconnect"):
        assert not Reconnector(clock=FakeClock()).observe(0, contacts=0)
    assert caplog.records == []


def record(identity: Identity, updated_at: float, addresses, **fields) -> PeerRecord:
    return PeerRecord(peer_id=identity.peer_id, role="trainer", addresses=addresses, version="0.1.0", protocol=1,
                      started_at=0.0, updated_at=updated_at, **fields)


def test_contacts_are_other_live_peers_most_recently_seen_first_with_their_peer_ids():
    me, old, fresh, left = (Identity.generate() for _ in range(4))
    records = [
        record(me, 50.0, [f"/ip4/10.0.0.1/tcp/1/p2p/{me.peer_id}"]),
        record(old, 10.0, ["/ip4/10.0.0.2/tcp/2", "/ip4/10.0.0.2/tcp/3", "/ip4/10.0.0.2/tcp/4"]),
        record(fresh, 40.0, [f"/ip4/10.0.0.3/tcp/5/p2p/{fresh.peer_id}"]),
        record(left, 45.0, ["/ip4/10.0.0.4/tcp/6"], leaving=True),
    ]
    assert recent_contacts(records, me.peer_id) == [
        f"/ip4/10.0.0.3/tcp/5/p2p/{fresh.peer_id}",
        f"/ip4/10.0.0.2/tcp/2/p2p/{old.peer_id}", f"/ip4/10.0.0.2/tcp/3/p2p/{old.peer_id}",  # two per peer
    ]
    assert recent_contacts(records, me.peer_id, limit=1) == [f"/ip4/10.0.0.3/tcp/5/p2p/{fresh.peer_id}"]


class FakeDHT:
    """Answers `run_coroutine` as the DHT process would: the neighbour count, or a rejoin's (recording its contacts)."""

    def __init__(self, initial_peers, neighbours: int, after_rejoin: int):
        self.initial_peers, self.neighbours, self.after_rejoin = initial_peers, neighbours, after_rejoin
        self.rejoined_with = []

    def run_coroutine(self, coroutine, return_future: bool = False):
        future = concurrent.futures.Future()
        if isinstance(coroutine, functools.partial):  # rejoin
            self.rejoined_with.append(coroutine.keywords["contacts"])
            self.neighbours = self.after_rejoin
        future.set_result(self.neighbours)
        return future


def test_a_node_cut_off_asks_its_initial_peers_and_the_peers_it_listed_last():
    me, other = Identity.generate(), Identity.generate()
    initial = f"/ip4/10.0.0.9/tcp/9/p2p/{Identity.generate().peer_id}"
    clock = FakeClock()
    dht = FakeDHT([initial], neighbours=3, after_rejoin=2)
    reconnection = SwarmReconnection(dht, min_interval_s=5, clock=clock)
    reconnection.note_listing([record(me, 1.0, []), record(other, 2.0, ["/ip4/10.0.0.2/tcp/2"])], me.peer_id)
    reconnection.check()
    assert dht.rejoined_with == []
    dht.neighbours = 0  # the outage
    reconnection.note_listing([record(me, 3.0, [])], me.peer_id)  # listed while cut off: only itself
    clock.now += 1
    reconnection.check()
    assert dht.rejoined_with == [], "checked at most once per min_interval_s"
    clock.now += 5
    reconnection.check()
    assert dht.rejoined_with == [[initial, f"/ip4/10.0.0.2/tcp/2/p2p/{other.peer_id}"]]
    assert not reconnection.cut_off, "back: the rejoin found 2 neighbours"
