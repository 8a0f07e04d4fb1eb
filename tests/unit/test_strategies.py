"""The averaging strategies against a fake host: what each round averages and how its outcome is applied."""

from __future__ import annotations

import pytest
import torch

from moshpeer.errors import UserError
from moshpeer.peer.strategies.diloco_outer import OuterOptimizer
from moshpeer.peer.strategies import make_strategy
from moshpeer.peer.strategies.diloco import DiLoCoStrategy
from moshpeer.peer.strategies.gradients import GradientsStrategy
from moshpeer.peer.strategies.parameters import ParametersStrategy
from peer_fakes import FakeHost, swarm_view


def accumulate(host: FakeHost, value: float, samples: int) -> None:
    """As the epoch loop would: gradients x samples into grad_sums."""
    for acc in host.counters.grad_sums:
        acc.add_(torch.full_like(acc, value), alpha=float(samples))
    host.counters.samples += samples


def params_of(host: FakeHost) -> list:
    return [p.detach().clone() for p in host.params]


# ---- gradients ----------------------------------------------------------------------------------

def test_gradients_plan_the_sample_weighted_mean_gradient_and_params_every_k_epochs():
    host = FakeHost(GradientsStrategy(params_every=3))
    strategy = host.strategy
    accumulate(host, 1.0, 10)
    accumulate(host, 4.0, 30)
    plan = strategy.plan_round(1, swarm_view())
    assert plan.averages == ("gradients",) and plan.tensors[0].numel() == sum(p.numel() for p in host.params)
    assert torch.allclose(plan.tensors[0], torch.full_like(plan.tensors[0], (10 + 120) / 40))
    with_params = strategy.plan_round(3, swarm_view())
    assert with_params.averages == ("gradients", "parameters") and with_params.tensors[0] is strategy.buffer
    assert torch.equal(strategy.param_copies[0], host.params[0].detach())


def test_gradients_apply_the_group_average_and_adopt_the_mean_parameters():
    host = FakeHost(GradientsStrategy(params_every=1), lr=0.5)
    strategy = host.strategy
    accumulate(host, 1.0, 8)
    plan = strategy.plan_round(0, swarm_view())
    for g in strategy.grads:
        g.fill_(2.0)  # the group's mean gradient
    for c in strategy.param_copies:
        c.add_(1.0)  # the group's mean parameters: ours + 1
    mean_params = [c.clone() for c in strategy.param_copies]
    spread = strategy.apply_averaged(plan)
    assert spread is not None and spread > 0
    for p, m in zip(host.params, mean_params):
        assert torch.allclose(p, m - 0.5 * 2.0)  # adopted, then one step on the averaged gradient
    assert host.counters.steps == 1 and all(p.grad is None for p in host.params)
    assert strategy.averaged_gradient(plan) is strategy.grads


def test_gradients_auto_adopts_lossy_parameters_only_when_groups_drift_apart():
    host = FakeHost(GradientsStrategy(params_every=1), compression="int8", group_size=4)
    strategy = host.strategy
    strategy.plan_round(0, swarm_view(trainers=4))
    assert strategy.adopt_params is False  # one group holds the whole swarm: codec noise for nothing
    strategy.plan_round(0, swarm_view(trainers=5))
    assert strategy.adopt_params is True


def test_gradients_alone_step_on_the_local_mean_gradient():
    host = FakeHost(GradientsStrategy(), lr=0.1)
    before = params_of(host)
    accumulate(host, 3.0, 4)
    host.strategy.apply_alone(None)
    for p, q in zip(host.params, before):
        assert torch.allclose(p, q - 0.1 * 3.0)
    assert host.counters.steps == 1


def test_gradients_with_error_feedback_never_average_parameters():
    host = FakeHost(GradientsStrategy(params_every=1), error_feedback=object())
    plan = host.strategy.plan_round(0, swarm_view())
    assert plan.averages == ("gradients",) and host.strategy.buffer.numel() == sum(p.numel() for p in host.params)


@pytest.mark.parametrize("kwargs", [{"average_parameters": "sometimes"}, {"params_every": 0}])
def test_gradients_reject_bad_options(kwargs):
    with pytest.raises(UserError):
        GradientsStrategy(**kwargs)


# ---- parameters ---------------------------------------------------------------------------------

