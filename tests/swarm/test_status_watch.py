"""`moshpeer status --watch`: a live view of a training swarm that refreshes, and leaves cleanly on Ctrl-C."""

from __future__ import annotations

import json
import signal

import pytest

from training_swarm import start_trainers, wait_event

pytestmark = [pytest.mark.timeout(240), pytest.mark.swarm]


def test_watch_refreshes_with_epochs_throughput_and_round_health_then_ctrl_c_exits_cleanly(swarm):
    run = "watched"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    trainers = start_trainers(swarm, 2, run, boot.maddrs, "--group-size", "2", "--min-peers", "2",
                              "--max-epochs", "400", "--eval-every", "50")
    for trainer in trainers:
        wait_event(trainer, "epoch", timeout=120, predicate=lambda e: e["epoch"] >= 2)

    watched = swarm.run("status", "--initial-peers", *boot.maddrs, "--run-id", run, "--watch", "--json",
                        "--interval", "3", "--count", "3", timeout=120)
    assert watched.returncode == 0, watched.stderr
    views = [json.loads(line) for line in watched.stdout.splitlines()]
    assert len(views) == 3  # one line per refresh, then it stops by itself
    first, last = views[0], views[-1]
    assert last["time"] > first["time"]
    assert last["swarm"]["global_epoch"] >= first["swarm"]["global_epoch"] >= 2

    def progress(view):  # what the trainers said about their training, which moves with every micro-batch
        return sorted((p["peer_id"], p["epoch"], p["step"], p["samples_accumulated"])
                      for p in view["peers"] if p["role"] == "trainer")

    assert progress(last) != progress(first)  # the view moves
    for view in views:
        swarm_now = view["swarm"]
        assert swarm_now["num_trainers"] == 2 and swarm_now["target_batch_size"] == 256
        trainers_now = [p for p in view["peers"] if p["role"] == "trainer"]
        throughput = sum(p["samples_per_second"] for p in trainers_now)
        assert swarm_now["samples_per_second"] == pytest.approx(throughput, abs=0.01)
        assert swarm_now["eta_s"] is None or swarm_now["eta_s"] >= 0
        for peer in trainers_now:
            health = peer["round_health"]
            assert 1 <= health["rounds"] <= 20 and 0 <= health["averaged"] <= health["rounds"]
            assert 0.0 <= health["lost_fraction"] <= 1.0 and health["seconds"] >= 0.0
            assert health["relayed_fraction"] == 0.0  # loopback: every member reached directly
    assert any(p["round_health"]["averaged"] > 0 for p in last["peers"] if p["role"] == "trainer")

    # The table view, until Ctrl-C: it exits 0 at once, without a traceback (conftest checks stderr).
    live = swarm.spawn("status", "--initial-peers", *boot.maddrs, "--run-id", run, "--watch", "--interval", "0.5")
    live.wait_for_line(lambda line: "recent rounds" in line, timeout=60)
    # A trainer's round health, and the path its chunks took (loopback: direct TCP to every member).
    live.wait_for_line(lambda line: "ok," in line and "% lost" in line and "direct" in line, timeout=30)
    live.send_signal(signal.SIGINT)
    assert live.wait_exit(15) == 0, live.describe()
    assert "swarm epoch" in live.stdout and "samples/s" in live.stdout
