"""`RecordPublisher` against a fake DHT node: one record, fresh timestamps, leaving on withdraw."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, List

import pytest

from moshpeer.dht import Identity
from moshpeer.peer.record_publisher import ADDRESS_CHECK_S, RecordPublisher, fresh_record

IDENTITY = Identity.generate()


class FakeDHT:
    """Stores what is published; `accept` says whether a node accepts it, `broken` makes the store raise."""

    def __init__(self) -> None:
        self.identity, self.owner_subkey, self.admission = IDENTITY, IDENTITY.owner_subkey, None
        self.stored: List[Any] = []
        self.accept, self.broken = True, False

    def get_visible_maddrs(self, latest: bool = False) -> List[str]:
        return [f"/ip4/127.0.0.1/tcp/{4000 + i}/p2p/{IDENTITY.peer_id}" for i in range(20)]

    def store(self, key, value, expiration_time, subkey=None, return_future=False):
        if self.broken:
            raise RuntimeError("DHT process died")
        self.stored.append(value)
        future = concurrent.futures.Future()
        future.set_result(self.accept)
        return future


def test_updates_are_published_with_a_fresh_timestamp_and_withdraw_marks_leaving():
    dht = FakeDHT()
    publisher = RecordPublisher(dht, "run", fresh_record(dht, "trainer"), expiration=15.0)
    assert len(publisher.record.addresses) <= 16  # capped: a record stays small
    first = publisher.record.updated_at
    publisher.update(epoch=3)
    assert dht.stored == []  # update alone publishes nothing
    assert publisher.publish(timeout=1.0) is True and publisher.record.epoch == 3
    assert publisher.record.updated_at >= first and len(dht.stored) == 1
    assert publisher.withdraw(timeout=1.0) is True and len(dht.stored) == 2
    assert publisher.record.leaving is False  # the local record stays; the DHT gets a leaving copy


def test_a_refused_or_failing_publication_is_reported_or_logged():
    dht = FakeDHT()
    publisher = RecordPublisher(dht, "run", fresh_record(dht, "aux"), expiration=15.0)
    dht.accept = False
    assert publisher.publish(timeout=1.0) is False
    dht.broken = True
    with pytest.raises(RuntimeError):
        publisher.publish(timeout=1.0)
    publisher.update_and_publish(epoch=1)  # best effort: logged, not raised
    assert publisher.record.epoch == 1
    with pytest.raises(ValueError):
        publisher.update(epoch=-1)  # the schema refuses it


def test_a_changed_address_goes_into_the_record_at_the_next_check():
    """A roaming laptop: the record said where the peer started (`moshpeer status`, and the contacts that peers cut
    off from the swarm dial). The DHT's visible addresses are read again every ADDRESS_CHECK_S."""
    dht = FakeDHT()
    publisher = RecordPublisher(dht, "run", fresh_record(dht, "trainer"), expiration=15.0)
    start = time.monotonic()
    assert publisher.refresh_addresses(now=start + 1.0) is False  # not due: the record was just made
    moved = [f"/ip4/10.0.0.7/tcp/4000/p2p/{IDENTITY.peer_id}"]
    dht.get_visible_maddrs = lambda latest=False: moved
    assert publisher.refresh_addresses(now=start + ADDRESS_CHECK_S + 1.0) is True
    assert publisher.record.addresses == moved and dht.stored == []  # published with the next beat
    assert publisher.refresh_addresses(now=start + ADDRESS_CHECK_S + 2.0) is False  # asked again only later
    assert publisher.refresh_addresses(now=start + 2 * ADDRESS_CHECK_S + 2.0) is False  # unchanged


def test_a_dht_that_cannot_say_its_addresses_leaves_the_record_as_it_was():
    dht = FakeDHT()
    publisher = RecordPublisher(dht, "run", fresh_record(dht, "trainer"), expiration=15.0)
    before = publisher.record.addresses

    def gone(latest=False):
        raise RuntimeError("DHT process died")

    dht.get_visible_maddrs = gone
    assert publisher.refresh_addresses(now=time.monotonic() + ADDRESS_CHECK_S + 1.0) is False
    assert publisher.record.addresses == before
