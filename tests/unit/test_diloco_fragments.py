"""Streaming DiLoCo's fragments: the split, which fragment each epoch averages, and checkpoints that resume
bit-identically, driven through the real epoch loop against the in-process fakes (identity averaging: every
round succeeds and leaves the buffer as it is, the group's mean of one member's Δ)."""

from __future__ import annotations

import argparse
import random
from typing import List

import pytest
import torch

from moshpeer.averaging.report import RoundResult
from moshpeer.cli.join import add_training_arguments, strategy_from_args
from moshpeer.errors import UserError
from moshpeer.peer.strategies.diloco import DiLoCoStrategy
from moshpeer.peer.strategies.diloco_fragments import split_fragments
from moshpeer.peer.strategies.diloco_outer import OuterState
from moshpeer.peer.state.validation import disagreeing_tensors
from peer_fakes import FakeHost, tiny_model

# 6 parameters of sizes 12, 4, 16, 4, 8, 2 (46 values)
SIZES = [12, 4, 16, 4, 8, 2]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def host_of(strategy: DiLoCoStrategy) -> FakeHost:
    return FakeHost(strategy, model=model())


def micro_batches(host: FakeHost, count: int) -> None:
    """`count` micro-batches through the epoch loop: gradients that depend on the parameters and on the
    step, one inner SGD step each; every round ending an epoch succeeds (identity averaging)."""
    for _ in range(count):
        host.averager.queue(RoundResult(ok=True, group_size=2, averaged=("pseudo_gradient",)))
        for i, p in enumerate(host.params):
            p.grad = torch.sin(3 * p.detach() + host.counters.steps + i)
        host.epochs.account(4)
    host.averager.outcomes.clear()  # the outcomes no round took


def resumed(host: FakeHost, strategy: DiLoCoStrategy) -> FakeHost:
    """A fresh peer restarted from `host`'s checkpoint: parameters, epoch, step count and the strategy's
    state (the inner optimizer, plain SGD, keeps none)."""
    state = {"params": [p.detach().clone() for p in host.params], "epoch": host.counters.epoch,
             "steps": host.counters.steps, "strategy": host.strategy.state_dict()}
    fresh = host_of(strategy)
    with torch.no_grad():
        for p, saved in zip(fresh.params, state["params"]):
            p.copy_(saved)
    fresh.counters.epoch, fresh.counters.steps = state["epoch"], state["steps"]
    fresh.strategy.load_state_dict(state["strategy"])
    return fresh


def averaged_numels(host: FakeHost) -> List[int]:
    return [sum(t.numel() for t in call["tensors"]) for call in host.averager.calls]


# ---- the split ----------------------------------------------------------------------------------

def test_split_balances_contiguous_runs_of_whole_parameters():
    assert split_fragments(SIZES, 1) == [(0, 6)]
    assert split_fragments(SIZES, 3) == [(0, 2), (2, 3), (3, 6)]  # 16, 16, 14 values
    assert split_fragments(SIZES, 6) == [(i, i + 1) for i in range(6)]
    assert split_fragments([1, 100, 1, 1], 2) == [(0, 2), (2, 4)]  # the cut nearest to half
    assert split_fragments([100, 1, 1, 1], 3) == [(0, 1), (1, 2), (2, 4)]  # every run keeps a parameter
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 50) for _ in range(rng.randint(1, 12))]
        fragments = rng.randint(1, len(sizes))
        runs = split_fragments(sizes, fragments)
        assert len(runs) == fragments and runs[0][0] == 0 and runs[-1][1] == len(sizes)
        assert all(first < end for first, end in runs)
        assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))


@pytest.mark.parametrize("fragments", [0, -1, 7, True])
def test_split_rejects_a_fragment_count_the_parameters_cannot_fill(fragments):
    with pytest.raises(UserError):
        split_fragments(SIZES, fragments)


# ---- settings -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{"inner_steps": 6, "fragments": 4}, {"fragments": 0}, {"fragments": True},
                                    {"fragments": 2.0}])
def test_bad_fragment_settings_raise_user_error(kwargs):
    with pytest.raises(UserError):
        DiLoCoStrategy(**kwargs)


