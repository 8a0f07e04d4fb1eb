"""`moshpeer status --json` prints every record field as JSON, binary ones (tags) as hex; the table says which
trainers are back from an outage."""

from __future__ import annotations

import json

from rich.console import Console

from moshpeer.cli.status import build_table, peer_as_json, status_as_json
from moshpeer.dht import PeerRecord
from moshpeer.peer.optimizer.witnesses import witness_tag

PEER = "Qm" + "abcdefgh" * 6


def test_witnessed_tags_and_the_member_tag_print_as_hex():
    record = PeerRecord(peer_id=PEER, role="trainer", version="t", protocol=4, started_at=0.0, updated_at=0.0,
                        witnessed=[witness_tag("Qm" + "x" * 44)], member_tag=b"\x01\x02")
    shown = peer_as_json(record, now=1.0)
    assert shown["witnessed"] == [witness_tag("Qm" + "x" * 44).hex()] and shown["member_tag"] == "0102"
    json.dumps(status_as_json("run", [record], now=1.0))  # the whole status, as printed


def test_a_trainer_back_from_an_outage_shows_since_when_it_trained_apart():
    record = PeerRecord(peer_id=PEER, role="trainer", version="t", protocol=7, started_at=0.0, updated_at=0.0,
                        epoch=346, step=9, apart_since=22)
    assert peer_as_json(record, now=1.0)["apart_since"] == 22
    console = Console(width=200, record=True)
    console.print(build_table("run", [record], now=1.0))
    assert "346/9, apart since 22" in console.export_text()
    # ... and the swarm's epoch leaves it out, like every peer does (progress.py): none other counts here.
    assert status_as_json("run", [record], now=1.0)["swarm"]["global_epoch"] == 0
