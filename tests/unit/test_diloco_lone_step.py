"""A Δ that came pending with an adopted state (overlapped DiLoCo: a donor always has a round in flight): the peer
steps alone on it at its first epoch end, then takes that step again on the group's Δ̄ once fetched
(moshpeer/peer/optimizer/lone_step_fetch.py), so that its θ_outer is the group's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moshpeer.averaging.report import RoundResult
from moshpeer.peer.optimizer.lone_step_fetch import LoneStepFetch
from moshpeer.peer.strategies.diloco import DiLoCoStrategy
from peer_fakes import FakeHost
from test_diloco_fragments import micro_batches, model, resumed

SETTINGS = dict(inner_steps=4, overlap=True)  # the default outer optimizer: Nesterov momentum, which a retake restores


def peer(state_of: FakeHost = None, retry_s: float = 0.01, inline: bool = False) -> FakeHost:
    """A peer whose rounds average to half of its own Δ (the group's Δ̄ is not its own); with `state_of`, started
    from that peer's state as a download leaves it (parameters, epoch, steps, strategy state)."""
    strategy = DiLoCoStrategy(**SETTINGS)
    host = resumed(state_of, strategy) if state_of is not None else FakeHost(strategy, model=model())
    host.averager.average = lambda tensors: [t.mul_(0.5) for t in tensors]
    host.epochs.lone_step = LoneStepFetch(host, retry_s=retry_s, start=(lambda work: work()) if inline else None)
    return host


def anchor(host: FakeHost) -> list:
    return host.strategy.parts[0].outer.anchor


def test_a_newcomer_takes_the_step_on_its_donors_pending_delta_again_with_the_groups_update():
    donor = peer()
    micro_batches(donor, 9)  # epochs 0 and 1 over, one step into epoch 2: the round of epoch 1 in flight
    assert donor.strategy.parts[0].outer.pending
    newcomer, unserved = peer(donor, inline=True), peer(donor)
    micro_batches(donor, 3)  # the donor's epoch 2 ends: the group's Δ̄ of epoch 1 applied and kept
    newcomer.updates = [donor.strategy.kept_update(1)]
    assert newcomer.updates[0] is not None
    for host in (newcomer, unserved):
        micro_batches(host, 3)  # their epoch 2 ends: the step on the donor's own Δ, alone
        assert host.strategy.lone_step().epoch == 1
        assert not all(torch.equal(a, b) for a, b in zip(anchor(host), anchor(donor)))
    assert newcomer.update_requests == [1] and newcomer.epochs.lone_step._looking[3]  # fitted, not yet taken
    for host in (donor, newcomer, unserved):
        micro_batches(host, 4)  # epoch 3 ends: the lone step taken again (or not), then the round of epoch 2
    assert newcomer.strategy.lone_step() is None and unserved.strategy.lone_step() is None
    # θ_outer: the group's (up to float rounding: the parameters were moved by the retake, and the next Δ taken from
    # them), while the peer no update reached stays apart by what the lone step got wrong.
    assert max(float((a - b).abs().max()) for a, b in zip(anchor(newcomer), anchor(donor))) < 1e-6
    assert max(float((a - b).abs().max()) for a, b in zip(anchor(unserved), anchor(donor))) > 1e-3
    assert donor.strategy.parts[0].outer.outer_steps == newcomer.strategy.parts[0].outer.outer_steps == 3


def test_an_update_of_another_round_does_not_fit_and_a_replaced_state_forgets_the_lone_step():
    donor = peer()
    micro_batches(donor, 9)
    newcomer = peer(donor, inline=True)
    micro_batches(donor, 3)
    update = donor.strategy.kept_update(1)
    newcomer.updates = [update]
    micro_batches(newcomer, 3)  # a lone step on the donor's Δ of epoch 1; the group's update of it fitted
    plan = newcomer.strategy.lone_step()
    with pytest.raises(ValueError, match="epoch 1"):  # the round of another epoch
        newcomer.strategy.fit_update(dataclasses.replace(plan, epoch=2), update)
    assert newcomer.epochs.lone_step._looking[3]
    newcomer.strategy.load_state_dict(donor.strategy.state_dict())  # a download replaces the state meanwhile
    before = [a.clone() for a in anchor(newcomer)]
    assert newcomer.epochs.lone_step.settle() is False  # the step it fitted for went with the old state
    assert all(torch.equal(a, b) for a, b in zip(anchor(newcomer), before))


def test_a_first_round_that_was_the_groups_round_of_the_pending_delta_takes_that_step_once():
    """The newcomer's first round met its group still matching for the round of the Δ the newcomer's state held
    (members declared epochs 1, 1 and 2): that round's average is the group's Δ̄ of epoch 1, so the lone step is
    undone and the round's average takes it, once (retaking it on the same Δ̄ as well took the step twice: the late
    joiner of the swarm test ended 0.2 from its group)."""
    donor = peer()
    micro_batches(donor, 9)  # one step into epoch 2, the round of epoch 1 in flight
    newcomer = peer(donor)
    group_delta = 0.5 * torch.cat([d.reshape(-1) for d in donor.strategy.parts[0].outer.pending_delta()])
    micro_batches(donor, 3)  # the donor's epoch 2 ends: the group's Δ̄ of epoch 1 applied
    theirs = [a.clone() for a in anchor(donor)]
    newcomer.averager.average = lambda tensors: tensors[0].copy_(group_delta)  # the round the newcomer meets
    newcomer.averager.queue(RoundResult(ok=True, group_size=3, averaged=("pseudo_gradient",), member_epochs=[1, 1, 2]))
    micro_batches(newcomer, 3)  # its epoch 2 ends: a lone step on the donor's Δ; its round (queued first) meets theirs
    newcomer.averager.average = None
    micro_batches(newcomer, 4)  # epoch 3 ends: the lone step undone, the round's average applied in its place
    assert newcomer.strategy.lone_step() is None
    # θ_outer: the donor's after the group's round of epoch 1, one outer step past round 0 (not two)
    assert newcomer.strategy.parts[0].outer.outer_steps == donor.strategy.parts[0].outer.outer_steps == 2
    assert max(float((a - b).abs().max()) for a, b in zip(anchor(newcomer), theirs)) < 1e-6
