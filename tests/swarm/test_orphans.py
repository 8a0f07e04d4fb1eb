"""A killed test run leaves no processes behind: the swarm harnesses start a `moshpeer.testing.orphans.Reaper`
that kills every process carrying the swarm's tag once the harness is gone, SIGKILL included, and removes the
torch shared-memory segments of the processes it killed."""

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
from shared_memory import SHARES_MEMORY, segments_of
from swarm import SWARM_TAG

from moshpeer.processes import SHM_MANAGER_NAME
from moshpeer.testing import orphans
from moshpeer.testing.orphans import Reaper, kill_tagged, remove_torch_segments, tagged_processes

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


def _torch_segments(processes) -> list:
    return [path for info in processes for path in segments_of(info.pid)]


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
        family = tagged_processes(SWARM_TAG, tag)
        names = {info.name for info in family}
        assert "p2pd" in names and len(names) >= 2, names  # `moshpeer dht`, its DHT process and p2pd are up
        assert _torch_segments(family), "hivemind's futures share their state through /dev/shm"
        harness.send_signal(sig)  # no cleanup code of the harness runs
        harness.wait(10)
        survivors = _wait_gone(tag, 20.0)
        assert not survivors, survivors
        # torch_shm_manager was killed too: the reaper removes the segments once every process is gone.
        deadline = time.monotonic() + 10.0
        while _torch_segments(family) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _torch_segments(family)
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


def test_a_peer_that_ended_before_the_reaper_leaves_no_shared_memory_behind():
    """A tagged process that shared a tensor and ended by itself (a demo's peer, before the harness's teardown)
    leaves its segments to its torch_shm_manager, which carries the tag too; the reaper lets the manager remove them
    instead of killing it with the rest (`moshpeer demo` under the swarm harness left 6 segments a run)."""
    tag = uuid.uuid4().hex
    peer = subprocess.Popen([sys.executable, "-c", SHARES_MEMORY], env={**os.environ, SWARM_TAG: tag},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert peer.stdout.readline().strip() == "shared"
        segments = segments_of(peer.pid)
        assert segments
        peer.stdin.close()
        assert peer.wait(30) == 0
        assert [info.name for info in tagged_processes(SWARM_TAG, tag)] == [SHM_MANAGER_NAME]  # in its 2 s
        assert kill_tagged(SWARM_TAG, tag) == []
        assert not [path for path in segments if os.path.exists(path)]
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        kill_tagged(SWARM_TAG, tag)


def test_only_the_segments_of_processes_that_are_gone_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(orphans, "SHARED_MEMORY_DIR", str(tmp_path))
    ended = subprocess.Popen(["true"])
    ended.wait()
    for pid in (ended.pid, os.getpid()):
        (tmp_path / f"torch_{pid}_123_0").write_bytes(b"x")
    (tmp_path / f"torch_{ended.pid}1_123_0").write_bytes(b"x")  # another pid that starts with the same digits
    assert remove_torch_segments([ended.pid, os.getpid()]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"torch_{ended.pid}1_123_0",
                                                                 f"torch_{os.getpid()}_123_0"])
