"""netlab (moshpeer.testing.netlab): shaped links in network namespaces, and MoshpitAverager over them.

Every test here needs root and iproute2; where namespaces cannot be made they skip with netlab's reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from averaging_swarm import AveragingSwarm
from averaging_worker import peer_values
from shared_memory import SHARES_MEMORY, segments_of
from moshpeer.averaging.partition import bandwidth_part_sizes, reduce_allgather_seconds
from moshpeer.simulation.time_model import group_round_seconds
from moshpeer.testing import netlab
from moshpeer.testing.netlab import Netlab

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(netlab.unavailable() is not None, reason=str(netlab.unavailable()))]
# Stock Linux's congestion control, what the simulator's fair links stand for (this kernel may default to BBR).
STOCK_TCP = "cubic" if "cubic" in netlab.tcp.available() else None
needs_delays = pytest.mark.skipif(netlab.unavailable(delays=True) is not None,
                                  reason=str(netlab.unavailable(delays=True)))
needs_sites = pytest.mark.skipif(netlab.unavailable(sites=True) is not None,
                                 reason=str(netlab.unavailable(sites=True)))
needs_cpu = pytest.mark.skipif(netlab.unavailable(cpu_budgets=True) is not None,
                               reason=str(netlab.unavailable(cpu_budgets=True)))

# hivemind's leader and follower can disagree on a group when a loaded machine stalls an event loop past the
# request timeout (the left-out peer finds no group); this file measures the data plane, so such a round reruns.
MATCHMAKING_ATTEMPTS = 3
# How far a round may be from the link's lower bound here: an idle machine measures 1.10-1.13x with CUBIC in 5 of 6
# runs, 1.36x in one (connection setup, TCP slow start, coding 8 MB on 2 shared cores, and one owner's part arriving
# late when its senders' flows share their uplinks unevenly); bench_wan holds the figure (utilization 0.93 at 100
# Mbit/s). With this VM's default BBR the same test measured 1.03-1.48x (CI failed at 1.48x, session 43).
ROUND_OVER_BOUND = 1.45
# Real over simulated round time at 8 and 16 peers: measured 1.21-1.27 (see the validation test's docstring).
SIMULATED_ROUND_GAP = 1.45

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


# UDP echo and a ping-like client: round trips in ms of 40 probes, one per line (real ones, over the lab's links).
PROBE = textwrap.dedent("""
    import socket, sys, time
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if sys.argv[1] == "echo":
        sock.bind((sys.argv[2], 7777))
        print("ready", flush=True)
        sock.settimeout(30)
        while True:
            data, sender = sock.recvfrom(2048)
            sock.sendto(data, sender)
    sock.settimeout(5)
    for _ in range(40):
        started = time.monotonic()
        sock.sendto(b"x" * 64, (sys.argv[2], 7777))
        sock.recvfrom(2048)
        print((time.monotonic() - started) * 1000)
