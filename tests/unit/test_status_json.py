"""`moshpeer status --json` prints every record field as JSON, binary ones (tags) as hex."""

from __future__ import annotations

import json

from moshpeer.cli.status import peer_as_json, status_as_json
from moshpeer.dht import PeerRecord
from moshpeer.peer.optimizer.witnesses import witness_tag

PEER = "Qm" + "abcdefgh" * 6


def test_witnessed_tags_and_the_member_tag_print_as_hex():
    record = PeerRecord(peer_id=PEER, role="trainer", version="t", protocol=4, started_at=0.0, updated_at=0.0,
                        witnessed=[witness_tag("Qm" + "x" * 44)], member_tag=b"\x01\x02")
    shown = peer_as_json(record, now=1.0)
    assert shown["witnessed"] == [witness_tag("Qm" + "x" * 44).hex()] and shown["member_tag"] == "0102"
    json.dumps(status_as_json("run", [record], now=1.0))  # the whole status, as printed
