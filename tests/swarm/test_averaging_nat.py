"""A peer behind NAT averages only once a relay holds its slot: its mates reach it through the relay its matchmaking
metadata names, and without one they could not connect to it at all."""

from __future__ import annotations

import pytest
import torch

from moshpeer import MoshpitAverager
from moshpeer.averaging.tcp_relay.role import NO_RELAY

pytestmark = pytest.mark.timeout(120)
RUN = "nat"


def test_a_peer_behind_nat_looks_for_a_group_only_once_a_relay_holds_its_slot(dht_node):
    """On netlab a peer that took its slot 0.1 s after declaring itself was absent from its first round, a parameters
    round whose members then averaged different sets (session 50). Without a relay it looks for no group; once a
    public peer serves one, it averages through it."""
    public_dht = dht_node(run_ids=[RUN])
    nat_dht = dht_node(run_ids=[RUN], behind_nat=True, initial_peers=[str(a) for a in public_dht.get_visible_maddrs()])
    behind = MoshpitAverager([torch.ones(8)], dht=nat_dht, run_id=RUN, target_group_size=2, matchmaking_time=1.0,
                             round_timeout=5.0)
    public = None
    try:
        alone = behind.step(timeout=1.0)
        assert not alone.ok and alone.error == NO_RELAY and alone.group_size <= 1
        public = MoshpitAverager([torch.full((8,), 3.0)], dht=public_dht, run_id=RUN, target_group_size=2,
                                 matchmaking_time=1.0, round_timeout=5.0)
        assert behind.wait_for_relay(30.0) is not None  # the public peer serves a relay: a slot within seconds
        futures = [averager.step(timeout=10.0, wait=False) for averager in (behind, public)]
        results = [future.result(timeout=future.deadline.remaining() + 5.0) for future in futures]
        assert all(r.ok and r.group_size == 2 for r in results), results
        assert torch.allclose(behind.tensors[0], torch.full((8,), 2.0))
        assert results[1].relayed  # the public peer reached the other through the relay
    finally:
        for averager in (behind, public):
            if averager is not None:
                averager.shutdown()
