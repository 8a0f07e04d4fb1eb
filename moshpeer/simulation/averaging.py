"""The averaging level of `moshpeer simulate`: N virtual peers, each holding a vector, averaging in Moshpit groups.

One round, for every peer at once (numpy arrays, no per-peer Python objects):

1. Failures: each peer fails in this round with probability p, independently of other peers and rounds
   (the Moshpit notebook's `uniform(0, 1) >= p` is alive). A failed peer takes no part in the round: it
   keeps its value and its group key, and nobody averages with it. It is back in the next round.
2. Grouping (production rule, `moshpeer.averaging.grid.assemble_groups`): alive peers sharing a key form
   groups of at most target_group_size; a group below min_group_size does not assemble and its peers keep
   their value and key.
3. Averaging in each group: the exact group mean, or, with chunk loss, the production part layout
   (`averaging.partition.Partition`) and the production estimator (`averaging.estimator.estimate_over_sum`)
   per chunk; a receiver that misses an averaged chunk keeps its own value for it.
4. Key rotation (production rule, `grid.rotate_grouped_keys` = hivemind's `update_key_on_group_assembled`),
   with a random group id per group as the leader draws it.

Topologies: "keys" (the above: what a moshpeer swarm does), "grid" (the Moshpit notebook's own averager:
fixed random cells of a g^M grid, round t averages along axis t mod M), "allreduce" (the notebook's
baseline: one group of everybody; if any peer failed in the round, the all-reduce fails and nobody's value
changes, so the next round restarts it).

Metric, as the notebook: error = mean over peers and coordinates of (x_i - mean)^2, where mean is the exact
mean of the initial values (the notebook prints `weights.var()`; averaging that keeps the sum keeps the mean,
so the two are equal; with chunk loss the sum drifts and only the distance to the initial mean is honest).
Values start i.i.d. N(0, 1). "Rounds to eps": the first round after which the error is below eps, capped at
`rounds` (the notebook caps at 50 and counts a run that never gets there as 50).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from moshpeer.averaging import grid
from moshpeer.averaging.estimator import estimate_over_sum
from moshpeer.averaging.partition import Partition

TOPOLOGIES = ("keys", "grid", "allreduce")
INITIAL_KEYS = ("random", "balanced")
RNG_STREAMS = ("independent", "notebook")
GROUP_ID_BYTES = 20  # hivemind's leader uses DHTID.generate().to_bytes(): 20 random bytes


@dataclass
class AveragingConfig:
    """One simulated swarm. `check()` raises ValueError naming the first bad field.

    :param peers: number of virtual peers N
    :param dim: values per peer (1 = scalars, as in the Moshpit paper)
    :param group_size: target_group_size g (also the side of the "grid" topology)
    :param min_group_size: smallest group that assembles (keys topology)
    :param key_bits: length of the group bits (keys topology); None = `grid.default_key_bits(N, g)`
    :param grid_dims: M of the "grid" topology; None = the smallest M with g^M >= N
    :param topology: "keys", "grid" or "allreduce" (see the module docstring)
    :param initial_keys: "random" (uniform bits, as a peer draws them) or "balanced" (every key held by the same
        number of peers, +-1: a full grid when N = g^M)
    :param failure_rate: probability that a peer fails in a round
    :param chunk_loss: probability that one chunk on one link is lost (both phases); 0 = exact group means
    :param chunk_numel: values per chunk when chunk_loss > 0
    :param rounds: round cap
    :param rng_streams: "independent" (numpy Generators: values, failures, grouping and loss each from its own
        stream) or "notebook" (values and failures from `np.random.RandomState(seed)` in the Moshpit notebook's
        call order: normal(0, 1, N), then uniform(0, 1, N) each round; so with seeds 0..9 the notebook's
        all-reduce runs are replayed draw for draw; groups and grid cells still come from their own stream)
    :param grid_seed: "grid" topology: draw the cells from this seed instead of the run's, so that restarts
        share one grid (the notebook draws its grid once per table cell, unseeded, and reuses it for all 10
        restarts)
    """

    peers: int = 512
    dim: int = 1
    group_size: int = 16
    min_group_size: int = 2
    key_bits: Optional[int] = None
    grid_dims: Optional[int] = None
    topology: str = "keys"
    initial_keys: str = "random"
    failure_rate: float = 0.0
    chunk_loss: float = 0.0
    chunk_numel: int = 1024
    rounds: int = 50
    rng_streams: str = "independent"
    grid_seed: Optional[int] = None

    def check(self) -> "AveragingConfig":
        if self.peers < 1:
            raise ValueError(f"peers must be >= 1, got {self.peers}")
        if self.dim < 1:
            raise ValueError(f"dim must be >= 1, got {self.dim}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2, got {self.group_size}")
        if not 1 <= self.min_group_size <= self.group_size:
            raise ValueError(f"min_group_size must be in [1, group_size], got {self.min_group_size}")
        if self.key_bits is not None and not 0 <= self.key_bits <= 62:
            raise ValueError(f"key_bits must be in [0, 62], got {self.key_bits}")
        if self.grid_dims is not None and not 1 <= self.grid_dims <= 62 // grid.bits_per_axis(self.group_size):
            raise ValueError(f"grid_dims out of range: {self.grid_dims}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if self.initial_keys not in INITIAL_KEYS:
            raise ValueError(f"initial_keys must be one of {INITIAL_KEYS}, got {self.initial_keys!r}")
        if not 0.0 <= self.failure_rate < 1.0:
            raise ValueError(f"failure_rate must be in [0, 1), got {self.failure_rate}")
        if not 0.0 <= self.chunk_loss < 1.0:
            raise ValueError(f"chunk_loss must be in [0, 1), got {self.chunk_loss}")
        if self.rng_streams not in RNG_STREAMS:
            raise ValueError(f"rng_streams must be one of {RNG_STREAMS}, got {self.rng_streams!r}")
        if self.chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {self.chunk_numel}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.topology == "grid" and self.peers > self.group_size ** self.resolved_grid_dims():
            raise ValueError(f"{self.peers} peers do not fit a {self.group_size}^{self.resolved_grid_dims()} grid")
        return self

    def resolved_key_bits(self) -> int:
        return grid.default_key_bits(self.peers, self.group_size) if self.key_bits is None else self.key_bits

    def resolved_grid_dims(self) -> int:
        if self.grid_dims is not None:
            return self.grid_dims
        dims = 1
        while self.group_size ** dims < self.peers:
            dims += 1
        return dims


@dataclass
class RoundStats:
    """What one round did (error after the round)."""

    round: int
    error: float
    spread: float
    failed: int
    groups: int
    mean_group_size: float
    alone: int
    chunks_lost: int = 0


@dataclass
class Trajectory:
    """One run: error[0] is the initial error, error[t] the error after round t."""

    seed: int
    error: List[float] = field(default_factory=list)
    rounds: List[RoundStats] = field(default_factory=list)

    def rounds_to(self, eps: float, cap: int) -> int:
        """First round whose error is below eps; `cap` if none is (the notebook's convention)."""
        for t, e in enumerate(self.error):
            if t > 0 and e < eps:
                return t
        return cap


class AveragingSimulation:
    """State of N virtual peers; `step()` runs one round. Seeded: the same (config, seed) gives the same run.

    Separate random streams for values, failures, grouping and loss, so that turning one of them on does not
    move the draws of the others (a run with failures starts from the same values as one without).

    :raises ValueError: a bad config (see `AveragingConfig.check`)
    """

    def __init__(self, config: AveragingConfig, seed: int = 0):
        self.config = config.check()
        self.seed = seed
        init_ss, fail_ss, group_ss, loss_ss, cells_ss = np.random.SeedSequence(seed).spawn(5)
        init_rng = np.random.default_rng(init_ss)
        self.group_rng = np.random.default_rng(group_ss)
        self.loss_rng = np.random.default_rng(loss_ss)
        n, g = config.peers, config.group_size
        if config.rng_streams == "notebook":
            legacy = np.random.RandomState(seed)
            self.values = legacy.normal(0, 1, (n, config.dim)).astype(np.float64)
            self._uniform = lambda: legacy.uniform(0, 1, n)
        else:
            fail_rng = np.random.default_rng(fail_ss)
            self.values = init_rng.standard_normal((n, config.dim))
            self._uniform = lambda: fail_rng.random(n)
        self.exact_mean = self.values.mean(axis=0)
        self.round = 0
        self.grouping: Optional[grid.Grouping] = None  # the last round's groups
        self.key_bits = config.resolved_key_bits()
        if config.initial_keys == "balanced":
            buckets = 1 << self.key_bits
            self.keys = (init_rng.permutation(n) % buckets).astype(np.int64)
        else:
            self.keys = grid.initial_group_keys(n, self.key_bits, init_rng)
        if config.topology == "grid":
            # The notebook's MoshpitAverager: distinct random cells of a g^M grid, fixed for the whole run.
            self.grid_dims = config.resolved_grid_dims()
            # Own stream: the cells do not depend on whether keys were drawn before them.
            cells_rng = np.random.default_rng(cells_ss if config.grid_seed is None else config.grid_seed)
            cells = cells_rng.choice(g ** self.grid_dims, size=n, replace=False)
            self.coords = np.stack(np.unravel_index(cells, (g,) * self.grid_dims), axis=1).astype(np.int64)

    # ---- metrics ------------------------------------------------------------------------------

    def error(self) -> float:
        """Mean over peers and coordinates of the squared distance to the exact initial mean."""
        diff = self.values - self.exact_mean
        return float(np.einsum("ij,ij->", diff, diff) / diff.size)

    def spread(self) -> float:
        """The notebook's `weights.var()`: variance across peers, averaged over coordinates."""
        return float(self.values.var(axis=0).mean())

    # ---- one round ----------------------------------------------------------------------------

    def step(self) -> RoundStats:
        """Run one round and return its stats (see the module docstring for what a round is)."""
        cfg = self.config
        self.round += 1
        alive = self._uniform() >= cfg.failure_rate  # drawn every round, as the notebook does
        alive_ids = np.flatnonzero(alive)
        if cfg.topology == "allreduce":
            if alive.all():
                grouping = grid.Grouping(np.arange(cfg.peers), np.array([0]), np.array([cfg.peers]),
                                         np.zeros(0, dtype=np.int64))
            else:  # any failure aborts the all-reduce: nothing changes this round
                grouping = grid.Grouping(*(np.zeros(0, dtype=np.int64),) * 3, alone=alive_ids)
        elif cfg.topology == "grid":
            axis = self.round % self.grid_dims  # the notebook's iter_num starts at 1
            g = cfg.group_size
            weights = g ** np.arange(self.grid_dims - 1, -1, -1, dtype=np.int64)
            weights[axis] = 0  # peers equal on every other coordinate share this round's group
            line = self.coords[alive_ids] @ weights
            grouping = grid.assemble_groups(alive_ids, line, g, 1, self.group_rng)
        else:
            grouping = grid.assemble_groups(alive_ids, self.keys[alive_ids], cfg.group_size, cfg.min_group_size,
                                            self.group_rng)
        self.grouping = grouping
        lost = self._average(grouping)
        if cfg.topology == "keys" and grouping.num_groups:
            blob = self.group_rng.bytes(GROUP_ID_BYTES * grouping.num_groups)
            group_ids = [blob[j * GROUP_ID_BYTES:(j + 1) * GROUP_ID_BYTES] for j in range(grouping.num_groups)]
            self.keys = grid.rotate_grouped_keys(self.keys, self.key_bits, grouping, cfg.group_size, group_ids)
        return RoundStats(
            round=self.round, error=self.error(), spread=self.spread(), failed=int(cfg.peers - alive_ids.size),
            groups=grouping.num_groups,
            mean_group_size=float(grouping.sizes.mean()) if grouping.num_groups else 0.0,
            alone=int(grouping.alone.size), chunks_lost=lost,
        )

    def _average(self, grouping: grid.Grouping) -> int:
        """Replace each group member's value by the group's average; returns chunks lost (0 without loss)."""
        if grouping.num_groups == 0:
            return 0
        if self.config.chunk_loss > 0:
            return self._average_lossy(grouping)
        members, sizes = grouping.members, grouping.sizes
        x = self.values[members]
        means = np.add.reduceat(x, grouping.starts, axis=0) / sizes[:, None]
        self.values[members] = np.repeat(means, sizes, axis=0)
        return 0

    def _average_lossy(self, grouping: grid.Grouping) -> int:
        """Reduce-scatter + all-gather with i.i.d. chunk loss on the production part layout and estimator.

        Every member has weight 1 and is present (failures happened before grouping). The owner of part j is
        member j in the group's order; its own value never crosses the network. Groups of one size share one
        `Partition`, so each (part, chunk) is handled for all of them at once; the estimator is called once per
        distinct number of arrived contributions (its weights are scalars), on a batch of chunks."""
        q, chunk_numel = self.config.chunk_loss, self.config.chunk_numel
        lost = 0
        after = self.values.copy()  # inputs are read from self.values, results written here
        for size in np.unique(grouping.sizes).tolist():
            if size == 1:
                continue
            starts = grouping.starts[grouping.sizes == size]
            members = grouping.members[starts[:, None] + np.arange(size)]  # (groups, size)
            part = Partition(self.config.dim, size, chunk_numel).pipelined()
            for j in range(size):
                owner, others = members[:, j], np.delete(members, j, axis=1)  # (G,), (G, size - 1)
                for c in range(part.num_chunks(j)):
                    lo, hi = part.chunk_range(j, c)
                    arrived = self.loss_rng.random(others.shape) >= q
                    counts = arrived.sum(axis=1)
                    lost += int(arrived.size - counts.sum())
                    block = self.values[others, lo:hi]  # (G, size - 1, L)
                    sums = np.einsum("gm,gml->gl", arrived.astype(block.dtype), block)
                    result = np.empty((owner.size, hi - lo))
                    for count in np.unique(counts).tolist():
                        rows = counts == count
                        own = torch.from_numpy(self.values[owner[rows], lo:hi].copy())
                        result[rows] = estimate_over_sum(own, 1.0, torch.from_numpy(sums[rows].copy()),
                                                         float(count), float(size - 1)).numpy()
                    after[owner, lo:hi] = result
                    got = self.loss_rng.random(others.shape) >= q
                    lost += int(got.size - got.sum())
                    # A receiver that missed the averaged chunk keeps its own value for it.
                    rows_idx, cols_idx = np.nonzero(got)
                    after[others[rows_idx, cols_idx], lo:hi] = result[rows_idx]
        self.values = after
        return lost

    def run(self, stop_below: Optional[float] = None) -> Trajectory:
        """Run up to `config.rounds` rounds; stop early once the error is below `stop_below`."""
        traj = Trajectory(seed=self.seed, error=[self.error()])
        while self.round < self.config.rounds:
            stats = self.step()
            traj.error.append(stats.error)
            traj.rounds.append(stats)
            if stop_below is not None and stats.error < stop_below:
                break
        return traj


@dataclass
class CellResult:
    """Restarts of one configuration: rounds to each eps (mean, sd, per restart) and the mean error per round."""

    config: AveragingConfig
    eps: List[float]
    rounds_to: Dict[float, List[int]]
    mean_error: List[float]
    trajectories: List[Trajectory] = field(default_factory=list, repr=False)

    def mean(self, eps: float) -> float:
        return float(np.mean(self.rounds_to[eps]))

    def sd(self, eps: float) -> float:
        return float(np.std(self.rounds_to[eps]))

    def summary(self) -> dict:
        """JSON-ready summary."""
        return {
            "config": asdict(self.config),
            "restarts": len(next(iter(self.rounds_to.values()))) if self.rounds_to else 0,
            "rounds_to": {f"{e:g}": {"mean": round(self.mean(e), 3), "sd": round(self.sd(e), 3),
                                     "runs": self.rounds_to[e]} for e in self.eps},
            "mean_error": [float(f"{e:.4g}") for e in self.mean_error],
        }


def run_cell(config: AveragingConfig, restarts: int = 10, seed: int = 0,
             eps: Sequence[float] = (1e-9, 1e-4)) -> CellResult:
    """`restarts` runs with seeds seed, seed + 1, ... (the notebook uses seeds 0..9); each stops once below the
    smallest eps or at the round cap. The mean error per round averages the runs, a stopped run counting with
    its last error (the notebook clips at machine epsilon instead; the means only feed the table).

    :raises ValueError: a bad config, restarts < 1 or eps not positive
    """
    if restarts < 1:
        raise ValueError(f"restarts must be >= 1, got {restarts}")
    if not eps or any(not e > 0 for e in eps):
        raise ValueError(f"eps must be positive, got {list(eps)}")
    config.check()
    eps = sorted(set(float(e) for e in eps))
    trajectories = [AveragingSimulation(config, seed + r).run(stop_below=eps[0]) for r in range(restarts)]
    rounds_to = {e: [t.rounds_to(e, config.rounds) for t in trajectories] for e in eps}
    length = max(len(t.error) for t in trajectories)
    padded = np.array([t.error + [t.error[-1]] * (length - len(t.error)) for t in trajectories])
    return CellResult(config=config, eps=eps, rounds_to=rounds_to, mean_error=padded.mean(axis=0).tolist(),
                      trajectories=trajectories)

