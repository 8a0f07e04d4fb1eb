"""State download against hostile donors (issue 14): one deadline inside the receive loop, memory that
follows the bytes that arrive, the donor's identity, full validation, and a cross-check between donors."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import tracemalloc

import msgpack
import pytest
import torch

from moshpeer.dht.identity import Identity
from moshpeer.peer.state import framing
from moshpeer.peer.state import sync as state_sync
from moshpeer.peer.optimizer import CollaborativeOptimizer
from moshpeer.peer.state.framing import StateOffer, serialize_state
from moshpeer.peer.state.sync import StateServer, download_state, fetch_state_from
from moshpeer.peer.state.validation import validate_counters
from moshpeer.peer.tensor_checks import validate_optimizer_state

pytestmark = pytest.mark.timeout(120)

RUN = "state-trust"


class SlowDonor:
    """Signs a header announcing `announced` bytes in one frame, then sends `drip` bytes every 0.1 s."""

    def __init__(self, identity: Identity, announced: int, drip: int):
        self.identity, self.announced, self.drip = identity, announced, drip
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.offer = StateOffer(identity.peer_id, "127.0.0.1", self.sock.getsockname()[1], 1)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            request = framing.recv_msgpack(conn, time.monotonic() + 10)
            digest = "0" * 64
            signed = framing.signed_fields(RUN, request["challenge"], 1, self.announced, digest)
            header = {"ok": True, "epoch": 1, "total_bytes": self.announced, "chunk_bytes": 64 << 20,
                      "sha256": digest, "public_key": self.identity.public_key.to_bytes(),
                      "signature": self.identity.private_key.sign(signed)}
            framing.send_frame(conn, msgpack.packb(header))
            try:
                conn.sendall(framing._LEN.pack(min(self.announced, 64 << 20)))
                while self.drip:
                    conn.sendall(b"x" * self.drip)
                    time.sleep(0.1)
                time.sleep(30)
            except OSError:
                pass


@pytest.fixture(scope="module")
def identity() -> Identity:
    return Identity.generate()


def test_one_deadline_for_the_whole_download(identity):
    """A donor trickling a 64 MiB frame (each recv well within any per-call timeout) is cut off at the
    download's deadline, not after the frame."""
    donor = SlowDonor(identity, 64 << 20, drip=1024)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        fetch_state_from(donor.offer, RUN, timeout=2.0, max_bytes=1 << 30)
    assert time.monotonic() - started < 3.0


def test_announced_size_is_never_allocated_up_front(identity):
    """A donor announcing 512 MiB and sending nothing costs the newcomer almost no memory."""
    donor = SlowDonor(identity, 512 << 20, drip=0)
    tracemalloc.start()
    try:
        with pytest.raises(TimeoutError):
            fetch_state_from(donor.offer, RUN, timeout=1.0, max_bytes=1 << 30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
    too_big = SlowDonor(identity, 512 << 20, drip=0)
    with pytest.raises(state_sync.ProtocolError, match="over this peer's limit"):
        fetch_state_from(too_big.offer, RUN, timeout=5.0, max_bytes=64 << 20)


def test_a_donor_must_be_the_peer_that_offered_the_state(identity):
    """Someone else's server behind an offer: its signed header names another key, and is refused."""
    donor = SlowDonor(identity, 1024, drip=0)
    impostor_offer = StateOffer(Identity.generate().peer_id, donor.offer.host, donor.offer.port, 1)
    with pytest.raises(state_sync.ProtocolError, match="not the peer that offered"):
        fetch_state_from(impostor_offer, RUN, timeout=5.0)


def _optimizer(dht) -> CollaborativeOptimizer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = CollaborativeOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), run_id=RUN, dht=dht, model=model,
                                 target_batch_size=64, batch_size_per_step=64, matchmaking_time=0.5,
                                 round_timeout=5.0, serve_state=False)
    model(torch.randn(4, 8)).sum().backward()
    opt.inner.step()  # Adam state exists: exp_avg, exp_avg_sq, step
    return opt


def test_forged_states_fail_validation(dht_node):
    """Parameters of 1e30, epoch 2^62, NaN or wrongly shaped Adam tensors: each is refused, and the
    optimizer's model stays as it was."""
    opt = _optimizer(dht_node(run_ids=[RUN]))
    try:
        before = [p.detach().clone() for p in opt.model.parameters()]
        good = opt.collaborative_state()
        opt.load_collaborative_state(good)  # the honest state passes

        def forged(change) -> dict:
            state = opt.collaborative_state()
            change(state)
            return state

        first_weight = next(iter(good["model"]))
        attacks = {
            "huge parameters": lambda s: s["model"][first_weight].fill_(1e30),
            "epoch 2^62": lambda s: s.update(epoch=1 << 62),
            "negative steps": lambda s: s.update(steps=-1),
            "NaN Adam moment": lambda s: s["optimizer"]["state"][0]["exp_avg"].fill_(float("nan")),
            "Adam moment of the wrong shape": lambda s: s["optimizer"]["state"][0].update(exp_avg=torch.zeros(3, 3)),
            "state for an unknown parameter": lambda s: s["optimizer"]["state"].update({99: {"step": torch.tensor(1.)}}),
            "another learning-rate layout": lambda s: s["optimizer"]["param_groups"][0].pop("lr"),
        }
        for name, attack in attacks.items():
            with pytest.raises(ValueError):
                opt.load_collaborative_state(forged(attack))
            for p, q in zip(opt.model.parameters(), before):
                assert torch.equal(p, q), name
        with pytest.raises(ValueError):
            validate_counters(11, 0, max_epoch=10)  # beyond what the swarm confirms
    finally:
        opt.shutdown()


