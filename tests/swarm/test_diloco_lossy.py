"""DiLoCo's outer step under chunk loss, with real averaging rounds (4 averagers in this process, each on its
own DHT node, rounds on loopback): 10% of Δ's chunks lost at random, the outer step does not lean toward
any member's own Δ; a chunk of Δ̄ that never arrived is this peer's own Δ in its outer step."""

from __future__ import annotations

import threading

import pytest
import torch

from averaging_stats import mean_within_bound, owner_pull
from averaging_worker import peer_values
from moshpeer.averaging import FaultyLinks, MoshpitAverager, Partition
from moshpeer.peer.strategies.diloco_outer import OuterState

pytestmark = pytest.mark.timeout(240)

PEERS, NUMEL, CHUNK_BYTES = 4, 4096, 256  # 64 values per chunk, 16 chunks per part
RUN = "diloco-lossy"


@pytest.fixture
def group(dht_node):
    boot = dht_node(run_ids=[RUN])
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    buffers = [torch.zeros(NUMEL) for _ in range(PEERS)]
    dhts = [boot] + [dht_node(initial_peers=maddrs, run_ids=[RUN]) for _ in range(PEERS - 1)]
    averagers = [MoshpitAverager([buf], dht=dht, run_id=RUN,
                                 target_group_size=PEERS, min_group_size=PEERS, chunk_bytes=CHUNK_BYTES,
                                 matchmaking_time=3.0, round_timeout=20.0) for buf, dht in zip(buffers, dhts)]
    try:
        yield averagers, buffers
    finally:
        for averager in averagers:
            averager.shutdown()


def full_round(averagers, buffers, faults: str, attempts: int = 3) -> list:
    """One round of all PEERS together, each with `faults` on its outgoing chunks. A round in which the
    group did not assemble in full (a loaded machine can stall a peer past matchmaking) is run again
    from the same values: these checks are about the data plane."""
    values = [buf.clone() for buf in buffers]
    for _ in range(attempts):
        reports = [None] * PEERS

        def run(k: int) -> None:
            averagers[k].links = FaultyLinks.parse(faults)
            reports[k] = averagers[k].step(weight=1.0, timeout=30.0)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(PEERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=90)
        if all(r is not None and r.ok and r.group_size == PEERS and not r.absent for r in reports):
            return reports
        for buf, value in zip(buffers, values):
            buf.copy_(value)
    raise AssertionError([(r.ok, r.error, r.group_size, r.absent) if r is not None else None for r in reports])


def outer_step_from(state: OuterState, delta: torch.Tensor) -> torch.Tensor:
    """θ_outer after an outer step on `delta` from a copy of `state` (the state itself is unchanged)."""
    copy = OuterState([torch.zeros(NUMEL)])
    copy.load_state_dict(state.state_dict())
    copy.outer_step([delta])
    return copy.anchor[0]


def local_params(seed: int, k: int, anchor: torch.Tensor) -> torch.Tensor:
    """Peer k after its inner steps: θ_outer − Δ_k (peers differ in their Δ's mean, as in the averaging tests)."""
    return anchor - 0.01 * peer_values(seed, k, NUMEL)


def test_outer_step_under_chunk_loss(group):
    """One group of 4 for both checks (setting up a group costs more than its rounds)."""
    averagers, buffers = group
    outer_step_is_unbiased_under_ten_percent_reduce_loss(averagers, buffers)
    missing_average_chunks_are_the_peers_own_delta(averagers, buffers)


def outer_step_is_unbiased_under_ten_percent_reduce_loss(averagers, buffers) -> None:
    """10% of Δ's chunks lost at random on their way to the owners: the outer step has no pull toward
    the owner's own Δ (the owner-pull statistic of the averaging tests, on θ_outer)."""
    states = [OuterState([torch.zeros(NUMEL)]) for _ in range(PEERS)]
    partition = Partition(NUMEL, PEERS, CHUNK_BYTES // 4)
    pulls, lost = [], 0
    for seed in range(300, 314):
        deltas = []
        for k, (state, buf) in enumerate(zip(states, buffers)):
            state.pseudo_gradient([local_params(seed, k, state.anchor[0])], [buf])
            deltas.append(buf.clone())
        exact_delta = torch.stack(deltas).mean(0)
        expected = [outer_step_from(state, exact_delta) for state in states]
        own_steps = [outer_step_from(state, delta) for state, delta in zip(states, deltas)]
        reports = full_round(averagers, buffers, f"drop_prob=0.1,phases=reduce,seed={seed}")
        lost += sum(r.reduce.chunks_lost for r in reports)
        for state, buf in zip(states, buffers):
            state.outer_step([buf])
        for state in states[1:]:
            assert torch.equal(state.anchor[0], states[0].anchor[0])  # no gather loss: one outer step for all
        owner_of_part = {r.my_index: k for k, r in enumerate(reports)}
        errors, offsets = [], []
        for part in range(PEERS):
            lo, hi = partition.part_range(part)
            owner = owner_of_part[part]
            errors.append(float((states[0].anchor[0][lo:hi] - expected[0][lo:hi]).mean()))
            offsets.append(float((own_steps[owner][lo:hi] - expected[0][lo:hi]).mean()))
        pulls.append(owner_pull(errors, offsets))
    assert lost > 0  # the injection really dropped chunks of Δ
    mean, bound = mean_within_bound(pulls)
    assert mean <= bound, (mean, bound, pulls)


def missing_average_chunks_are_the_peers_own_delta(averagers, buffers) -> None:
    """10% of the averaged chunks lost on their way back: there the outer step used this peer's own Δ."""
    states = [OuterState([torch.zeros(NUMEL)]) for _ in range(PEERS)]
    chunk_numel = CHUNK_BYTES // 4
    partition = Partition(NUMEL, PEERS, chunk_numel)
    missing_seen = 0
    for seed in range(400, 404):
        deltas = []
        for k, (state, buf) in enumerate(zip(states, buffers)):
            state.pseudo_gradient([local_params(seed, k, state.anchor[0])], [buf])
            deltas.append(buf.clone())
        own_steps = [outer_step_from(state, delta) for state, delta in zip(states, deltas)]
        reports = full_round(averagers, buffers, f"drop_prob=0.1,phases=gather,seed={seed}")
        for k, (state, buf, report) in enumerate(zip(states, buffers, reports)):
            state.outer_step([buf])
            for part, chunk in report.missing_chunks:
                lo = partition.part_range(part)[0] + chunk * chunk_numel
                hi = min(lo + chunk_numel, partition.part_range(part)[1])
                assert torch.equal(buf[lo:hi], deltas[k][lo:hi])
                assert torch.equal(state.anchor[0][lo:hi], own_steps[k][lo:hi])
                missing_seen += 1
    assert missing_seen > 0
