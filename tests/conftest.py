"""Shared fixtures: real multi-process swarms (`swarm`) and in-process DHT nodes (`dht_node`).

Both clean up whatever happens in the test: no moshpeer process and no p2pd survives a test.
"""

from __future__ import annotations

import time
from typing import Callable, List

import pytest

from swarm import LOOPBACK, Swarm, process_group  # tests/ is on sys.path (pytest rootdir conftest)


@pytest.fixture
def swarm():
    """A `tests.swarm.Swarm`: spawn `moshpeer ...` processes; all of them are gone after the test."""
    with Swarm() as s:
        yield s


@pytest.fixture
def dht_node() -> Callable:
    """Factory for DHT nodes in the test process: `dht_node(initial_peers=[...], run_ids=[...], ...)`.

    Takes `moshpeer.dht.start_dht`'s arguments (listening on loopback by default); every node and its
    p2pd are stopped after the test.
    """
    from moshpeer.dht import start_dht

    nodes: List = []

    def start(**kwargs):
        kwargs.setdefault("host_maddrs", [LOOPBACK])
        dht = start_dht(**kwargs)
        nodes.append(dht)
        return dht

    yield start
    for dht in nodes:
        dht.stop()
    deadline = time.monotonic() + 5.0
    leftovers = [info for dht in nodes for info in process_group(dht.pid)]
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.05)
        leftovers = [info for dht in nodes for info in process_group(dht.pid)]
    assert not leftovers, f"DHT processes survived the test: {leftovers}"
