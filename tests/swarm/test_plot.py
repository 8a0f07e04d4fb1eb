"""`join --events FILE` and `moshpeer plot`: a real short run, plotted."""

from __future__ import annotations

import json

import pytest

from training_swarm import start_trainers

pytestmark = pytest.mark.timeout(240)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.swarm
def test_events_of_a_real_run_plot_to_three_pngs(swarm, tmp_path):
    run = "plotted"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    files = [tmp_path / f"peer{k}.jsonl" for k in range(2)]
    peers = [start_trainers(swarm, 1, run, boot.maddrs, "--group-size", "2", "--min-peers", "2",
                            "--max-epochs", "6", "--eval-every", "2", "--events", str(path))[0] for path in files]
    for peer in peers:
        assert peer.wait_exit(180) == 0, peer.describe(40)

    for peer, path in zip(peers, files):
        printed = [json.loads(line) for line in peer.stdout_lines
                   if line.startswith("{") and json.loads(line)["event"] != "ready"]
        written = [json.loads(line) for line in path.read_text().splitlines()]
        assert written == printed  # the file holds exactly the event lines the peer printed
        assert [e["epoch"] for e in written if e["event"] == "epoch"][-1] == 6

    out = tmp_path / "plots"
    result = swarm.run("plot", *map(str, files), "--out", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    names = sorted(line.rsplit("/", 1)[-1] for line in result.stdout.splitlines())
    assert names == ["loss.png", "metric.png", "rounds.png"]
    for name in names:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 20_000, name  # a drawn figure, not an empty canvas


def test_plot_of_a_file_without_epochs_is_one_line(swarm, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"event": "ready"}\nnot json\n')
    result = swarm.run("plot", str(empty), "--out", str(tmp_path / "plots"), timeout=60)
    assert result.returncode == 2
    assert result.stderr_lines == [f"moshpeer plot: error: {empty} holds no epoch lines (expected the output of "
                                   "'moshpeer join' or its --events file)"]
