"""The averaging-level simulator (moshpeer.simulation) and `moshpeer simulate`: seeded, in-process, fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from moshpeer.averaging import grid
from moshpeer.simulation import AveragingConfig, AveragingSimulation, run_cell

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("g,m", [(2, 3), (4, 3), (8, 2)])
def test_full_grid_reaches_exact_mean_in_m_rounds(g, m):
    n = g ** m
    config = AveragingConfig(peers=n, dim=3, group_size=g, min_group_size=g, key_bits=(m - 1) * grid.bits_per_axis(g),
                             initial_keys="balanced", rounds=m)
    sim = AveragingSimulation(config, seed=5)
    errors = [sim.error()] + [sim.step().error for _ in range(m)]
    assert errors[m - 1] > 1e-6  # not before round M...
    assert errors[m] < 1e-28  # ...exact (to float64) after M rounds
    assert np.allclose(sim.values, sim.exact_mean, rtol=0, atol=1e-13)


def test_full_fixed_grid_topology_is_exact_too():
    config = AveragingConfig(peers=64, group_size=4, grid_dims=3, topology="grid", rounds=3)
    traj = AveragingSimulation(config, seed=1).run()
    assert traj.error[2] > 1e-6 and traj.error[3] < 1e-28


def test_error_never_grows_without_loss():
    for topology in ("keys", "grid"):
        config = AveragingConfig(peers=300, dim=4, group_size=8, topology=topology, grid_dims=3, failure_rate=0.1,
                                 rounds=15)
        err = AveragingSimulation(config, seed=3).run().error
        # Averaging within groups can only lower the sum of squared distances to the (kept) mean.
        assert all(b <= a * (1 + 1e-9) + 1e-30 for a, b in zip(err, err[1:])), err
        assert err[-1] < 1e-4 * err[0]


def test_failures_slow_convergence():
    base = AveragingConfig(peers=256, group_size=8, rounds=60)
    clean = run_cell(base, restarts=5, seed=0, eps=(1e-9,))
    faulty = run_cell(AveragingConfig(peers=256, group_size=8, rounds=60, failure_rate=0.3), restarts=5, seed=0,
                      eps=(1e-9,))
    assert faulty.mean(1e-9) > clean.mean(1e-9) + 1


def test_allreduce_baseline_replays_the_notebook():
    """With the notebook's RNG streams, seeds 0..9 give the notebook's own all-reduce cells (41.7 and 50.0)."""
    cell = run_cell(AveragingConfig(peers=512, topology="allreduce", failure_rate=0.01, rng_streams="notebook"),
                    restarts=10, seed=0, eps=(1e-9,))
    assert cell.rounds_to[1e-9] == [50, 50, 26, 50, 50, 40, 50, 50, 50, 1]
    assert cell.mean(1e-9) == pytest.approx(41.7)
    no_failures = run_cell(AveragingConfig(peers=512, topology="allreduce"), restarts=3, eps=(1e-9,))
    assert no_failures.rounds_to[1e-9] == [1, 1, 1]


def test_small_cell_is_stable_for_a_fixed_seed():
    config = AveragingConfig(peers=64, group_size=8, failure_rate=0.05, rounds=30)
    first = run_cell(config, restarts=3, seed=7)
    again = run_cell(config, restarts=3, seed=7)
    assert first.rounds_to == again.rounds_to and first.mean_error == again.mean_error
    assert first.rounds_to == {1e-9: [11, 11, 10], 1e-4: [5, 5, 5]}
    other = run_cell(config, restarts=3, seed=8)
    assert other.mean_error != first.mean_error


def test_paper_cell_n512_grid():
    """The Moshpit notebook's averager (32 x 32 grid, 512 peers, no failures): paper 8.2 (3.6) rounds."""
    cell = run_cell(AveragingConfig(peers=512, group_size=32, grid_dims=2, topology="grid", rng_streams="notebook"),
                    restarts=10, seed=0)
    assert abs(cell.mean(1e-9) - 8.2) <= 0.5 and abs(cell.mean(1e-4) - 3.6) <= 0.5


