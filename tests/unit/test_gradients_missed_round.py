"""A gradients-mode peer whose round failed while its group averaged takes the group's step (`rejoins_by_update`)
instead of a lone one that would leave its parameters apart until the next parameters round: the members keep
the averaged gradient they stepped on until they plan their next round, the late peer fetches it, checks it,
steps on it and carries its own gradient into its next contribution. Nobody downloads a whole state for it."""

from __future__ import annotations

import pytest
import torch

from moshpeer.averaging.report import RoundResult
from moshpeer.peer.optimizer.epoch_loop import MISSED_CAUGHT_UP, MISSED_ROUND_UPDATE
from moshpeer.peer.optimizer.missed_round import ROUND_OVER, nobody_left_in
from moshpeer.peer.strategies.gradients import GradientsStrategy
from moshpeer.peer.strategies.round_update import RoundUpdate
from peer_fakes import FakeHost, peer_record, swarm_view

SHARE = 32  # two trainers, a target batch of 64: each ends its epoch at 32 samples


def member_and_latecomer(compression: str = "none") -> tuple:
    """Two peers from the same start: the member's round averages (the group's gradient = half its own: a mate
    whose gradient was zero), the latecomer's finds no group while the swarm moved on."""
    member, late = (FakeHost(GradientsStrategy(average_parameters=False), compression=compression, lr=0.1)
                    for _ in range(2))
    member.averager.average = lambda tensors: tensors[0].mul_(0.5)
    member.averager.queue(RoundResult(ok=True, group_size=2, averaged=("gradients",)))
    late.averager.queue(RoundResult(ok=False, error="no group"))
    late.swarm.moved_on = True
    return member, late


def latecomer_that_took_the_update(declares_work: bool = False) -> tuple:
    """(member, latecomer, the latecomer's record of epoch 0) after the member averaged epoch 0 (gradient 1, halved
    by its mate) and the latecomer (gradient 3; with spot checks if `declares_work`) missed that round and took the
    member's update."""
    member, late = member_and_latecomer()
    if declares_work:
        late.epochs.declares_work, late.epochs.batch_size_per_step = True, 8
    member.backward(1.0)
    member.epochs.account(SHARE)
    late.updates = [member.strategy.kept_update(0)]
    late.backward(3.0)
    missed = late.epochs.account(SHARE)
    assert missed.error == MISSED_ROUND_UPDATE
    return member, late, missed


def params(host: FakeHost) -> list:
    return [p.detach().clone() for p in host.params]


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_a_latecomer_takes_the_groups_step_and_keeps_the_groups_parameters(compression):
    member, late = member_and_latecomer(compression)
    member.backward(1.0)
    assert member.epochs.account(SHARE).ok
    update = member.strategy.kept_update(0)
    assert update is not None and member.strategy.kept_update(1) is None
    late.updates = [update]
    late.backward(3.0)
    record = late.epochs.account(SHARE)
    assert record.error == MISSED_ROUND_UPDATE and not record.ok and record.carried_samples == SHARE
    assert late.update_requests == [0] and late.downloads == [] and late.counters.epoch == 1
    for ours, theirs in zip(late.params, member.params):
        if compression == "none":
            assert torch.equal(ours, theirs)  # the group's step, bit for bit
        else:  # re-encoded once: within the codec's error of one step (lr 0.1 x gradient 0.5)
            assert (ours - theirs).abs().max() <= 0.05 * 0.01


def test_a_latecomer_stepping_alone_would_have_stayed_apart():
    # What the update prevents: the same miss without a donor leaves the latecomer on its own step.
    member, late = member_and_latecomer()
    member.backward(1.0)
    member.epochs.account(SHARE)
    late.backward(3.0)
    record = late.epochs.account(SHARE)
    assert record.error == "no group" and record.carried_samples == 0 and late.downloads == []
    assert late.update_requests == [0]  # it asked; nobody had the update: a lone step, no state download
    for ours, theirs in zip(late.params, member.params):
        assert torch.allclose(ours, theirs - 0.1 * (3.0 - 0.5))


def test_the_next_round_sends_both_epochs_gradients_weighed_by_their_samples():
    _, late, _ = latecomer_that_took_the_update()
    sent = []
    late.averager.average = lambda tensors: sent.append(tensors[0].clone())
    late.averager.queue(RoundResult(ok=True, group_size=2, averaged=("gradients",)))
    late.backward(1.0)
    record = late.epochs.account(SHARE)
    assert record.ok and record.samples_carried_in == SHARE and late.averager.calls[-1]["weight"] == 2.0 * SHARE
    assert torch.allclose(sent[0], torch.full_like(sent[0], (3.0 + 1.0) / 2))  # the mean over both epochs
    assert late.strategy.carried_sums is None and late.counters.carried == {}  # it went into that round
    late.averager.queue(RoundResult(ok=True, group_size=2, averaged=("gradients",)))
    late.backward(1.0)
    assert late.epochs.account(SHARE).ok and late.averager.calls[-1]["weight"] == float(SHARE)


