"""One hostile peer in a real 4-process swarm (issue 14): `--aggregation clipped` keeps the honest peers near
their own mean, the owners flag the hostile peer by its libp2p peer id, and no honest peer is flagged."""

from __future__ import annotations

import pytest
import torch
from averaging_swarm import AveragingSwarm
from averaging_worker import peer_values

pytestmark = pytest.mark.timeout(240)

PEERS, NUMEL, CHUNK_BYTES = 4, 4096, 1024  # 256 values per chunk, 4 chunks per part
HOSTILE = PEERS - 1


def test_clipped_aggregation_resists_a_hostile_peer_in_a_real_swarm():
    with AveragingSwarm(PEERS, "--numel", str(NUMEL), "--target-group-size", "4", "--min-group-size", "4",
                        "--chunk-bytes", str(CHUNK_BYTES), "--matchmaking-time", "3.0", "--aggregation", "clipped",
                        per_worker_args=lambda k: ["--faults", "byzantine=-100,weight=1e6"] if k == HOSTILE
                        else []) as swarm:
        peer_ids = [w.ready["maddrs"][0].split("/p2p/")[-1] for w in swarm.workers]
        for attempt in range(3):  # a round in which all four met (matchmaking may split a first round)
            swarm.all("set", 30, cmd="set", seed=7)
            reports = swarm.all("report", 90, cmd="step")
            if all(r["ok"] and r["group_size"] == PEERS and not r["absent"] for r in reports):
                break
        else:
            pytest.fail(f"no full round: {[(r['ok'], r['group_size'], r['error']) for r in reports]}")
        values = [torch.tensor(v["values"]) for v in swarm.all("values", 30, cmd="values")]
    honest = sum(peer_values(7, k, NUMEL) for k in range(HOSTILE)) / HOSTILE
    # The plain mean (weight capped at 2x the median) would sit near (3 x 1 + 2 x -300) / 5 = -120.
    for k in range(HOSTILE):
        assert float((values[k] - honest).abs().mean()) < 2.0, k
    for k, report in enumerate(reports):
        assert report["aggregation"] == "clipped"
        if k != HOSTILE:  # every honest owner clipped the hostile peer in each chunk of its part, nobody else
            assert report["flagged"] == {peer_ids[HOSTILE]: NUMEL // PEERS // (CHUNK_BYTES // 4)}, report["flagged"]


def test_robust_followers_leave_the_pairs_a_hostile_leader_starts_and_avoid_it():
    """Issue 26, `leader_pair`: a peer with target group size 2 and the earliest declared expiration is the first
    leader everyone asks, and starts its group as soon as one follower joined. A group of two averages nothing
    under `clipped` (never fewer than three), so on main that follower was kept out of the honest group round after
    round. Now it leaves the pair and asks the next leader (no honest peer ends a round in a group of two), and
    skips that leader from then on: each honest peer is paired at most once, and soon nobody asks it."""
    with AveragingSwarm(PEERS, "--numel", str(NUMEL), "--target-group-size", "4", "--min-group-size", "2",
                        "--chunk-bytes", str(CHUNK_BYTES), "--matchmaking-time", "3.0", "--aggregation", "clipped",
                        per_worker_args=lambda k: ["--target-group-size", "2", "--matchmaking-time", "1.0"]
                        if k == HOSTILE else []) as swarm:
        averaged_together = pairs = 0
        for seed in range(6):
            swarm.all("set", 30, cmd="set", seed=seed)
            reports = swarm.all("report", 90, cmd="step")
            honest = reports[:HOSTILE]
            assert all(not r["ok"] or r["group_size"] >= 3 for r in honest), [r["group_size"] for r in honest]
            averaged_together += all(r["ok"] and r["group_size"] >= 3 and not r["robust_too_few"] for r in honest)
            if not reports[HOSTILE]["ok"]:
                break  # nobody joined the hostile leader any more
            pairs += reports[HOSTILE]["group_size"] == 2
        else:
            pytest.fail("the hostile leader still found a follower after six rounds")
        assert pairs <= HOSTILE  # each honest peer left its pair once, then skipped it
        assert averaged_together >= 1
