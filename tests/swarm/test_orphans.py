"""A killed test run leaves no processes behind: the swarm harnesses start a `moshpeer.testing.orphans.Reaper`
that kills every process carrying the swarm's tag once the harness is gone, SIGKILL included."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from swarm import SWARM_TAG

from moshpeer.testing.orphans import Reaper, kill_tagged, tagged_processes

pytestmark = pytest.mark.timeout(120)

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
REPO = Path(__file__).resolve().parents[2]

# A harness as a test uses it: a Swarm that started `moshpeer dht` (and so its p2pd), then hangs.
HARNESS = textwrap.dedent(f"""
    import json, sys, time
    sys.path.insert(0, {str(HELPERS)!r})
    from swarm import Swarm
    swarm = Swarm()
    boot = swarm.bootstrap("orphans")
    print(json.dumps({{"tag": swarm.tag, "pid": boot.pid}}), flush=True)
    time.sleep(600)
""")


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    if not selector.select(timeout):
        raise AssertionError(f"the harness printed nothing within {timeout} s")
    return proc.stdout.readline()


def _wait_gone(tag: str, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while True:
        alive = tagged_processes(SWARM_TAG, tag)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_the_harness_kills_its_moshpeer_processes(sig):
    repo = str(REPO)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    harness = subprocess.Popen([sys.executable, "-c", HARNESS], stdout=subprocess.PIPE, text=True, env=env)
    tag = None
    try:
        started = json.loads(_first_line(harness, 90.0))
        tag = started["tag"]
        names = {info.name for info in tagged_processes(SWARM_TAG, tag)}
        assert "p2pd" in names and len(names) >= 2, names  # `moshpeer dht`, its DHT process and p2pd are up
        harness.send_signal(sig)  # no cleanup code of the harness runs
        harness.wait(10)
        survivors = _wait_gone(tag, 20.0)
        assert not survivors, survivors
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait()
        if tag is not None:
            kill_tagged(SWARM_TAG, tag)


def test_closing_the_reaper_kills_tagged_processes_and_only_those():
    tag = uuid.uuid4().hex
    tagged = subprocess.Popen(["sleep", "60"], env={**os.environ, SWARM_TAG: tag}, start_new_session=True)
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        reaper = Reaper(SWARM_TAG, tag)
        assert [info.pid for info in tagged_processes(SWARM_TAG, tag)] == [tagged.pid]
        reaper.close()
        assert tagged.wait(5) == -signal.SIGTERM
        assert bystander.poll() is None
    finally:
        for proc in (tagged, bystander):
            proc.kill()
            proc.wait()
