"""`moshpeer simulate`, averaging level: the Moshpit paper's averaging cells, the production key rule on the same
cells, the wall time of one 10,000-peer round, and the group-size table of docs/simulation.md.

Parts:
1. paper cells: the Moshpit notebook's own setup (averaging_experiments/plot_results.ipynb): scalars N(0, 1),
   a 32 x 32 grid (grid_size 32, 2 dims) with peers on distinct random cells, round t averages along axis
   t mod 2, failures `uniform >= p` per peer per round, all-reduce = nothing changes unless every peer is up,
   error = variance across peers, cap 50 rounds, 10 restarts with seeds 0..9 and the notebook's RNG calls
   (np.random.seed, normal, uniform per round). Also the same cells over --many restarts (seeds 0..many-1,
   independent streams) for the expected value and its standard error.
2. production keys: the same cells with hivemind's group keys and rotation (moshpeer.averaging.grid),
   g = 32, 5 key bits (the 32 x 32 grid), min_group_size 2.
3. round_wall_s_10k: seconds of one simulated round at 10,000 peers, dim 1,000, p = 0.01, for g in {4, 8, 16}
   (median of --timed rounds after one warm-up round; the largest over g is reported), without and with 1%
   chunk loss (chunks of 64 values, production estimator).
4. group size: rounds to 1e-4 for g in {4, 8, 16} at 100, 1,000, 10,000 peers (default key bits, p = 0 and
   p = 0.01, dim 1).
5. training level (moshpeer.simulation.training), 1,000 peers, 200 rounds, DiLoCo (H = 50, production outer
   step) on Moshpit groups of 16 against the synchronous baseline on the same swarm and links, at a failure rate
   where the baseline's goodput is <= 30% (0.04 failures per peer per hour); the same without failures
   (loss_ratio_failures); 10% hostile peers sending -100x with mean / clipped / trimmed aggregation
   (byz10_*_loss_ratio); the hostile fraction at which clipped stops keeping the loss within 2%
   (--training-rounds rounds each, fewer with --quick); DiLoCo averaging Δ only (outer_params_every=0) against
   production's θ_outer rounds; the same swarm training a small network (--workload mlp); a second swarm on
   internet links as context, also without production's straggler hold, with a DiLoCo quorum of 0.75, and with
   every failure a preemption the peer checkpointed on (production's start rule: resume or download).
6. the control plane (moshpeer.simulation.control_plane): each peer's progress traffic in the DHT at the
   production cadence for 4 to 10,000 peers (dht_rate_*_bps), and the 1,000-peer DiLoCo swarm on home links
   (20 Mbit/s, 50 ms, equal peers, no failures) with and without it (goodput_1k_diloco_home, goodput_1k_diloco_home_no_dht).

7. link reuse: the fraction of a round's connections whose two peers shared a group within the last 1, 3 or 10
   rounds (what kept connections can carry), g in {4, 16}, 16 to 1,000 peers (link_reuse_n*_g*_w*).

    python benchmarks/bench_simulate.py [--many 100] [--timed 3] [--skip-groups] [--skip-training]

Ends with one JSON line (n512_rounds_to_1e9, n512_rounds_to_1e4, n512_p01_rounds, n512_p01_allreduce_rounds,
n900_p005_rounds, n900_p005_allreduce_rounds, round_wall_s_10k, goodput_1k_diloco, goodput_1k_sync,
loss_ratio_failures, byz10_clipped_loss_ratio, byz10_mean_loss_ratio, clipped_breaks_at, ...). Wall times are
upper bounds when the machine is shared. A loss ratio of a run that diverged (inf or nan) is reported as 1e30.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moshpeer.simulation import AveragingConfig, AveragingSimulation, run_cell  # noqa: E402
from moshpeer.simulation.link_reuse import LinkReuse  # noqa: E402

PAPER = {  # the notebook's printed table, 32 x 32 grid, 10 restarts: rounds to 1e-9 (1e-4)
    ("moshpit", 512, 0.0): (8.2, 3.6), ("moshpit", 512, 0.01): (8.8, 3.9), ("moshpit", 900, 0.005): (5.9, 3.1),
    ("allreduce", 512, 0.0): (1.0, 1.0), ("allreduce", 512, 0.01): (41.7, 41.7),
    ("allreduce", 900, 0.005): (50.0, 50.0),
}


def cell_config(kind: str, peers: int, p: float, streams: str, grid_seed=None) -> AveragingConfig:
    if kind == "allreduce":
        return AveragingConfig(peers=peers, topology="allreduce", failure_rate=p, rng_streams=streams)
    if kind == "keys":
        return AveragingConfig(peers=peers, group_size=32, key_bits=5, min_group_size=2, failure_rate=p,
                               rng_streams=streams)
    return AveragingConfig(peers=peers, group_size=32, grid_dims=2, topology="grid", failure_rate=p,
                           rng_streams=streams, grid_seed=grid_seed)


def allreduce_expected(peers: int, p: float, cap: int = 50) -> float:
    """E[min(T, cap)] for T ~ Geometric(q), q = (1 - p)^N: the all-reduce succeeds only when nobody failed."""
    q = (1 - p) ** peers
    return (1 - (1 - q) ** cap) / q if q > 0 else float(cap)


def paper_cells(grids: int, many: int) -> dict:
    """Per cell: the paper's protocol (10 restarts, seeds 0..9, notebook RNG calls; for the grid one grid shared by
    the 10 restarts, as the notebook draws it once per cell) repeated over `grids` grid draws (mean and sd of the
    10-restart figure); and `many` independent restarts for the expected value."""
    rows, figures = [], {}
    for kind in ("grid", "keys", "allreduce"):
        for peers, p in ((512, 0.0), (512, 0.01), (900, 0.005)):
            draws = [run_cell(cell_config(kind, peers, p, "notebook", grid_seed=1000 + k), restarts=10, seed=0)
                     for k in range(grids if kind == "grid" else 1)]
            m9 = [d.mean(1e-9) for d in draws]
            m4 = [d.mean(1e-4) for d in draws]
            big = run_cell(cell_config(kind, peers, p, "independent"), restarts=many, seed=0)
            paper = PAPER.get(("allreduce" if kind == "allreduce" else "moshpit", peers, p))
            spread = statistics.pstdev(m9) if len(m9) > 1 else draws[0].sd(1e-9)
            rows.append((kind, peers, p, statistics.mean(m9), spread, statistics.mean(m4), big.mean(1e-9),
                         big.sd(1e-9) / max(1, many - 1) ** 0.5, big.mean(1e-4), paper))
            key = f"{'' if kind == 'grid' else kind + '_'}n{peers}" + ("" if p == 0 else f"_p{str(p)[2:]}")
            figures[f"{key}_rounds_to_1e9"] = round(statistics.mean(m9), 2)
            figures[f"{key}_rounds_to_1e4"] = round(statistics.mean(m4), 2)
            figures[f"{key}_rounds_to_1e9_sd"] = round(spread, 2)
            figures[f"{key}_rounds_to_1e9_many"] = round(big.mean(1e-9), 3)
            figures[f"{key}_rounds_to_1e4_many"] = round(big.mean(1e-4), 3)
            if kind == "allreduce":
                figures[f"{key}_expected"] = round(allreduce_expected(peers, p), 2)
    print(f"paper's protocol: 10 restarts (seeds 0..9, notebook RNG calls); grid: mean +- sd over {grids} grid draws, "
          f"others: mean +- sd over the 10 restarts; expected: {many} independent restarts, mean +- standard error")
    print(f"{'averager':>9} {'N':>4} {'p':>6} | {'protocol: 1e-9 (1e-4)':>22} | {'expected: 1e-9 (1e-4)':>26} | "
          f"{'paper':>12}")
    for kind, peers, p, m9, sd9, m4, b9, se, b4, paper in rows:
        print(f"{kind:>9} {peers:>4} {p:>6g} | {m9:>7.2f} +- {sd9:>4.2f} ({m4:>4.2f}) | {b9:>10.2f} +- {se:>4.2f} "
              f"({b4:>5.2f}) | {'' if paper is None else f'{paper[0]:.1f} ({paper[1]:.1f})':>12}")
    for peers, p in ((512, 0.01), (900, 0.005)):
        print(f"all-reduce N={peers} p={p:g}: analytic expectation {allreduce_expected(peers, p):.1f} rounds "
              f"(cap 50); P(all 10 restarts hit the cap) = {(1 - (1 - p) ** peers) ** 500:.4f}")
    # The names for the cells: the notebook's averager (grid topology) and its all-reduce.
    # (n512_rounds_to_1e9 and n512_rounds_to_1e4 already carry those names.)
    figures["n512_p01_rounds"] = figures["n512_p01_rounds_to_1e9"]
    figures["n512_p01_allreduce_rounds"] = figures["allreduce_n512_p01_rounds_to_1e9"]
    figures["n900_p005_rounds"] = figures["n900_p005_rounds_to_1e9"]
    figures["n900_p005_allreduce_rounds"] = figures["allreduce_n900_p005_rounds_to_1e9"]
    return figures


def round_timing(timed: int) -> dict:
    figures, lines = {}, []
    for loss in (0.0, 0.01):
        worst = 0.0
        for g in (4, 8, 16):
            config = AveragingConfig(peers=10_000, dim=1_000, group_size=g, min_group_size=2, failure_rate=0.01,
                                     chunk_loss=loss, chunk_numel=64, rounds=timed + 1)
            sim = AveragingSimulation(config, seed=0)
            sim.step()  # warm-up: first touches of the arrays
            times = []
            for _ in range(timed):
                started = time.perf_counter()
                stats = sim.step()
                times.append(time.perf_counter() - started)
            median = statistics.median(times)
            worst = max(worst, median)
            lines.append(f"10,000 peers, dim 1,000, g={g:>2}, chunk loss {loss:g}: {median:.2f} s/round "
                         f"(groups {stats.groups}, mean size {stats.mean_group_size:.1f}, key bits {sim.key_bits})")
            figures[f"round_wall_s_10k_g{g}" + ("_loss" if loss else "")] = round(median, 3)
        figures["round_wall_s_10k" + ("_loss" if loss else "")] = round(worst, 3)
    print("\n".join(lines))
    return figures


def group_sizes() -> dict:
    figures = {}
    print(f"{'N':>6} {'p':>5} " + " ".join(f"{f'g={g}':>12}" for g in (4, 8, 16)) + "   (rounds to 1e-4, mean +- sd)")
    for peers in (100, 1_000, 10_000):
        for p in (0.0, 0.01):
            cells = []
            for g in (4, 8, 16):
                cell = run_cell(AveragingConfig(peers=peers, group_size=g, failure_rate=p, rounds=50),
                                restarts=10 if peers < 10_000 else 5, seed=0, eps=(1e-4,))
                cells.append(f"{cell.mean(1e-4):>5.1f} +- {cell.sd(1e-4):.1f}")
                figures[f"groups_n{peers}_p{p:g}_g{g}_rounds_to_1e4"] = round(cell.mean(1e-4), 2)
            print(f"{peers:>6} {p:>5g} " + " ".join(f"{c:>12}" for c in cells))
    return figures


LINK_REUSE_WINDOWS = (1, 3, 10)  # rounds; a kept connection lives 60 s: 1 round at a minute's period, 6 at 10 s


def link_reuse(rounds: int = 60, warmup: int = 10) -> dict:
    """Part 7: the fraction of a round's links (sender -> receiver) whose two peers shared a group within the last
    w rounds, the most that kept connections (averaging/kept_links.py) can carry, on the production key rule
    (mean over rounds after `warmup`)."""
    figures = {}
    print(f"{'N':>6} {'g':>3} " + " ".join(f"{f'w={w}':>7}" for w in LINK_REUSE_WINDOWS)
          + "   (links whose peers met within w rounds)")
    for peers in (16, 64, 256, 1_000):
        for g in (4, 16):
            sim = AveragingSimulation(AveragingConfig(peers=peers, group_size=g, dim=1), seed=0)
            trackers = [LinkReuse(w) for w in LINK_REUSE_WINDOWS]
            fractions: List[List[float]] = [[] for _ in trackers]
            for _ in range(rounds):
                sim.step()
                for tracker, kept in zip(trackers, fractions):
                    kept.append(tracker.observe(sim.round, sim.grouping))
            means = [statistics.mean(kept[warmup:]) for kept in fractions]
            for w, mean in zip(LINK_REUSE_WINDOWS, means):
                figures[f"link_reuse_n{peers}_g{g}_w{w}"] = round(mean, 3)
            print(f"{peers:>6} {g:>3} " + " ".join(f"{mean:>7.3f}" for mean in means))
    return figures


TRAINING_FAILURES_PER_HOUR = 0.04  # a failure every 90 s somewhere in 1,000 peers: sync's goodput is ~22% there
DIVERGED = 1e30


def _ratio(a: float, b: float) -> float:
    value = a / b if b > 0 else math.nan
    return round(value, 5) if math.isfinite(value) else DIVERGED


MLP_ROUNDS = 100
INTERNET_QUORUM = 0.75  # DiLoCo's quorum in the internet-links arm (Decoupled DiLoCo's minimum-quorum idea)


def training_scenarios(rounds: int, peers: int, hostile_rounds: int, goodput: bool = True) -> dict:
    """Part 5 (see the module docstring); without `goodput`, its hostile-peer runs only."""
    import torch

    from moshpeer.simulation.training import run_sync, run_training
    from moshpeer.simulation.training_config import TrainingConfig, Workload

    torch.set_num_threads(1)  # small vectorized steps: threads only add contention on a shared machine
    figures = {}
    workload = Workload(dim=64)
    # Links fast enough that sync loses little to communication without failures: its collapse is the failures'.
    base = dict(peers=peers, mode="diloco", rounds=rounds, inner_steps=50, group_size=16, workload=workload,
                model_params=10_000_000, uplink=1.25e9, downlink=1.25e9, rtt_s=0.001, speed=16.0, rejoin_s=600.0)

    def line(name: str, r) -> None:
        print(f"{name:<38} goodput {r.goodput:6.3f}  final loss {r.final_loss:10.5g} (floor {r.loss_floor:.4g}, "
              f"spread {r.final_spread:.3g})  sim {r.sim_seconds / 3600:5.2f} h  failures {r.failures:>4}  "
              f"stalls {r.stalls:>3}  GB/peer {r.bytes_per_peer / 1e9:6.2f}", flush=True)

    if not goodput:
        return hostile_scenarios(base, hostile_rounds, line)
    started = time.perf_counter()
    failing = run_training(TrainingConfig(**base, failure_rate_per_hour=TRAINING_FAILURES_PER_HOUR), seed=0)
    figures["training_1k_200_rounds_wall_s"] = round(time.perf_counter() - started, 1)
    line(f"diloco, {TRAINING_FAILURES_PER_HOUR}/peer/h", failing)
    sync = run_sync(TrainingConfig(**base, failure_rate_per_hour=TRAINING_FAILURES_PER_HOUR), seed=0,
                    seconds=failing.sim_seconds)
    line(f"sync, {TRAINING_FAILURES_PER_HOUR}/peer/h", sync)
    clean = run_training(TrainingConfig(**base), seed=0)
    line("diloco, no failures", clean)
    sync_clean = run_sync(TrainingConfig(**base), seed=0, seconds=clean.sim_seconds)
    line("sync, no failures", sync_clean)
    figures.update(
        training_failures_per_peer_hour=TRAINING_FAILURES_PER_HOUR,
        goodput_1k_diloco=round(failing.goodput, 4), goodput_1k_sync=round(sync.goodput, 4),
        goodput_1k_diloco_no_failures=round(clean.goodput, 4), goodput_1k_sync_no_failures=round(sync_clean.goodput, 4),
        training_1k_failures=failing.failures, training_1k_stalls=failing.stalls, sync_1k_failures=sync.failures,
        loss_ratio_failures=_ratio(failing.final_loss, clean.final_loss),
        excess_loss_ratio_failures=_ratio(failing.excess_loss, clean.excess_loss),
        diloco_1k_final_loss=round(clean.final_loss, 5), diloco_1k_loss_floor=round(clean.loss_floor, 5),
        diloco_1k_final_spread=round(clean.final_spread, 5), sync_1k_final_loss=round(sync.final_loss, 5),
        diloco_1k_bytes_per_peer=round(failing.bytes_per_peer), sync_1k_bytes_per_peer=round(sync.bytes_per_peer),
    )
    # DiLoCo averaging Δ only (outer_params_every=0, production before its θ_outer rounds): the disagreement between
    # peers' θ_outer those rounds remove (docs/simulation.md).
    outer0 = run_training(TrainingConfig(**base, outer_params_every=0,
                                         failure_rate_per_hour=TRAINING_FAILURES_PER_HOUR), seed=0)
    line("diloco, Δ only, failures", outer0)
    outer0_clean = run_training(TrainingConfig(**base, outer_params_every=0), seed=0)
    line("diloco, Δ only, no failures", outer0_clean)
    figures.update(goodput_1k_diloco_outer0=round(outer0.goodput, 4),
                   loss_ratio_failures_outer0=_ratio(outer0.final_loss, outer0_clean.final_loss),
                   diloco_1k_outer0_final_loss=round(outer0_clean.final_loss, 5),
                   diloco_1k_outer0_final_spread=round(outer0_clean.final_spread, 5))
    # The same swarm training a small network (--workload mlp: 16 inputs, 32 hidden units, 577 parameters learning a
    # teacher), production DiLoCo with and without failures, and averaging Δ only. H = 20 and MLP_ROUNDS rounds: a
    # step of 1,000 networks takes ~30 ms on one core, so 200 rounds of H = 50 would take 5 minutes a run.
    mlp = dict(base, workload=Workload(kind="mlp", dim=16, hidden=32), inner_steps=20, rounds=min(rounds, MLP_ROUNDS))
    started = time.perf_counter()
    mlp_failing = run_training(TrainingConfig(**mlp, failure_rate_per_hour=TRAINING_FAILURES_PER_HOUR), seed=0)
    figures["mlp_1k_wall_s"] = round(time.perf_counter() - started, 1)
    line(f"mlp diloco, {TRAINING_FAILURES_PER_HOUR}/peer/h", mlp_failing)
    mlp_clean = run_training(TrainingConfig(**mlp), seed=0)
    line("mlp diloco, no failures", mlp_clean)
    mlp_outer0 = run_training(TrainingConfig(**mlp, outer_params_every=0), seed=0)
    line("mlp diloco, Δ only, no failures", mlp_outer0)
    figures.update(goodput_1k_mlp_diloco=round(mlp_failing.goodput, 4),
                   loss_ratio_failures_mlp=_ratio(mlp_failing.final_loss, mlp_clean.final_loss),
                   mlp_1k_initial_loss=round(mlp_clean.initial_loss, 5), mlp_1k_loss_floor=round(mlp_clean.loss_floor, 5),
                   mlp_1k_final_loss=round(mlp_clean.final_loss, 5),
                   mlp_1k_outer0_final_loss=round(mlp_outer0.final_loss, 5),
                   mlp_1k_final_spread=round(mlp_clean.final_spread, 5),
                   mlp_1k_outer0_final_spread=round(mlp_outer0.final_spread, 5))
    # The same swarm on internet links (100 Mbit/s, 50 ms, speeds and links +-10%): context, not a floor.
    internet = dict(base, uplink=12.5e6, downlink=12.5e6, rtt_s=0.05, link_spread=0.1, speed_spread=0.1)
    net = run_training(TrainingConfig(**internet, failure_rate_per_hour=TRAINING_FAILURES_PER_HOUR), seed=0)
    line("diloco, internet links", net)
    figures["diloco_1k_internet_catch_ups"] = net.catch_ups
    net_sync = run_sync(TrainingConfig(**internet, failure_rate_per_hour=TRAINING_FAILURES_PER_HOUR), seed=0,
                        seconds=net.sim_seconds)
    line("sync, internet links", net_sync)
    figures.update(goodput_1k_diloco_internet=round(net.goodput, 4),
                   goodput_1k_sync_internet=round(net_sync.goodput, 4),
                   diloco_1k_internet_dht_bytes_per_peer=round(net.dht_bytes_per_peer),
                   diloco_1k_internet_final_loss=round(net.final_loss, 5),
                   diloco_1k_internet_alone_fraction=round(net.alone_fraction, 4))
    figures["diloco_1k_internet_state_downloads"] = net.state_downloads
    # Production's round timing on those links: without the straggler hold (the simulator before session 26), and
    # with a DiLoCo quorum of 0.75 (slow peers end their epoch early and their Δ weighs their samples); and every
    # failure a preemption the peer checkpointed on (production's start rule then resumes those the swarm has not
    # left more than --max-staleness epochs behind, rejoin.py).
    for suffix, timing in (("_no_hold", {"straggler_hold": False}), ("_quorum", {"quorum": INTERNET_QUORUM}),
                           ("_resume", {"resume_fraction": 1.0})):
        r = run_training(TrainingConfig(**internet, **timing, failure_rate_per_hour=TRAINING_FAILURES_PER_HOUR),
                         seed=0)
        line(f"diloco, internet links, {suffix[1:].replace('_', ' ')}", r)
        figures.update({f"goodput_1k_diloco_internet{suffix}": round(r.goodput, 4),
                        f"diloco_1k_internet{suffix}_final_loss": round(r.final_loss, 5),
                        f"diloco_1k_internet{suffix}_alone_fraction": round(r.alone_fraction, 4),
                        f"diloco_1k_internet{suffix}_catch_ups": r.catch_ups,
                        f"diloco_1k_internet{suffix}_state_downloads": r.state_downloads,
                        f"diloco_1k_internet{suffix}_checkpoint_resumes": r.checkpoint_resumes,
                        f"diloco_1k_internet{suffix}_sim_h": round(r.sim_seconds / 3600, 3)})
    figures["diloco_1k_internet_sim_h"] = round(net.sim_seconds / 3600, 3)
    # Home links (20 Mbit/s, 50 ms), equal peers (no late members to blur it): where the control plane's traffic
    # takes a visible share of each link.
    home = dict(base, uplink=2.5e6, downlink=2.5e6, rtt_s=0.05)
    for suffix, budget in (("", {}), ("_no_dht", {"progress_budget_bps": 0.0})):
        r = run_training(TrainingConfig(**home, **budget), seed=0)
        line(f"diloco, home links{', no control plane' if suffix else ''}", r)
        figures[f"goodput_1k_diloco_home{suffix}"] = round(r.goodput, 4)
        figures[f"diloco_1k_home{suffix}_sim_h"] = round(r.sim_seconds / 3600, 3)
        figures[f"diloco_1k_home{suffix}_dht_bytes_per_peer"] = round(r.dht_bytes_per_peer)
        figures[f"diloco_1k_home{suffix}_bytes_per_peer"] = round(r.bytes_per_peer)

    figures.update(hostile_scenarios(base, hostile_rounds, line))
    return figures


def hostile_scenarios(base: dict, hostile_rounds: int, line) -> dict:
    """Part 5's hostile peers: -100x contributions, no failures (their effect alone). The honest run of each fraction
    is the same swarm with the same peers marked hostile but sending honestly (scale 1), so that both runs measure
    the loss on the same honest peers' data."""
    from moshpeer.simulation.training import run_training
    from moshpeer.simulation.training_config import TrainingConfig

    figures = {}
    if hostile_rounds <= 0:
        return figures
    hostile_base = dict(base, rounds=hostile_rounds)

    def hostile_ratio(fraction: float, aggregation: str) -> float:
        honest = run_training(TrainingConfig(**hostile_base, hostile_fraction=fraction, hostile_scale=1.0,
                                             aggregation=aggregation), seed=1)
        r = run_training(TrainingConfig(**hostile_base, hostile_fraction=fraction, aggregation=aggregation), seed=1)
        line(f"{int(fraction * 100)}% hostile, honest, {aggregation}", honest)
        line(f"{int(fraction * 100)}% hostile -100x, {aggregation}", r)
        return _ratio(r.final_loss, honest.final_loss)

    for aggregation in ("mean", "clipped", "trimmed"):
        figures[f"byz10_{aggregation}_loss_ratio"] = hostile_ratio(0.1, aggregation)
    breaks = None
    for fraction in (0.15, 0.2, 0.3, 0.4, 0.5):
        ratio = figures[f"byz{round(fraction * 100)}_clipped_loss_ratio"] = hostile_ratio(fraction, "clipped")
        if ratio > 1.02:
            breaks = fraction
            break
    figures["clipped_breaks_at"] = breaks  # None: held up to 50%
    figures["hostile_rounds"] = hostile_rounds
    return figures


