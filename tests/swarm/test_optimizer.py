"""CollaborativeOptimizer in one process: the torch.optim.Optimizer surface, sample-weighted accumulation
for a lone peer, and state download (including a donor that lies about its checksum)."""

from __future__ import annotations

import hashlib
import socket
import threading
import time

import msgpack
import pytest
import torch
from hivemind.utils import get_dht_time

from moshpeer.dht.keys import state_offers_key
from moshpeer.peer.state import framing
from moshpeer.peer.state import pieces as state_pieces
from moshpeer.peer.optimizer import CollaborativeOptimizer
from moshpeer.peer.strategies.gradients import GradientsStrategy

pytestmark = pytest.mark.timeout(120)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def batches(n: int, size: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 8, generator=generator), torch.randint(0, 3, (size,), generator=generator))
            for _ in range(n)]


def loss_of(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def collaborative(model, dht, run_id, **kwargs) -> CollaborativeOptimizer:
    kwargs.setdefault("target_batch_size", 64)
    return CollaborativeOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), run_id=run_id, dht=dht,
                                  model=model, matchmaking_time=0.5, round_timeout=5.0, progress_refresh=0.2,
                                  **kwargs)


def test_lone_peer_steps_on_the_sample_weighted_mean_gradient(dht_node):
    dht = dht_node(run_ids=["lone"])
    model, reference = make_model(), make_model()
    opt = collaborative(model, dht, "lone", batch_size_per_step=16)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    try:
        assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups is opt.inner.param_groups
        data = batches(8, 16)
        # Micro-batches of unequal size: the mean must weight each by its samples.
        sizes = [16, 16, 8, 24] * 2
        for batch, size in zip(data, sizes):
            loss_of(model, (batch[0][:size] if size <= 16 else torch.cat([batch[0], batch[0][: size - 16]]),
                            batch[1][:size] if size <= 16 else torch.cat([batch[1], batch[1][: size - 16]]))
                    ).backward()
            opt.step(batch_size=size)
            opt.zero_grad()
        assert opt.local_epoch == 2 and [r.error for r in opt.rounds] == ["alone", "alone"]
        assert [r.samples for r in opt.rounds] == [64, 64]

        for epoch in range(2):
            ref_opt.zero_grad()
            total = 0
            for batch, size in list(zip(data, sizes))[epoch * 4 : epoch * 4 + 4]:
                x = batch[0][:size] if size <= 16 else torch.cat([batch[0], batch[0][: size - 16]])
                y = batch[1][:size] if size <= 16 else torch.cat([batch[1], batch[1][: size - 16]])
                (loss_of(reference, (x, y)) * size).backward()
                total += size
            for p in reference.parameters():
                p.grad /= total
            ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    finally:
        opt.shutdown()


def test_scheduler_and_state_dict_pass_through(dht_node):
    dht = dht_node(run_ids=["surface"])
    model = make_model()
    opt = collaborative(model, dht, "surface", batch_size_per_step=32)
    try:
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for batch in batches(2, 32):
            loss_of(model, batch).backward()
            opt.step()
            opt.zero_grad()
            scheduler.step()
        assert opt.inner.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)
        state = opt.state_dict()
        assert state["collaborative"]["epoch"] == 1 and state["state"]
        other_dht = dht_node(run_ids=["surface2"])  # one averager per DHT node and run
        fresh = collaborative(make_model(), other_dht, "surface2", batch_size_per_step=32, serve_state=False)
        try:
            hooked = []
            fresh.register_step_post_hook(lambda optimizer, args, kwargs: hooked.append(optimizer))
            fresh.load_state_dict(state)
            assert fresh.local_epoch == 1
            assert fresh.inner.param_groups[0]["lr"] == pytest.approx(opt.inner.param_groups[0]["lr"])
            # The wrapped optimizer replaced its groups and state while loading: ours are still its very objects,
            # so a scheduler attached later changes the learning rate the inner optimizer uses.
            assert fresh.param_groups is fresh.inner.param_groups and fresh.state is fresh.inner.state
            torch.optim.lr_scheduler.StepLR(fresh, step_size=1, gamma=0.1).step()
            assert fresh.inner.param_groups[0]["lr"] == pytest.approx(opt.inner.param_groups[0]["lr"] * 0.1)
            loss_of(fresh.model, batches(1, 32)[0]).backward()
            fresh.step()
            assert hooked == [fresh]  # torch's step hooks run around our step
        finally:
            fresh.shutdown()
    finally:
        opt.shutdown()


