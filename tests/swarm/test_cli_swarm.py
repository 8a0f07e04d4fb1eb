"""The swarm through the real CLI: `moshpeer dht`, `moshpeer join` and `moshpeer status` as processes.

Peers leaving: SIGTERM (withdraw at once, exit 0 within 5 s, p2pd gone) and SIGKILL (the record
expires; the orphaned DHT process and p2pd clean themselves up).
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from moshpeer.dht import list_peers
from moshpeer.dht.identity import Identity
from swarm import LOOPBACK

pytestmark = pytest.mark.timeout(150)

EXIT_BUDGET = 5.0  # seconds from SIGTERM until the process and its p2pd are gone
NO_TRAIN = ("--no-train",)  # membership only: these tests are about the swarm, not training


def wait_for(condition, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def live_ids(dht, run_id: str) -> set:
    return {record.peer_id for record in list_peers(dht, run_id)}


def test_join_and_status_with_four_peers(swarm):
    run = "four-peers"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    # Four peers start at once; one cannot accept connections (client mode), yet joins and shows up.
    common = ("--initial-peers", *boot.maddrs, "--run-id", run, "--host-maddrs", LOOPBACK, "--heartbeat", "1")
    common += NO_TRAIN
    peers = [swarm.spawn("join", *common) for _ in range(3)] + [swarm.spawn("join", *common, "--client-mode")]
    for peer in peers:
        ready = peer.wait_ready()
        assert ready["run_id"] == run and ready["role"] == "trainer" and ready["maddrs"]
        assert all(maddr.endswith("/p2p/" + ready["peer_id"]) for maddr in ready["maddrs"])
        assert peer.p2pd_processes(), "each peer runs its own p2pd"

    # Two status commands at once: JSON through the bootstrap node, the table through a trainer.
    as_json = swarm.spawn("status", "--initial-peers", *boot.maddrs, "--run-id", run, "--json")
    as_table = swarm.spawn("status", "--initial-peers", *peers[1].maddrs, "--run-id", run)
    assert as_json.wait_exit(60) == 0, as_json.describe()
    listed = json.loads(as_json.stdout)
    assert listed["run_id"] == run
    by_id = {entry["peer_id"]: entry for entry in listed["peers"]}
    assert set(by_id) == {boot.peer_id} | {peer.peer_id for peer in peers}
    assert by_id[boot.peer_id]["role"] == "bootstrap"
    for peer in peers:
        entry = by_id[peer.peer_id]
        assert entry["role"] == "trainer" and entry["addresses"] == peer.maddrs
        assert 0 <= entry["last_seen_s"] < 10

    assert as_table.wait_exit(60) == 0, as_table.describe()
    assert "5 live peers (4 trainers, 1 bootstrap)" in as_table.stdout
    for peer in [boot, *peers]:
        assert peer.peer_id[-8:] in as_table.stdout

    # Everyone stops on SIGTERM: exit 0, and every process (p2pd included) gone within the budget.
    everyone = [boot, *peers]
    started = time.monotonic()
    for proc in everyone:
        proc.send_signal(signal.SIGTERM)
    wait_for(lambda: all(proc.returncode is not None for proc in everyone), timeout=EXIT_BUDGET)
    assert [proc.returncode for proc in everyone] == [0] * len(everyone), [p.describe() for p in everyone]
    wait_for(lambda: not any(proc.p2pd_processes() for proc in everyone), timeout=EXIT_BUDGET)
    assert time.monotonic() - started < EXIT_BUDGET


def test_sigterm_withdraws_within_one_heartbeat(swarm, dht_node):
    run = "sigterm"
    heartbeat = 2.0
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    # A long expiration: if the peer vanishes quickly, it is the withdrawal, not the expiry.
    (peer,) = swarm.join(1, run, boot.maddrs, "--heartbeat", str(heartbeat), "--expiration", "60", *NO_TRAIN)
    observer = dht_node(initial_peers=boot.maddrs, run_ids=[run], client_mode=True)
    wait_for(lambda: peer.peer_id in live_ids(observer, run), timeout=10)
    assert peer.p2pd_processes()

    started = time.monotonic()
    peer.send_signal(signal.SIGTERM)
    wait_for(lambda: peer.peer_id not in live_ids(observer, run), timeout=heartbeat)
    wait_for(lambda: peer.returncode is not None and not peer.p2pd_processes(), timeout=EXIT_BUDGET)
    assert time.monotonic() - started < EXIT_BUDGET
    assert peer.returncode == 0, peer.describe()
    # torch's shared-memory helper notices on its own that its parent left; nothing else remains.
    wait_for(lambda: not peer.family(), timeout=10)
    assert "Traceback" not in peer.stderr

    status = swarm.run("status", "--initial-peers", *boot.maddrs, "--run-id", run, "--json")
    assert status.returncode == 0, status.stderr
    assert [entry["peer_id"] for entry in json.loads(status.stdout)["peers"]] == [boot.peer_id]


def test_sigkill_record_expires_and_orphans_clean_up(swarm, dht_node):
    run = "sigkill"
    expiration = 4.0
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    (peer,) = swarm.join(1, run, boot.maddrs, "--heartbeat", "1", "--expiration", str(expiration), *NO_TRAIN)
    observer = dht_node(initial_peers=boot.maddrs, run_ids=[run], client_mode=True)
    wait_for(lambda: peer.peer_id in live_ids(observer, run), timeout=10)
    helpers = [info for info in peer.family() if info.pid != peer.pid]
    assert any(info.name == "p2pd" for info in helpers)

    killed_at = time.monotonic()
    peer.kill()  # the main process only, as in a crash: no withdrawal
    assert peer.peer_id in live_ids(observer, run), "a killed peer stays listed until its record expires"
    wait_for(lambda: peer.peer_id not in live_ids(observer, run), timeout=expiration + 5)
    gone_after = time.monotonic() - killed_at
    assert expiration - 1.5 <= gone_after <= expiration + 5, gone_after
    # Its DHT process noticed it was orphaned and took p2pd down with it.
    dht_and_p2pd = {info.pid for info in helpers if info.name != "torch_shm_manag"}
    wait_for(lambda: not dht_and_p2pd & {info.pid for info in peer.family()}, timeout=5)
    wait_for(lambda: not peer.family(), timeout=10)
    assert boot.returncode is None, "the rest of the swarm keeps running"


def test_two_machines_with_copies_of_one_identity_file_the_newer_stops(swarm, tmp_path):
    """A copied --identity file (one disk image launched twice): both start together, and the swarm would see them
    as one peer. Within a few heartbeats the newer stops with one line and exit code 2 (hivemind's start check
    may instead stop one at start, also with one line); the other goes on. (It warns when it read its twin's record,
    a race it can lose: twins.py.)"""
    run = "twins"
    boot = swarm.bootstrap(run)
    key = Identity.generate().to_file_bytes()
    copies = []
    for name in ("image-a.key", "image-b.key"):  # two files: this machine's identity lock cannot see the copy
        (tmp_path / name).write_bytes(key)
        copies.append(swarm.spawn("dht", "--run-id", run, "--initial-peers", *boot.maddrs, "--host-maddrs", LOOPBACK,
                                  "--identity", str(tmp_path / name), "--heartbeat", "1"))
    deadline = time.monotonic() + 60
    while all(proc.returncode is None for proc in copies):
        assert time.monotonic() < deadline, "both copies still run: " + "\n".join(p.describe() for p in copies)
        time.sleep(0.2)
    stopped = next(proc for proc in copies if proc.returncode is not None)
    survivor = next(proc for proc in copies if proc is not stopped)
    errors = [line for line in stopped.stderr.splitlines() if "error:" in line]
    assert stopped.returncode == 2 and len(errors) == 1 and "identity" in errors[0], stopped.describe()
    assert "Traceback" not in stopped.stderr
    assert survivor.returncode is None, survivor.describe()
    assert survivor.terminate() == 0
