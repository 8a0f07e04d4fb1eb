"""The data plane's relay for peers behind NAT (moshpeer/averaging/tcp_relay/), in-process on loopback: a
group averages through it exactly, a slot needs its key, a sender learns at once why a circuit failed, a peer
whose relay leaves takes a slot on another, and one whose relay drops its circuits moves to another."""

from __future__ import annotations

import dataclasses
import queue
import socket
import time
from types import SimpleNamespace

import pytest
import torch
from local_group import identities, run_group
from waiting import holds_within

from moshpeer.averaging import DataPlane, wire
from moshpeer.averaging.tcp_relay import protocol
from moshpeer.averaging.tcp_relay.directory import list_relays
from moshpeer.averaging.tcp_relay.protocol import RelayRefused
from moshpeer.averaging.tcp_relay import role as role_module
from moshpeer.averaging.tcp_relay.reservation import RelayReservation, open_circuit
from moshpeer.averaging.tcp_relay.role import SILENT_ROUNDS_TO_MOVE, RelayRole, RelayWatch
from moshpeer.averaging.tcp_relay import service as service_module
from moshpeer.averaging.tcp_relay.service import RelayService
from moshpeer.errors import ProtocolError

NUMEL, CHUNK = 300_000, 65_536


def relay_plane() -> tuple:
    plane, service = DataPlane(), RelayService()
    plane.serve_protocol(protocol.MAGIC, service.handle)
    return plane, service


def hold_slot(identity, relays, plane: DataPlane) -> RelayReservation:
    reservation = RelayReservation(identity, lambda: list(relays), plane.accept_socket)
    reservation.start()
    assert reservation.wait_for_slot(10.0), "no relay took the slot"
    return reservation


def test_a_group_averages_exactly_through_a_relay_and_reports_the_members_it_relayed():
    """Member 2 is behind NAT: it announces no address, only the relay on member 0's data plane. Members 0 and
    1 reach it through circuits there; it reaches them directly. The round is exact."""
    (plane0, service), plane1, plane2 = relay_plane(), DataPlane(), DataPlane()
    reservation = hold_slot(identities(3)[2], [plane0.address], plane2)

    def behind_nat(group):
        group[2] = dataclasses.replace(group[2], host="", port=0, relay=plane0.address)
        return group

    tensors = [torch.randn(NUMEL) for _ in range(3)]
    exact = sum(tensors) / 3
    try:
        results = run_group(tensors, planes=[plane0, plane1, plane2], reshape=behind_nat, chunk_numel=CHUNK)
    finally:
        reservation.stop()
    assert [r.relayed for r in results] == [[2], [2], []]
    for result in results:
        assert not result.absent and result.reduce.chunks_lost == 0 and result.gather.chunks_lost == 0
    for t in tensors:
        assert torch.allclose(t, exact, rtol=0, atol=1e-6)
    assert service.circuits_opened == 2 and reservation.circuits_accepted == 2
    assert service.bytes_relayed > 2 * 4 * NUMEL / 3  # members 0 and 1 sent member 2 its part, and got theirs


def test_a_slot_needs_the_key_of_its_peer_id():
    plane, service = relay_plane()
    try:
        sock = socket.create_connection(plane.address)
        sock.sendall(protocol.opening())
        challenge = protocol.recv_message(sock, time.monotonic() + 5)["challenge"]
        honest, thief = identities(2)
        # The thief sends the honest peer's key with its own signature: no slot, the connection ends.
        protocol.send_message(sock, op="reserve", key=honest.public_key.to_bytes(),
                              sig=thief.private_key.sign(protocol.reservation_statement(challenge)))
        with pytest.raises(ConnectionError):
            protocol.recv_message(sock, time.monotonic() + 5)
        assert service.reservations == 0
    finally:
        plane.close()


def test_a_circuit_to_a_peer_without_a_slot_is_refused_with_the_reason():
    plane, service = relay_plane()
    try:
        with pytest.raises(RelayRefused, match="no slot"):
            open_circuit(plane.address, identities(1)[0].peer_id_bytes, time.monotonic() + 5)
        assert service.refused == 1
    finally:
        plane.close()


def test_a_peer_whose_relay_leaves_takes_a_slot_on_another():
    (first, first_service), (second, second_service) = relay_plane(), relay_plane()
    relays = [first.address]
    behind_nat = DataPlane()
    reservation = hold_slot(identities(1)[0], relays, behind_nat)
    try:
        assert reservation.relay == first.address
        relays[:] = [second.address]
        first_service.close()  # the relay leaves: it closes its slots' control connections
        assert reservation.wait_for_slot(15.0, on=second.address) and second_service.reservations == 1
    finally:
        reservation.stop()
        for plane in (first, second, behind_nat):
            plane.close()