@contextlib.contextmanager
def _donors(dht_node, states):
    """A bootstrap node, and a StateServer per (epoch, model[, more of the state]), each on its own DHT node,
    advertised for the run: -> (bootstrap maddrs, [(server, its dht)]); the servers shut down on exit."""
    boot = dht_node(run_ids=[RUN])
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    servers = []
    try:
        for epoch, model, *more in states:
            dht = dht_node(initial_peers=maddrs, run_ids=[RUN])
            data = serialize_state({"model": {k: v.clone() for k, v in model.items()}, "epoch": epoch,
                                    **(more[0] if more else {})})
            server = StateServer(lambda data=data, epoch=epoch: (epoch, data), run_id=RUN, identity=dht.identity)
            servers.append((server, dht))
            assert server.advertise(dht, epoch, expiration=300)
        yield maddrs, servers
    finally:
        for server, _ in servers:
            server.shutdown()


def _newcomer_seeing(dht_node, maddrs, count):
    newcomer = dht_node(initial_peers=maddrs, run_ids=[RUN])
    deadline = time.monotonic() + 30
    while len(state_sync.list_state_offers(newcomer, RUN)) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    return newcomer


def test_cross_check_prefers_an_epoch_two_donors_hold(dht_node):
    """A forger claims an epoch ahead of two honest donors: the two honest ones, at one epoch, confirm each
    other first, and the forger is never asked."""
    honest = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(1))}
    forged = {"w": honest["w"] * -3.0}
    with _donors(dht_node, ((6, forged), (5, honest), (5, honest))) as (maddrs, servers):
        newcomer = _newcomer_seeing(dht_node, maddrs, 3)
        downloaded = download_state(newcomer, RUN, timeout=30, show_progress=False)
        assert torch.equal(downloaded.state["model"]["w"], honest["w"]) and downloaded.epoch == 5
        assert downloaded.donor != servers[0][1].identity.peer_id and downloaded.failed_donors == []
        assert downloaded.confirmation == "same bytes"  # the two honest donors signed identical states
        assert servers[0][0].served == 0  # the forger's state was never downloaded


def test_a_disagreeing_pair_is_set_aside_and_the_download_fails_at_once(dht_node):
    """A forger one epoch ahead and one honest donor disagree: both are set aside, and with no donor left
    the download fails right away instead of waiting out its timeout."""
    honest = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(1))}
    with _donors(dht_node, ((6, {"w": honest["w"] * -3.0}), (5, honest))) as (maddrs, _):
        newcomer = _newcomer_seeing(dht_node, maddrs, 2)
        started = time.monotonic()
        with pytest.raises(state_sync.StateDownloadFailed, match="disagree"):
            download_state(newcomer, RUN, timeout=60, show_progress=False)
        assert time.monotonic() - started < 20.0  # not the 60 s timeout


def test_the_cross_check_compares_what_the_caller_says_honest_donors_hold_alike(dht_node):
    """Two DiLoCo-like donors: one θ_outer ("anchor"), parameters far apart (each one's own inner steps since the
    last outer step). Compared on their parameters they are set aside; on what `agreed` names, they confirm each
    other; and a forged anchor is still caught."""
    anchor = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    apart = [anchor + torch.randn(64, 64, generator=torch.Generator().manual_seed(seed)) for seed in (2, 3)]
    donors = [(5, {"w": w}, {"anchor": {"w": anchor}}) for w in apart]
    with _donors(dht_node, donors) as (maddrs, _):
        newcomer = _newcomer_seeing(dht_node, maddrs, 2)
        with pytest.raises(state_sync.StateDownloadFailed, match="disagree"):
            download_state(newcomer, RUN, timeout=60, show_progress=False)
        downloaded = download_state(newcomer, RUN, timeout=60, show_progress=False,
                                    agreed=lambda state: state["anchor"])
        assert downloaded.confirmation == "cross-checked" and torch.equal(downloaded.state["anchor"]["w"], anchor)
    donors[1] = (5, {"w": apart[1]}, {"anchor": {"w": -3 * anchor}})
    with _donors(dht_node, donors) as (maddrs, _):
        newcomer = _newcomer_seeing(dht_node, maddrs, 2)
        with pytest.raises(state_sync.StateDownloadFailed, match="disagree"):
            download_state(newcomer, RUN, timeout=60, show_progress=False, agreed=lambda state: state["anchor"])