def test_more_fragments_than_parameters_or_with_error_feedback_fail_at_bind():
    with pytest.raises(UserError, match="number of parameters"):
        FakeHost(DiLoCoStrategy(inner_steps=3, fragments=3), model=tiny_model())  # 2 parameters
    with pytest.raises(UserError, match="error feedback"):
        FakeHost(DiLoCoStrategy(inner_steps=2, fragments=2), model=model(), error_feedback=object())


def test_the_cli_flag_builds_a_fragmented_strategy():
    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    args = parser.parse_args(["--averaging", "diloco", "--inner-steps", "8", "--diloco-fragments", "4"])
    strategy = strategy_from_args(args)
    assert (strategy.inner_steps, strategy.fragments, strategy.steps_per_epoch) == (8, 4, 2)
    assert strategy_from_args(parser.parse_args(["--averaging", "diloco"])).fragments == 1
    with pytest.raises(UserError, match="multiple of fragments"):
        strategy_from_args(parser.parse_args(["--averaging", "diloco", "--diloco-fragments", "3"]))  # H = 50


# ---- rounds -------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [False, True])
def test_each_epoch_averages_the_fragment_of_its_epoch_only(overlap):
    host = host_of(DiLoCoStrategy(inner_steps=6, fragments=3, overlap=overlap))
    assert host.strategy.settings()["fragments"] == 3
    micro_batches(host, 2 * 6)  # 6 epochs of H/F = 2 inner steps
    # Each fragment's first round carries its θ_outer too (outer_params_every 4): twice its values.
    assert averaged_numels(host) == [32, 32, 28] + [16, 16, 14]
    # After its H inner steps each fragment took two outer steps.
    assert [part.outer.outer_steps for part in host.strategy.parts] == ([2, 2, 2] if not overlap else [2, 2, 1])


def test_after_a_round_only_its_fragment_moves_to_theta_outer():
    host = host_of(DiLoCoStrategy(inner_steps=4, fragments=2))
    micro_batches(host, 2)  # epoch 0 averages fragment 0 (identity: θ_outer_new = θ_outer − Δ = θ_local)
    first, second = host.strategy.parts
    assert all(torch.equal(p, a) for p, a in zip(first.params, first.outer.anchor))
    assert not any(torch.equal(p, a) for p, a in zip(second.params, second.outer.anchor))  # still training


def test_one_fragment_is_plain_diloco():
    # The outer loop of DiLoCo by hand, on one OuterState over all parameters, against the strategy.
    host = host_of(DiLoCoStrategy(inner_steps=3))
    reference = host_of(DiLoCoStrategy(inner_steps=3))
    outer = OuterState(reference.params)
    for _ in range(4):
        micro_batches(host, 3)
        for _ in range(3):
            for i, p in enumerate(reference.params):
                p.grad = torch.sin(3 * p.detach() + reference.counters.steps + i)
            reference.inner_step()
        delta = [torch.empty_like(p) for p in reference.params]
        outer.pseudo_gradient(reference.params, delta)
        outer.apply(delta, reference.params)
    assert all(torch.equal(p, q) for p, q in zip(host.params, reference.params))
    assert averaged_numels(host) == [2 * sum(SIZES)] + [sum(SIZES)] * 3  # θ_outer too in the 1st (and 5th...)
    state = host.strategy.state_dict()
    assert state["fragments"] == 1 and state["outer"]["outer_steps"] == 4  # the format of earlier versions
    older = {key: value for key, value in state.items() if key != "fragments"}
    host_of(DiLoCoStrategy(inner_steps=3)).strategy.load_state_dict(older)  # what earlier versions wrote


# ---- checkpoints and newcomers ------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [False, True])
def test_a_fragmented_checkpoint_resumes_bit_identically(overlap):
    # With overlap the checkpoint holds a pending Δ (fragment 0, sent at the end of epoch 3) whose round the
    # restarted peer never runs: it takes that outer step on its own Δ, which identity averaging makes the
    # group's, at the end of epoch 4, when the uninterrupted peer resolves the round.
    settings = dict(inner_steps=6, fragments=3, overlap=overlap)
    uninterrupted = host_of(DiLoCoStrategy(**settings))
    micro_batches(uninterrupted, 23)
    interrupted = host_of(DiLoCoStrategy(**settings))
    micro_batches(interrupted, 9)  # epoch 4 (fragment 1), one inner step into it
    assert (interrupted.counters.epoch, interrupted.strategy.steps_this_epoch) == (4, 1)
    assert interrupted.strategy.parts[0].outer.pending == overlap
    restarted = resumed(interrupted, DiLoCoStrategy(**settings))
    micro_batches(restarted, 14)
    assert all(torch.equal(p, q) for p, q in zip(restarted.params, uninterrupted.params))
    for ours, theirs in zip(restarted.strategy.parts, uninterrupted.strategy.parts):
        assert all(torch.equal(a, b) for a, b in zip(ours.outer.anchor, theirs.outer.anchor))
        assert ours.outer.outer_steps == theirs.outer.outer_steps


