"""What a peer does about NAT on its data plane: `RelayRole`.

Behind NAT (`start_dht(behind_nat=True)`) it holds a slot on a relay found in the run's directory, and
announces that relay to its groups; a public peer serves as a relay and offers itself in the directory.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

from moshpeer.averaging.dataplane import DataPlane
from moshpeer.averaging.tcp_relay import protocol
from moshpeer.averaging.tcp_relay.directory import RelayPublisher, list_relays
from moshpeer.averaging.tcp_relay.reservation import RelayReservation
from moshpeer.averaging.tcp_relay.service import RelayService


# Rounds in a row in which a peer behind NAT heard from none of its group's other members before it leaves its relay.
SILENT_ROUNDS_TO_MOVE = 3
# The error of a round of a peer behind NAT that no relay holds a slot for (`RelayRole.round_relay`): no group is
# looked for, since nobody could connect to it.
NO_RELAY = "behind NAT and no relay holds a slot for this peer yet (a public peer of the run serves one)"


class RelayWatch:
    """Whether the relay we hold a slot on carries our circuits: a hostile or broken relay can keep our slot alive
    (it answers pings) and drop every circuit to us. Then nobody's contribution reaches us, round after round, while
    our own outbound connections still work. After SILENT_ROUNDS_TO_MOVE such rounds in a row, move to another."""

    def __init__(self, rounds: int = SILENT_ROUNDS_TO_MOVE):
        self.rounds, self.silent = rounds, 0

    def note_round(self, others: int, unheard: int) -> bool:
        """One round with `others` other members, `unheard` of which delivered nothing to us -> move now?"""
        if others <= 0:
            return False
        self.silent = self.silent + 1 if unheard >= others else 0
        if self.silent >= self.rounds:
            self.silent = 0
            return True
        return False


class RelayRole:
    """:param behind_nat: hold a slot on some relay (nobody can connect to us directly)
    :param serve: otherwise, serve as a relay on `plane` and offer it in the directory
    :param admit: a private run's check of a public key asking for a slot (None: anyone)"""

    def __init__(self, dht, run_id: str, plane: DataPlane, *, behind_nat: bool, serve: bool,
                 admit: Optional[Callable[[bytes], None]] = None):
        self.reservation: Optional[RelayReservation] = None
        self._watch, self._watched = RelayWatch(), None  # the relay whose record `_watch` keeps
        self.service: Optional[RelayService] = None
        self._publisher: Optional[RelayPublisher] = None
        if behind_nat:
            self.reservation = RelayReservation(dht.identity, lambda: list_relays(dht, run_id), plane.accept_socket)
        elif serve:
            self.service = RelayService(admit)
            plane.serve_protocol(protocol.MAGIC, self.service.handle)
            self._publisher = RelayPublisher(dht, run_id, plane.reachable_address)

    @property
    def relay(self) -> Optional[Tuple[str, int]]:
        """The relay through which peers reach us now (behind NAT, holding a slot); None otherwise."""
        return self.reservation.relay if self.reservation is not None else None

    def wait_for_relay(self, timeout: float) -> Optional[Tuple[str, int]]:
        """`relay`, waiting up to `timeout` seconds for one to hold our slot (None at once for a public peer)."""
        if self.reservation is None or not self.reservation.wait_for_slot(timeout):
            return None
        return self.reservation.relay

    def round_relay(self, wait_s: float, transport: str) -> Tuple[Optional[Tuple[str, int]], bool]:
        """(the relay a round's matchmaking metadata names, whether this peer is unreachable without one): behind NAT
        mates reach it only through that relay (over TCP; a "libp2p" transport reaches it through p2pd), so it
        waits up to `wait_s` for a slot, and without one looks for no group (NO_RELAY): on netlab a peer that took
        its slot 0.1 s after declaring itself was absent from its first round, a parameters round whose members then
        averaged different member sets (session 50). (None, False) at once for a public peer."""
        if transport == "libp2p":
            return self.relay, False
        relay = self.wait_for_relay(wait_s)
        return relay, self.reservation is not None and relay is None

    def note_round(self, others: int, unheard: int) -> None:
        """Behind NAT: a round with `others` other members, `unheard` of which delivered nothing to us. Leaves the
        relay after SILENT_ROUNDS_TO_MOVE silent rounds in a row (`RelayWatch`); nothing for a public peer."""
        relay = self.reservation.relay if self.reservation is not None else None
        if relay is None:
            return
        if relay != self._watched:  # a new relay starts with a clean record
            self._watch, self._watched = RelayWatch(), relay
        if self._watch.note_round(others, unheard):
            self.reservation.move_on(f"none of our groups' members reached us through it in "
                                     f"{self._watch.rounds} rounds in a row")

    def start(self) -> None:
        for part in (self.reservation, self._publisher):
            if part is not None:
                part.start()

    def stop(self) -> None:
        if self.reservation is not None:
            self.reservation.stop()
        if self._publisher is not None:
            self._publisher.stop()
        if self.service is not None:
            self.service.close()