def test_a_lone_step_after_a_missed_round_takes_the_carried_gradient_too():
    _, late, _ = latecomer_that_took_the_update()
    late.updates, before = [], params(late)
    late.swarm.moved_on = False
    late.averager.queue(RoundResult(ok=False, error="no group"))
    late.backward(1.0)
    assert late.epochs.account(SHARE).error == "no group"
    for p, q in zip(late.params, before):
        assert torch.allclose(p, q - 0.1 * 2.0)  # lr x the mean of 3 and 1, equal samples
    assert late.strategy.carried_sums is None


def test_the_kept_gradient_is_gone_once_the_member_plans_its_next_round():
    member, _ = member_and_latecomer()
    member.backward(1.0)
    member.epochs.account(SHARE)
    assert member.strategy.kept_update(0) is not None
    member.backward(1.0)
    member.epochs.account(SHARE)  # its next round (abandoned) overwrote the buffer
    assert member.strategy.kept_update(0) is None and member.strategy.kept_update(1) is None


@pytest.mark.parametrize("wrong, why", [({"epoch": 1}, "epoch"), ({"numel": 3}, "values"),
                                        ({"scale": 30.0}, "norm")])
def test_an_update_that_does_not_fit_is_refused_and_the_latecomer_steps_alone(wrong, why, caplog):
    member, late = member_and_latecomer()
    member.backward(1.0)
    member.epochs.account(SHARE)
    kept = RoundUpdate.from_state(member.strategy.kept_update(0))
    numel = wrong.get("numel", kept.numel)
    late.updates = [RoundUpdate.encode(torch.full((numel,), 0.5 * wrong.get("scale", 1.0)),
                                       epoch=wrong.get("epoch", 0), fragment=0, steps=0, compression="none").to_state()]
    late.backward(3.0)
    before = params(late)
    record = late.epochs.account(SHARE)
    assert record.error == "no group" and late.downloads == [] and why in caplog.text
    for p, q in zip(late.params, before):
        assert torch.allclose(p, q - 0.1 * 3.0)


def test_a_downloaded_state_drops_the_carried_gradient():
    _, late, _ = latecomer_that_took_the_update()
    assert late.strategy.carried_samples == SHARE
    late.strategy.load_state_dict({})  # what adopting a donor's state or a checkpoint does
    assert late.strategy.carried_sums is None and late.strategy.carried_samples == 0


def test_the_latecomer_starts_its_next_epoch_as_far_in_as_its_donor_was():
    # Late by more than the matchmaking window, a peer that computed its whole share of the next epoch would be as
    # late for the next round, and every one after: it counts the donor's samples into that epoch as done.
    member, late = member_and_latecomer()
    member.backward(1.0)
    member.epochs.account(SHARE)
    member.backward(1.0)
    assert member.epochs.account(8) is None  # 8 samples into the next epoch when it serves
    update = member.strategy.kept_update(0)
    assert update["phase"] == [1, 8]
    late.updates = [update]
    late.backward(3.0)
    assert late.epochs.account(SHARE).error == MISSED_ROUND_UPDATE and late.strategy.head_start() == 8
    late.backward(1.0)
    assert late.epochs.account(SHARE - 16) is None
    late.averager.queue(RoundResult(ok=True, group_size=2, averaged=("gradients",)))
    record = late.epochs.account(8)  # the share less the head start: the epoch is over
    assert record.ok and record.samples == SHARE - 8 and late.averager.calls[-1]["weight"] == SHARE - 8 + SHARE
    assert late.strategy.head_start() == 0  # one epoch only


def test_the_update_is_the_missed_epochs_and_no_other():
    member, late = member_and_latecomer()
    late.averager.outcomes.clear()
    for host in (member, late):  # both average epoch 0 together
        host.averager.average = lambda tensors: None
        host.averager.queue(RoundResult(ok=True, group_size=2, averaged=("gradients",)))
        host.backward(1.0)
        assert host.epochs.account(SHARE).ok
    member.averager.average = lambda tensors: tensors[0].mul_(0.5)
    member.averager.queue(RoundResult(ok=True, group_size=2, averaged=("gradients",)))
    member.backward(1.0)
    assert member.epochs.account(SHARE).ok
    assert member.strategy.kept_update(0) is None and member.strategy.kept_update(1)["epoch"] == 1
    late.averager.queue(RoundResult(ok=False, error="no group"))
    late.updates = [member.strategy.kept_update(1)]
    late.backward(3.0)
    assert late.epochs.account(SHARE).error == MISSED_ROUND_UPDATE and late.update_requests == [1]
    assert all(torch.equal(p, q) for p, q in zip(late.params, member.params))


def test_with_spot_checks_the_missed_work_is_dropped_so_the_next_contribution_stays_checkable():
    # A spot check recomputes a contribution from the member's declared epoch and data; one holding a carried
    # gradient of another epoch's parameters cannot be recomputed (it declared no work, and failed the check).
    member, late, missed = latecomer_that_took_the_update(declares_work=True)
    assert missed.dropped_samples == SHARE and missed.carried_samples == 0
    assert late.counters.dropped_samples == SHARE and late.counters.carried == {}
    assert late.strategy.carried_sums is None
    assert all(torch.equal(p, q) for p, q in zip(late.params, member.params))  # the group's step all the same
    late.averager.queue(RoundResult(ok=True, group_size=2, averaged=("gradients",)))
    late.backward(1.0)
    assert late.epochs.account(SHARE).ok
    assert late.averager.calls[-1]["weight"] == float(SHARE) and late.averager.calls[-1]["work"] == (1, 8)