""")
# Connect to port 5555 within 3 s; prints the local address or the error.
CONNECT = ("import socket, sys\ntry:\n    s = socket.create_connection((sys.argv[1], 5555), timeout=3)\n"
           "    print('connected', s.getsockname()[1])\nexcept OSError as e:\n    print('failed', type(e).__name__)")
# Accept one connection within 5 s; prints the address it came from.
ACCEPT = ("import socket\nserver = socket.create_server(('0.0.0.0', 5555))\nprint('listening', flush=True)\n"
          "server.settimeout(5)\ntry:\n    conn, peer = server.accept()\n    print('from', peer[0], peer[1])\n"
          "except OSError:\n    print('nothing')")


def lab_names(lab_id: str) -> list:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout + \
        subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout + \
        " ".join(os.listdir("/sys/fs/cgroup/cpu") if os.path.isdir("/sys/fs/cgroup/cpu") else [])
    return [word for word in listed.split() if lab_id in word]


def fastest_rtt_ms(lab: Netlab, a: int, b: int) -> float:
    """The fastest of 40 probes' round trips. A loaded machine only ever adds to a round trip (the CI lane
    beside this test once lifted the median by 14 ms for seconds at a time), while the delay line's jitter is
    bounded; so the fastest probe is the one that shows the configured delay."""
    echo = lab.popen(b, [sys.executable, "-c", PROBE, "echo", lab.nodes[b].address], stdout=subprocess.PIPE,
                     text=True)
    assert echo.stdout.readline().strip() == "ready"
    probe = lab.run(a, [sys.executable, "-c", PROBE, "ping", lab.nodes[b].address], capture_output=True, text=True)
    echo.kill()
    echo.wait()
    return min(float(line) for line in probe.stdout.split())


@needs_delays
def test_delay_line_gives_the_configured_round_trip():
    # Jitter 4 ms is +-2 ms on each peer's line: a round trip between two delayed peers is never below its
    # configured value less 4 ms (the line never releases a packet early). Above it, the 10%: under
    # tests/stress.sh even the fastest of 40 probes came 6 ms late (75.9 ms for 70).
    with Netlab([100, 100, 100], rtt=["100ms", "100ms", "40ms"], jitter="4ms") as lab:
        assert 96 <= fastest_rtt_ms(lab, 0, 1) <= 110  # both peers add 50 ms each way
        assert 66 <= fastest_rtt_ms(lab, 0, 2) <= 77  # 50 + 20
    with Netlab([100, 100]) as lab:
        assert fastest_rtt_ms(lab, 0, 1) < 5  # no delay line unless asked for
    assert not lab_names(lab.lab_id)


@needs_sites
def test_sites_translate_as_their_kind_and_drop_what_nobody_asked_for():
    kinds = [None, "cone", "symmetric", "firewall", None]
    with Netlab([None] * 5, sites=kinds) as lab:
        public = lab.nodes[0].address

        def connect(a: int, b: int, target: str) -> tuple:
            server = lab.popen(b, [sys.executable, "-c", ACCEPT], stdout=subprocess.PIPE, text=True)
            assert server.stdout.readline().strip() == "listening"
            client = lab.run(a, [sys.executable, "-c", CONNECT, target], capture_output=True, text=True)
            seen = server.stdout.readline().split()
            server.wait(10)
            return client.stdout.split(), seen

        for k, kind in enumerate(kinds[1:4], start=1):
            (status, port), (_, source, seen_port) = connect(k, 0, public)  # outbound: always works
            node = lab.nodes[k]
            if kind == "firewall":  # routed: the others see the peer's own address
                assert status == "connected" and source == node.address
            else:  # translated: the others see the site's address
                assert status == "connected" and source == node.site_address != node.address
            if kind == "cone":
                assert seen_port == port  # the mapping keeps the inside port
            # Inbound, unsolicited: silently dropped (a timeout, not a refusal), whatever the address.
            for target in filter(None, {node.address, node.site_address}):
                client, seen = connect(0, k, target)
                assert client[0] == "failed" and seen == ["nothing"], (kind, target, client)
        # Symmetric: a new outside port per destination, so a port learned through one peer is useless.
        ports = {connect(2, b, lab.nodes[b].address)[1][2] for b in (0, 4)}
        assert len(ports) == 2
    assert not lab_names(lab.lab_id)


@needs_cpu
def test_cpu_budgets_hold_a_peer_to_its_share_and_are_torn_down():
    spin = "import time\nt, w = time.process_time(), time.time()\nwhile time.time() - w < 2: pass\n" \
           "print(time.process_time() - t)"
    with Netlab([None, None], cpu_shares=[0.25, None]) as lab:
        group = lab.nodes[0].cgroup
        assert group is not None and abs(float((group / "cpu.cfs_quota_us").read_text()) / 100_000 - 0.25) < 1e-9
        budgeted = float(lab.run(0, [sys.executable, "-c", spin], capture_output=True, text=True).stdout)
        assert budgeted <= 2 * 0.25 * 1.2  # 0.5 s of CPU in 2 s of wall time, whatever else runs here
    assert not group.exists() and not lab_names(lab.lab_id)


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


def test_teardown_leaves_no_shared_memory_behind():
    """A peer killed by the teardown leaves no torch segment in /dev/shm: its torch_shm_manager, which runs in the
    lab too, is let remove them instead of being killed first (bench_wan's runs used to leave 8 a run)."""
    with Netlab([None]) as lab:
        peer = lab.popen(0, [sys.executable, "-c", SHARES_MEMORY], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
        assert peer.stdout.readline().strip() == "shared"
        segments = segments_of(peer.pid)
        assert segments
    assert not [path for path in segments if os.path.exists(path)]


@needs_delays
def test_an_initial_window_is_set_on_every_route_between_peers():
    """What `ip route change ... initcwnd N initrwnd N` does on a host, on the routes a peer's packets take:
    through the delay line (rtt) and straight to the router."""
    with Netlab([None, None], rtt=["50ms", None], initial_window=64) as lab:
        for k in range(2):
            route = lab.run(k, ["ip", "route", "get", lab.nodes[1 - k].address], capture_output=True, text=True)
            assert "initcwnd 64" in route.stdout and "initrwnd 64" in route.stdout, route.stdout
    with pytest.raises(netlab.NetlabError):
        Netlab([None], initial_window=0)


def test_peers_run_the_congestion_control_asked_for_and_the_host_list_is_put_back():
    """A namespace may only choose an allowed algorithm: the lab allows it while it is up, then puts the host's
    list back."""
    allowed = netlab.tcp.SYSCTL / "tcp_allowed_congestion_control"
    before = allowed.read_text()
    name = next((n for n in ("cubic", "reno") if n in netlab.tcp.available()), None)
    if name is None:
        pytest.skip("neither cubic nor reno in this kernel")
    with Netlab([None, None], tcp_congestion=name) as lab:
        chosen = lab.run(1, ["sysctl", "-n", "net.ipv4.tcp_congestion_control"], capture_output=True, text=True)
        assert chosen.stdout.strip() == name
    assert allowed.read_text() == before


def test_leftovers_of_a_killed_owner_are_cleaned_up():
    features = "rtt='20ms', cpu_shares=0.5" if netlab.unavailable(delays=True, cpu_budgets=True) is None else ""
    code = ("import os, subprocess; from moshpeer.testing.netlab import Netlab; "
            f"lab = Netlab([10, 10], {features}).up(); "
            "lab.popen(0, ['sleep', '60'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            "print(lab.lab_id, flush=True); os.kill(os.getpid(), 9)")
    crashed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    lab_id = crashed.stdout.strip()
    assert crashed.returncode == -9 and lab_id and lab_names(lab_id)
    removed = netlab.cleanup()
    assert any(lab_id in name for name in removed)
    assert not lab_names(lab_id)


ROUND_FACTS = ("ok", "error", "group_size", "my_index", "lost_fraction", "missing_chunks", "absent", "departed",
               "relayed", "rejected_messages", "total_s")


def average_once(lab: Netlab, numel: int, tmp_path, *extra: str, rounds: int = 1, relay_ok: bool = False,
                 behind_nat=lambda k: False) -> tuple:
    """`rounds` group all-reduces of all peers in `lab`, each of the same values; -> (reports of the last round,
    or a list of them per round if rounds > 1; max relative error vs the exact mean over all rounds).
    `behind_nat(k)`: worker k starts its DHT with behind_nat=True."""
    n = len(lab.nodes)
    with AveragingSwarm(n, "--numel", str(numel), "--target-group-size", str(n), "--min-group-size", str(n),
                        "--matchmaking-time", "3.0", "--round-timeout", "60", *extra,
                        per_worker_args=lambda k: ["--host", lab.nodes[k].address] + ["--behind-nat"] * behind_nat(k),
                        wrap=lab.command) as swarm:
        exact = torch.stack([peer_values(3, k, numel) for k in range(n)]).double().mean(0)
        errors, per_round = [], []
        for _ in range(rounds):
            for _attempt in range(MATCHMAKING_ATTEMPTS):  # a round matchmaking left a peer out is run again
                swarm.all("set", 60, cmd="set", seed=3)
                reports = swarm.all("report", 120, cmd="step")
                if all(r["ok"] for r in reports):
                    break
            assert all(r["ok"] and r["group_size"] == n and not r["absent"] and (relay_ok or not r["relayed"])
                       for r in reports), \
                [(r["ok"], r["error"], r["absent"], r["relayed"]) for r in reports]
            per_round.append(reports)
            for worker, report in zip(swarm.workers, reports):
                path = tmp_path / f"values{worker.index}.pt"
                worker.send(cmd="dump", path=str(path))
                worker.read_event("dumped", 60)
                values = torch.load(path).double()
                errors.append(float((values - exact).norm() / exact.norm()))
                # Shown with a failing test's output: which worker's values were off, and what its round said.
                facts = {k: report.get(k) for k in ROUND_FACTS}
                print(f"round {len(per_round)} worker {worker.index}: rel err {errors[-1]:.1e}, {facts}")
    return (per_round if rounds > 1 else per_round[0]), max(errors)


def group_round_s(reports) -> float:
    """From the moment the last member learned the group (no one can finish before) to the last one done."""
    return max(r["ended_at"] for r in reports) - max(r["ended_at"] - r["total_s"] for r in reports)


@pytest.mark.swarm
def test_three_peers_at_20_mbit_average_8_mb_exactly_near_the_lower_bound(tmp_path):
    numel, rate = 2_000_000, 20.0  # 8 MB of fp32
    with Netlab([rate] * 3, tcp_congestion=STOCK_TCP) as lab:
        reports, err = average_once(lab, numel, tmp_path)
    n, upload = 3, rate * 1e6 / 8
    lower_bound = simulated_round_s(numel, [upload] * n)  # the simulator's model of the round: 2 (n-1)/n of 8 MB
    round_s = group_round_s(reports)
    print(f"round {round_s:.2f} s, lower bound {lower_bound:.2f} s, rel err {err:.1e}, measured uploads "
          f"{[round(r['upload_bps'] / 1e6, 2) for r in reports]} MB/s")
    assert err <= 1e-6
    assert round_s <= ROUND_OVER_BOUND * lower_bound, (round_s, lower_bound, [r["total_s"] for r in reports])
    # Each peer measured its own uplink on the round's traffic (what it announces for partitioning): the
    # payload rate is ~96% of the link's; acknowledgements queued behind the receivers' data blur it a little.
    assert all(0.8 * upload <= r["upload_bps"] <= 1.2 * upload for r in reports), [r["upload_bps"] for r in reports]


def simulated_round_s(numel: int, uploads, rtt_s: float = 0.0) -> float:
    """What `moshpeer.simulation` predicts for an fp32 round with equal parts over these uploads (bytes/s; the
    lab's downlinks are not limited): its time model, the one the training level runs on."""
    n = len(uploads)
    parts = [numel // n + (k < numel % n) for k in range(n)]
    return group_round_seconds(numel, parts, uploads, [float("inf")] * n, rtt_s, 4)[0]


@pytest.mark.swarm
@needs_delays
def test_a_first_round_200_ms_apart_takes_what_the_simulator_says(tmp_path):
    """The simulator's time model on long round trips: a group's first round opens fresh connections, so it pays
    their setup and TCP's slow start, which a swarm of hundreds pays nearly every round (docs/simulation.md, "Session
    49: round trips"). 3 peers at 100 Mbit/s, 200 ms apart, 4 MB each: the model says 2.3 s, of which 0.45 s is the
    link's bound (without setup and slow start it said 0.85 s)."""
    numel, upload, rtt_s = 1_000_000, 100e6 / 8, 0.2
    with Netlab([100] * 3, rtt=f"{rtt_s * 1000:g}ms", tcp_congestion=STOCK_TCP) as lab:
        reports, err = average_once(lab, numel, tmp_path)
    real_s, simulated_s = group_round_s(reports), simulated_round_s(numel, [upload] * 3, rtt_s)
    print(f"first round 200 ms apart: real {real_s:.2f} s, simulated {simulated_s:.2f} s, "
          f"ratio {real_s / simulated_s:.3f}, kept {[r.get('connections_kept') for r in reports]}")
    assert err <= 1e-6
    assert 0.75 * simulated_s <= real_s <= 1.3 * simulated_s, (real_s, simulated_s)


@pytest.mark.slow
@pytest.mark.parametrize("peers", [8, 16])
def test_simulated_round_time_matches_real_peers_on_shaped_links(tmp_path, peers):
    """Issue 23's real-vs-simulated validation of bandwidth-bound round time: `peers` processes on 20 Mbit/s
    uplinks average 8 MB in one group, against the simulator's time model (perfect pipelining, fair links).

    Measured on the 2-core VM (docs/simulation.md), with chunks cut so that a part has at least 4 (partition.py's
    `pipelined_chunk_numel`): 3 peers 1.19x, 8 peers 1.25-1.27x, 16 peers 1.21x; with one 1 MB chunk per part,
    as before that rule, 8 peers took 1.45-1.60x. The bound leaves room for a loaded machine."""
    numel, upload = 2_000_000, 20e6 / 8
    with Netlab([upload * 8 / 1e6] * peers, tcp_congestion=STOCK_TCP) as lab:
        reports, err = average_once(lab, numel, tmp_path)
    real_s, simulated_s = group_round_s(reports), simulated_round_s(numel, [upload] * peers)
    print(f"{peers} peers: real round {real_s:.2f} s, simulated {simulated_s:.2f} s, ratio {real_s / simulated_s:.3f}")
    assert err <= 1e-6
    assert 0.9 * simulated_s <= real_s <= SIMULATED_ROUND_GAP * simulated_s, (real_s, simulated_s)


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


@needs_sites
def test_a_peer_behind_a_symmetric_nat_averages_and_the_report_names_the_path(tmp_path):
    """Two public peers and one behind a symmetric NAT (`start_dht(behind_nat=True)`): nobody can open a
    connection to the NATed peer, so it holds a slot on a public peer's relay, and its group mates reach it
    through circuits there; it reaches them directly. Every round averages exactly, and each report says which
    members were relayed, none of them over libp2p."""
    numel = 200_000
    with Netlab([None] * 3, sites=[None, None, "symmetric"]) as lab:
        (first, second), err = average_once(lab, numel, tmp_path, rounds=2, relay_ok=True,
                                            behind_nat=lambda k: k == 2)
    for reports in (first, second):
        by_peer = {r["my_index"]: r for r in reports}  # reports come in worker order: worker 2 is behind the NAT
        natted = reports[2]["my_index"]
        for index, report in by_peer.items():
            if index == natted:
                assert report["relayed"] == [], report["relayed"]  # it can open connections to everyone
            else:
                assert report["relayed"] == [natted], (index, report["relayed"])  # nobody can open one to it
            assert report["over_libp2p"] == [], report["over_libp2p"]  # the relay on the data plane carried it
    assert err <= 1e-6