def test_parameters_average_parameters_and_the_optimizer_statistic():
    model = torch.nn.Linear(3, 2)
    host = FakeHost(ParametersStrategy(), model=model)
    host.inner = torch.optim.Adam(host.params, lr=0.1)
    for p in host.params:
        p.grad = torch.ones_like(p)
    host.inner.step()
    strategy = host.strategy
    plan = strategy.plan_round(0, swarm_view())
    assert plan.averages == ("parameters", "optimizer_state") and plan.tensors == (strategy.buffer,)
    second_moment = host.inner.state[host.params[0]]["exp_avg_sq"]
    assert torch.equal(strategy.stat_copies[0], second_moment)
    for c in strategy.param_copies:
        c.fill_(0.25)
    for s in strategy.stat_copies:
        s.fill_(-1.0)  # lossy averaging may leave a second moment slightly negative
    assert strategy.apply_averaged(plan) > 0
    assert all(torch.all(p == 0.25) for p in host.params)
    assert torch.all(host.inner.state[host.params[0]]["exp_avg_sq"] == 0)  # clamped at zero


def test_parameters_without_optimizer_state_send_zeros_and_alone_changes_nothing():
    host = FakeHost(ParametersStrategy(average_optimizer_state=False))
    plan = host.strategy.plan_round(0, swarm_view())
    assert all(float(s.abs().sum()) == 0 for s in host.strategy.stat_copies)
    before = params_of(host)
    assert host.strategy.apply_alone(plan) is None
    assert all(torch.equal(p, q) for p, q in zip(host.params, before))


# ---- diloco -------------------------------------------------------------------------------------

def test_diloco_counts_inner_steps_and_averages_the_pseudo_gradient():
    host = FakeHost(DiLoCoStrategy(inner_steps=2, outer_optimizer=OuterOptimizer("sgd", 1.0, 0.0)))
    strategy = host.strategy
    start = params_of(host)
    assert strategy.epoch_is_over() is False
    strategy.on_micro_batch(8)
    with torch.no_grad():
        for p in host.params:
            p.sub_(0.5)  # the inner steps moved θ_local by -0.5
    strategy.on_micro_batch(8)
    assert strategy.epoch_is_over() is True
    plan = strategy.plan_round(1, swarm_view())  # epoch 0 would carry θ_outer too (outer_params_every)
    assert plan.averages == ("pseudo_gradient",) and strategy.steps_this_epoch == 0
    assert all(torch.allclose(d, torch.full_like(d, 0.5)) for d in strategy.delta)  # Δ = θ_outer − θ_local
    for d in strategy.delta:
        d.fill_(0.25)  # the group's mean Δ
    assert strategy.apply_averaged(plan) is None
    for p, q in zip(host.params, start):
        assert torch.allclose(p, q - 0.25)  # plain SGD, lr 1: θ_outer − Δ̄, and every peer restarts there


def test_diloco_alone_takes_the_outer_step_on_its_own_pseudo_gradient():
    host = FakeHost(DiLoCoStrategy(inner_steps=1, outer_optimizer=OuterOptimizer("sgd", 1.0, 0.0)))
    start = params_of(host)
    with torch.no_grad():
        for p in host.params:
            p.sub_(0.5)
    host.strategy.apply_alone(None)
    for p, q in zip(host.params, start):
        assert torch.allclose(p, q - 0.5)


def test_diloco_state_round_trips_and_rejects_another_setting():
    host = FakeHost(DiLoCoStrategy(inner_steps=4))
    host.strategy.on_micro_batch(1)
    state = host.strategy.state_dict()
    other = FakeHost(DiLoCoStrategy(inner_steps=4))
    other.strategy.load_state_dict(state)
    assert other.strategy.steps_this_epoch == 1
    short = FakeHost(DiLoCoStrategy(inner_steps=1))
    with pytest.raises(ValueError):
        short.strategy.load_state_dict({**state, "steps_this_epoch": 3})
    assert short.strategy.steps_this_epoch == 0  # nothing changed
    assert host.strategy.settings()["inner_steps"] == 4


