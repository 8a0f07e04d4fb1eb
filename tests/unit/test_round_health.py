"""Round health in the peer record (issue 22): the share of a peer's connections to group members that went over
the relay, computed from its recent rounds' reports, bounded in the record's schema, and shown as the path."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from moshpeer.averaging.report import DataPlaneStats, RoundResult
from moshpeer.cli.status import _describe_path
from moshpeer.dht.records import RoundHealth
from moshpeer.peer.optimizer.rounds import CollaborativeRound
from moshpeer.peer.runtime.health import round_health


def _round(group_size: int, relayed=(), ok: bool = True) -> CollaborativeRound:
    result = RoundResult(ok=ok, group_size=group_size, data=DataPlaneStats(relayed=list(relayed)))
    return CollaborativeRound(epoch=0, samples=1, result=result)


class _Record:
    def __init__(self, health):
        self.round_health = None if health is None else RoundHealth(**health)


def test_the_relayed_share_counts_connections_to_members_over_averaged_rounds():
    # Groups of 3 and 4 (2 + 3 connections), one member relayed in each; a round alone does not count.
    health = round_health([_round(3, [2]), _round(4, [1]), _round(1, ok=False)])
    assert health["rounds"] == 3 and health["averaged"] == 2
    assert health["relayed_fraction"] == pytest.approx(2 / 5)
    assert _describe_path(_Record(health)) == "40% relayed"
    direct = round_health([_round(3), _round(2)])
    assert direct["relayed_fraction"] == 0.0 and _describe_path(_Record(direct)) == "direct"
    assert _describe_path(_Record(round_health([_round(1, ok=False)]))) == "-"  # never averaged: no path
    assert _describe_path(_Record(None)) == "-"


def test_a_record_claiming_more_than_every_connection_relayed_is_refused():
    with pytest.raises(ValidationError):
        RoundHealth(rounds=1, averaged=1, lost_fraction=0.0, seconds=1.0, relayed_fraction=1.5)
    old = RoundHealth(rounds=1, averaged=1, lost_fraction=0.0, seconds=1.0)  # a record without the field
    assert old.relayed_fraction == 0.0
