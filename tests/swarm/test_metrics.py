"""`--metrics-port`: scrape the Prometheus endpoints of a real swarm; the metrics are there and move."""

from __future__ import annotations

import time
import urllib.request
from typing import Dict, Tuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarm import Proc
from training_swarm import start_trainers, wait_event

pytestmark = pytest.mark.timeout(240)

Samples = Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]


def scrape(proc: Proc) -> Samples:
    """Every sample of the process's endpoint: (name, sorted labels) -> value."""
    url = f"http://127.0.0.1:{proc.ready['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, metric: str, **labels: str) -> float:
    key = (metric, tuple(sorted(labels.items())))
    assert key in samples, f"{key} not scraped; have {sorted(k for k in samples if k[0].startswith(metric))}"
    return samples[key]


@pytest.mark.swarm
def test_scraped_metrics_cover_rounds_training_state_and_checkpoints(swarm, tmp_path):
    run = "metrics"
    boot = swarm.bootstrap(run, "--heartbeat", "1", "--metrics-port", "0")
    common = ("--group-size", "2", "--max-epochs", "400", "--eval-every", "1", "--metrics-port", "0")
    first, second = start_trainers(swarm, 2, run, boot.maddrs, *common, "--min-peers", "2")
    # One peer checkpoints (every 4 micro-batches) so that its checkpoint metrics move.
    (saver,) = start_trainers(swarm, 1, run, boot.maddrs, *common, "--checkpoint-dir", str(tmp_path / "ckpt"),
                              "--checkpoint-every-steps", "4")
    for peer in (first, second, saver):
        peer.wait_ready()
    wait_event(first, "epoch", timeout=120, predicate=lambda e: e["epoch"] >= 3 and e["ok"])
    before = scrape(first)
    # An epoch that surely ended after that scrape (events are read from the start of the output, and the
    # peer may be epochs ahead of the line above), averaged in a group (3 peers in groups of 2: one is alone).
    scraped_epoch = value(before, "moshpeer_epoch")
    epoch = wait_event(first, "epoch", timeout=120,
                       predicate=lambda e: e["epoch"] >= scraped_epoch + 2 and e["ok"] and e["group_size"] >= 2)
    after = scrape(first)

    for phase in ("matchmaking", "reduce_scatter", "all_gather", "total"):
        count = ("moshpeer_round_seconds_count", {"phase": phase})
        assert value(after, count[0], **count[1]) > value(before, count[0], **count[1]) > 0
        value(after, "moshpeer_round_seconds_bucket", phase=phase, le="+Inf")
    assert value(after, "moshpeer_rounds_total", outcome="averaged") > value(before, "moshpeer_rounds_total",
                                                                             outcome="averaged")
    for phase in ("reduce_scatter", "all_gather"):
        for name in ("moshpeer_sent_bytes_total", "moshpeer_received_bytes_total", "moshpeer_chunks_expected_total"):
            assert value(after, name, phase=phase) > value(before, name, phase=phase) > 0, name
        assert value(after, "moshpeer_chunks_lost_total", phase=phase) >= 0
    assert value(after, "moshpeer_epoch") >= epoch["epoch"] > value(before, "moshpeer_epoch")
    assert 1 <= value(after, "moshpeer_group_size") <= 3  # the latest round's (it may have been alone)
    assert value(after, "moshpeer_samples_total") > value(before, "moshpeer_samples_total")
    assert value(after, "moshpeer_samples_per_second") > 0
    assert value(after, "moshpeer_loss") > 0
    assert 0 < value(after, "moshpeer_metric", name="accuracy") <= 1
    for name in ("moshpeer_rejected_connections_total", "moshpeer_rejected_messages_total"):
        assert value(after, name) == 0
    assert value(after, "moshpeer_connections_kept_total") >= value(before, "moshpeer_connections_kept_total")
    assert value(after, "moshpeer_peer_info", run_id=run, peer_id=first.peer_id, role="trainer", command="join") == 1

    # Checkpoint writes of the saver.
    wait_event(saver, "checkpoint", timeout=120)
    wait_event(saver, "epoch", timeout=120, predicate=lambda e: e["epoch"] >= 4)
    # Checkpoints are written in the background and the metrics poll the store from the training loop: the
    # first periodic write shows up at the first poll after it finished (CI scraped before that once).
    deadline = time.monotonic() + 60
    saved = scrape(saver)
    while ("moshpeer_checkpoint_writes_total", (("kind", "periodic"),)) not in saved and time.monotonic() < deadline:
        time.sleep(0.5)
        saved = scrape(saver)
    assert value(saved, "moshpeer_checkpoint_writes_total", kind="periodic") >= 1
    assert value(saved, "moshpeer_checkpoint_bytes_total") > 0
    assert value(saved, "moshpeer_checkpoint_write_seconds_count") >= 1

    # A late joiner downloads the swarm's state.
    (late,) = start_trainers(swarm, 1, run, boot.maddrs, *common)
    late.wait_ready()
    loaded = wait_event(late, "state_loaded", timeout=120)
    wait_event(late, "epoch", timeout=120)
    joined = scrape(late)
    assert value(joined, "moshpeer_state_downloads_total", outcome="ok") == 1
    assert value(joined, "moshpeer_state_download_bytes_total") == loaded["bytes"]
    assert value(joined, "moshpeer_state_download_seconds_count") == 1

    # The bootstrap node serves its identity and process metrics.
    node = scrape(boot)
    assert value(node, "moshpeer_peer_info", run_id=run, peer_id=boot.peer_id, role="bootstrap", command="dht") == 1
    assert value(node, "process_cpu_seconds_total") > 0


def test_the_grafana_dashboard_only_queries_metrics_that_exist():
    import json
    import re
    from pathlib import Path

    from moshpeer.peer.runtime.metrics import PeerMetrics

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana" / "moshpeer.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\b(?:moshpeer|process)_[a-z_]+", target["expr"])}
    exposed = {family.name for family in PeerMetrics().registry.collect()}
    suffixes = re.compile(r"_(total|bucket|count|sum)$")
    missing = sorted(name for name in queried if suffixes.sub("", name) not in exposed and name not in exposed)
    assert not missing, missing
    assert {"moshpeer_round_seconds_bucket", "moshpeer_sent_bytes_total", "moshpeer_chunks_lost_total"} <= queried