def control_plane_rates() -> dict:
    """Part 6's table: what progress in the DHT costs one peer at the production cadence, by swarm size."""
    from moshpeer.simulation.control_plane import ControlPlane, read_cycle_bytes

    plane, figures = ControlPlane(), {}
    print(f"{'peers':>7} {'read interval s':>16} {'KB per read':>12} {'KB/s per peer':>14} {'of 20 Mbit/s':>13}")
    for peers in (4, 8, 16, 100, 1_000, 10_000):
        rate = plane.floor_rate(peers)
        print(f"{peers:>7} {plane.cadence.floor(peers):>16.2f} {read_cycle_bytes(peers) / 1e3:>12.0f} "
              f"{rate / 1e3:>14.1f} {rate / 2.5e6:>13.1%}")
        figures[f"dht_rate_{peers}_bps"] = round(rate)
        figures[f"dht_read_interval_{peers}_s"] = round(plane.cadence.floor(peers), 2)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grids", type=int, default=100, help="grid draws for the paper's protocol (default 100)")
    parser.add_argument("--many", type=int, default=100, help="restarts for the expected values (default 100)")
    parser.add_argument("--timed", type=int, default=3, help="timed rounds per 10,000-peer case (default 3)")
    parser.add_argument("--skip-groups", action="store_true",
                        help="skip the group-size table and link reuse (parts 4, 7)")
    parser.add_argument("--skip-averaging", action="store_true", help="skip parts 1 to 4 (training level only)")
    parser.add_argument("--skip-training", action="store_true", help="skip the training level (part 5)")
    parser.add_argument("--training-rounds", type=int, default=200, help="rounds of the goodput runs (default 200)")
    parser.add_argument("--training-peers", type=int, default=1000, help="peers of the training runs (default 1000)")
    parser.add_argument("--skip-goodput", action="store_true",
                        help="part 5: only the hostile-peer runs (skip the goodput and control-plane runs)")
    parser.add_argument("--hostile-rounds", type=int, default=100,
                        help="rounds of each hostile-peer run (default 100; 0 skips them)")
    args = parser.parse_args()
    started = time.perf_counter()
    figures = {"machine": f"{platform.machine()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}"}
    if not args.skip_averaging:
        figures.update(paper_cells(args.grids, args.many))
        figures.update(round_timing(args.timed))
        if not args.skip_groups:
            figures.update(group_sizes())
            figures.update(link_reuse())
    figures.update(control_plane_rates())
    if not args.skip_training:
        figures.update(training_scenarios(args.training_rounds, args.training_peers, args.hostile_rounds,
                                          goodput=not args.skip_goodput))
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
