"""MoshpitAverager in real multi-process swarms on 127.0.0.1 (one worker process per peer, many rounds each)."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from averaging_stats import mean_within_bound, owner_pull
from averaging_swarm import AveragingSwarm
from averaging_worker import peer_values
from moshpeer.averaging import Partition

pytestmark = pytest.mark.timeout(240)

# Swarms whose groups must be full (min = target group size): a group assembles the moment it fills, so
# a long matchmaking window costs nothing when all goes well. It sets how long a leader waits and hivemind's
# request_timeout (half of it): under heavy CPU load (2 cores, five test suites) a peer stalled longer than
# request_timeout abandons a leader that has just accepted it, the one disagreement hivemind's matchmaking
# has no commit step for. 3 s keeps that out of reach; the data plane would report it (`absent`) anyway.
FULL_GROUP_MATCHMAKING_S = "3.0"

# Rounds (or a grid's swarm) a test may run again when matchmaking left a peer out (see FULL_GROUP_MATCHMAKING_S:
# even 3 s was exceeded once in CI, a worker found no group while its 3 mates counted it and reported it absent).
MATCHMAKING_ATTEMPTS = 3


def exact_mean(seed: int, n: int, numel: int) -> torch.Tensor:
    return torch.stack([peer_values(seed, k, numel) for k in range(n)]).mean(0)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def run_grid(n: int, group: int, bits_per_peer, rounds: int, numel: int = 4096) -> None:
    """Every round must form the full grid's groups (one missing member and the mean is not exact). A swarm in
    which matchmaking left a peer out of a round (see FULL_GROUP_MATCHMAKING_S; seen once in a lane run under
    tests/stress.sh: "no group found" for one of 8 peers) is started afresh, up to MATCHMAKING_ATTEMPTS times:
    its group keys no longer form the grid. The data plane's part, lossless rounds and the exact mean, is
    asserted on every round that formed its groups."""
    for _attempt in range(MATCHMAKING_ATTEMPTS):
        with AveragingSwarm(n, "--numel", str(numel), "--target-group-size", str(group),
                            "--min-group-size", str(group), "--matchmaking-time", FULL_GROUP_MATCHMAKING_S,
                            per_worker_args=lambda k: ["--grid-bits", bits_per_peer(k)]) as swarm:
            swarm.all("set", 30, cmd="set", seed=7)
            for _ in range(rounds):
                reports = swarm.all("report", 60, cmd="step")
                # A member left out by matchmaking is absent and its part is lost by its mates: check fullness
                # first (found in CI: the lossless assertion fired on such a round before the retry could run).
                full = all(r["ok"] and r["group_size"] == group and not r["absent"] for r in reports)
                if full:
                    assert all(r["lost_fraction"] == 0 for r in reports), reports
                else:
                    failed = [(r["ok"], r["error"], r["group_size"], r["absent"]) for r in reports] + \
                        ["\n".join(w.stderr_lines[-15:]) for w, r in zip(swarm.workers, reports)
                         if not r["ok"] or r["absent"]]
                    break
            else:
                exact = exact_mean(7, n, numel)
                for answer in swarm.all("values", 30, cmd="values"):
                    assert rel_err(torch.tensor(answer["values"]), exact) <= 1e-6
                return
    raise AssertionError(failed)


def test_exact_mean_8_peers_groups_of_2_after_3_rounds():
    # Grid 2x2x2: the 2 group bits are the coordinates on the axes not averaged this round.
    run_grid(8, 2, lambda k: format(k >> 1, "02b"), rounds=3)


@pytest.mark.slow
def test_exact_mean_16_peers_groups_of_4_after_2_rounds():
    # Grid 4x4: 2 group bits = the coordinate on the other axis.
    run_grid(16, 4, lambda k: format(k >> 2, "02b"), rounds=2)


# ---- one 4-peer swarm (one group of 4) for the loss tests -----------------------------------------

NUMEL, CHUNK_BYTES, PEERS = 4096, 256, 4  # 64 values per chunk, 16 chunks per part


@pytest.fixture(scope="module")
def lossy_swarm():
    with AveragingSwarm(PEERS, "--numel", str(NUMEL), "--target-group-size", "4", "--min-group-size", "4",
                        "--chunk-bytes", str(CHUNK_BYTES), "--matchmaking-time", FULL_GROUP_MATCHMAKING_S) as swarm:
        yield swarm


def step_in_full_group(swarm: AveragingSwarm, faults: str, prepare=lambda: None) -> list:
    """One round with fault injection in which all PEERS met (the loss tests are about the data plane).
    `prepare` runs before each attempt (e.g. resets the values a partial round changed)."""
    for _ in range(MATCHMAKING_ATTEMPTS):
        prepare()
        reports = swarm.all("report", 60, cmd="step", faults=faults)
        if all(r["ok"] and r["group_size"] == PEERS and not r["absent"] for r in reports):
            return reports
    raise AssertionError([(r["ok"], r["error"], r["group_size"], r["absent"], r["wall_s"]) for r in reports])


def test_unbiased_under_random_reduce_loss(lossy_swarm):
    """10% of contributions lost at random: the owner's estimate does not lean toward its own value."""
    partition = Partition(NUMEL, PEERS, CHUNK_BYTES // 4)
    pulls, lost = [], 0
    for seed in range(100, 114):
        reports = step_in_full_group(lossy_swarm, f"drop_prob=0.1,phases=reduce,seed={seed}",
                                     prepare=lambda: lossy_swarm.all("set", 30, cmd="set", seed=seed))
        lost += sum(r["reduce"]["chunks_lost"] for r in reports)
        values = [torch.tensor(a["values"]) for a in lossy_swarm.all("values", 30, cmd="values")]
        for v in values[1:]:
            assert torch.equal(v, values[0])  # no gather loss: everyone holds the owners' estimates
        exact = exact_mean(seed, PEERS, NUMEL)
        owner_of_part = {r["my_index"]: k for k, r in enumerate(reports)}
        errors, offsets = [], []
        for part in range(PEERS):
            lo, hi = partition.part_range(part)
            own = peer_values(seed, owner_of_part[part], NUMEL)
            errors.append(float((values[0][lo:hi] - exact[lo:hi]).mean()))
            offsets.append(float((own[lo:hi] - exact[lo:hi]).mean()))
        pulls.append(owner_pull(errors, offsets))
    assert lost > 0  # the injection really dropped chunks
    mean, bound = mean_within_bound(pulls)
    assert mean <= bound, (mean, bound, pulls)


def test_bounded_drift_under_gather_loss(lossy_swarm):
    """10% of averaged chunks lost: peers keep their own value there, and the spread does not grow."""
    spreads = []
    lossy_swarm.all("set", 30, cmd="set", seed=200)
    for seed in range(201, 217):
        lossy_swarm.all("added", 30, cmd="add", seed=seed, scale=1.0)  # new "gradients" every round
        reports = step_in_full_group(lossy_swarm, f"drop_prob=0.1,phases=gather,seed={seed}")
        assert sum(r["gather"]["chunks_lost"] for r in reports) == sum(len(r["missing_chunks"]) for r in reports)
        values = torch.stack([torch.tensor(a["values"]) for a in lossy_swarm.all("values", 30, cmd="values")])
        spreads.append(float(values.std(0).mean()))
    first, second = statistics.mean(spreads[:8]), statistics.mean(spreads[8:])
    assert max(spreads) < 3.0, spreads  # one round of fresh noise has spread ~1.3
    assert second <= 2.0 * first + 0.05, spreads


# ---- a peer killed mid-round ------------------------------------------------------------------------


def test_sigkilled_peer_mid_round():
    numel, chunk_bytes, round_timeout = 65536, 4096, 20.0
    with AveragingSwarm(4, "--numel", str(numel), "--target-group-size", "4", "--min-group-size", "4",
                        "--chunk-bytes", str(chunk_bytes), "--matchmaking-time", FULL_GROUP_MATCHMAKING_S,
                        "--round-timeout", str(round_timeout)) as swarm:
        victim, survivors = swarm.workers[3], swarm.workers[:3]
        for worker in survivors:
            worker.send(cmd="step")
        victim.send(cmd="step", faults="delay_s=0.3")  # slow sender: the round is surely still running
        victim.wait_stderr("assembled", timeout=60)
        killed_at = time.monotonic()
        victim.kill()
        reports = [w.read_event("report", round_timeout + 30) for w in survivors]
        assert time.monotonic() - killed_at < round_timeout + 5
        victim_index = ({0, 1, 2, 3} - {r["my_index"] for r in reports}).pop()
        for r in reports:
            assert r["ok"] and r["group_size"] == 4
            assert r["total_s"] <= round_timeout + 2
            assert r["total_s"] < round_timeout / 2  # the broken connections tell them at once; no deadline wait
            assert r["lost_fraction"] > 0 and r["reduce"]["chunks_lost"] > 0
            assert any(part == victim_index for part, _ in r["missing_chunks"])
        for w in survivors:
            w.wait_stderr("lost", timeout=10)  # the warning line
        values = [torch.tensor(a["values"]) for a in swarm.all("values", 30, workers=survivors, cmd="values")]
        partition = Partition(numel, 4, chunk_bytes // 4)
        compared = 0
        for part in range(4):
            for chunk in range(partition.num_chunks(part)):
                lo, hi = partition.chunk_range(part, chunk)
                holders = [v for v, r in zip(values, reports)
                           if r["my_index"] == part or [part, chunk] not in r["missing_chunks"]]
                if part == victim_index:
                    assert len(holders) <= 1 or all(torch.equal(h[lo:hi], holders[0][lo:hi]) for h in holders)
                for h in holders[1:]:
                    assert torch.equal(h[lo:hi], holders[0][lo:hi]), (part, chunk)
                    compared += 1
        assert compared > 0


# ---- libp2p-stream fallback -------------------------------------------------------------------------


def test_member_without_direct_address_averages_over_libp2p_streams():
    """Member 3 announces no TCP address (as behind NAT): every chunk to and from it travels over libp2p
    streams through the P2P daemons, with the same handshake and checks, and the round is exact."""
    numel, chunk_bytes = 4096, 2048  # several chunks per part, so the relayed streams carry a pipeline
    with AveragingSwarm(4, "--numel", str(numel), "--target-group-size", "4", "--min-group-size", "4",
                        "--chunk-bytes", str(chunk_bytes), "--matchmaking-time", FULL_GROUP_MATCHMAKING_S,
                        per_worker_args=lambda k: ["--transport", "libp2p"] if k == 3 else []) as swarm:
        swarm.all("set", 30, cmd="set", seed=11)
        reports = swarm.all("report", 60, cmd="step")
        assert all(r["ok"] and r["group_size"] == 4 and not r["absent"] for r in reports), reports
        assert all(r["lost_fraction"] == 0 and r["rejected_connections"] == 0 for r in reports), reports
        natted = reports[3]["my_index"]
        assert reports[3]["relayed"] == sorted({0, 1, 2, 3} - {natted})  # it sends everything over libp2p
        for r in reports[:3]:
            assert r["relayed"] == [natted]  # the others reach only it over libp2p, each other directly
        exact = exact_mean(11, 4, numel)
        for answer in swarm.all("values", 30, cmd="values"):
            assert rel_err(torch.tensor(answer["values"]), exact) <= 1e-6


@pytest.mark.slow
def test_every_connection_over_libp2p_streams_for_150_rounds_loses_nothing():
    """A soak of the stream bridge (relay.py): every member reaches every other over libp2p, 12 relayed connections
    a round. The bridge closes a stream as soon as one side ends; a daemon that reset it (discarding what the other
    end had not read yet, as a join request's answers were lost: docs/averaging.md) would show here as lost chunks
    at the end of a phase."""
    numel, chunk_bytes = 65536, 8192  # 32 KB chunks, 2 per part and phase
    problems, full_rounds = [], 0
    with AveragingSwarm(4, "--numel", str(numel), "--target-group-size", "4", "--min-group-size", "4",
                        "--chunk-bytes", str(chunk_bytes), "--matchmaking-time", FULL_GROUP_MATCHMAKING_S,
                        per_worker_args=lambda k: ["--transport", "libp2p"]) as swarm:
        swarm.all("set", 30, cmd="set", seed=11)
        for round_index in range(150):
            reports = swarm.all("report", 60, cmd="step")
            if not all(r["ok"] and r["group_size"] == 4 and not r["absent"] for r in reports):
                continue  # matchmaking left a member out (FULL_GROUP_MATCHMAKING_S): not the bridge's doing
            full_rounds += 1
            for r in reports:
                assert len(r["relayed"]) == 3, r["relayed"]
                if r["lost_fraction"] or r["rejected_connections"] or r["departed"]:
                    problems.append((round_index, r["my_index"], r["lost_fraction"], r["rejected_connections"],
                                     r["departed"]))
    assert not problems, problems
    assert full_rounds >= 140, full_rounds


# ---- matchmaking at the deadline ----------------------------------------------------------------------


def test_group_assembled_at_the_followers_deadline_reaches_the_follower():
    """Two peers, groups of up to 4 (never full), each looking for exactly its matchmaking time: the leader
    assembles the pair at its declared expiration, which is the follower's search end give or take the
    milliseconds between their starts. A follower that stopped waiting at its search end (hivemind's
    look_for_group with timeout = deadline) would leave while its leader counts it; ours waits for the
    leader's answer, so both members see the same group every round."""
    with AveragingSwarm(2, "--numel", "256", "--target-group-size", "4", "--min-group-size", "2",
                        "--matchmaking-time", "1.0") as swarm:
        for seed in range(5):
            swarm.all("set", 30, cmd="set", seed=seed)
            reports = swarm.all("report", 60, cmd="step", search_s=1.0)
            assert all(r["ok"] and r["group_size"] == 2 and not r["absent"] for r in reports), reports
            assert reports[0]["group_id"] == reports[1]["group_id"]
            exact = exact_mean(seed, 2, 256)
            for answer in swarm.all("values", 30, cmd="values"):
                assert rel_err(torch.tensor(answer["values"]), exact) <= 1e-6
