"""`moshpeer demo --peers 2`: a short run through the real CLI writes the loss plot and the summary."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(240)


def test_demo_two_peers_writes_plot_and_summary(swarm, tmp_path):
    out = tmp_path / "demo"
    result = swarm.run("demo", "--peers", "2", "--run-id", "demo-test", "--max-seconds", "60", "--max-epochs", "6",
                       "--target-metric", "0.999", "--out", str(out), "--no-live", "--events",
                       str(tmp_path / "events.jsonl"), timeout=220)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    # One string, so that a failure shows all of it (pytest cuts the repr of a list): the terminal's lines, each
    # peer's epochs and errors, and the demo's stderr.
    seen = "\n".join(lines + [f"{e['peer']} {e['event']} {e.get('epoch')} {e.get('error')} {e.get('reason')}"
                               for e in events if e["event"] in ("epoch", "done", "state_loaded")]
                      + [result.stderr[-2000:]])
    final = json.loads(lines[-1])
    assert final["event"] == "demo_done" and final["stop_reason"] == "peers finished", seen
    # The terminal gets one short readable line per peer epoch; the whole records go to --events.
    epoch_lines = [line for line in lines[:-1] if " epoch " in line]
    assert len(epoch_lines) >= 12 and all(len(line) < 160 and not line.lstrip().startswith("{")
                                          for line in epoch_lines), seen
    assert {e["peer"] for e in events if e["event"] == "epoch"} == {"peer1", "peer2"}
    assert all("round" in e for e in events if e["event"] == "epoch")  # the whole record, round result included

    png = (out / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["peers"] == 2 and len(summary["per_peer"]) == 2
    for peer in summary["per_peer"]:
        assert peer["reason"] == "max_epochs" and peer["epochs"] == 6
        assert [h["epoch"] for h in peer["history"]] == list(range(1, 7))
        losses = [h["loss"] for h in peer["history"]]
        assert losses[-1] < losses[0], losses  # it trained
        assert peer["exit_code"] == 0