# ---- a peer that ends its epoch when nobody else is left in it ------------------------------------------------

def latecomer_among(epochs: list) -> tuple:
    """(member, latecomer): the member averaged epoch 0; the latecomer ends epoch 0 with other trainers' records at
    `epochs` (and an aux peer's and a leaving trainer's at 0, which never count), the member's update on offer."""
    member, late = member_and_latecomer()
    late.averager.outcomes.clear()  # a search would find the round pending until its deadline: abandoned
    member.backward(1.0)
    assert member.epochs.account(SHARE).ok
    others = [peer_record(k + 1, epoch=e) for k, e in enumerate(epochs)]
    others += [peer_record(6, epoch=0, role="aux"), peer_record(7, epoch=0, leaving=True)]
    late.swarm.progress.view = swarm_view(trainers=len(epochs) + 1, epoch=max(epochs), peers=tuple(others))
    late.updates = [member.strategy.kept_update(0)]
    late.backward(3.0)
    return member, late


def test_a_peer_whose_mates_are_all_past_its_epoch_takes_their_step_without_searching():
    member, late = latecomer_among([1, 2])
    record = late.epochs.account(SHARE)
    assert record.error == MISSED_ROUND_UPDATE and late.update_requests == [0]
    assert late.averager.calls == []  # no search for a group that could not form
    assert all(torch.equal(p, q) for p, q in zip(late.params, member.params))
    assert record.carried_samples == SHARE


def test_a_peer_with_a_mate_still_in_its_epoch_searches_for_a_group_as_usual():
    _, late = latecomer_among([1, 0])
    late.averager.queue(RoundResult(ok=True, group_size=2, averaged=("gradients",)))
    record = late.epochs.account(SHARE)
    assert record.ok and len(late.averager.calls) == 1 and late.update_requests == []


def test_a_peer_left_alone_in_its_epoch_without_an_update_on_offer_steps_alone_and_says_why():
    _, late = latecomer_among([1])
    late.updates = []
    record = late.epochs.account(SHARE)
    assert record.error == ROUND_OVER and late.averager.calls == [] and late.update_requests == [0]


def test_nobody_is_left_in_an_epoch_only_when_every_other_live_trainer_is_past_it():
    me = peer_record(0, epoch=0)
    assert nobody_left_in([me, peer_record(1, epoch=1), peer_record(2, epoch=5)], 0, me.peer_id)
    assert not nobody_left_in([me, peer_record(1, epoch=1), peer_record(2, epoch=0)], 0, me.peer_id)
    assert not nobody_left_in([me], 0, me.peer_id)  # alone is not "the others moved on"
    assert nobody_left_in([me, peer_record(1, epoch=1), peer_record(2, epoch=0, role="aux"),
                           peer_record(3, epoch=0, leaving=True)], 0, me.peer_id)


def test_a_latecomer_that_missed_a_parameters_round_takes_the_groups_state_not_their_gradient():
    """The members of a round that averages the parameters adopt them (with the default settings: every
    params_every epochs, the first round included); their kept update is the gradient alone, and a latecomer stepping
    on it would stay on its own parameters until the next parameters round (200 ms apart, session 50: a peer that
    missed the first round trained 16 epochs on its own initialization). It takes their state instead."""
    member, late = (FakeHost(GradientsStrategy(), lr=0.1) for _ in range(2))
    member.averager.queue(RoundResult(ok=True, group_size=2, averaged=("gradients", "parameters")))
    member.backward(1.0)
    assert member.epochs.account(SHARE).ok
    late.averager.queue(RoundResult(ok=False, error="no group"))
    late.swarm.moved_on = True
    late.updates = [member.strategy.kept_update(0)]  # on offer, and not taken
    late.donor_state = object()
    late.backward(3.0)
    record = late.epochs.account(SHARE)
    assert late.update_requests == [] and late.downloads == [1]
    assert record.error == MISSED_CAUGHT_UP and late.counters.epoch == 1


@pytest.mark.parametrize("params_round", [True, False])
def test_only_a_peer_that_missed_a_parameters_round_watches_the_swarm_for_the_others_round(params_round):
    """The others' round shows in the records a heartbeat after ours gave up: a peer that missed a parameters round
    watches for it (a lone step would leave it on its own parameters), one that missed a gradients round looks once
    and steps alone (it only prefers their update)."""
    late = FakeHost(GradientsStrategy(average_parameters="auto" if params_round else False), lr=0.1)
    late.averager.queue(RoundResult(ok=False, error="no group"))
    late.swarm.moved_on_within = 1.0
    late.donor_state = object()
    late.backward(1.0)
    record = late.epochs.account(SHARE)
    if params_round:
        assert record.error == MISSED_CAUGHT_UP and late.downloads == [1]
    else:
        assert record.error == "no group" and late.downloads == [] and late.update_requests == []
