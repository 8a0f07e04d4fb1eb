"""Shared fixtures: real multi-process swarms (`swarm`) and in-process DHT nodes (`dht_node`).

Both clean up whatever happens in the test: no moshpeer process and no p2pd survives a test. And
every test fails if a process it spawned (through tests/helpers/swarm.py, tests/helpers/averaging_swarm.py
or tests/helpers/trainer_process.py) printed a traceback or "Task was destroyed but it is pending!" on stderr:
a peer leaving is one log line, never a traceback. A test that provokes a real bug on purpose says
so with `@pytest.mark.allow_stderr_tracebacks`.

Layout: tests/unit/ (in-process), tests/swarm/ (tests that spawn processes), tests/helpers/ (the modules they
share: harnesses, worker scripts, fakes). Tests import helpers by bare name (`from swarm import Swarm`), and a
few import each other (`from test_training import ...`), so all three folders go on sys.path here.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, List

import pytest

TESTS = Path(__file__).resolve().parent
for _folder in ("swarm", "unit", "helpers"):  # helpers end up first: `import swarm` is tests/helpers/swarm.py
    if str(TESTS / _folder) not in sys.path:
        sys.path.insert(0, str(TESTS / _folder))

from swarm import LOOPBACK, Swarm, forbidden_stderr, process_group  # noqa: E402  (tests/helpers/swarm.py)


@pytest.fixture(autouse=True)
def clean_process_stderr(request):
    """Fail the test if a process it spawned printed a traceback or a pending-task line (see module doc).

    Autouse fixtures are set up first and torn down last: by then the test's swarms are stopped and
    their stderr is complete."""
    forbidden_stderr()  # start clean, whatever an earlier test left
    yield
    found = forbidden_stderr()
    if found and request.node.get_closest_marker("allow_stderr_tracebacks") is None:
        pytest.fail("spawned processes printed a traceback or a pending-task line:\n" + "\n".join(found),
                    pytrace=False)


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