def test_chunk_loss_uses_the_estimator():
    config = AveragingConfig(peers=128, dim=40, group_size=8, rounds=4, chunk_numel=3)
    exact = AveragingSimulation(config, seed=2)
    nearly = AveragingSimulation(AveragingConfig(**{**config.__dict__, "chunk_loss": 1e-15}), seed=2)
    for _ in range(4):
        exact.step()
        nearly.step()
    assert np.allclose(exact.values, nearly.values, rtol=0, atol=1e-12)  # nothing lost: the group mean

    lossy = AveragingSimulation(AveragingConfig(**{**config.__dict__, "chunk_loss": 0.3, "rounds": 30}), seed=2)
    traj = lossy.run()
    assert sum(s.chunks_lost for s in traj.rounds) > 0
    # The peers still agree (spread -> 0), but on a value that drifted from the exact mean: each lossy estimate
    # adds noise to the group's sum. Measured: drift MSE ~0.007 at 30% loss (~0.001 at 10%), from unit variance.
    assert lossy.spread() < 1e-9
    drift = float(np.mean((lossy.values.mean(axis=0) - lossy.exact_mean) ** 2))
    assert traj.error[-1] == pytest.approx(drift, rel=1e-6)
    assert 1e-5 < drift < 0.02


def test_bad_config_raises():
    with pytest.raises(ValueError):
        AveragingConfig(peers=0).check()
    with pytest.raises(ValueError):
        AveragingConfig(min_group_size=20, group_size=16).check()
    with pytest.raises(ValueError):
        AveragingConfig(peers=100, group_size=4, grid_dims=2, topology="grid").check()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "moshpeer", "simulate", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=env)


def test_cli_bad_knob_is_one_line_and_exit_2():
    result = _cli("--peers", "-3")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moshpeer simulate: error: ") and "--peers" in lines[0], lines
    assert result.stdout == ""


def test_cli_prints_a_table_and_a_json_line(capsys):
    # In-process (the subprocess test above covers the entry point): a fresh interpreter would spend seconds
    # importing torch and hivemind through moshpeer.averaging.
    from moshpeer.cli.main import main

    code = main(["simulate", "--peers", "64", "--group-size", "8", "--restarts", "2", "--failure-rate", "0.05"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["event"] == "simulate" and summary["peers"] == 64 and summary["restarts"] == 2
    assert set(summary["rounds_to"]) == {"1e-09", "0.0001"}
    assert any(line.startswith("rounds to 1e-09") for line in lines)


def test_batched_lossy_round_equals_one_estimator_call_per_chunk():
    """The simulator batches chunks by arrived count; replaying its loss draws chunk by chunk, group by group,
    with one `estimate_over_sum` call each (what an owner does), gives the same values."""
    import torch

    from moshpeer.averaging.estimator import estimate_over_sum
    from moshpeer.averaging.partition import Partition

    config = AveragingConfig(peers=90, dim=23, group_size=8, min_group_size=2, chunk_loss=0.35, chunk_numel=2)
    sim = AveragingSimulation(config, seed=4)
    before = sim.values.copy()
    loss_state = sim.loss_rng.bit_generator.state
    group_state = sim.group_rng.bit_generator.state
    sim.step()

    # Replay: the same grouping (same group stream) and the same loss draws, in the simulator's draw order.
    replay_groups = np.random.default_rng()
    replay_groups.bit_generator.state = group_state
    keys = AveragingSimulation(config, seed=4).keys
    grouping = grid.assemble_groups(np.arange(90), keys, 8, 2, replay_groups)
    loss = np.random.default_rng()
    loss.bit_generator.state = loss_state
    expected = before.copy()
    for size in np.unique(grouping.sizes).tolist():
        starts = grouping.starts[grouping.sizes == size]
        groups = [grouping.members[s:s + size] for s in starts.tolist()]
        part = Partition(23, size, 2)
        for j in range(size):
            for c in range(part.num_chunks(j)):
                lo, hi = part.chunk_range(j, c)
                arrived_all = loss.random((len(groups), size - 1)) >= 0.35
                got_all = loss.random((len(groups), size - 1)) >= 0.35
                for members, arrived, got in zip(groups, arrived_all, got_all):
                    owner, others = members[j], np.delete(members, j)
                    total = torch.from_numpy(before[others[arrived], lo:hi].sum(axis=0))
                    avg = estimate_over_sum(torch.from_numpy(before[owner, lo:hi].copy()), 1.0, total,
                                            float(arrived.sum()), float(size - 1)).numpy()
                    expected[owner, lo:hi] = avg
                    expected[others[got], lo:hi] = avg
    assert np.allclose(sim.values, expected, rtol=0, atol=1e-12)