def test_diloco_rounds_carry_theta_outer_every_k_and_members_adopt_its_mean():
    plain_sgd = OuterOptimizer("sgd", 1.0, 0.0)
    a, b = (FakeHost(DiLoCoStrategy(inner_steps=1, outer_optimizer=plain_sgd, outer_params_every=2)) for _ in range(2))
    for anchor in b.strategy.parts[0].outer.anchor:
        anchor.add_(1.0)  # b's θ_outer drifted from a's (another group applied other Δ̄s)
    plans = [host.strategy.plan_round(0, swarm_view()) for host in (a, b)]
    assert all(plan.averages == ("pseudo_gradient", "outer_parameters") for plan in plans)
    flat_a = torch.cat([x.reshape(-1) for x in a.strategy.parts[0].outer.anchor])
    assert torch.equal(plans[0].tensors[1], flat_a)
    for i in range(2):  # the group's all-reduce
        mean = (plans[0].tensors[i] + plans[1].tensors[i]) / 2
        for plan in plans:
            plan.tensors[i].copy_(mean)
    spreads = [host.strategy.apply_averaged(plan) for host, plan in zip((a, b), plans)]
    assert all(spread is not None and spread > 0 for spread in spreads)
    for x, y in zip(a.params, b.params):
        assert torch.allclose(x, y)  # one θ_outer again, and both restart from it
    for host in (a, b):
        assert host.strategy.plan_round(1, swarm_view()).averages == ("pseudo_gradient",)
    assert a.strategy.settings()["outer_params_every"] == 2


def test_diloco_fragments_carry_their_own_slice_of_theta_outer():
    host = FakeHost(DiLoCoStrategy(inner_steps=2, fragments=2, outer_params_every=3))
    strategy = host.strategy
    outer_epochs = [epoch for epoch in range(12) if len(strategy.plan_round(epoch, swarm_view()).tensors) == 2]
    assert outer_epochs == [0, 1, 6, 7]  # each fragment's 1st and 4th round
    plan = strategy.plan_round(7, swarm_view())
    part = strategy.parts[1]
    assert plan.tensors[1].numel() == part.buffer.numel()
    assert torch.equal(plan.tensors[1], torch.cat([x.reshape(-1) for x in part.outer.anchor]))


def test_diloco_auto_adopts_a_lossy_theta_outer_only_when_groups_drift_apart():
    host = FakeHost(DiLoCoStrategy(inner_steps=1), compression="int8", group_size=4)
    host.strategy.plan_round(0, swarm_view(trainers=4))
    assert host.strategy.adopt_outer is False  # one group holds the whole swarm: codec noise for nothing
    host.strategy.plan_round(0, swarm_view(trainers=5))
    assert host.strategy.adopt_outer is True


@pytest.mark.parametrize("options", [{"outer_params_every": 0}, {"average_outer": False}])
def test_diloco_never_averages_theta_outer_when_told_or_with_error_feedback(options):
    for host in (FakeHost(DiLoCoStrategy(inner_steps=1, **options)),
                 FakeHost(DiLoCoStrategy(inner_steps=1), error_feedback=object())):
        assert host.strategy.plan_round(0, swarm_view()).averages == ("pseudo_gradient",)
        assert host.strategy.outer_copy is None and host.strategy.settings()["outer_params_every"] == 0


@pytest.mark.parametrize("kwargs", [{"inner_steps": 0}, {"inner_steps": True}, {"outer_optimizer": "sgd"},
                                    {"outer_params_every": -1}, {"outer_params_every": True},
                                    {"average_outer": "sometimes"}])
def test_diloco_rejects_bad_options(kwargs):
    with pytest.raises(UserError):
        DiLoCoStrategy(**kwargs)


# ---- by name ------------------------------------------------------------------------------------

def test_make_strategy_builds_named_modes_with_their_options():
    assert make_strategy("gradients", params_every=None).params_every == 16  # None: the class's default
    assert make_strategy("gradients", params_every=2).params_every == 2
    assert make_strategy("diloco", inner_steps=7).inner_steps == 7
    instance = ParametersStrategy()
    assert make_strategy(instance) is instance
    with pytest.raises(UserError):
        make_strategy("parameters", inner_steps=3)  # not an option of that mode
    with pytest.raises(UserError):
        make_strategy(instance, params_every=2)  # options travel inside the instance
    with pytest.raises(UserError):
        make_strategy("nonsense")


def test_diloco_under_error_feedback_steps_with_plain_sgd_unless_told_otherwise():
    # SparseLoCo: the residual's decay stands in for the outer momentum (compression/residual_feedback.py).
    assert FakeHost(DiLoCoStrategy(inner_steps=1), error_feedback=object()).strategy.settings()["outer_optimizer"] \
        == "sgd:lr=1,momentum=0"
    assert FakeHost(DiLoCoStrategy(inner_steps=1)).strategy.settings()["outer_optimizer"] == \
        "nesterov:lr=0.7,momentum=0.9"
    given = OuterOptimizer("nesterov", lr=0.5, momentum=0.8)
    assert FakeHost(DiLoCoStrategy(inner_steps=1, outer_optimizer=given), error_feedback=object()) \
        .strategy.settings()["outer_optimizer"] == "nesterov:lr=0.5,momentum=0.8"
