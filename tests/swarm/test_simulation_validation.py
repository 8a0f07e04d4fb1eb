"""The simulator against real peers (issue 23, item 4): the same swarm, N `MoshpitAverager` processes on loopback
and N virtual peers of `moshpeer.simulation` ("keys" topology: the production grouping and key-rotation rules),
must need the same number of rounds, within one, for the spread of the peers' values to fall below eps relative
to the start. The peers start on a full grid (balanced initial keys: worker k holds key k mod 2^bits), where the
simulator is exact in M rounds for every seed, so the comparison does not depend on luck: any difference is the
real swarm's (smaller groups, a wrong key rotation). A swarm in which hivemind's matchmaking left a peer out of a
round, which the simulator does not model, is started afresh (MATCHMAKING_ATTEMPTS). 4 peers in groups
of 2 in the swarm lane; 8 peers in groups of 2 and 16 in groups of 4 are slow-marked.

What the real run adds that the simulator leaves out: hivemind's matchmaking (a peer can miss a round, groups
can come out smaller), chunking and float32 arithmetic. Round times are not compared here: on loopback nothing is
bandwidth-bound (that comparison runs on netlab links: test_netlab.py's simulated_round_time test)."""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import pytest
import torch

from averaging_swarm import AveragingSwarm
from averaging_worker import peer_values
from moshpeer.simulation import AveragingConfig, AveragingSimulation

NUMEL, SEED = 1000, 7


def rounds_below(relative_errors: List[float], eps: float) -> int:
    """First round whose error (relative to round 0) is below eps; the last round + 1 if none is."""
    for t, e in enumerate(relative_errors):
        if t > 0 and e < eps:
            return t
    return len(relative_errors)


def grid_bits(k: int, key_bits: int) -> str:
    return format(k % (1 << key_bits), f"0{key_bits}b")


def real_errors(n: int, g: int, key_bits: int, rounds: int, tmp_path,
                matchmaking_s: float) -> Tuple[List[float], List[int]]:
    """Relative error (mean squared distance to the initial mean / its initial value) after each of `rounds` rounds
    of n real peers, and the group sizes each round formed (smallest per round)."""
    initial = torch.stack([peer_values(SEED, k, NUMEL) for k in range(n)]).double()
    mean = initial.mean(0)
    start = float(((initial - mean) ** 2).mean())
    errors, smallest = [1.0], []
    with AveragingSwarm(n, "--numel", str(NUMEL), "--target-group-size", str(g), "--min-group-size", "2",
                        "--matchmaking-time", str(matchmaking_s), "--round-timeout", "30",
                        per_worker_args=lambda k: ["--grid-bits", grid_bits(k, key_bits)]) as swarm:
        swarm.all("set", 60, cmd="set", seed=SEED)
        for _ in range(rounds):
            reports = swarm.all("report", 120, cmd="step")
            smallest.append(min(r["group_size"] if r["ok"] else 1 for r in reports))
            values = []
            for worker in swarm.workers:
                path = tmp_path / f"values{worker.index}.pt"
                worker.send(cmd="dump", path=str(path))
                worker.read_event("dumped", 60)
                values.append(torch.load(path).double())
            errors.append(float(((torch.stack(values) - mean) ** 2).mean()) / start)
    return errors, smallest


def simulated_rounds(n: int, g: int, key_bits: int, rounds: int, eps: float, restarts: int = 50) -> List[int]:
    config = AveragingConfig(peers=n, dim=NUMEL, group_size=g, min_group_size=2, key_bits=key_bits,
                             initial_keys="balanced", rounds=rounds)
    runs = []
    for seed in range(restarts):
        trajectory = AveragingSimulation(config, seed).run()
        runs.append(rounds_below([e / trajectory.error[0] for e in trajectory.error], eps))
    return runs


# Real swarms a comparison may start afresh when matchmaking left a peer out of a round (as in
# test_averaging_swarm.py: under CPU load a peer stalled past its request timeout abandons a leader that had just
# accepted it; seen once in a swarm-lane run, a peer alone in rounds 1 and 2). The simulator does not model that
# failure, and after it the group keys no longer form the grid, so that swarm's rounds are not comparable.
MATCHMAKING_ATTEMPTS = 3


def check(n: int, g: int, key_bits: int, eps: float, tmp_path, rounds: int = 6) -> None:
    for attempt in range(MATCHMAKING_ATTEMPTS):
        # 16 processes on a small machine need longer than 2 s to fill groups of 4 (measured: a peer was alone in
        # every round at 2 s on 2 busy cores)
        errors, smallest = real_errors(n, g, key_bits, rounds, tmp_path, matchmaking_s=2.0 if n <= 8 else 5.0)
        real = rounds_below(errors, eps)
        if min(smallest[:real], default=g) >= g:
            break
        print(f"attempt {attempt + 1}: matchmaking left a peer out (smallest group per round {smallest}); "
              f"starting the swarm afresh")
    else:
        pytest.fail(f"matchmaking left a peer out in each of {MATCHMAKING_ATTEMPTS} swarms: {smallest}")
    simulated = simulated_rounds(n, g, key_bits, rounds, eps)
    print(f"{n} peers, groups of {g}: real {real} rounds to {eps:g} (relative errors "
          f"{[f'{e:.1e}' for e in errors]}; smallest group per round {smallest}); simulated mean "
          f"{np.mean(simulated):.2f} (10-90%: {np.percentile(simulated, 10):.0f}-{np.percentile(simulated, 90):.0f})")
    assert real <= rounds, errors  # the real swarm converged at all
    assert abs(real - float(np.mean(simulated))) <= 1.0, (real, simulated, errors, smallest)


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_four_real_peers_converge_in_the_rounds_the_simulator_predicts(tmp_path):
    check(4, 2, key_bits=1, eps=1e-4, tmp_path=tmp_path)  # a 2 x 2 grid: exact in 2 rounds


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("n,g,key_bits", [(8, 2, 2), (16, 4, 2)])  # 2 x 2 x 2 (3 rounds), 4 x 4 (2 rounds)
def test_eight_and_sixteen_real_peers_converge_in_the_rounds_the_simulator_predicts(n, g, key_bits, tmp_path):
    check(n, g, key_bits, eps=1e-4, tmp_path=tmp_path)
