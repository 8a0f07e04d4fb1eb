"""netlab (moshpeer.testing.netlab): shaped links in network namespaces, and MoshpitAverager over them.

Every test here needs root and iproute2; where namespaces cannot be made they skip with netlab's reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from averaging_swarm import AveragingSwarm
from averaging_worker import peer_values
from moshpeer.averaging.partition import bandwidth_part_sizes, reduce_allgather_seconds
from moshpeer.testing import netlab
from moshpeer.testing.netlab import Netlab

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(netlab.unavailable() is not None, reason=str(netlab.unavailable()))]

# hivemind's leader and follower can disagree on a group when a loaded machine stalls an event loop past the
# request timeout (the left-out peer finds no group); this file measures the data plane, so such a round reruns.
MATCHMAKING_ATTEMPTS = 3
# How far a round may be from the link's lower bound here: an idle machine measures 1.13-1.24x (connection setup,
# TCP slow start and coding 8 MB on 2 shared cores); bench_wan holds the figure (utilization 0.93 at 100 Mbit/s).
ROUND_OVER_BOUND = 1.45

# A TCP stream between two namespaces; prints the receiver's MB/s.
STREAM = textwrap.dedent("""
    import socket, sys, time
    if sys.argv[1] == "recv":
        server = socket.create_server((sys.argv[2], 5555))
        print("listening", flush=True)
        conn, _ = server.accept()
        buf, got, started = bytearray(1 << 16), 0, time.monotonic()
        while (n := conn.recv_into(buf)):
            got += n
        print(got / (time.monotonic() - started) / 1e6, flush=True)
    else:
        with socket.create_connection((sys.argv[2], 5555)) as conn:
            conn.sendall(b"x" * int(sys.argv[3]))
