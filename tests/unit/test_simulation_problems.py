"""The training level's problems (moshpeer.simulation.problems): the small network's hand-written backprop against
autograd, and what the network shows that the convex problem does not (in-process, seeded, a few seconds)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moshpeer.simulation.problems import TeacherMLP
from moshpeer.simulation.training import TrainingConfig, Workload, run_sync, run_training

pytestmark = pytest.mark.timeout(60)

torch.set_num_threads(1)

MLP = Workload(kind="mlp", dim=16, hidden=32)


def _config(**overrides) -> TrainingConfig:
    base = dict(peers=32, group_size=16, rounds=50, inner_steps=20, mode="diloco", workload=MLP,
                model_params=1_000_000, uplink=125e6, downlink=125e6, rtt_s=0.01)
    base.update(overrides)
    return TrainingConfig(**base)


def _mlp(peers: int = 4) -> TeacherMLP:
    honest = np.ones(peers, dtype=bool)
    return TeacherMLP(MLP, peers, honest, np.random.default_rng(0), torch.Generator().manual_seed(0))


def test_mlp_gradients_are_autograd_gradients():
    problem = _mlp()
    peers = np.arange(4)
    models = problem.start.repeat(4, 1) + 0.1 * torch.randn(4, problem.dim, generator=torch.Generator().manual_seed(1))
    inputs, labels = problem.minibatches(peers)
    by_hand = problem.batch_gradients(models, inputs, labels)
    leaf = models.clone().requires_grad_(True)
    out, _ = problem.forward(leaf, inputs)
    (0.5 * (out - labels).pow(2).mean(dim=1)).sum().backward()
    assert by_hand.shape == (4, problem.dim) == (4, MLP.parameters())
    torch.testing.assert_close(by_hand, leaf.grad, rtol=1e-4, atol=1e-6)


def test_mlp_loss_is_the_label_noise_at_the_teacher_and_more_elsewhere():
    problem = _mlp()
    assert problem.loss(problem.teacher[None]) == pytest.approx(problem.loss_floor()) == 0.5 * MLP.noise ** 2
    assert problem.loss(problem.start[None]) > 10 * problem.loss_floor()


def test_mlp_trains_in_groups_as_the_synchronous_baseline_does():
    config = _config(mode="gradients", rounds=300, inner_steps=1)
    moshpit, sync = run_training(config, seed=0), run_sync(config, seed=0, steps=300)
    assert moshpit.final_loss < 0.2 * moshpit.initial_loss
    assert moshpit.final_loss == pytest.approx(sync.final_loss, rel=0.1)


def test_mlp_diloco_across_groups_drifts_apart_unless_the_groups_also_average_theta_outer():
    # Averaging Δ alone (outer_params_every=0): each peer applies its group's Δ̄ to its own θ_outer, and nothing
    # contracts the differences between peers (docs/simulation.md); on the network they grow until the loss rises
    # again. Production's default rounds that also average θ_outer (every 4th) keep the swarm on one model.
    one_group = run_training(_config(group_size=32), seed=0)
    delta_only = run_training(_config(outer_params_every=0), seed=0)
    production = run_training(_config(), seed=0)
    assert one_group.final_spread < 1e-9
    assert delta_only.final_loss > 3 * one_group.final_loss and delta_only.final_spread > 0.1
    assert production.final_loss < 1.5 * one_group.final_loss


def test_cli_trains_the_network_and_refuses_an_unknown_workload_in_one_line(capsys):
    from moshpeer.cli.main import main

    assert main(["simulate", "--level", "training", "--workload", "mlp", "--peers", "16", "--rounds", "3",
                 "--inner-steps", "2", "--dim", "8", "--hidden", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"][0]
    assert result["loss_floor"] == pytest.approx(0.5 * MLP.noise ** 2)
    assert main(["simulate", "--level", "training", "--workload", "cnn"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and "workload" in captured.err
