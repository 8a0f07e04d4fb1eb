"""DiLoCo's outer loop in one process (moshpeer.peer.strategies.diloco_outer): the outer step, the one-step delay, its state."""

from __future__ import annotations

import pytest
import torch

from moshpeer.errors import UserError
from moshpeer.peer.strategies.diloco_outer import OuterOptimizer, OuterState, describe_outer_optimizer, parse_outer_optimizer


def params_like(seed: int, shapes=((4, 3), (3,))) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for shape in shapes]


def test_default_outer_step_is_nesterov_sgd_from_the_paper():
    theta = params_like(0)
    state = OuterState(theta)
    deltas = [params_like(1), params_like(2)]
    expected, momentum = [t.clone() for t in theta], [torch.zeros_like(t) for t in theta]
    for delta in deltas:
        local = [t - d for t, d in zip(state.anchor, delta)]  # a peer that moved by -delta
        out = [torch.empty_like(t) for t in theta]
        state.pseudo_gradient(local, out)
        for o, d in zip(out, delta):
            torch.testing.assert_close(o, d)
        state.apply(out, local)
        for e, m, d in zip(expected, momentum, delta):
            m.mul_(0.9).add_(d)
            e.sub_(0.7 * (d + 0.9 * m))  # Nesterov: step along g + momentum * buf
    for e, a, p in zip(expected, state.anchor, local):
        torch.testing.assert_close(a, e)
        assert torch.equal(p, a)  # the next round starts from θ_outer
    assert state.outer_steps == 2


def test_plain_averaging_outer_optimizer_gives_the_mean_of_the_local_models():
    theta = params_like(0)
    peers = [OuterState(theta, OuterOptimizer("sgd", lr=1.0, momentum=0.0)) for _ in range(3)]
    locals_ = [params_like(10 + i) for i in range(3)]
    deltas = []
    for state, local in zip(peers, locals_):
        out = [torch.empty_like(t) for t in theta]
        state.pseudo_gradient(local, out)
        deltas.append(out)
    mean_delta = [sum(parts) / 3 for parts in zip(*deltas)]
    for state, local in zip(peers, locals_):
        state.apply(mean_delta, local)
    mean_local = [sum(parts) / 3 for parts in zip(*locals_)]
    for state in peers:
        for a, m in zip(state.anchor, mean_local):
            torch.testing.assert_close(a, m)


def test_delayed_outer_step_keeps_the_local_progress_made_meanwhile():
    # One peer, outer SGD with lr 1 and no momentum: the delayed outer step on its own Δ must leave it
    # exactly where plain local training would be, however far it went on after sending.
    theta = params_like(0)
    state = OuterState(theta, OuterOptimizer("sgd", lr=1.0, momentum=0.0))
    local = [t.clone() for t in theta]
    buffer = [torch.empty_like(t) for t in theta]
    sent_total = [torch.zeros_like(t) for t in theta]
    for step in range(4):
        for p, d in zip(local, params_like(20 + step)):
            p.sub_(0.1 * d)  # inner steps before the boundary
        if state.pending:
            state.apply_delayed([d.clone() for d in state.pending_delta()], local)
        state.send(local, buffer)
        for total, d in zip(sent_total, buffer):
            total.add_(d)
        with pytest.raises(ValueError, match="pending"):
            state.send(local, buffer)
    walked = [t.clone() for t in theta]
    for step in range(4):
        for w, d in zip(walked, params_like(20 + step)):
            w.sub_(0.1 * d)
    for p, w in zip(local, walked):
        torch.testing.assert_close(p, w)
    # Every inner step entered exactly one sent Δ: together they are the whole way travelled.
    for total, t, w in zip(sent_total, theta, walked):
        torch.testing.assert_close(total, t - w)


def test_delayed_outer_step_moves_peers_onto_the_new_outer_parameters():
    theta = params_like(0)
    state = OuterState(theta)
    local = [t - 0.1 * d for t, d in zip(theta, params_like(1))]
    buffer = [torch.empty_like(t) for t in theta]
    state.send(local, buffer)
    progress = [0.05 * d for d in params_like(2)]
    for p, g in zip(local, progress):
        p.sub_(g)  # inner steps while the round runs
    averaged = [0.5 * b for b in buffer]  # what the group returned
    state.apply_delayed(averaged, local)
    for p, a, g in zip(local, state.anchor, progress):
        torch.testing.assert_close(p, a - g)
    assert not state.pending and state.outer_steps == 1