def test_a_peer_that_does_not_answer_its_dial_costs_the_sender_one_bounded_wait(monkeypatch):
    """A slot holder that ignores its dials (hung, or hostile): the sender is refused once the accept window
    passes, and an accept that comes later finds no circuit and is closed."""
    monkeypatch.setattr(service_module, "REQUEST_TIMEOUT", 0.5)
    plane, service = relay_plane()
    holder = identities(1)[0]
    control = socket.create_connection(plane.address)
    try:
        control.sendall(protocol.opening())
        challenge = protocol.recv_message(control, time.monotonic() + 5)["challenge"]
        protocol.send_message(control, op="reserve", key=holder.public_key.to_bytes(),
                              sig=holder.private_key.sign(protocol.reservation_statement(challenge)))
        assert protocol.recv_message(control, time.monotonic() + 5)["ok"] is True
        started = time.monotonic()
        with pytest.raises(RelayRefused, match="did not accept"):
            open_circuit(plane.address, holder.peer_id_bytes, time.monotonic() + 10)
        assert time.monotonic() - started < 5.0
        sid = protocol.recv_message(control, time.monotonic() + 5)["sid"]  # the dial it ignored
        late = socket.create_connection(plane.address)
        late.sendall(protocol.opening())
        protocol.recv_message(late, time.monotonic() + 5)
        protocol.send_message(late, op="accept", sid=sid)
        late.settimeout(5.0)
        assert late.recv(1) == b""  # no circuit waits for it: closed
        late.close()
    finally:
        control.close()
        plane.close()


def test_the_relay_directory_keeps_only_well_formed_offers_of_their_owners():
    """Entries arrive from the network: one naming another peer, a malformed one and our own are dropped."""
    me, honest, liar = identities(3)

    def offer(owner, **fields):
        value = {"peer_id": owner.peer_id, "host": "10.0.0.1", "port": 7000, "tag": b"", **fields}
        return owner.owner_subkey, SimpleNamespace(value=value)

    entries = dict([offer(honest), offer(liar, peer_id=honest.peer_id, port=7001), offer(me, port=7002)])
    entries[b"not an owner"] = SimpleNamespace(value={"peer_id": "x", "host": "h", "port": 1})
    found = SimpleNamespace(value=entries)
    dht = SimpleNamespace(identity=me, admission=None,
                          get=lambda key, latest, return_future: SimpleNamespace(result=lambda timeout: found))
    assert list_relays(dht, "run") == [("10.0.0.1", 7000)]


class CircuitDroppingRelay(RelayService):
    """A hostile relay: it holds slots and answers their pings, but drops every circuit a sender asks for."""

    def _connect(self, conn: socket.socket, target: bytes) -> None:
        conn.close()


def test_relay_watch_moves_after_silent_rounds_in_a_row_only():
    watch = RelayWatch(rounds=3)
    assert [watch.note_round(2, 2), watch.note_round(2, 2), watch.note_round(2, 1)] == [False] * 3  # one got through
    assert [watch.note_round(2, 2), watch.note_round(0, 0), watch.note_round(2, 2)] == [False] * 3  # alone: no news
    assert watch.note_round(3, 3) is True and watch.silent == 0  # then it starts over on the next relay


def test_a_peer_behind_nat_leaves_a_relay_that_drops_its_circuits_for_another(monkeypatch):
    """The hostile relay keeps the slot alive, so only the rounds can tell: after SILENT_ROUNDS_TO_MOVE rounds in
    which no member reached us, the peer takes a slot on the other relay, avoids the hostile one although it is
    still offered, and a sender's circuit through the new relay reaches it."""
    hostile_plane, hostile = DataPlane(), CircuitDroppingRelay()
    hostile_plane.serve_protocol(protocol.MAGIC, hostile.handle)
    good_plane, good = relay_plane()
    delivered = queue.Queue()  # the circuits that reached the peer behind NAT
    behind_nat = SimpleNamespace(accept_socket=lambda sock, label: delivered.put(sock))
    offered = [hostile_plane.address]
    monkeypatch.setattr(role_module, "list_relays", lambda dht, run_id: list(offered))
    identity = identities(1)[0]
    role = RelayRole(SimpleNamespace(identity=identity), "run", behind_nat, behind_nat=True, serve=False)
    target = identity.peer_id_bytes
    role.start()
    try:
        assert role.wait_for_relay(10.0) == hostile_plane.address
        offered.append(good_plane.address)
        with pytest.raises((ConnectionError, ProtocolError, OSError)):
            open_circuit(hostile_plane.address, target, time.monotonic() + 5)
        for _ in range(SILENT_ROUNDS_TO_MOVE - 1):
            role.note_round(others=2, unheard=2)
        assert role.relay == hostile_plane.address  # not yet
        role.note_round(others=2, unheard=2)
        assert role.reservation.wait_for_slot(15.0, on=good_plane.address)
        assert good.reservations == 1  # counted before it answered "reserved"
        # The hostile relay frees the slot when its control thread sees the holder hang up, which may come after
        # the move (asserted at once, this failed in 2 of 3 runs of the unit suite beside three busy loops).
        assert holds_within(lambda: hostile.reservations == 0, 10.0), hostile.reservations
        with open_circuit(good_plane.address, target, time.monotonic() + 5) as sender:
            sender.sendall(b"through the new relay")
            with delivered.get(timeout=5) as receiver:
                receiver.settimeout(5)
                assert wire.recv_exactly_by(receiver, 21, time.monotonic() + 5) == b"through the new relay"
    finally:
        role.stop()
        for plane in (hostile_plane, good_plane):
            plane.close()
