"""A missed DiLoCo round costs a round, not a download (issue 27): the members keep the Δ̄ they applied, a peer
whose round failed while they averaged fetches it, checks it and takes the same outer step, and falls back to a
download only when no update fits. The wire part runs on a real `StateServer` over localhost."""

from __future__ import annotations

import pytest
import torch

from moshpeer.averaging.report import RoundResult
from moshpeer.dht.identity import Identity
from moshpeer.errors import ProtocolError
from moshpeer.peer.optimizer.epoch_loop import MISSED_ROUND_UPDATE
from moshpeer.peer.state.framing import deserialize_state, serialize_state
from moshpeer.peer.state.sync import StateOffer, StateServer, fetch_state_from
from moshpeer.peer.state.updates import UPDATE_KIND, UPDATE_OP, update_handler
from moshpeer.peer.strategies.diloco import DiLoCoStrategy
from moshpeer.peer.strategies.round_update import UPDATE_NORM_BOUND, RoundUpdate
from peer_fakes import FakeHost


def member_and_latecomer(compression: str = "none", **diloco) -> tuple:
    """Two peers from the same start: the member's round averages (its Δ̄ = half its own Δ: a mate that did
    nothing), the latecomer's finds no group while the swarm moved on. Each takes one epoch of inner steps."""
    diloco.setdefault("inner_steps", 1)
    member, late = (FakeHost(DiLoCoStrategy(**diloco), compression=compression) for _ in range(2))
    member.averager.average = lambda tensors: tensors[0].mul_(0.5)  # θ_outer, if it travels, is the mate's too
    member.averager.queue(RoundResult(ok=True, group_size=2, averaged=("pseudo_gradient",)))
    late.averager.queue(RoundResult(ok=False, error="no group"))
    late.swarm.moved_on, late.donor_state = True, object()
    return member, late


def anchors(host: FakeHost) -> list:
    return [a.clone() for part in host.strategy.parts for a in part.outer.anchor]


@pytest.mark.parametrize("compression", ["none", "int8", "int4"])
def test_a_latecomer_takes_the_groups_step_instead_of_a_download(compression):
    member, late = member_and_latecomer(compression)
    member.backward(1.0)
    assert member.epochs.account(8).ok
    update = member.strategy.kept_update(0)
    assert update is not None and member.strategy.kept_update(1) is None
    late.updates = [update]
    late.backward(3.0)
    record = late.epochs.account(8)
    assert record.error == MISSED_ROUND_UPDATE and not record.ok
    assert late.update_requests == [0] and late.downloads == []  # one round's bytes, no state download
    assert record.carried_samples == 8 and record.dropped_samples == 0 and late.counters.dropped_samples == 0
    assert late.counters.epoch == 1
    for ours, theirs in zip(anchors(late), anchors(member)):
        if compression == "none":
            assert torch.equal(ours, theirs)  # the group's Δ̄ bit for bit
        else:  # re-encoded once: within the codec's error of one update
            step = 0.1 * 0.5  # the member's Δ̄ per value: lr x gradient x 1/2
            assert (ours - theirs).abs().max() <= step * (0.01 if compression == "int8" else 0.15)
    # Both are at θ_outer, and the latecomer keeps its own step of the missed round (lr 0.1 x gradient 3): its next
    # Δ carries it into the next round instead of losing it.
    for p, q in zip(late.params, member.params):
        assert torch.allclose(p, q - 0.3, atol=0.01)
    for own in late.strategy._own_delta(late.strategy.parts[0]):
        assert torch.allclose(own, torch.full_like(own, 0.3), atol=0.01)


def latecomer_that_took_the_update() -> tuple:
    """A latecomer that missed round 0 and took the member's update (its epoch's 8 samples now carried) -> (the
    latecomer, the record of its missed round)."""
    member, late = member_and_latecomer()
    member.backward(1.0)
    member.epochs.account(8)
    late.updates = [member.strategy.kept_update(0)]
    late.backward(3.0)
    return late, late.epochs.account(8)


def test_the_next_round_weighs_the_carried_work_with_its_own():
    # Merging by tokens: the latecomer's next Δ holds two epochs of its work, so its round weighs both epochs'
    # samples; the round after that is back to one epoch's.
    late, missed = latecomer_that_took_the_update()
    assert missed.error == MISSED_ROUND_UPDATE
    assert late.averager.calls[-1]["weight"] == 8.0
    for weight in (16.0, 8.0):
        late.averager.queue(RoundResult(ok=True, group_size=2, averaged=("pseudo_gradient",)))
        late.backward(1.0)
        record = late.epochs.account(8)
        assert record.ok and late.averager.calls[-1]["weight"] == weight
        assert record.samples == 8 and record.samples_carried_in == weight - 8


def test_a_download_drops_the_carried_work_too():
    late, missed = latecomer_that_took_the_update()
    assert missed.carried_samples == 8
    late.averager.queue(RoundResult(ok=False, error="no group"))
    late.updates = [{"format": 99}]  # the second missed round's update does not fit: a download
    late.backward(1.0)
    record = late.epochs.account(8)
    assert record.error == "missed round; caught up" and record.dropped_samples == 16
    assert late.counters.dropped_samples == 16 and late.counters.carried == {}


