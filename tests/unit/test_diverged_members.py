"""Members whose copies of what a group should hold alike drifted apart are found and brought back together.

DiLoCo's θ_outer is the same, bit for bit, on every member of a healthy swarm. A member that
missed an outer step, or a group that mixed Δs of two epochs, leaves one copy apart; with a lossy codec and a swarm
that one group holds, "auto" never adopted the group's θ_outer (the codec's noise for nothing), so it stayed apart
for good (0.18, relative, in a late-joiner run: docs/training.md). Now every member tells its group a digest of its
copy in the rounds that carry it (`RoundPlan.digest`, `MemberInfo.digest`), the result says whether they differed
(`RoundResult.members_diverged`), and then every member adopts the group's mean whatever the codec."""

from __future__ import annotations

import msgpack
import pytest
import torch

from moshpeer.averaging.arguments import check_round_args
from moshpeer.averaging.group_dataplane import round_facts
from moshpeer.averaging.member_info import MemberInfo, pack_member_info, parse_member_info
from moshpeer.averaging.report import DataPlaneStats, RoundResult
from moshpeer.errors import ProtocolError, UserError
from moshpeer.peer.strategies.averaged_buffers import values_digest
from moshpeer.peer.strategies.diloco import DiLoCoStrategy
from moshpeer.peer.strategies.diloco_outer import OuterOptimizer
from moshpeer.peer.strategies.gradients import GradientsStrategy
from peer_fakes import FakeHost, swarm_view


def test_the_digest_tells_equal_bits_from_a_chunk_apart_on_any_size():
    values = torch.randn(3 * (1 << 22) + 5)  # more values than the digest hashes: a strided sample
    assert values_digest(values) == values_digest(values.clone()) and len(values_digest(values)) == 16
    apart = values.clone()
    apart[1 << 20: (1 << 20) + 16384] += 1e-3  # one lost chunk's worth of values
    assert values_digest(apart) != values_digest(values)
    assert values_digest(values[:100]) != values_digest(values[1:101])


def test_the_digest_travels_in_matchmaking_and_a_bad_one_is_refused():
    assert parse_member_info(pack_member_info("127.0.0.1", 4000, 1.0, bytes(16), digest=b"d" * 16)).digest == b"d" * 16
    assert parse_member_info(pack_member_info("127.0.0.1", 4000, 1.0, bytes(16))).digest == b""
    packed = msgpack.unpackb(pack_member_info("127.0.0.1", 4000, 1.0, bytes(16)))
    for bad in (b"x" * 33, "text", 7):
        with pytest.raises(ProtocolError, match="bad digest"):
            parse_member_info(msgpack.packb({**packed, "digest": bad}))
    with pytest.raises(UserError, match="digest"):
        check_round_args(2, target_group_size=None, matchmaking_time=None, digest=b"x" * 33)


@pytest.mark.parametrize("digests, diverged", [
    ((b"a", b"a", b"a"), False),
    ((b"a", b"b", b"a"), True),
    ((b"a", b"", b"a"), False),  # a member that told none (a round without such values) is no evidence
    ((b"", b"", b""), False),
])
def test_the_round_says_whether_its_members_told_different_digests(digests, diverged):
    members = [MemberInfo("127.0.0.1", 4000 + i, 1.0, bytes(16), digest=d) for i, d in enumerate(digests)]
    _, facts = round_facts(DataPlaneStats(), ["a", "b", "c"], members, 0, None)
    assert facts["members_diverged"] is diverged


def diloco_pair():
    """Two int8 DiLoCo members of a swarm one group holds, at a round that carries θ_outer, b's copy apart."""
    a, b = (FakeHost(DiLoCoStrategy(inner_steps=1, outer_optimizer=OuterOptimizer("sgd", 1.0, 0.0)),
                     compression="int8", group_size=4) for _ in range(2))
    for anchor in b.strategy.parts[0].outer.anchor:
        anchor.add_(0.5)  # b missed an outer step
    plans = [host.strategy.plan_round(0, swarm_view(trainers=2)) for host in (a, b)]
    for i in range(2):  # the group's all-reduce
        mean = (plans[0].tensors[i] + plans[1].tensors[i]) / 2
        for plan in plans:
            plan.tensors[i].copy_(mean)
    return (a, b), plans


def outer_of(host: FakeHost) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in host.strategy.parts[0].outer.anchor])


@pytest.mark.parametrize("diverged", [False, True])
def test_diloco_members_whose_theta_outer_drifted_apart_adopt_its_mean_whatever_the_codec(diverged):
    (a, b), plans = diloco_pair()
    assert plans[0].digest != plans[1].digest and all(len(plan.digest) == 16 for plan in plans)
    assert not a.strategy.adopt_outer  # int8, one group: left alone unless the digests differ
    spreads = [host.strategy.apply_averaged(plan, diverged) for host, plan in zip((a, b), plans)]
    if diverged:
        assert all(spread > 0 for spread in spreads) and torch.equal(outer_of(a), outer_of(b))
    else:
        assert spreads == [None, None] and torch.allclose(outer_of(b) - outer_of(a), torch.tensor(0.5))


def test_diloco_members_that_hold_the_same_theta_outer_tell_the_same_digest():
    a, b = (FakeHost(DiLoCoStrategy(inner_steps=1), compression="int8") for _ in range(2))
    assert a.strategy.plan_round(0, swarm_view()).digest == b.strategy.plan_round(0, swarm_view()).digest
    assert a.strategy.plan_round(1, swarm_view()).digest == b""  # a round that carries no θ_outer


def test_gradients_mode_tells_no_digest_of_its_parameters():
    """Each member steps with its own inner optimizer state: healthy members' parameters differ anyway, and adopting
    their lossy mean every parameters round would put the codec's noise into the weights every time."""
    host = FakeHost(GradientsStrategy(params_every=1), compression="int8", group_size=4)
    plan = host.strategy.plan_round(0, swarm_view(trainers=2))
    assert plan.averages == ("gradients", "parameters") and plan.digest == b""
    assert host.strategy.apply_averaged(plan, True) is None  # nor adopts on another peer's say


def test_the_epoch_loop_tells_the_digest_and_applies_what_the_round_said():
    host = FakeHost(DiLoCoStrategy(inner_steps=1), compression="int8", group_size=4)
    group_mean = outer_of(host) + 0.25
    def average(tensors):  # the group's: no pseudo-gradient (no outer step moves θ_outer), its θ_outer mean
        tensors[0].zero_()
        tensors[1].copy_(group_mean)

    host.averager.average = average
    host.averager.queue(RoundResult(ok=True, group_size=2, averaged=("pseudo_gradient", "outer_parameters"),
                                    members_diverged=True))
    told = values_digest(outer_of(host))
    host.backward(1.0)
    record = host.epochs.account(8)
    assert record.ok and host.averager.calls[0]["digest"] == told
    assert record.param_spread > 0 and torch.allclose(outer_of(host), group_mean)
