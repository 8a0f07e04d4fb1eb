"""`StateExchange` against a fake host: saving, adopting and refusing states (no network)."""

from __future__ import annotations

import pytest
import torch

from moshpeer.peer.optimizer.state_exchange import StateExchange
from moshpeer.peer.strategies.diloco import DiLoCoStrategy
from moshpeer.peer.strategies.gradients import GradientsStrategy
from peer_fakes import FakeHost, tiny_model


def exchange_for(host: FakeHost) -> StateExchange:
    return StateExchange(host, dht=None, run_id="unit", role="trainer", serve=False, address="127.0.0.1",
                         download_timeout=1.0)


def trained(seed: int = 0, strategy=None) -> FakeHost:
    host = FakeHost(strategy or GradientsStrategy(), model=tiny_model(seed))
    host.backward(1.0)
    host.inner_step()
    return host


def test_state_dict_round_trips_epoch_steps_and_the_strategys_state():
    host = trained(strategy=DiLoCoStrategy(inner_steps=4))
    host.counters.epoch = 7
    host.strategy.on_micro_batch(1)
    state = exchange_for(host).state_dict()
    assert state["collaborative"]["epoch"] == 7 and state["collaborative"]["steps"] == 1
    other = FakeHost(DiLoCoStrategy(inner_steps=4))
    exchange_for(other).load_state_dict(state)
    assert (other.counters.epoch, other.counters.steps, other.strategy.steps_this_epoch) == (7, 1, 1)
    plain = FakeHost(GradientsStrategy())
    exchange_for(plain).load_state_dict(host.inner.state_dict())  # a plain torch state dict loads too
    assert plain.counters.epoch == 0


def test_a_newcomer_adopts_a_donors_collaborative_state_and_starts_a_fresh_epoch():
    donor = trained(seed=1)
    donor.counters.epoch = 3
    state = exchange_for(donor).collaborative_state()
    newcomer = FakeHost(GradientsStrategy(), model=tiny_model(2))
    newcomer.counters.samples = 5
    exchange_for(newcomer).load_collaborative_state(state)
    assert all(torch.equal(p, q) for p, q in zip(newcomer.params, donor.params))
    assert newcomer.counters.epoch == 3 and newcomer.counters.steps == 1 and newcomer.counters.samples == 0


def test_a_state_of_another_model_is_refused_and_changes_nothing():
    donor = FakeHost(GradientsStrategy(), model=torch.nn.Linear(4, 2))
    state = exchange_for(donor).collaborative_state()
    host = trained()
    before = [p.detach().clone() for p in host.params]
    exchange = exchange_for(host)
    with pytest.raises(ValueError):
        exchange.load_collaborative_state(state)
    with pytest.raises(ValueError):
        exchange.check_state_fits({**exchange.collaborative_state(), "format": 2})
    with pytest.raises(ValueError):
        exchange.check_state_fits(exchange.collaborative_state(), max_epoch=-1)  # an epoch beyond what is plausible
    assert all(torch.equal(p, q) for p, q in zip(host.params, before)) and host.counters.epoch == 0


def test_a_checkpoint_continues_exactly_and_a_mismatched_one_is_refused():
    host = trained()
    host.counters.epoch, host.counters.samples, host.counters.total_samples = 2, 12, 40
    host.counters.grad_sums[0].fill_(3.0)
    saved = exchange_for(host).checkpoint_state()
    saved = {k: ([t.clone() for t in v] if k == "grad_accumulators" else v) for k, v in saved.items()}
    restored = FakeHost(GradientsStrategy())
    exchange_for(restored).load_checkpoint_state(saved)
    c = restored.counters
    assert (c.epoch, c.steps, c.samples, c.total_samples) == (2, 1, 12, 40) and torch.all(c.grad_sums[0] == 3.0)
    with pytest.raises(ValueError):
        exchange_for(FakeHost(GradientsStrategy(), model=torch.nn.Linear(4, 2))).load_checkpoint_state(saved)


def test_a_donor_serves_one_snapshot_per_epoch():
    host = trained()
    exchange = exchange_for(host)
    first = exchange.serialized_state()
    host.backward(1.0)
    host.inner_step()  # inner steps within the epoch: the same bytes, so pieces of one download agree
    assert exchange.serialized_state() is first
    host.counters.epoch += 1
    second = exchange.serialized_state()
    assert second[0] == 1 and second[1] != first[1]


def test_a_busy_donor_serves_the_previous_epochs_snapshot_but_never_an_older_one(monkeypatch):
    """test_preemption_swarm's failure under load: survivors advertising epoch 18 served the snapshot they had
    cut at epoch 1 (their lock busy with a round), and the rejoined peer adopted epoch 1."""
    import threading

    from moshpeer.peer.optimizer import state_exchange

    monkeypatch.setattr(state_exchange, "SNAPSHOT_WAIT_S", 0.05)
    host = trained()
    exchange = exchange_for(host)
    host.counters.epoch = 1
    assert exchange.serialized_state()[0] == 1
    held, release = threading.Event(), threading.Event()

    def hold_lock():  # an epoch's end in progress
        with host.lock:
            held.set()
            release.wait(5)

    holder = threading.Thread(target=hold_lock)
    holder.start()
    held.wait(5)
    try:
        host.counters.epoch = 2
        assert exchange.serialized_state()[0] == 1  # the previous epoch's: served at once
        host.counters.epoch = 18
        with pytest.raises(TimeoutError):
            exchange.serialized_state()  # epoch 1 while at 18: never
    finally:
        release.set()
        holder.join()
    assert exchange.serialized_state()[0] == 18


def test_a_residual_is_checkpointed_but_never_handed_to_a_newcomer():
    # The residual is this peer's own unsent Δ: a newcomer that adopted it would send it a second time.
    from moshpeer.compression import get_compression
    from moshpeer.compression.residual_feedback import ResidualFeedback

    def with_residual(seed: int) -> FakeHost:
        model = tiny_model(seed)
        numel = sum(p.numel() for p in model.parameters())
        residual = ResidualFeedback(numel, get_compression("topk-int2:0.5:4:2").sparsifier)
        return FakeHost(DiLoCoStrategy(inner_steps=2), model=model, error_feedback=residual)

    donor = with_residual(1)
    donor.error_feedback.e.normal_()
    donor.error_feedback.steps = 3
    saved = exchange_for(donor).state_dict()
    restored = with_residual(2)
    exchange_for(restored).load_state_dict(saved)
    assert torch.equal(restored.error_feedback.e, donor.error_feedback.e) and restored.error_feedback.steps == 3

    served = exchange_for(donor).collaborative_state()
    assert served["error_feedback"] is None
    newcomer = with_residual(3)
    newcomer.error_feedback.e.fill_(1.0)  # whatever it held before is not the swarm's either
    exchange_for(newcomer).load_collaborative_state(served)
    assert not newcomer.error_feedback.e.any() and newcomer.error_feedback.steps == 0