""")


def lab_names(lab_id: str) -> list:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout + \
        subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    return [word for word in listed.split() if lab_id in word]


def test_shaped_private_links_and_teardown():
    with Netlab([20, None]) as lab:
        assert lab_names(lab.lab_id)
        # Nothing outside the bridge is reachable: no route out of a namespace.
        route = lab.run(0, ["ip", "route", "get", "192.0.2.1"], capture_output=True, text=True)
        assert route.returncode != 0
        receiver = lab.popen(1, [sys.executable, "-c", STREAM, "recv", lab.nodes[1].address],
                             stdout=subprocess.PIPE, text=True)
        assert receiver.stdout.readline().strip() == "listening"
        sender = lab.run(0, [sys.executable, "-c", STREAM, "send", lab.nodes[1].address, str(5_000_000)])
        assert sender.returncode == 0
        rate = float(receiver.stdout.readline())
        receiver.wait(10)
        assert 2.5 * 0.8 < rate < 2.5 * 1.05  # 20 Mbit/s = 2.5 MB/s on the wire, ~96% of it is payload
        assert lab.tx_bytes(0) > 5_000_000
    assert not lab_names(lab.lab_id)


def test_leftovers_of_a_killed_owner_are_cleaned_up():
    code = ("import os, subprocess; from moshpeer.testing.netlab import Netlab; lab = Netlab([10, 10]).up(); "
            "lab.popen(0, ['sleep', '60'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            "print(lab.lab_id, flush=True); os.kill(os.getpid(), 9)")
    crashed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    lab_id = crashed.stdout.strip()
    assert crashed.returncode == -9 and lab_id and lab_names(lab_id)
    removed = netlab.cleanup()
    assert any(lab_id in name for name in removed)
    assert not lab_names(lab_id)


def average_once(lab: Netlab, numel: int, tmp_path, *extra: str, rounds: int = 1) -> tuple:
    """`rounds` group all-reduces of all peers in `lab`, each of the same values; -> (reports of the last round,
    or a list of them per round if rounds > 1; max relative error vs the exact mean over all rounds)."""
    n = len(lab.nodes)
    with AveragingSwarm(n, "--numel", str(numel), "--target-group-size", str(n), "--min-group-size", str(n),
                        "--matchmaking-time", "3.0", "--round-timeout", "60", *extra,
                        per_worker_args=lambda k: ["--host", lab.nodes[k].address], wrap=lab.command) as swarm:
        exact = torch.stack([peer_values(3, k, numel) for k in range(n)]).double().mean(0)
        errors, per_round = [], []
        for _ in range(rounds):
            for _attempt in range(MATCHMAKING_ATTEMPTS):  # a round matchmaking left a peer out is run again
                swarm.all("set", 60, cmd="set", seed=3)
                reports = swarm.all("report", 120, cmd="step")
                if all(r["ok"] for r in reports):
                    break
            assert all(r["ok"] and r["group_size"] == n and not r["absent"] and not r["relayed"] for r in reports), \
                [(r["ok"], r["error"], r["absent"], r["relayed"]) for r in reports]
            per_round.append(reports)
            for worker in swarm.workers:
                path = tmp_path / f"values{worker.index}.pt"
                worker.send(cmd="dump", path=str(path))
                worker.read_event("dumped", 60)
                values = torch.load(path).double()
                errors.append(float((values - exact).norm() / exact.norm()))
    return (per_round if rounds > 1 else per_round[0]), max(errors)


def group_round_s(reports) -> float:
    """From the moment the last member learned the group (no one can finish before) to the last one done."""
    return max(r["ended_at"] for r in reports) - max(r["ended_at"] - r["total_s"] for r in reports)


@pytest.mark.swarm
def test_three_peers_at_20_mbit_average_8_mb_exactly_near_the_lower_bound(tmp_path):
    numel, rate = 2_000_000, 20.0  # 8 MB of fp32
    with Netlab([rate] * 3) as lab:
        reports, err = average_once(lab, numel, tmp_path)
    n, size, upload = 3, numel * 4, rate * 1e6 / 8
    lower_bound = 2 * (n - 1) / n * size / upload
    round_s = group_round_s(reports)
    print(f"round {round_s:.2f} s, lower bound {lower_bound:.2f} s, rel err {err:.1e}, measured uploads "
          f"{[round(r['upload_bps'] / 1e6, 2) for r in reports]} MB/s")
    assert err <= 1e-6
    assert round_s <= ROUND_OVER_BOUND * lower_bound, (round_s, lower_bound, [r["total_s"] for r in reports])
    # Each peer measured its own uplink on the round's traffic (what it announces for partitioning): the
    # payload rate is ~96% of the link's; acknowledgements queued behind the receivers' data blur it a little.
    assert all(0.8 * upload <= r["upload_bps"] <= 1.2 * upload for r in reports), [r["upload_bps"] for r in reports]


@pytest.mark.slow
def test_heterogeneous_uploads_slow_member_owns_less_after_measuring(tmp_path):
    numel, uploads = 2_000_000, [40.0, 40.0, 40.0, 5.0]  # 8 MB; one uplink 8x slower
    size, bws = numel * 4, [u * 1e6 / 8 for u in uploads]
    equal_s = reduce_allgather_seconds(size, bws, [numel // 4] * 4)
    optimum_s = reduce_allgather_seconds(size, bws, bandwidth_part_sizes(numel, bws))
    with Netlab(uploads) as lab:
        # Round 1: nobody knows its bandwidth yet (equal parts); round 2: parts by the measured uploads.
        (first, second), err = average_once(lab, numel, tmp_path, "--partition", "bandwidth", rounds=2)
    slow = second[3]["my_index"]  # the slow peer's place in the group (matchmaking orders members)
    assert not first[0]["part_sizes"] and second[0]["part_sizes"][slow] < numel // 20, second[0]["part_sizes"]
    assert err <= 1e-6
    first_s, second_s = group_round_s(first), group_round_s(second)
    assert first_s >= 0.9 * equal_s
    print(f"equal parts {first_s:.2f} s (bound {equal_s:.2f}), by bandwidth {second_s:.2f} s (optimum {optimum_s:.2f})")
    assert second_s <= 1.25 * optimum_s, (second_s, optimum_s, equal_s)