@pytest.mark.parametrize("donor_at, skipped", [((1, 3), 3), ((2, 0), 7)])
def test_the_latecomer_starts_its_next_epoch_where_it_meets_the_next_round(donor_at, skipped):
    # Late by more than the matchmaking window, a peer that computed all H steps of the next epoch would be as late
    # for the next round, and every one after: it starts as many steps in as the donor was when it served the
    # update ((1, 3)), or at the epoch's last step when the donor had already ended that epoch ((2, 0): it learned
    # of its miss late, e.g. after a slow first micro-batch, and the donor's round of epoch 1 is under way).
    member, late = member_and_latecomer(inner_steps=8)
    for _ in range(8):
        member.backward(1.0)
        member.epochs.account(8)
    for _ in range(donor_at[1]):
        assert member.epochs.account(8) is None
    update = member.strategy.kept_update(0)
    assert update["phase"] == [1, donor_at[1]]  # what a donor says of itself
    update["phase"] = list(donor_at)  # (a donor whose round of epoch 1 ended would serve that round's update)
    late.updates = [update]
    for _ in range(8):
        late.backward(3.0)
        record = late.epochs.account(8)
    assert record.error == MISSED_ROUND_UPDATE and late.strategy.steps_this_epoch == skipped
    late.averager.queue(RoundResult(ok=True, group_size=2, averaged=("pseudo_gradient",)))
    steps = 8 - skipped  # to the next round
    assert [late.epochs.account(8) is None for _ in range(steps)] == [True] * (steps - 1) + [False]


def test_an_update_that_does_not_fit_falls_back_to_a_download():
    member, late = member_and_latecomer()
    member.backward(1.0)
    member.epochs.account(8)
    wrong_epoch = {**member.strategy.kept_update(0), "epoch": 5}
    too_large = RoundUpdate.encode(torch.full((8,), 100.0), epoch=0, fragment=0, steps=0,
                                   compression="none").to_state()
    late.updates = [wrong_epoch, too_large, {"format": 99}]
    late.backward(1.0)
    record = late.epochs.account(8)
    assert record.error == "missed round; caught up" and late.downloads == [1]


def test_an_overlapped_latecomer_takes_the_groups_step_and_keeps_its_progress():
    member, late = member_and_latecomer(overlap=True, inner_steps=1)
    for host, grad in ((member, 1.0), (late, 3.0)):
        host.backward(grad)
        assert host.epochs.account(8).error == "round in flight"
    assert member.epochs.account(8).ok  # the next epoch end resolves round 0
    late.updates = [member.strategy.kept_update(0)]
    record = late.epochs.account(8)  # resolves its round 0 (missed) and sends the Δ of its second epoch
    assert record.epoch == 0 and record.error == MISSED_ROUND_UPDATE and record.carried_samples == 8
    assert late.update_requests == [0] and late.downloads == []
    assert late.averager.calls[-1]["weight"] == 16.0  # the pending Δ holds both epochs' samples
    for ours, theirs in zip(anchors(late), anchors(member)):
        assert torch.equal(ours, theirs)
    # Both epochs' inner steps (lr 0.1 x gradient 3 each) are kept: the missed round's is carried into the Δ now
    # pending, with the second epoch's.
    for pending in late.strategy.parts[0].outer.pending_delta():
        assert torch.allclose(pending, torch.full_like(pending, 0.6))


def test_a_member_keeps_the_latest_update_of_each_fragment():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    host = FakeHost(DiLoCoStrategy(inner_steps=2, fragments=2), model=model)
    for epoch in range(3):
        host.averager.queue(RoundResult(ok=True, group_size=2, averaged=("pseudo_gradient",)))
        host.backward(1.0)
        assert host.epochs.account(8).ok
    # Rounds 0 and 2 averaged fragment 0, round 1 fragment 1: round 0's Δ̄ is gone, 1 and 2 are kept.
    assert host.strategy.kept_update(0) is None
    for epoch, fragment in ((1, 1), (2, 0)):
        kept = RoundUpdate.from_state(host.strategy.kept_update(epoch))
        assert (kept.epoch, kept.fragment, kept.numel) == (epoch, fragment, host.strategy.parts[fragment].buffer.numel())
    assert RoundUpdate.from_state(host.strategy.kept_update(2)).steps == 1  # fragment 0's second step


def test_check_fits_names_what_is_wrong():
    own = torch.ones(8)
    update = RoundUpdate.encode(torch.full((8,), 0.5), epoch=3, fragment=1, steps=2, compression="int8")
    fits = dict(epoch=3, fragment=1, steps=2, own=own)
    assert torch.allclose(update.check_fits(**fits), torch.full((8,), 0.5), atol=0.01)
    for wrong, message in (({"epoch": 4}, "epoch 3"), ({"fragment": 0}, "fragment 1"),
                           ({"steps": 1}, "2 steps"), ({"own": torch.ones(9)}, "8 values"),
                           ({"own": own * 0.5 / (UPDATE_NORM_BOUND + 1)}, "norm")):
        with pytest.raises(ValueError, match=message):
            update.check_fits(**{**fits, **wrong})


