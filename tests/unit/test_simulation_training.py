"""The training level of the simulator (moshpeer.simulation.training) and `moshpeer simulate --level training`:
seeded, in-process, small swarms (the 1,000-peer figures come from benchmarks/bench_simulate.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from moshpeer.averaging.partition import bandwidth_part_sizes, reduce_allgather_seconds
from moshpeer.simulation.time_model import (CONNECTION_SETUP_RTTS, INITIAL_WINDOW_BYTES, WIRE_BYTES_PER_PAYLOAD_BYTE,
                                            slow_start_seconds)
from moshpeer.simulation.training import (
    MoshpitTraining,
    TrainingConfig,
    Workload,
    group_round_seconds,
    run_sync,
    run_training,
)

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(1)  # small tensors: threads only add contention

# A workload that converges in a few hundred steps (the scenario default is slower and 1,000 peers).
FAST = Workload(dim=32, lr=0.05, heterogeneity=0.3, noise=1.0, batch=32)


def _config(**overrides) -> TrainingConfig:
    base = dict(peers=32, group_size=16, rounds=40, inner_steps=5, workload=FAST, model_params=1_000_000,
                uplink=125e6, downlink=125e6, rtt_s=0.01)
    base.update(overrides)
    return TrainingConfig(**base)


def test_round_time_with_unlimited_downlinks_is_the_production_upload_bound_plus_round_trips():
    ups = [10e6, 20e6, 40e6, 5e6]
    sizes = bandwidth_part_sizes(1_000_000, ups)
    seconds, sent = group_round_seconds(1_000_000, sizes, ups, [1e15] * 4, rtt_s=0.0, bytes_per_value=4)
    assert seconds == pytest.approx(WIRE_BYTES_PER_PAYLOAD_BYTE * reduce_allgather_seconds(4e6, ups, sizes), rel=1e-9)
    # Every member uploads numel - s_i + (n - 1) s_i values.
    assert sent == [pytest.approx(4 * (1_000_000 + 2 * s)) for s in sizes]
    # A slow downlink is the limit when it is slower than what the uplinks allow.
    slow, _ = group_round_seconds(1_000_000, sizes, ups, [1e6] * 4, rtt_s=0.0, bytes_per_value=4)
    assert slow > seconds
    # Round trips: one per phase, the fresh connections' setup, and the slowest member's slow start.
    far, _ = group_round_seconds(1_000_000, sizes, ups, [1e15] * 4, rtt_s=0.05, bytes_per_value=4)
    assert far > seconds + (2 + CONNECTION_SETUP_RTTS) * 0.05


def test_slow_start_costs_round_trips_until_the_window_covers_the_path():
    assert slow_start_seconds(1e6, 4e6, 0.0) == 0.0
    assert slow_start_seconds(10_000, 4e6, 0.2) == 0.0  # fits the initial window: one flight, sent at once
    # 1 MB at 4 MB/s over 200 ms (an 800 KB path): windows of 14.5, 29, ..., 463 KB take 6 round trips for 912 KB,
    # which would have taken 0.23 s at the link's rate.
    sent = INITIAL_WINDOW_BYTES * (2 ** 6 - 1)
    assert slow_start_seconds(1e6, 4e6, 0.2) == pytest.approx(6 * 0.2 - sent / 4e6)
    # Past the ramp the connection runs at its rate: a longer transfer costs no more.
    assert slow_start_seconds(1e9, 4e6, 0.2) == pytest.approx(slow_start_seconds(1e6, 4e6, 0.2))
    # A wider path takes more doublings to fill.
    assert slow_start_seconds(1e9, 40e6, 0.2) > slow_start_seconds(1e9, 4e6, 0.2)


def test_a_larger_initial_window_shortens_rounds_far_apart_and_a_bad_one_is_refused():
    near, far, wide = (_config(peers=32, rounds=10, rtt_s=rtt, initial_window=window)
                       for rtt, window in ((0.0, 10), (0.2, 10), (0.2, 64)))
    seconds = [run_training(config, seed=1).sim_seconds for config in (near, far, wide)]
    assert seconds[0] < seconds[2] < seconds[1]
    with pytest.raises(ValueError, match="initial_window"):
        _config(initial_window=0).check()


def test_same_seed_same_run_and_seeds_differ():
    config = _config(peers=16, rounds=15, failure_rate_per_hour=20.0, rejoin_s=30.0)
    a, b = run_training(config, seed=3), run_training(config, seed=3)
    assert a.summary() == b.summary()
    assert a.failures > 0  # the failure process is on
    assert run_training(config, seed=4).final_loss != a.final_loss


def test_sync_goodput_falls_with_failure_rate():
    goodputs = []
    for rate in (0.0, 0.5, 5.0):  # failures per peer per hour, 64 peers
        config = _config(peers=64, failure_rate_per_hour=rate, rejoin_s=300.0)
        goodputs.append(run_sync(config, seed=1, seconds=2 * 3600).goodput)
    assert goodputs[0] > 0.8
    assert goodputs[0] > goodputs[1] > goodputs[2]
    assert goodputs[2] < 0.3


def test_moshpit_goodput_holds_where_sync_collapses():
    config = _config(peers=64, rounds=60, inner_steps=50, failure_rate_per_hour=5.0, rejoin_s=300.0)
    moshpit = run_training(config, seed=1)
    sync = run_sync(config, seed=1, seconds=moshpit.sim_seconds)
    assert moshpit.failures > 10 and sync.failures > 10
    assert moshpit.goodput > 0.8 > 0.3 > sync.goodput


def test_diloco_without_failures_matches_gradients_mode_loss():
    # One group of 16: every peer meets every other each round (larger swarms: see docs/simulation.md, DiLoCo's
    # per-peer outer state drifts apart). The same number of inner steps (60 x 5 = 300) on the convex problem;
    # both end near the optimum (loss floor 0.526); gradients mode keeps a little more SGD noise (0.546 vs 0.530).
    diloco = run_training(_config(peers=16, mode="diloco", rounds=60, inner_steps=5,
                                  outer_optimizer="nesterov:lr=0.7,momentum=0.9"), seed=2)
    gradients = run_training(_config(peers=16, mode="gradients", rounds=300), seed=2)
    assert diloco.initial_loss > 5 * diloco.final_loss  # both trained...
    assert gradients.initial_loss > 5 * gradients.final_loss
    assert diloco.final_loss == pytest.approx(gradients.final_loss, rel=0.05)  # ...to the same loss
    assert diloco.final_loss < 1.02 * diloco.loss_floor


def test_clipped_bounds_a_minus_100x_attacker_where_mean_does_not():
    ratios = {}
    for aggregation in ("mean", "clipped"):
        # The honest run: the same peers marked hostile, sending honestly (the loss is over the same honest peers).
        honest = run_training(_config(peers=20, group_size=10, mode="gradients", rounds=80, hostile_fraction=0.1,
                                      hostile_scale=1.0, aggregation=aggregation), seed=5).final_loss
        config = _config(peers=20, group_size=10, mode="gradients", rounds=80, hostile_fraction=0.1,
                         hostile_scale=-100.0, aggregation=aggregation)
        ratios[aggregation] = run_training(config, seed=5).final_loss / honest
    assert ratios["clipped"] < 1.05
    assert not ratios["mean"] < 2.0  # also true for inf / nan


def test_replayed_stale_work_drags_diloco_under_mean_and_clipped_bounds_it():
    """20% of the peers send, each round, the Δ they computed 20 of their rounds earlier (honestly computed, just
    stale: inside any plausible radius). Early Δs are the large ones, so the replay keeps pushing θ_outer back along
    an old direction: `mean` ends at 1.34x the honest run's loss, `clipped` at 1.08x (measured, seed 1). The same
    replay of stale gradients in gradients mode costs nothing measurable (0.99x): one old step among many."""
    base = dict(peers=40, group_size=10, mode="diloco", rounds=40, inner_steps=5, hostile_fraction=0.2)
    ratios = {}
    for aggregation in ("mean", "clipped"):
        honest = run_training(_config(**base, hostile_scale=1.0, aggregation=aggregation), seed=1).final_loss
        replayed = run_training(_config(**base, hostile_scale=1.0, hostile_replay=20, aggregation=aggregation), seed=1)
        ratios[aggregation] = replayed.final_loss / honest
    assert ratios["mean"] > 1.2 and ratios["clipped"] < 1.15, ratios


def test_sign_flipping_attackers_inside_the_clip_radius_become_suspects_of_the_production_tracker():
    """-1x from 10% of the peers: each owner's production SuspectTracker distrusts them (here both rules fire: on
    this convex problem a reversed gradient is also clipped often), no honest peer is distrusted at the end, and the
    loss stays near the honest run's: 1.046x, where the same run with every tracker's `distrusted` emptied ends at
    1.184x (and `mean` at 2.57x; session 21)."""
    base = dict(peers=20, group_size=10, mode="gradients", rounds=80, hostile_fraction=0.1, aggregation="clipped")
    honest = run_training(_config(**base, hostile_scale=1.0), seed=5).final_loss
    sim = MoshpitTraining(_config(**base, hostile_scale=-1.0), seed=5)
    result = sim.run()
    hostile = {str(int(k)) for k in np.flatnonzero(sim.swarm.hostile)}
    suspected = {peer for tracker in sim.suspects.values() for peer in tracker.suspects}
    assert hostile and suspected == hostile
    assert result.final_loss / honest < 1.1


def test_a_member_dying_in_a_round_stalls_its_group_until_the_deadline():
    config = _config(peers=16, rounds=30, inner_steps=50, failure_rate_per_hour=10.0, rejoin_s=60.0)
    sim = MoshpitTraining(config, seed=0)
    result = sim.run()
    assert result.failures > 0 and result.lost_s > 0
    if result.stalls:
        assert result.wait_s > 0
    assert math.isfinite(result.final_loss)


def test_bad_config_raises_value_error():
    for bad in (dict(mode="adam"), dict(aggregation="median"), dict(hostile_fraction=1.0), dict(uplink=0.0),
                dict(outer_optimizer="nesterov:lr=-1"), dict(hostile_replay=-1)):
        with pytest.raises(ValueError):
            _config(**bad).check()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "moshpeer", "simulate", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=env)


def test_cli_rejects_a_bad_training_knob_with_one_line_and_exit_2():
    result = _cli("--level", "training", "--failures-per-hour", "-1")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moshpeer simulate: error: ") and "--failures-per-hour" in lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize("argv,needle", [
    (["--level", "training", "--mode", "adam"], "mode"),
    (["--level", "training", "--aggregation", "median"], "aggregation"),
    (["--mode", "diloco"], "--level training"),
    (["--no-straggler-hold"], "--level training"),
    (["--level", "training", "--mode", "gradients", "--quorum", "0.5"], "quorum is a diloco setting"),
])
def test_cli_bad_values_in_process_are_one_line_and_exit_2(argv, needle, capsys):
    from moshpeer.cli.main import main

    assert main(["simulate", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and captured.out == ""


def test_cli_training_prints_a_table_and_a_json_line(capsys, tmp_path):
    from moshpeer.cli.main import main

    code = main(["simulate", "--level", "training", "--peers", "32", "--rounds", "5", "--inner-steps", "5",
                 "--dim", "16", "--sync", "--plot", str(tmp_path)])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["level"] == "training" and summary["peers"] == 32
    assert [r["system"] for r in summary["results"]] == ["moshpit-diloco", "sync"]
    assert any("goodput" in line for line in lines[:-1])
    assert (tmp_path / "loss-vs-time.png").stat().st_size > 0


def test_a_late_diloco_peer_catches_up_and_the_clocks_stay_together():
    # Speeds +-30%, without the straggler hold: some members are ready more than the window after their group formed.
    # Production DiLoCo takes the group's update from a member instead of stepping alone, so nobody falls further
    # and further behind, and carries its own Δ into its next round, so no compute is lost.
    config = _config(peers=48, rounds=30, inner_steps=20, speed_spread=0.3, matchmaking_window_s=30.0,
                     straggler_hold=False)
    sim = MoshpitTraining(config, seed=0)
    result = sim.run()
    assert result.catch_ups > 0 and result.lost_s == 0
    round_compute = config.inner_steps * FAST.batch / config.speed
    assert float(np.ptp(sim.clock)) < 4 * round_compute
    assert result.goodput < 0.9  # fast peers wait for slow ones: fixed H costs goodput with uneven speeds