def test_a_newcomer_mid_schedule_averages_the_fragment_of_the_swarms_epoch():
    donor = host_of(DiLoCoStrategy(inner_steps=6, fragments=3))
    micro_batches(donor, 10)  # epoch 5: fragment 2 comes next
    newcomer = resumed(donor, DiLoCoStrategy(inner_steps=6, fragments=3))
    micro_batches(newcomer, 2)
    assert averaged_numels(newcomer) == [14]
    assert [part.outer.outer_steps for part in newcomer.strategy.parts] == [2, 2, 2]


def other_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))


@pytest.mark.parametrize("other", [lambda: host_of(DiLoCoStrategy(inner_steps=6, fragments=2)),
                                   lambda: host_of(DiLoCoStrategy(inner_steps=6, fragments=1)),
                                   lambda: FakeHost(DiLoCoStrategy(inner_steps=6, fragments=3), model=other_model())])
def test_a_state_of_another_fragment_count_or_shape_is_refused_and_changes_nothing(other):
    donor = host_of(DiLoCoStrategy(inner_steps=6, fragments=3))
    micro_batches(donor, 3)
    state = other().strategy.state_dict()
    before = donor.strategy.state_dict()
    with pytest.raises(ValueError):
        donor.strategy.load_state_dict(state)
    after = donor.strategy.state_dict()
    assert after["steps_this_epoch"] == before["steps_this_epoch"] == 1
    for ours, saved in zip(after["outer"], before["outer"]):
        assert all(torch.equal(a, b) for a, b in zip(ours["anchor"], saved["anchor"]))
        assert ours["outer_steps"] == saved["outer_steps"]


def test_a_bad_fragment_state_is_refused_before_any_fragment_changes():
    host = host_of(DiLoCoStrategy(inner_steps=4, fragments=2))
    micro_batches(host, 4)
    state = host.strategy.state_dict()
    fresh = host_of(DiLoCoStrategy(inner_steps=4, fragments=2))
    # The second fragment's outer optimizer state does not fit its optimizer (a param group of other parameters).
    state["outer"][1]["optimizer"]["param_groups"][0]["params"] = [0]
    with pytest.raises(ValueError, match="param group does not match"):
        fresh.strategy.load_state_dict(state)
    assert fresh.strategy.parts[0].outer.outer_steps == 0  # the first one, which fits, was not taken either


@pytest.mark.parametrize("overlap", [False, True])
def test_donors_agree_on_theta_outer_while_their_own_inner_steps_set_their_parameters_apart(overlap):
    """A download's cross-check compares what honest donors hold alike (state/sync.py): for DiLoCo, θ_outer of
    every fragment. Two donors of one group hold the same θ_outer, and parameters as far apart as their own inner
    steps took them since (early in training, further than the cross-check's tolerance: measured in a swarm)."""
    settings = dict(inner_steps=6, fragments=3, overlap=overlap)
    donor = host_of(DiLoCoStrategy(**settings))
    micro_batches(donor, 7)
    other = resumed(donor, DiLoCoStrategy(**settings))
    with torch.no_grad():
        for p in other.params:
            p.add_(torch.randn_like(p))  # its own inner steps since the last outer step
    models = [{str(i): p.detach().clone() for i, p in enumerate(host.params)} for host in (donor, other)]
    assert disagreeing_tensors(*models)
    agreed = [host.strategy.agreed_tensors(host.strategy.state_dict()) for host in (donor, other)]
    assert len(agreed[0]) == len(SIZES) and disagreeing_tensors(*agreed) == []
    forged = other.strategy.state_dict()
    forged["outer"][1]["anchor"] = [-3 * anchor for anchor in forged["outer"][1]["anchor"]]
    forged_names = [f"outer1.{i}" for i in range(len(forged["outer"][1]["anchor"]))]
    assert disagreeing_tensors(agreed[0], donor.strategy.agreed_tensors(forged)) == forged_names
