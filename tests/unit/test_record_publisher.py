"""`RecordPublisher` against a fake DHT node: one record, fresh timestamps, leaving on withdraw."""

from __future__ import annotations

import concurrent.futures
from typing import Any, List

import pytest

from moshpeer.dht import Identity
from moshpeer.peer.record_publisher import RecordPublisher, fresh_record

IDENTITY = Identity.generate()


class FakeDHT:
    """Stores what is published; `accept` says whether a node accepts it, `broken` makes the store raise."""

    def __init__(self) -> None:
        self.identity, self.owner_subkey, self.admission = IDENTITY, IDENTITY.owner_subkey, None
        self.stored: List[Any] = []
        self.accept, self.broken = True, False

    def get_visible_maddrs(self) -> List[str]:
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