def test_two_donors_signing_one_forgery_do_not_outvote_an_honest_one(dht_node):
    """Two Sybil donors serve the very same forged bytes beside one honest donor, all at one epoch (issue 26).
    Identical signatures do not confirm a state that another donor contradicts: the forgery is compared with the
    honest state, they disagree, all are set aside, and the newcomer adopts nothing rather than the forgery."""
    honest = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(1))}
    forged = {"w": honest["w"] * -3.0}
    with _donors(dht_node, ((5, forged), (5, forged), (5, honest))) as (maddrs, servers):
        newcomer = _newcomer_seeing(dht_node, maddrs, 3)
        with pytest.raises(state_sync.StateDownloadFailed, match="disagree") as refused:
            download_state(newcomer, RUN, timeout=60, show_progress=False)
        assert servers[2][1].identity.peer_id in str(refused.value)  # compared with the honest donor's state


def test_a_peer_that_saw_the_honest_donor_average_adopts_its_state_beside_two_sybils(dht_node):
    """The same two Sybils and one honest donor, for a peer that has averaged once (witnesses.py): it asks only the
    donor it saw average, so the Sybils can neither outvote nor contradict it, and it adopts the honest state
    (main set everything aside here, and the newcomer trained on without a state)."""
    honest = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(1))}
    forged = {"w": honest["w"] * -3.0}
    with _donors(dht_node, ((5, forged), (5, forged), (5, honest))) as (maddrs, servers):
        newcomer = _newcomer_seeing(dht_node, maddrs, 3)
        witnessed = frozenset({servers[2][1].identity.peer_id})
        downloaded = download_state(newcomer, RUN, timeout=60, show_progress=False, prefer=witnessed)
        assert torch.equal(downloaded.state["model"]["w"], honest["w"]) and downloaded.epoch == 5
        assert servers[0][0].served == 0 and servers[1][0].served == 0  # the Sybils were never asked
        assert downloaded.confirmation == "unconfirmed"  # and the event line says the state is a lone donor's


def test_factored_optimizer_state_is_accepted():
    """Adafactor keeps row and column factors (the parameter's shape reduced to 1 along one dimension): an
    honest donor's state of such an optimizer passes, a factor of a foreign shape does not."""
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.Adafactor(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    params = list(model.parameters())
    validate_optimizer_state(optimizer.state_dict(), params, optimizer.state_dict())
    forged = optimizer.state_dict()
    forged["state"][0] = {**forged["state"][0], "row_var": torch.zeros(4, 2)}  # a copy: torch shares the entry
    with pytest.raises(ValueError, match="row_var"):
        validate_optimizer_state(optimizer.state_dict(), params, forged)


def test_donors_beyond_the_confirmed_epoch_are_not_asked(dht_node):
    """The faked-progress attack's second half: a donor offering epoch 2^40 (what no robust view confirms) is
    never asked; the newcomer downloads from the donor at the confirmed epoch."""
    boot = dht_node(run_ids=[RUN])
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    servers, asked = [], []
    try:
        for epoch in (1 << 40, 5):
            dht = dht_node(initial_peers=maddrs, run_ids=[RUN])
            data = serialize_state({"model": {"w": torch.full((4,), float(epoch % 7))}, "epoch": epoch})
            server = StateServer(lambda data=data, epoch=epoch: (epoch, data), run_id=RUN, identity=dht.identity,
                                 on_served=lambda served, epoch=epoch: asked.append(epoch))
            assert server.advertise(dht, epoch, expiration=300)
            servers.append(server)
        newcomer = dht_node(initial_peers=maddrs, run_ids=[RUN])
        deadline = time.monotonic() + 30
        while len(state_sync.list_state_offers(newcomer, RUN)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        downloaded = download_state(newcomer, RUN, max_epoch=6, timeout=30, show_progress=False)
        assert downloaded.epoch == 5 and asked == [5] and downloaded.failed_donors == []
    finally:
        for server in servers:
            server.shutdown()


def test_a_download_fails_at_once_when_every_donor_is_past_the_confirmed_epoch(dht_node):
    """Donors never go back an epoch: when all of them are past `max_epoch`, waiting out the timeout only stalls
    the caller (CI: a peer whose view lagged a fast swarm waited 60 s for donors that had moved on)."""
    boot = dht_node(run_ids=[RUN])
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    dht = dht_node(initial_peers=maddrs, run_ids=[RUN])
    data = serialize_state({"model": {"w": torch.zeros(4)}, "epoch": 40})
    server = StateServer(lambda: (40, data), run_id=RUN, identity=dht.identity)
    try:
        assert server.advertise(dht, 40, expiration=300)
        newcomer = dht_node(initial_peers=maddrs, run_ids=[RUN])
        deadline = time.monotonic() + 30
        while not state_sync.list_state_offers(newcomer, RUN) and time.monotonic() < deadline:
            time.sleep(0.2)
        started = time.monotonic()
        with pytest.raises(state_sync.StateDownloadFailed, match="above 10"):
            download_state(newcomer, RUN, max_epoch=10, timeout=30, show_progress=False)
        assert time.monotonic() - started < 10
    finally:
        server.shutdown()
