"""A peer that ended its epoch just after its mates' group closed meets their round of the next epoch in matchmaking
(rounds are not keyed by epoch). Before: it averaged with them and kept its own count, one epoch behind theirs for
good, so every later round mixed its epoch e with their e + 1, and an owner's spot checks skipped it as "another
epoch" until the third skip in a row failed an honest peer (CI, the free-rider swarm test). Now members tell their
epoch in matchmaking and a member behind the epoch its group agreed on takes that count."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest
import torch

from moshpeer.averaging.member_info import pack_member_info, parse_member_info
from moshpeer.averaging.report import RoundResult
from moshpeer.dht.records import PeerRecord
from moshpeer.errors import ProtocolError
from moshpeer.peer.optimizer.epoch_agreement import agreed_epoch
from moshpeer.peer.optimizer.epoch_loop import MET_A_LATER_ROUND
from moshpeer.peer.strategies.diloco import DiLoCoStrategy
from moshpeer.peer.strategies.gradients import GradientsStrategy
from peer_fakes import FakeHost

SHARE = 32  # two trainers, a target batch of 64: each ends its epoch at 32 samples


@pytest.mark.parametrize("own, declared, taken", [
    (2, [2, 3, 3, 3], 3),  # behind its group: takes the group's epoch
    (2, [2, 3, 3], 3),
    (2, [2, 3], None),  # a tie moves nobody: either of the two may be the one behind
    (2, [2, 2, 3, 3], None),
    (3, [2, 2, 3], None),  # ahead of its group: never backwards
    (2, [2, 2, 2, 1 << 40], None),  # one member declaring a far epoch moves nobody
    (2, [2, 9, 9, 1 << 40], 9),  # ... nor past what the others declared
    (2, [], None),  # nobody declared one (an averager used without epochs)
])
def test_the_group_epoch_is_the_lower_median_and_only_moves_a_peer_forward(own, declared, taken):
    assert agreed_epoch(own, declared) == taken


def test_the_epoch_travels_in_matchmaking_and_a_bad_one_is_refused():
    info = parse_member_info(pack_member_info("127.0.0.1", 4000, 64.0, bytes(16), epoch=7))
    assert info.epoch == 7
    assert parse_member_info(pack_member_info("127.0.0.1", 4000, 64.0, bytes(16))).epoch is None
    for bad in (-1, 1 << 62):
        with pytest.raises(ProtocolError, match="bad epoch"):
            parse_member_info(pack_member_info("127.0.0.1", 4000, 64.0, bytes(16), epoch=bad))
    for bad in ("3", 1.5, True):
        packed = msgpack.unpackb(pack_member_info("127.0.0.1", 4000, 64.0, bytes(16)))
        with pytest.raises(ProtocolError, match="bad epoch"):
            parse_member_info(msgpack.packb({**packed, "epoch": bad}))


def test_a_gradients_peer_in_its_groups_round_of_a_later_epoch_takes_that_count():
    host = FakeHost(GradientsStrategy(average_parameters=False))
    host.averager.queue(RoundResult(ok=True, group_size=4, averaged=("gradients",), member_epochs=[0, 1, 1, 1]))
    host.backward(1.0)
    record = host.epochs.account(SHARE)
    assert host.averager.calls[0]["epoch"] == 0  # it told its group its own epoch
    assert record.ok and record.epoch == 0 and record.joined_epoch == 1 and host.counters.epoch == 2
    assert host.swarm.progress.reports[-1]["epoch"] == 2  # and the swarm sees the count it took
    # It serves the group's averaged gradient as that epoch's update, to a peer that missed the same round.
    assert host.strategy.kept_update(0) is None and host.strategy.kept_update(1) is not None
    host.averager.queue(RoundResult(ok=True, group_size=4, averaged=("gradients",), member_epochs=[2, 2, 2, 2]))
    host.backward(1.0)
    record = host.epochs.account(SHARE)
    assert host.averager.calls[1]["epoch"] == 2 and record.joined_epoch is None and host.counters.epoch == 3


def test_a_round_without_a_majority_ahead_leaves_the_count():
    host = FakeHost(GradientsStrategy(average_parameters=False))
    host.averager.queue(RoundResult(ok=True, group_size=2, averaged=("gradients",), member_epochs=[0, 5]))
    host.backward(1.0)
    assert host.epochs.account(SHARE).joined_epoch is None and host.counters.epoch == 1


def test_an_overlapping_diloco_peer_takes_the_count_when_its_round_settles():
    """The round of epoch 0 runs while the peer computes epoch 1; it settles at the end of epoch 1, when the peer is
    already one further: the count moves by what the group was ahead."""
    host = FakeHost(DiLoCoStrategy(inner_steps=1, overlap=True))
    host.averager.queue(RoundResult(ok=True, group_size=3, averaged=("pseudo_gradient",), member_epochs=[0, 1, 1]))
    host.backward(1.0)
    assert host.epochs.account(8).error == "round in flight" and host.counters.epoch == 1
    host.backward(1.0)
    settled = host.epochs.account(8)
    assert settled.ok and settled.epoch == 0 and settled.joined_epoch == 1 and host.counters.epoch == 3


# ---- the step it missed: a member keeps its update one epoch longer while a straggler is in view ------------------

def straggler_record(epoch: int) -> PeerRecord:
    return PeerRecord(peer_id="Qm" + "s" * 44, role="trainer", epoch=epoch, version="test", protocol=2,
                      started_at=0.0, updated_at=0.0)


def member_after_two_rounds(straggler_in_view: bool) -> FakeHost:
    """A member that averaged epoch 0 (the group's gradient: half its own 1.0) and epoch 1 (0.25), with or without
    a trainer's record at epoch 0 in view when it planned epoch 1."""
    member = FakeHost(GradientsStrategy(average_parameters=False), lr=0.1)
    member.averager.average = lambda tensors: tensors[0].mul_(0.5)
    member.averager.queue(RoundResult(ok=True, group_size=3, averaged=("gradients",), member_epochs=[0, 0, 0]))
    member.backward(1.0)
    assert member.epochs.account(SHARE).ok
    if straggler_in_view:
        member.swarm.progress.view = replace(member.swarm.progress.view, peers=(straggler_record(0),))
    member.averager.average = lambda tensors: tensors[0].fill_(0.25)
    member.averager.queue(RoundResult(ok=True, group_size=3, averaged=("gradients",), member_epochs=[1, 1, 0]))
    member.backward(1.0)
    assert member.epochs.account(SHARE).ok
    return member


def straggler_in_the_next_round(member: FakeHost) -> tuple:
    """A peer from the same start that ended epoch 0 after the member's group closed and met its round of epoch 1:
    -> (the straggler, its record of that round)."""
    late = FakeHost(GradientsStrategy(average_parameters=False), lr=0.1)
    kept = member.strategy.kept_update(0)
    late.updates = [kept] if kept is not None else []
    late.averager.average = lambda tensors: tensors[0].fill_(0.25)
    late.averager.queue(RoundResult(ok=True, group_size=3, averaged=("gradients",), member_epochs=[0, 1, 1]))
    late.backward(3.0)
    return late, late.epochs.account(SHARE)


def test_a_peer_that_met_its_mates_next_round_takes_their_step_before_it_and_keeps_their_parameters():
    member = member_after_two_rounds(straggler_in_view=True)
    assert member.strategy.kept_update(0) is not None and member.strategy.kept_update(1) is not None
    late, record = straggler_in_the_next_round(member)
    assert record.ok and record.joined_epoch == 1 and late.counters.epoch == 2 and late.update_requests == [0]
    for ours, theirs in zip(late.params, member.params):
        assert torch.equal(ours, theirs)  # the same two steps in the same order, bit for bit
    assert late.downloads == []  # nothing to download: it is on their parameters


def test_without_a_straggler_in_view_nothing_is_kept_and_the_peer_takes_the_groups_state(caplog):
    member = member_after_two_rounds(straggler_in_view=False)
    assert member.strategy.kept_update(0) is None  # no encode, no memory, for a straggler nobody saw
    late, record = straggler_in_the_next_round(member)
    assert record.ok and record.joined_epoch == 1 and "one step apart" in caplog.text
    assert late.downloads == [2]  # a state of the group's next epoch: it holds the step it missed
    # No donor here: nothing more is recorded, and it trains on one step apart (the step of epoch 0 it missed).
    assert late.epochs.rounds[-1] is record
    assert late.counters.epoch == 2
    for ours, theirs in zip(late.params, member.params):
        assert torch.allclose(ours, theirs + 0.1 * 0.5)


def test_a_round_two_epochs_on_means_the_groups_state_even_with_the_step_before():
    late = FakeHost(GradientsStrategy(average_parameters=False), lr=0.1)
    late.averager.queue(RoundResult(ok=True, group_size=3, averaged=("gradients",), member_epochs=[0, 2, 2]))
    late.donor_state = object()
    late.backward(1.0)
    record = late.epochs.account(SHARE)
    assert record.ok and record.joined_epoch == 2 and late.update_requests == [] and late.downloads == [3]
    assert late.epochs.rounds[-1].error == MET_A_LATER_ROUND and late.epochs.rounds[-2] is record


def test_the_kept_update_of_the_round_before_lasts_until_its_straggler_could_no_longer_ask_for_it():
    """Peers 200 ms apart (docs/training.md, session 50): a straggler that met the member's round of epoch 1 with its
    epoch 0 asked for the step of epoch 0 only after the member had planned epoch 2; it then downloaded a whole state,
    and was one epoch late again at every round. So the update of epoch 0 lasts until the member plans epoch 3 (a
    straggler still at epoch 0 by then meets a round two epochs on, and takes the group's state anyway)."""
    member = member_after_two_rounds(straggler_in_view=True)
    member.averager.queue(RoundResult(ok=True, group_size=3, averaged=("gradients",), member_epochs=[2, 2, 2]))
    member.backward(1.0)
    assert member.epochs.account(SHARE).ok  # planned epoch 2 with the straggler still at epoch 0
    assert member.strategy.kept_update(0) is not None
    assert member.strategy.kept_update(1) is None  # nobody is at epoch 1: not encoded
    late, record = straggler_in_the_next_round(member)
    assert record.ok and record.joined_epoch == 1 and late.update_requests == [0] and late.downloads == []
    member.averager.queue(RoundResult(ok=True, group_size=3, averaged=("gradients",), member_epochs=[3, 3, 3]))
    member.backward(1.0)
    assert member.epochs.account(SHARE).ok  # planned epoch 3: a straggler at epoch 0 is too far behind for it
    assert member.strategy.kept_update(0) is None and member.strategy.kept_update(1) is None