class LyingDonor:
    """A donor that speaks the protocol (signing the honest manifest with its own identity) but sends pieces that
    do not match it."""

    def __init__(self, payload: bytes, identity, run_id: str, epoch: int):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.payload, self.identity, self.run_id, self.epoch = payload, identity, run_id, epoch
        piece = state_pieces.piece_bytes_for(len(payload), 1 << 20)
        self.manifest = state_pieces.Manifest(
            epoch, len(payload), hashlib.sha256(payload).hexdigest(), piece,
            tuple(hashlib.sha256(payload[i : i + piece]).digest() for i in range(0, len(payload), piece)))
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                request = framing.recv_msgpack(conn, time.monotonic() + 10)
                self.requests += 1
                m = self.manifest
                if request["op"] == "get_manifest":
                    signed = state_pieces._manifest_fields(self.run_id, request["challenge"], m)
                    header = {"ok": True, "epoch": m.epoch, "total_bytes": m.total_bytes, "sha256": m.sha256,
                              "piece_bytes": m.piece_bytes, "public_key": self.identity.public_key.to_bytes(),
                              "signature": self.identity.private_key.sign(signed)}
                    framing.send_frame(conn, msgpack.packb(header))
                    framing.send_frame(conn, b"".join(m.piece_hashes))
                    continue
                framing.send_frame(conn, msgpack.packb({"ok": True}))
                for index in range(request["first"], request["first"] + request["count"]):
                    start, end = m.piece_range(index, 1)
                    corrupted = bytearray(self.payload[start:end])
                    corrupted[len(corrupted) // 2] ^= 0xFF
                    framing.send_frame(conn, bytes(corrupted))


def test_download_skips_a_lying_donor_and_adopts_the_honest_one(dht_node):
    run = "sync"
    boot = dht_node(run_ids=[run])
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    donor_dht = dht_node(initial_peers=maddrs, run_ids=[run])
    liar_dht = dht_node(initial_peers=maddrs, run_ids=[run])
    newcomer_dht = dht_node(initial_peers=maddrs, run_ids=[run])

    donor_model = make_model(seed=0)
    # Two trainers in the run: each one's share of the 128-sample target is 64 samples (two steps).
    donor = collaborative(donor_model, donor_dht, run, batch_size_per_step=32, target_batch_size=128)
    newcomer = collaborative(make_model(seed=5), newcomer_dht, run, batch_size_per_step=32, target_batch_size=128,
                             serve_state=False)
    newcomer.progress.refresh_now()
    assert donor.wait_for_peers(2, timeout=30) == 2
    try:
        for batch in batches(6, 32):  # three epochs on the donor
            loss_of(donor_model, batch).backward()
            donor.step()
            donor.zero_grad()
        assert donor.local_epoch == 3
        donor.advertise(force=True)
        # The liar claims one epoch more than the swarm (the most the robust progress view confirms), so it is
        # asked first.
        liar = LyingDonor(donor.exchange.serialized_state()[1], liar_dht.identity, run, epoch=4)
        offer = {"peer_id": liar_dht.identity.peer_id, "host": "127.0.0.1", "port": liar.port, "epoch": 4,
                 "protocol": framing.STATE_PROTOCOL}
        assert liar_dht.store(state_offers_key(run), offer, expiration_time=get_dht_time() + 30,
                              subkey=liar_dht.owner_subkey)

        downloaded = newcomer.catch_up()
        assert downloaded is not None and liar.requests == 2  # its manifest, then one range of pieces
        assert downloaded.donor == donor_dht.identity.peer_id
        assert [peer for peer, _ in downloaded.failed_donors] == [liar_dht.identity.peer_id]
        assert "does not match the manifest" in downloaded.failed_donors[0][1]
        assert newcomer.local_epoch == 3
        for p, q in zip(newcomer.model.parameters(), donor_model.parameters()):
            assert torch.equal(p, q)
        assert newcomer.inner.state_dict()["state"][0]["step"] == donor.inner.state_dict()["state"][0]["step"]
    finally:
        newcomer.shutdown()
        donor.shutdown()


def _train_together(optimizers, models, epochs: int, batch_size: int = 32, min_ok_rounds: int = 0) -> None:
    """Step every optimizer in its own thread (real averaging rounds between them) for `epochs` epochs, or
    until each has averaged with a group `min_ok_rounds` times (a loaded machine loses some rounds)."""
    errors = []

    def run(opt, model, seed):
        try:
            data = iter(batches(64, batch_size, seed=seed))
            def finished() -> bool:
                averaged = sum(r.ok for r in opt.rounds)
                return opt.local_epoch >= epochs or (min_ok_rounds > 0 and averaged >= min_ok_rounds)

            while not finished():
                loss_of(model, next(data)).backward()
                opt.step()
                opt.zero_grad()
        except Exception as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(o, m, i + 1)) for i, (o, m) in enumerate(zip(optimizers, models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert not errors and not any(t.is_alive() for t in threads)


def test_error_feedback_state_is_checkpointed_and_downloaded(dht_node):
    run = "ef"
    boot = dht_node(run_ids=[run])
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    dhts = [dht_node(initial_peers=maddrs, run_ids=[run]) for _ in range(3)]
    models = [make_model(seed=0), make_model(seed=0)]
    options = dict(batch_size_per_step=32, target_batch_size=64, compression="arc-topk:0.25", error_feedback=True)
    peers = [collaborative(model, dht, run, **options) for model, dht in zip(models, dhts)]
    newcomer = None
    try:
        assert peers[0].wait_for_peers(2, timeout=30) == 2 and peers[1].wait_for_peers(2, timeout=30) == 2
        _train_together(peers, models, epochs=12, min_ok_rounds=2)
        donor = peers[0]
        assert any(r.ok for r in donor.rounds), [r.error for r in donor.rounds]
        feedback = donor.state_dict()["collaborative"]["error_feedback"]
        assert feedback["steps"] == sum(r.ok for r in donor.rounds) and float(feedback["e_bar"].abs().sum()) > 0

        # state_dict / load_state_dict carry it.
        restored_opt = collaborative(make_model(seed=3), dht_node(run_ids=["ef-restore"]), "ef-restore",
                                     serve_state=False, **options)
        try:
            restored_opt.load_state_dict(donor.state_dict())
            for name in ("h", "e", "e_bar"):
                assert torch.equal(getattr(restored_opt.error_feedback, name), feedback[name])
            assert restored_opt.error_feedback.steps == feedback["steps"]
        finally:
            restored_opt.shutdown()

        # A newcomer downloads it with the parameters.
        newcomer = collaborative(make_model(seed=9), dhts[2], run, serve_state=False, **options)
        donor.advertise(force=True)
        peers[1].advertise(force=True)
        downloaded = newcomer.catch_up()
        assert downloaded is not None
        source = peers[0] if downloaded.donor == dhts[0].identity.peer_id else peers[1]
        for name in ("h", "e", "e_bar"):
            assert torch.equal(getattr(newcomer.error_feedback, name), getattr(source.error_feedback, name))
        assert newcomer.error_feedback.steps == source.error_feedback.steps > 0
    finally:
        for opt in peers + ([newcomer] if newcomer is not None else []):
            opt.shutdown()


def test_error_feedback_needs_a_sparsifying_codec(dht_node):
    from moshpeer.errors import UserError

    with pytest.raises(UserError, match="sparsifying codec"):
        collaborative(make_model(), dht_node(run_ids=["ef-bad"]), "ef-bad", batch_size_per_step=32,
                      compression="int8", error_feedback=True)


def test_group_target_follows_live_peers_and_budget_bounds_the_window(dht_node):
    from moshpeer.peer.optimizer.round_timing import MIN_BUDGET_WINDOW_S
    from moshpeer.peer.optimizer.progress import ProgressSnapshot

    def swarm(trainers: int, aux: int = 0) -> ProgressSnapshot:
        return ProgressSnapshot(global_epoch=0, samples_accumulated=0, target_batch_size=64, num_trainers=trainers,
                                num_aux=aux, samples_per_second=0.0, fetched_at=0.0)

    model = make_model()
    opt = collaborative(model, dht_node(run_ids=["target"]), "target", batch_size_per_step=16, group_size=4,
                        compute_budget=0.4)
    timing = opt.timing
    timing.matchmaking_time = 1.0
    try:
        assert [opt.epochs.group_target(swarm(n)) for n in (1, 2, 3, 4, 9)] == [2, 2, 3, 4, 4]
        assert opt.epochs.group_target(swarm(2, aux=1)) == 3 and opt.epochs.group_target(swarm(4, aux=1)) == 4
        timing.begin_epoch()  # the epoch begins now
        assert timing.matchmaking_window() == 1.0  # no full group assembled yet: the whole matchmaking time
        # Once the averager saw one assemble (0.05 s), the window ends at the budget deadline of the epoch (0.4 s
        # after it began), never below the floor.
        timing.fastest_assembly = lambda size: 0.05
        window = timing.matchmaking_window()
        assert MIN_BUDGET_WINDOW_S < window <= 0.4
        timing.epoch_budget._start -= 0.5  # the epoch began 0.5 s earlier: the deadline has passed
        assert timing.matchmaking_window() == pytest.approx(MIN_BUDGET_WINDOW_S)
        timing.fastest_assembly = lambda size: 0.15  # the averager saw complete groups take 0.15 s (a loaded machine)
        assert timing.matchmaking_window() == pytest.approx(0.45)
        timing.compute_budget = None
        timing.begin_epoch()
        assert timing.matchmaking_window() == 1.0  # no budget: the configured matchmaking time
    finally:
        opt.shutdown()


def test_gradient_rounds_send_the_parameters_only_every_k_epochs(dht_node):
    run = "every"
    boot = dht_node(run_ids=[run])
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    models = [make_model(seed=0), make_model(seed=1)]  # they start apart: the first parameter round joins them
    peers = [collaborative(model, dht_node(initial_peers=maddrs, run_ids=[run]), run, batch_size_per_step=32,
                           averaging=GradientsStrategy(params_every=3)) for model in models]
    try:
        assert all(opt.wait_for_peers(2, timeout=30) == 2 for opt in peers)
        _train_together(peers, models, epochs=7)
        for opt in peers:
            ok = [r for r in opt.rounds if r.ok]
            for r in ok:
                assert r.averaged == (("gradients", "parameters") if r.epoch % 3 == 0 else ("gradients",)), r
            grads_only = [r.bytes_sent for r in ok if r.averaged == ("gradients",)]
            with_params = [r.bytes_sent for r in ok if "parameters" in r.averaged]
            assert grads_only and with_params, [(r.epoch, r.ok, r.error) for r in opt.rounds]
            assert max(grads_only) < 0.55 * min(with_params), (grads_only, with_params)
            first = next(r for r in ok if "parameters" in r.averaged)
            assert first.param_spread > 0 if first.epoch == 0 else True
        if all(r.ok for opt in peers for r in opt.rounds):  # then nobody ever stepped alone since epoch 0
            for p, q in zip(*(m.parameters() for m in models)):
                assert torch.equal(p, q)
    finally:
        for opt in peers:
            opt.shutdown()
