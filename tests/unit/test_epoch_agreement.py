"""A peer that ended its epoch just after its mates' group closed meets their round of the next epoch in matchmaking
(rounds are not keyed by epoch). Before: it averaged with them and kept its own count, one epoch behind theirs for
good, so every later round mixed its epoch e with their e + 1, and an owner's spot checks skipped it as "another
epoch" until the third skip in a row failed an honest peer (CI, the free-rider swarm test). Now members tell their
epoch in matchmaking and a member behind the epoch its group agreed on takes that count."""

from __future__ import annotations

import pytest

from moshpeer.averaging.member_info import pack_member_info, parse_member_info
from moshpeer.averaging.report import RoundResult
from moshpeer.errors import ProtocolError
from moshpeer.peer.optimizer.epoch_agreement import agreed_epoch
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
    import msgpack

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