def test_state_round_trips_bit_identical_and_rejects_misfits():
    theta = params_like(0)
    state = OuterState(theta)
    local = [t - d for t, d in zip(theta, params_like(1))]
    buffer = [torch.empty_like(t) for t in theta]
    state.pseudo_gradient(local, buffer)
    state.apply(buffer, local)
    state.send([p - 0.01 for p in local], buffer)
    saved = state.state_dict()

    restored = OuterState(params_like(5))
    restored.load_state_dict(saved)
    assert restored.outer_steps == 1 and restored.pending
    for a, b in zip(restored.anchor, state.anchor):
        assert torch.equal(a, b)
    # Both take the same next steps bit for bit (the momentum came along).
    for s in (state, restored):
        s.apply_delayed(buffer, [p.clone() for p in local])
        s.apply(params_like(3), [p.clone() for p in local])
    for a, b in zip(restored.anchor, state.anchor):
        assert torch.equal(a, b)

    before = [a.clone() for a in restored.anchor]
    bad_shape = dict(saved, anchor=[torch.zeros(2, 2), saved["anchor"][1]])
    non_finite = dict(saved, anchor=[saved["anchor"][0] * float("nan"), saved["anchor"][1]])
    for bad in (bad_shape, non_finite, dict(saved, format=7), dict(saved, optimizer=None), "junk"):
        with pytest.raises(ValueError):
            restored.load_state_dict(bad)
    for a, b in zip(restored.anchor, before):
        assert torch.equal(a, b)


def test_outer_optimizer_specs():
    assert parse_outer_optimizer("nesterov") == OuterOptimizer()
    assert parse_outer_optimizer("sgd:lr=1,momentum=0") == OuterOptimizer("sgd", 1.0, 0.0)
    assert describe_outer_optimizer(OuterOptimizer()) == "nesterov:lr=0.7,momentum=0.9"
    assert parse_outer_optimizer(OuterOptimizer("adam", 0.1, 0.5).describe()) == OuterOptimizer("adam", 0.1, 0.5)
    for bad in ("lion", "nesterov:lr=-1", "nesterov:beta=3", "sgd:lr=x", "nesterov:momentum=0"):
        with pytest.raises(UserError):
            parse_outer_optimizer(bad)


def test_a_strangers_outer_state_gets_the_checks_a_model_state_gets():
    """Issue 26: a DiLoCo outer state with 1e30 in θ_outer or in the momentum passed (only non-finite values were
    refused): after one outer step the parameters were inf, and a momentum of the wrong shape raised at the next
    outer step. Now each is refused before anything is adopted, and an honest state still loads."""
    donor = OuterState(params_like(0))
    local = [t - d for t, d in zip(donor.anchor, params_like(1))]
    out = [torch.empty_like(t) for t in local]
    donor.pseudo_gradient(local, out)
    donor.apply(out, local)  # one outer step: a momentum buffer exists
    honest = donor.state_dict()
    newcomer = OuterState(params_like(0))
    newcomer.check_state(honest)

    def forged(change):
        state = donor.state_dict()
        change(state)
        return state

    momentum = next(iter(honest["optimizer"]["state"].values()))
    key = next(k for k, v in momentum.items() if isinstance(v, torch.Tensor))
    attacks = {
        "θ_outer of 1e30": lambda s: s["anchor"][0].fill_(1e30),
        "momentum of 1e30": lambda s: next(iter(s["optimizer"]["state"].values()))[key].fill_(1e30),
        "momentum of the wrong shape": lambda s: next(iter(s["optimizer"]["state"].values())).update(
            {key: torch.zeros(7, 7)}),
    }
    for name, change in attacks.items():
        with pytest.raises(ValueError):
            newcomer.check_state(forged(change))
        with pytest.raises(ValueError):
            newcomer.load_state_dict(forged(change))
    assert all(torch.equal(a, b) for a, b in zip(newcomer.anchor, params_like(0)))  # nothing was adopted
    newcomer.load_state_dict(honest)
    assert all(torch.equal(a, b) for a, b in zip(newcomer.anchor, donor.anchor))
