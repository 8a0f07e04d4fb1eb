"""Two machines with one identity (moshpeer/dht/twins.py): which record is a twin's, when to look, who stops."""

from __future__ import annotations

import logging

import pytest

from moshpeer.dht.identity import Identity
from moshpeer.dht.records import PeerRecord
from moshpeer.dht.twins import TwinWatch, find_twin

ME = Identity.generate().peer_id
OTHER = Identity.generate().peer_id


def record(peer_id: str = ME, *, started_at: float, updated_at: float, port: int = 4000, **fields) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, role="trainer", addresses=[f"/ip4/10.0.0.{port % 250}/tcp/{port}/p2p/{peer_id}"],
                      version="0.1.0", protocol=1, started_at=started_at, updated_at=updated_at, **fields)


OWN = record(started_at=1000.0, updated_at=1010.0)


def test_only_another_live_machine_under_this_id_is_a_twin():
    assert find_twin([OWN], OWN) is None, "this peer's own record"
    assert find_twin([record(OTHER, started_at=900.0, updated_at=1011.0)], OWN) is None, "another peer"
    # This machine's previous run (same key, another start) last published before this run started: it is gone.
    assert find_twin([record(started_at=500.0, updated_at=999.0)], OWN) is None
    assert find_twin([record(started_at=500.0, updated_at=1005.0, leaving=True)], OWN) is None, "a twin that left"
    older = record(started_at=990.0, updated_at=1008.0, port=5000)
    newer = record(started_at=1004.0, updated_at=1009.0, port=5000)
    assert find_twin([record(OTHER, started_at=1.0, updated_at=1009.0), older], OWN) is older
    assert find_twin([newer], OWN) is newer


def test_the_checks_come_at_every_heartbeat_early_then_every_few():
    watch = TwinWatch(heartbeat_s=2.0, first=2, eager_s=10.0, every=3)
    assert [beat for beat in range(1, 15) if watch.due()] == [2, 3, 4, 5, 8, 11, 14]


def test_the_newer_twin_stops_with_one_clear_error_and_the_older_warns_once(caplog):
    older = record(started_at=990.0, updated_at=1008.0, port=5000)
    error = TwinWatch(heartbeat_s=5.0).check([older], OWN)
    assert error is not None and error.exit_code == 2
    message = str(error)
    assert ME in message and "/ip4/10.0.0.0/tcp/5000" in message and "started 10.0 s before this one" in message
    assert "own --identity file" in message and "\n" not in message

    newer = record(started_at=1004.0, updated_at=1009.0, port=5000)
    watch = TwinWatch(heartbeat_s=5.0)
    with caplog.at_level(logging.WARNING, logger="moshpeer.dht.twins"):
        assert watch.check([newer], OWN) is None, "the older one goes on"
        assert watch.check([newer.updated(updated_at=1014.0)], OWN) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "started 4.0 s after this one" in warnings[0] and "newer one stops" in warnings[0]


@pytest.mark.parametrize("others", [[], [record(OTHER, started_at=0.0, updated_at=1009.0)]])
def test_no_twin_no_verdict(others):
    assert TwinWatch(heartbeat_s=5.0).check(others + [OWN], OWN) is None