@pytest.mark.parametrize("bad", [{"format": 2}, {"epoch": True}, {"numel": -1}, {"codec": "gzip"},
                                 {"payloads": [torch.zeros(4)]}, {"payloads": "bytes"}, {"phase": [1]},
                                 {"phase": [1, -2]}, {"phase": "late"}])
def test_a_strangers_update_is_refused_unless_every_field_has_its_type(bad):
    state = RoundUpdate.encode(torch.ones(8), epoch=0, fragment=0, steps=0, compression="int4").to_state()
    with pytest.raises(ValueError):
        RoundUpdate.from_state({**state, **bad})


def test_a_corrupt_payload_is_refused_when_decoded():
    update = RoundUpdate.encode(torch.ones(8), epoch=0, fragment=0, steps=0, compression="none")
    broken = RoundUpdate(**{**update.__dict__, "payloads": [torch.full((32,), 255, dtype=torch.uint8)]})  # NaNs
    with pytest.raises(ValueError, match="does not decode"):
        broken.decode()


def test_a_donor_serves_its_kept_update_signed_as_an_update():
    identity = Identity.generate()
    data = serialize_state(RoundUpdate.encode(torch.arange(8.0), epoch=3, fragment=0, steps=1,
                                              compression="none").to_state())
    server = StateServer(lambda: (9, b"state"), run_id="upd", identity=identity,
                         handlers={UPDATE_OP: update_handler(lambda epoch: data if epoch == 3 else None)})
    try:
        offer = StateOffer(identity.peer_id, server.host, server.port, 4)
        epoch, got, _ = fetch_state_from(offer, "upd", timeout=10.0, op=UPDATE_OP, fields={"epoch": 3},
                                         kind=UPDATE_KIND)
        assert epoch == 3 and torch.equal(RoundUpdate.from_state(deserialize_state(got)).decode(), torch.arange(8.0))
        with pytest.raises(ProtocolError, match="bad state header"):  # no update of that round: {"ok": false}
            fetch_state_from(offer, "upd", timeout=10.0, op=UPDATE_OP, fields={"epoch": 2}, kind=UPDATE_KIND)
        with pytest.raises(ProtocolError, match="signature"):  # an update's header does not pass for a state's
            fetch_state_from(offer, "upd", timeout=10.0, op=UPDATE_OP, fields={"epoch": 3})
        assert fetch_state_from(offer, "upd", timeout=10.0)[:2] == (9, b"state")  # the state op is unchanged
    finally:
        server.shutdown()


def test_a_sparse_update_travels_as_its_non_zero_blocks():
    # A topk-int2 round's Δ̄ is zero outside its selected rows: densely encoded (int8) it took 33x the round's bytes.
    numel = 64 * 256 + 100  # a partial last block
    delta = torch.zeros(numel)
    delta[3 * 256:4 * 256] = torch.linspace(-1, 1, 256)
    delta[-50:] = 0.25  # in the partial last block
    update = RoundUpdate.encode(delta, epoch=1, fragment=0, steps=0, compression="topk-int2:0.0156")
    state = update.to_state()
    assert state["format"] == 2 and state["blocks"].tolist() == [3, 64]
    assert update.nbytes < 2 * 256 + 64 + 8  # two blocks of int8 and their two indices, not numel bytes
    decoded = RoundUpdate.from_state(deserialize_state(serialize_state(state))).decode()
    outside = torch.ones(numel, dtype=torch.bool)
    outside[3 * 256:4 * 256] = outside[64 * 256:] = False
    assert decoded.numel() == numel and not decoded[outside].any()  # zero outside the blocks, exactly
    assert torch.allclose(decoded, delta, atol=0.01)
    # A dense Δ̄ stays in the dense format (format 1: what peers of earlier versions read).
    assert RoundUpdate.encode(torch.ones(numel), epoch=1, fragment=0, steps=0,
                              compression="int8").to_state()["format"] == 1
    for bad in (torch.tensor([64, 3], dtype=torch.int32), torch.tensor([3, 65], dtype=torch.int32),
                torch.tensor([-1, 3], dtype=torch.int32), torch.tensor([3, 3], dtype=torch.int32)):
        with pytest.raises(ValueError, match="blocks"):
            RoundUpdate.from_state({**state, "blocks": bad}).decode()
    for bad in (torch.tensor([3, 64]), [3, 64], None):  # not int32, not a tensor, missing
        with pytest.raises(ValueError, match="blocks"):
            RoundUpdate.from_state({**state, "blocks": bad})
    with pytest.raises(ValueError, match="chunk"):  # blocks that the payloads do not hold
        RoundUpdate.from_state({**state, "blocks": torch.tensor([3], dtype=torch.int32)}).decode()
