"""The training level of `moshpeer simulate`: N virtual peers train one model on a simulated clock.

Nothing sleeps: every peer carries its own clock (seconds of simulated time) and every duration comes from a
model (compute: samples / speed; a group round: bytes / link speed + round trips; failures: exponential).
The training math runs for real, vectorized over peers (one row of a matrix per peer).

**Workload.** A convex problem: least squares in its population form. Peer i's loss is
f_i(x) = 1/2 (x - c_i)^T D (x - c_i), D diagonal with eigenvalues log-spaced in [1/condition, 1], c_i = c* + a
per-peer offset (non-IID shards, `heterogeneity`); a minibatch of B samples gives the gradient D (x - c_i) plus
N(0, noise^2 / B) per coordinate. The swarm's loss is the mean of the f_i over the honest peers, evaluated at
each honest peer's own model and averaged (so disagreement between peers costs loss); its minimum is
`loss_floor()` (the spread of the c_i), reported with every figure.

**Modes** (the production strategies, `moshpeer/peer/strategies/`):

- `gradients`: each round = one step: the peer's minibatch gradient is averaged in its group and applied with
  SGD; every `DEFAULT_PARAMS_EVERY` rounds the parameters are averaged too (as `GradientsStrategy` does).
- `parameters`: one local SGD step, then the parameters are averaged in the group.
- `diloco`: H inner SGD steps, then the pseudo-gradient Δ = θ_outer - θ_local is averaged in the group and the
  production `OuterState` (SGD, Nesterov, lr 0.7, momentum 0.9: `OuterOptimizer()`) takes the outer step, on
  all peers' rows at once. A peer with no group steps on its own Δ (`DiLoCoStrategy.apply_alone`).

**One round** (`MoshpitTraining.step`), for the peers up at its start:

1. compute: each peer's clock advances by steps x batch / speed. A peer whose failure time falls inside fails
   there: the work since its last completed round is lost, it is down for Exp(rejoin_s) (or for good, with
   probability `never_return`), and it takes no part in the round.
2. grouping: the key rule as the averaging level models it (`grid.assemble_groups` on the peers' group keys),
   then the matchmaking window (`_window`): a group keeps its largest set of members ready within
   `matchmaking_window_s` of each other. An earlier member waited the window in vain and steps alone; a later one
   found the group gone: in DiLoCo it catches up as production does (`catches_up_after_missed_round`: it
   downloads a member's state after the round and loses the round's compute), in the other modes it steps
   alone. A group smaller than `min_group_size` does not assemble. Rounds are numbered swarm-wide: every peer
   takes part in each round it is up for, so a fast peer waits for its group's slowest member (fixed H, as in
   production without DropCompute).
3. the group round starts when its last member is ready, after matchmaking ((2 + log2 N) round trips of the
   slowest member's RTT: DHT lookup, join request, leader's reply). Its data-plane time is the bandwidth model
   of `group_round_seconds` over the production part sizes (`partition.bandwidth_part_sizes`) of a vector of
   `model_params` values. A member whose failure time falls inside the round sends nothing: the owners treat
   it as departed, its own part is lost for everybody (each keeps its own value there), and the others wait
   for the round's deadline (the latest of the survivors' production `DeadlineLearner`; each peer records every
   round it finished, as a peer does).
4. aggregation per owner part and chunk (production `Partition` on the workload's dimension): `mean` = the
   production estimator `estimate_over_sum` over what arrived (with chunk loss), `clipped`/`trimmed` = the
   production `robust_combine`; declared weights capped by `cap_weights` (`weight_cap_factor(mode)`); lost
   averaged chunks keep the receiver's own value.
5. keys rotate with hivemind's rule (`grid.rotate_grouped_keys`); a rejoining peer downloads the state of a
   random live honest peer (state bytes / its downlink) and resumes at the swarm's median clock. A peer that was
   ready only after its group had formed catches up as production DiLoCo does (`catches_up_after_missed_round`):
   it downloads a member's state after the round, and its round's compute is lost.

**Hostile peers** (a fixed random subset): they train honestly but send `hostile_scale` x their contribution
(-100 = the issue's scaled attack, -1 = sign flip) and declare `hostile_weight` x their true weight. As owners
they aggregate honestly (a hostile owner is out of robust aggregation's reach; see aggregation.py).

**Goodput** = useful compute (peer-seconds of compute that ended in a completed round) / up time (peer-seconds
the peers were up). Lost compute (failed mid-epoch), waiting for slower members, matchmaking, the data plane,
deadlines and state downloads are not useful. Both systems' down time (a machine away) is out of the
denominator: the synchronous baseline is elastic (it restarts without the failed peer) rather than waiting.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from moshpeer.averaging import grid
from moshpeer.averaging.adaptive_deadlines import DeadlineLearner
from moshpeer.averaging.aggregation import AGGREGATIONS, cap_weights, robust_combine, weight_cap_factor
from moshpeer.averaging.estimator import estimate_over_sum
from moshpeer.averaging.partition import Partition, bandwidth_part_sizes
from moshpeer.peer.strategies.diloco_outer import OuterState, parse_outer_optimizer
from moshpeer.peer.strategies.gradients import DEFAULT_PARAMS_EVERY

MODES = ("gradients", "parameters", "diloco")
PARTITIONS = ("bandwidth", "equal")
GROUP_ID_BYTES = 20
HOUR = 3600.0


@dataclass
class Workload:
    """The convex problem (see the module docstring). `check()` raises ValueError naming the first bad field."""

    dim: int = 256
    condition: float = 10.0
    heterogeneity: float = 0.3
    noise: float = 1.0
    batch: int = 32
    lr: float = 0.003

    def check(self) -> "Workload":
        if self.dim < 1:
            raise ValueError(f"dim must be >= 1, got {self.dim}")
        if not self.condition >= 1:
            raise ValueError(f"condition must be >= 1, got {self.condition}")
        for name in ("heterogeneity", "noise"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if not 0 < self.lr <= 1:
            raise ValueError(f"lr must be in (0, 1] (the largest eigenvalue is 1), got {self.lr}")
        return self


@dataclass
class TrainingConfig:
    """One simulated training run. `check()` raises ValueError naming the first bad field.

    Links are per peer: the value given, times a lognormal factor of sd `link_spread` (0 = all equal); compute
    speeds likewise with `speed_spread`. Times in seconds, bandwidths in bytes/s, failure rate per peer per hour.

    :param model_params: values of the model the time model moves (the workload's `dim` is what the math
        trains: a small stand-in; bytes and round times are those of a model of `model_params` values)
    :param bytes_per_value: wire bytes per value (4 = fp32, 2 = fp16, 1 = int8)
    :param inner_steps: H (diloco); gradients and parameters rounds are one step
    :param outer_params_every: diloco, NOT production behaviour (a proposal the simulator can evaluate): every K
        rounds the group also averages θ_outer and its members adopt the average before the outer step, as
        `GradientsStrategy` does with parameters; 0 (default) = never, as `DiLoCoStrategy` does
    :param matchmaking_window_s: how long the first ready member of a group waits for the others
    :param round_timeout_s: cap of the adaptive round deadline (`DeadlineLearner`, floor `min_round_timeout_s`)
    :param rejoin_s: mean time a failed peer stays away (exponential)
    :param never_return: probability that a failed peer never comes back
    :param chunk_loss: probability that one chunk on one link is lost (both phases)
    :param chunk_numel: values per chunk of the workload vector
    """

    peers: int = 1000
    mode: str = "diloco"
    rounds: int = 200
    inner_steps: int = 50
    outer_optimizer: str = "nesterov:lr=0.7,momentum=0.9"
    outer_params_every: int = 0
    group_size: int = 16
    min_group_size: int = 2
    key_bits: Optional[int] = None
    aggregation: str = "mean"
    partition: str = "bandwidth"
    model_params: int = 10_000_000
    bytes_per_value: int = 4
    uplink: float = 125e6
    downlink: float = 125e6
    rtt_s: float = 0.05
    link_spread: float = 0.0
    speed: float = 16.0
    speed_spread: float = 0.0
    failure_rate_per_hour: float = 0.0
    rejoin_s: float = 600.0
    never_return: float = 0.0
    chunk_loss: float = 0.0
    chunk_numel: int = 1024
    hostile_fraction: float = 0.0
    hostile_scale: float = -100.0
    hostile_weight: float = 1.0
    matchmaking_window_s: float = 30.0
    round_timeout_s: float = 120.0
    min_round_timeout_s: float = 5.0
    workload: Workload = field(default_factory=Workload)

    def check(self) -> "TrainingConfig":
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.peers >= 1, f"peers must be >= 1, got {self.peers}")
        need(self.mode in MODES, f"mode must be one of {MODES}, got {self.mode!r}")
        need(self.rounds >= 1, f"rounds must be >= 1, got {self.rounds}")
        need(self.outer_params_every >= 0, f"outer_params_every must be >= 0, got {self.outer_params_every}")
        need(self.inner_steps >= 1, f"inner_steps must be >= 1, got {self.inner_steps}")
        try:
            parse_outer_optimizer(self.outer_optimizer)
        except Exception as e:  # UserError: one line naming what is wrong
            raise ValueError(str(e)) from None
        need(self.group_size >= 2, f"group_size must be >= 2, got {self.group_size}")
        need(1 <= self.min_group_size <= self.group_size, f"min_group_size must be in [1, group_size], "
             f"got {self.min_group_size}")
        need(self.key_bits is None or 0 <= self.key_bits <= 62, f"key_bits must be in [0, 62], got {self.key_bits}")
        need(self.aggregation in AGGREGATIONS, f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        need(self.partition in PARTITIONS, f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        need(self.model_params >= 1, f"model_params must be >= 1, got {self.model_params}")
        need(self.bytes_per_value >= 1, f"bytes_per_value must be >= 1, got {self.bytes_per_value}")
        for name in ("uplink", "downlink", "speed", "rejoin_s", "matchmaking_window_s", "round_timeout_s",
                     "min_round_timeout_s"):
            value = getattr(self, name)
            need(0 < value < math.inf, f"{name} must be a positive number, got {value}")
        need(self.min_round_timeout_s <= self.round_timeout_s, "min_round_timeout_s must be <= round_timeout_s")
        for name in ("rtt_s", "link_spread", "speed_spread", "failure_rate_per_hour"):
            value = getattr(self, name)
            need(0 <= value < math.inf, f"{name} must be finite and >= 0, got {value}")
        for name in ("never_return", "chunk_loss"):
            value = getattr(self, name)
            need(0 <= value < 1, f"{name} must be in [0, 1), got {value}")
        need(0 <= self.hostile_fraction < 1, f"hostile_fraction must be in [0, 1), got {self.hostile_fraction}")
        need(math.isfinite(self.hostile_scale), f"hostile_scale must be finite, got {self.hostile_scale}")
        need(0 < self.hostile_weight < math.inf, f"hostile_weight must be positive, got {self.hostile_weight}")
        need(self.chunk_numel >= 1, f"chunk_numel must be >= 1, got {self.chunk_numel}")
        self.workload.check()
        return self

    def resolved_key_bits(self) -> int:
        return grid.default_key_bits(self.peers, self.group_size) if self.key_bits is None else self.key_bits

    def steps_per_round(self) -> int:
        return self.inner_steps if self.mode == "diloco" else 1


# ---- the time model ----------------------------------------------------------------------------------


def group_round_seconds(numel: int, part_sizes: Sequence[int], uplinks: Sequence[float], downlinks: Sequence[float],
                        rtt_s: float, bytes_per_value: float) -> Tuple[float, List[float]]:
    """Data-plane time of one group round and the bytes each member uploads.

    Member i uploads its contribution to every other part (numel - s_i values, reduce-scatter) and its averaged
    part to the n - 1 others ((n - 1) s_i, all-gather), and downloads as much. Chunks are pipelined (an owner
    sends a chunk back as soon as it is final), so the round lasts as long as the busiest link:
    max_i max(U_i / up_i, D_i / down_i), plus one round trip per phase. With unlimited downlinks this is the
    production model `partition.reduce_allgather_seconds` (the one `bandwidth_part_sizes` optimizes) plus two
    round trips.

    :raises ValueError: part sizes that do not fit the members, or a non-positive link speed
    """
    n = len(part_sizes)
    if n != len(uplinks) or n != len(downlinks) or sum(part_sizes) != numel:
        raise ValueError("part sizes, uplinks and downlinks must have one entry per member and sum to numel")
    if any(not b > 0 for b in list(uplinks) + list(downlinks)):
        raise ValueError("link speeds must be positive")
    if n == 1:
        return 0.0, [0.0]
    busiest = 0.0
    sent = []
    for s, up, down in zip(part_sizes, uplinks, downlinks):
        volume = (numel - s + (n - 1) * s) * bytes_per_value
        busiest = max(busiest, volume / up, volume / down)
        sent.append(volume)
    return busiest + 2 * rtt_s, sent


def matchmaking_seconds(peers: int, rtt_s: float) -> float:
    """Matchmaking of one round: a DHT lookup of the group key (about log2 N hops) plus the join request and
    the leader's reply. A model, not production timing (hivemind's matchmaking is asynchronous)."""
    return (2 + math.ceil(math.log2(max(peers, 2)))) * rtt_s


def ring_allreduce_seconds(numel: int, peers: int, uplink: float, downlink: float, rtt_s: float,
                           bytes_per_value: float) -> float:
    """The synchronous baseline's all-reduce of `numel` values among `peers`: a ring's bandwidth term
    (2 (n - 1) / n of the vector through the slowest link) with a tree's latency term (2 log2 n round trips).
    Generous to the baseline: no real all-reduce has both."""
    if peers <= 1:
        return 0.0
    volume = 2 * (peers - 1) / peers * numel * bytes_per_value
    return volume / min(uplink, downlink) + 2 * math.ceil(math.log2(peers)) * rtt_s


# ---- results ----------------------------------------------------------------------------------------


@dataclass
class TrainingResult:
    """What a run measured. `curve` = (simulated seconds, loss) after each round (sync: each checkpoint
    interval); `stalls` = group rounds (sync: steps) that waited for a dead member until a deadline/timeout;
    `catch_ups` = peers that came after their group had formed and downloaded a member's state instead."""

    system: str
    config: dict
    rounds: int
    sim_seconds: float
    goodput: float
    useful_s: float
    up_s: float
    lost_s: float
    wait_s: float
    comm_s: float
    stalls: int
    failures: int
    final_loss: float
    loss_floor: float
    initial_loss: float
    bytes_per_peer: float
    final_spread: float = 0.0
    catch_ups: int = 0
    mean_group_size: float = 0.0
    alone_fraction: float = 0.0
    curve: List[Tuple[float, float]] = field(default_factory=list)

    @property
    def excess_loss(self) -> float:
        """Final loss minus the optimum (what training can still remove)."""
        return self.final_loss - self.loss_floor

    def summary(self) -> dict:
        """JSON-ready figures (the curve thinned to at most 50 points)."""
        step = max(1, len(self.curve) // 50)
        out = {k: v for k, v in asdict(self).items() if k not in ("curve", "config")}
        out["excess_loss"] = self.excess_loss
        out["curve"] = [(round(t, 1), float(f"{loss:.6g}")) for t, loss in self.curve[::step]]
        return {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in out.items()}


# ---- shared setup -----------------------------------------------------------------------------------


class _Swarm:
    """Per-peer properties and the workload's data; one seed gives one swarm (both systems see the same)."""

    def __init__(self, config: TrainingConfig, seed: int):
        self.config = config.check()
        w = config.workload
        n = config.peers
        data_ss, peer_ss, fail_ss, group_ss, noise_ss, loss_ss = np.random.SeedSequence(seed).spawn(6)
        data_rng, peer_rng = np.random.default_rng(data_ss), np.random.default_rng(peer_ss)
        self.fail_rng = np.random.default_rng(fail_ss)
        self.group_rng = np.random.default_rng(group_ss)
        self.loss_rng = np.random.default_rng(loss_ss)
        self.noise_gen = torch.Generator().manual_seed(int(np.random.default_rng(noise_ss).integers(1 << 62)))
        self.curvature = torch.from_numpy(np.logspace(0, -math.log10(w.condition), w.dim)).float()
        target = data_rng.standard_normal(w.dim)
        self.centers = torch.from_numpy(target + w.heterogeneity * data_rng.standard_normal((n, w.dim))).float()
        self.start = torch.zeros(w.dim)

        def spread(sd: float) -> np.ndarray:
            return np.exp(sd * peer_rng.standard_normal(n) - sd * sd / 2) if sd > 0 else np.ones(n)

        self.uplink = config.uplink * spread(config.link_spread)
        self.downlink = config.downlink * spread(config.link_spread)
        self.rtt = config.rtt_s * spread(config.link_spread)
        self.speed = config.speed * spread(config.speed_spread)
        hostile = int(round(config.hostile_fraction * n))
        self.hostile = np.zeros(n, dtype=bool)
        self.hostile[peer_rng.choice(n, hostile, replace=False)] = True
        self.honest = ~self.hostile
        honest_centers = self.centers[torch.from_numpy(self.honest)]
        self.honest_center_mean = honest_centers.mean(dim=0)
        diff = honest_centers - self.honest_center_mean
        self._floor = float(0.5 * (diff * diff * self.curvature).sum(dim=1).mean())

    def loss_floor(self) -> float:
        """The smallest possible swarm loss: every honest peer at the mean of the honest centers."""
        return self._floor

    def loss(self, models: torch.Tensor) -> float:
        """Mean over rows of the honest peers' mean loss at that row's model (rows: models of honest peers)."""
        diff = models - self.honest_center_mean
        return self._floor + float(0.5 * (diff * diff * self.curvature).sum(dim=1).mean())

    def gradients(self, x: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
        """Minibatch gradients of peers at their models `x` (one row each; `centers`: their rows of the centers)."""
        w = self.config.workload
        noise = torch.randn(x.shape, generator=self.noise_gen).mul_(w.noise / math.sqrt(w.batch))
        return (x - centers).mul_(self.curvature).add_(noise)

    def spread(self, models: torch.Tensor) -> float:
        """Disagreement: mean over rows of 1/2 |x - mean x|_D^2 (the part of the loss that averaging removes)."""
        diff = models - models.mean(dim=0)
        return float(0.5 * (diff * diff * self.curvature).sum(dim=1).mean())

    def next_failure(self, now: np.ndarray) -> np.ndarray:
        """Failure times after `now` (exponential; inf without failures)."""
        rate = self.config.failure_rate_per_hour / HOUR
        if rate <= 0:
            return np.full(np.shape(now), np.inf)
        return now + self.fail_rng.exponential(1 / rate, np.shape(now))


# ---- Moshpit training --------------------------------------------------------------------------------


class MoshpitTraining:
    """The swarm training with Moshpit groups (mode gradients, parameters or diloco); `run()` or `step()`.

    Deterministic for a (config, seed). Bad config: ValueError (see `TrainingConfig.check`).
    """

    def __init__(self, config: TrainingConfig, seed: int = 0):
        self.swarm = s = _Swarm(config, seed)
        self.config = config
        n, dim = config.peers, config.workload.dim
        self.x = s.start.repeat(n, 1)  # each peer's model (diloco: θ_local between rounds = θ_outer)
        self.outer = (OuterState([self.x], parse_outer_optimizer(config.outer_optimizer))
                      if config.mode == "diloco" else None)
        self.clock = np.zeros(n)
        self.fail_at = s.next_failure(self.clock)
        self.down_until = np.zeros(n)  # > clock: away; inf: gone for good
        self.down_s = np.zeros(n)
        self.useful = np.zeros(n)
        self.lost = np.zeros(n)
        self.wait = np.zeros(n)
        self.comm = np.zeros(n)
        self.sent = np.zeros(n)
        self.key_bits = config.resolved_key_bits()
        self.keys = grid.initial_group_keys(n, self.key_bits, s.group_rng)
        self.deadlines: Dict[int, DeadlineLearner] = {}
        self.round = 0
        self.stalls = self.failures = self.catch_ups = 0
        self.group_sizes: List[int] = []
        self.alone = 0
        self.participations = 0
        self.initial_loss = s.loss(self.x[torch.from_numpy(s.honest)])
        self.curve: List[Tuple[float, float]] = [(0.0, self.initial_loss)]
        self.mm_s = matchmaking_seconds(n, 1.0)  # x the slowest member's RTT

    # -- helpers --

    def _deadline(self, peer: int) -> DeadlineLearner:
        if peer not in self.deadlines:
            c = self.config
            self.deadlines[peer] = DeadlineLearner(matchmaking_floor=c.matchmaking_window_s,
                                                  matchmaking_cap=c.matchmaking_window_s,
                                                  round_floor=c.min_round_timeout_s, round_cap=c.round_timeout_s)
        return self.deadlines[peer]

    def _fail(self, peers: np.ndarray, at: np.ndarray) -> None:
        """Peers fail at times `at`: away for Exp(rejoin_s), or for good with probability never_return."""
        if peers.size == 0:
            return
        s, c = self.swarm, self.config
        self.failures += int(peers.size)
        away = s.fail_rng.exponential(c.rejoin_s, peers.size)
        gone = s.fail_rng.random(peers.size) < c.never_return
        back = np.where(gone, np.inf, at + away)
        self.down_until[peers] = back
        self.clock[peers] = at
        self.fail_at[peers] = np.where(gone, np.inf, s.next_failure(np.where(gone, 0.0, back)))

    def _rejoin(self, now: float) -> None:
        """Peers whose time away is over by the swarm's median clock download a live honest peer's state."""
        s, c = self.swarm, self.config
        back = np.flatnonzero((self.down_until > self.clock) & (self.down_until <= now))
        if back.size == 0:
            return
        live = np.flatnonzero((self.down_until <= self.clock) & s.honest)
        if live.size == 0:
            return
        donors = live[s.group_rng.integers(0, live.size, back.size)]
        self.down_s[back] += self.down_until[back] - self.clock[back]
        state_values = c.model_params * (2 if c.mode == "diloco" else 1)  # diloco: θ_outer and its momentum
        download = state_values * 4 / s.downlink[back]
        resume = np.maximum(self.down_until[back] + download, now)
        self.wait[back] += resume - self.down_until[back]  # the download, then waiting for the next round
        self.clock[back] = resume
        self.down_until[back] = 0.0
        self._adopt(back, donors)

    def _adopt(self, peers: np.ndarray, donors: np.ndarray) -> None:
        """`peers` take over their donors' state: the model and, for DiLoCo, θ_outer and the outer momentum."""
        b, d = torch.from_numpy(peers), torch.from_numpy(donors)
        self.x[b] = self.x[d]
        if self.outer is not None:
            anchor = self.outer.anchor[0]
            anchor[b] = anchor[d]
            momentum = self.outer.optimizer.state.get(anchor, {}).get("momentum_buffer")
            if momentum is not None:
                momentum[b] = momentum[d]

    # -- one round --

    def step(self) -> None:
        """One round for every peer that is up (see the module docstring)."""
        s, c = self.swarm, self.config
        self.round += 1
        up = self.down_until <= self.clock
        now = float(np.median(self.clock[up])) if up.any() else float(self.clock.max())
        self._rejoin(now)
        active = np.flatnonzero(self.down_until <= self.clock)
        if active.size == 0:
            return
        steps = c.steps_per_round()
        compute = steps * c.workload.batch / s.speed[active]
        ready = self.clock[active] + compute
        failing = self.fail_at[active] < ready
        self.lost[active[failing]] += self.fail_at[active[failing]] - self.clock[active[failing]]
        self._fail(active[failing], self.fail_at[active[failing]])
        survivors, ready, compute = active[~failing], ready[~failing], compute[~failing]
        honest, contributions, weights = self._compute(survivors)
        ready_of = np.full(c.peers, np.nan)
        ready_of[survivors] = ready

        grouping = grid.assemble_groups(survivors, self.keys[survivors], c.group_size, c.min_group_size,
                                        s.group_rng)
        grouping, late, late_group = self._window(grouping, ready_of)
        if c.mode != "diloco" and late.size:
            # Only DiLoCoStrategy catches up after a missed round; the other strategies step alone (apply_alone).
            grouping = grid.Grouping(grouping.members, grouping.starts, grouping.sizes,
                                     np.r_[grouping.alone, late].astype(np.int64))
            late = late_group = np.zeros(0, dtype=np.int64)
        row_of = np.full(c.peers, -1, dtype=np.int64)
        row_of[survivors] = np.arange(survivors.size)
        averaged = honest.clone()  # alone, or a lost averaged chunk: the peer's own (honest) value
        done = np.ones(survivors.size, dtype=bool)  # False: died during the round, or came late
        ends, donors = np.zeros(grouping.num_groups), np.full(grouping.num_groups, -1, dtype=np.int64)
        for j in range(grouping.num_groups):
            members = grouping.members[grouping.starts[j]:grouping.starts[j] + grouping.sizes[j]]
            done_members, ends[j] = self._group_round(members, row_of[members], ready_of[members], contributions,
                                                      weights, averaged)
            done[row_of[members]] = done_members
            if done_members.any():
                donors[j] = members[np.flatnonzero(done_members)[0]]
        # Late (ready after its group had formed): production DiLoCo's catch-up rule (`catches_up_after_missed_round`,
        # CollaborativeOptimizer: the swarm moved past this epoch): download the state of a member that finished
        # the round; this round's compute is lost.
        catch_up = late[donors[late_group] >= 0] if late.size else late
        catch_donor = donors[late_group][donors[late_group] >= 0] if late.size else late
        catch_end = ends[late_group][donors[late_group] >= 0] if late.size else np.zeros(0)
        alone = np.r_[grouping.alone, late[donors[late_group] < 0]].astype(np.int64) if late.size else grouping.alone
        done[row_of[catch_up]] = False
        # Alone: waited the matchmaking window in vain, then steps on its own contribution.
        self.alone += int(alone.size)
        self.participations += int(survivors.size)
        self.wait[alone] += c.matchmaking_window_s
        self.clock[alone] = ready_of[alone] + c.matchmaking_window_s
        self.useful[survivors[done]] += compute[done]
        self._apply(survivors, done, averaged)
        if catch_up.size:
            self.lost[catch_up] += compute[row_of[catch_up]]
            self.catch_ups += int(catch_up.size)
            self._adopt(catch_up, catch_donor)
            state_values = c.model_params * (2 if c.mode == "diloco" else 1)
            resume = catch_end + state_values * 4 / s.downlink[catch_up]
            self.wait[catch_up] += resume - ready_of[catch_up]
            self.clock[catch_up] = resume
        if grouping.num_groups:
            blob = s.group_rng.bytes(GROUP_ID_BYTES * grouping.num_groups)
            ids = [blob[k * GROUP_ID_BYTES:(k + 1) * GROUP_ID_BYTES] for k in range(grouping.num_groups)]
            self.keys = grid.rotate_grouped_keys(self.keys, self.key_bits, grouping, c.group_size, ids)
        live_honest = np.flatnonzero((self.down_until <= self.clock) & s.honest)
        if live_honest.size:
            t = float(np.median(self.clock[self.down_until <= self.clock]))
            self.curve.append((t, s.loss(self.x[torch.from_numpy(live_honest)])))

    def _compute(self, peers: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """The round's local work of `peers` -> (its honest contribution, what it sends, its declared weight)."""
        s, c = self.swarm, self.config
        rows = torch.from_numpy(peers)
        x = self.x[rows]
        centers = s.centers[rows]
        lr = c.workload.lr
        if c.mode == "diloco":
            local = x.clone()
            for _ in range(c.inner_steps):
                local.sub_(s.gradients(local, centers), alpha=lr)
            self.x[rows] = local
            contribution = self.outer.anchor[0][rows] - local  # Δ = θ_outer - θ_local
            if c.outer_params_every and self.round % c.outer_params_every == 0:
                contribution = torch.cat([contribution, self.outer.anchor[0][rows]], dim=1)
        elif c.mode == "gradients":
            contribution = s.gradients(x, centers)
            if self.round % DEFAULT_PARAMS_EVERY == 0:  # GradientsStrategy's parameter rounds
                contribution = torch.cat([contribution, x], dim=1)
        else:
            x = x - lr * s.gradients(x, centers)
            self.x[rows] = x
            contribution = x.clone()
        weights = np.full(peers.size, float(c.workload.batch * c.steps_per_round()))
        hostile = s.hostile[peers]
        sent = contribution
        if hostile.any():
            sent = contribution.clone()
            h = torch.from_numpy(hostile)
            sent[h] *= c.hostile_scale
            weights[hostile] *= c.hostile_weight
        return contribution, sent, weights

    def _window(self, grouping: grid.Grouping, ready_of: np.ndarray) -> Tuple[grid.Grouping, np.ndarray, np.ndarray]:
        """The matchmaking window: a group forms from the largest set of its members whose ready times lie within
        `matchmaking_window_s` of each other (the latest such set on a tie); a member ready earlier waited the
        window in vain and goes alone; one ready later found the group gone: it is returned as late, with the index
        of the group it missed (-> grouping, late peers, their groups)."""
        c = self.config
        none = np.zeros(0, dtype=np.int64)
        if grouping.num_groups == 0:
            return grouping, none, none
        ready = ready_of[grouping.members]
        first = np.minimum.reduceat(ready, grouping.starts)
        last = np.maximum.reduceat(ready, grouping.starts)
        if (last - first <= c.matchmaking_window_s).all():
            return grouping, none, none
        keep = np.ones(grouping.members.size, dtype=bool)
        late = np.zeros(grouping.members.size, dtype=bool)
        for j in np.flatnonzero(last - first > c.matchmaking_window_s).tolist():
            lo = int(grouping.starts[j])
            times = ready[lo:lo + int(grouping.sizes[j])]
            order = np.sort(times)
            # For each member as the latest of the set: how many are ready within the window before it.
            counts = np.arange(order.size) - np.searchsorted(order, order - c.matchmaking_window_s) + 1
            best = int(np.flatnonzero(counts == counts.max())[-1])
            keep[lo:lo + times.size] = (times <= order[best]) & (times >= order[best] - c.matchmaking_window_s)
            late[lo:lo + times.size] = times > order[best]
        group_of = grouping.group_of_member()
        sizes = np.bincount(group_of[keep], minlength=grouping.num_groups)
        ok = sizes >= c.min_group_size
        in_ok = keep & ok[group_of]
        members = grouping.members[in_ok]
        kept = sizes[ok]
        starts = np.r_[0, np.cumsum(kept)[:-1]] if kept.size else np.zeros(0, dtype=np.int64)
        new_index = np.cumsum(ok) - 1
        is_late = late & ok[group_of]
        alone = np.r_[grouping.alone, grouping.members[~in_ok & ~is_late]]
        regrouped = grid.Grouping(members, starts.astype(np.int64), kept.astype(np.int64), alone.astype(np.int64))
        return regrouped, grouping.members[is_late], new_index[group_of[is_late]]

    def _group_round(self, members: np.ndarray, rows: np.ndarray, ready: np.ndarray, contributions: torch.Tensor,
                     weights: np.ndarray, averaged: torch.Tensor) -> Tuple[np.ndarray, float]:
        """Time, traffic and aggregation of one group; writes the members' results into `averaged`; returns
        which members finished the round (the others failed in it) and when it ended."""
        s, c = self.swarm, self.config
        n = members.size
        self.group_sizes.append(n)
        ups, downs = s.uplink[members], s.downlink[members]
        numel = c.model_params * (2 if contributions.shape[1] > c.workload.dim else 1)
        if c.partition == "bandwidth":
            sizes = bandwidth_part_sizes(numel, ups.tolist())
        else:
            sizes = Partition(numel, n, c.chunk_numel).part_starts
            sizes = [b - a for a, b in zip(sizes, sizes[1:])]
        data_s, sent = group_round_seconds(numel, sizes, ups, downs, float(s.rtt[members].max()), c.bytes_per_value)
        start = float(ready.max()) + self.mm_s * float(s.rtt[members].max())
        end = start + data_s
        dying = self.fail_at[members] < end
        payload = numel * c.bytes_per_value
        alive_members = members[~dying].tolist()
        if dying.any():
            # Nobody hears from a member that died: each owner waits for its part until its own deadline, so the
            # round ends at the latest of the survivors' deadlines. (A round with a dead member is not recorded.)
            self.stalls += 1
            waits = [self._deadline(m).round_deadline(n, payload) for m in alive_members] or [c.round_timeout_s]
            end = start + max(data_s, max(waits))
        else:
            # Every member records the round, as every peer's own DeadlineLearner does.
            for m in alive_members:
                self._deadline(m).observe_round(n, payload, data_s, hit_deadline=False, member_died=False)
        self.sent[members[~dying]] += np.asarray(sent)[~dying]
        self.wait[members] += start - ready
        self.comm[members[~dying]] += end - start
        self.clock[members[~dying]] = end
        if dying.any():
            died = members[dying]
            self.lost[died] += ready[dying] - self.clock[died]  # the epoch's compute, not only the round
            self._fail(died, self.fail_at[died])
        self._aggregate(rows, contributions, weights, dying, averaged)
        return ~dying, end

    def _aggregate(self, rows: np.ndarray, contributions: torch.Tensor, weights: np.ndarray, dying: np.ndarray,
                   averaged: torch.Tensor) -> None:
        """Each member owns one part of the workload vector; aggregate it from what arrived, send it back."""
        c = self.config
        n = rows.size
        v = contributions[torch.from_numpy(rows)]
        dim = v.shape[1]
        w = cap_weights(weights[np.arange(n)].tolist(), weight_cap_factor(c.aggregation))
        present = ~dying
        # A receiver keeps its own (honest) value where nothing comes back; a hostile owner aggregates honestly,
        # from its own honest value (robust aggregation cannot defend against a lying owner anyway).
        own_values = averaged[torch.from_numpy(rows)]
        if c.aggregation == "mean" and c.chunk_loss == 0 and not dying.any():
            # One weighted mean for the whole vector: the same as per part, except that a hostile owner's own
            # share of its own part (1/n of 1/n of the vector) is counted as sent, not as honest.
            wt = torch.tensor(w, dtype=v.dtype)
            averaged[torch.from_numpy(rows)] = (wt @ v / wt.sum()).expand(n, dim)
            return
        partition = Partition(dim, n, c.chunk_numel)
        rng = self.swarm.loss_rng
        result = own_values.clone()
        v = v.clone()
        wt = torch.tensor(w, dtype=v.dtype)
        for owner in range(n):
            if dying[owner]:
                continue  # its part never comes back: everybody keeps its own value there
            lo_part, hi_part = partition.part_range(owner)
            v[owner, lo_part:hi_part] = own_values[owner, lo_part:hi_part]
            for chunk in range(partition.num_chunks(owner)):
                lo, hi = partition.chunk_range(owner, chunk)
                arrived = present & (rng.random(n) >= c.chunk_loss)
                arrived[owner] = True
                if c.aggregation == "mean":
                    others = present.copy()
                    others[owner] = False
                    got = arrived & others
                    mask = torch.from_numpy(got).to(v.dtype)
                    total = (wt * mask) @ v[:, lo:hi]
                    value = estimate_over_sum(v[owner, lo:hi].clone(), w[owner], total, float((wt * mask).sum()),
                                              float(wt[torch.from_numpy(others)].sum()))
                else:
                    idx = np.flatnonzero(arrived)
                    value, _ = robust_combine(c.aggregation, v[torch.from_numpy(idx), lo:hi],
                                              [w[i] for i in idx], own=int(np.flatnonzero(idx == owner)[0]))
                back = present & (rng.random(n) >= c.chunk_loss)
                back[owner] = True
                result[torch.from_numpy(back), lo:hi] = value
        averaged[torch.from_numpy(rows)] = result

    def _apply(self, peers: np.ndarray, done: np.ndarray, averaged: torch.Tensor) -> None:
        """Each peer that finished the round (in a group or alone) applies what it got, as its strategy does."""
        c = self.config
        ok = peers[done]
        if ok.size == 0:
            return
        rows = torch.from_numpy(ok)
        got = averaged[torch.from_numpy(np.flatnonzero(done))]
        if c.mode == "diloco":
            dim = c.workload.dim
            delta = torch.zeros_like(self.x)
            delta[rows] = got[:, :dim]
            if got.shape[1] > dim:  # outer_params_every: adopt the group's θ_outer, then step from it
                self.outer.anchor[0][rows] = got[:, dim:]
            self._outer_step(rows, delta)
        elif c.mode == "gradients":
            dim = c.workload.dim
            self.x[rows] = self.x[rows] - c.workload.lr * got[:, :dim]
            if got.shape[1] > dim:
                self.x[rows] = got[:, dim:] - c.workload.lr * got[:, :dim]
        else:
            self.x[rows] = got

    def _outer_step(self, rows: torch.Tensor, delta: torch.Tensor) -> None:
        """The production outer step (`OuterState.apply`) on all rows at once; rows of peers that took no outer
        step this round (away, or failed) are put back: their θ_outer and momentum do not move."""
        anchor = self.outer.anchor[0]
        skip = torch.ones(anchor.shape[0], dtype=torch.bool)
        skip[rows] = False
        saved_anchor, saved_x = anchor[skip].clone(), self.x[skip].clone()
        momentum = self.outer.optimizer.state.get(anchor, {}).get("momentum_buffer")
        saved_momentum = momentum[skip].clone() if momentum is not None else None
        self.outer.apply([delta], [self.x])
        anchor[skip] = saved_anchor
        self.x[skip] = saved_x
        momentum = self.outer.optimizer.state[anchor]["momentum_buffer"]
        if saved_momentum is not None:
            momentum[skip] = saved_momentum
        else:
            momentum[skip] = 0.0

    # -- a run --

    def run(self) -> TrainingResult:
        """`config.rounds` rounds; the figures of the whole run."""
        for _ in range(self.config.rounds):
            self.step()
        return self.result()

    def result(self) -> TrainingResult:
        s, c = self.swarm, self.config
        # Per peer: up from 0 to its own clock (an away peer's clock stopped when it failed), less its time away.
        # Clocks of peers in different groups differ by up to a round at the end; each peer counts its own.
        end = float(np.median(self.clock))
        still_away = self.down_until > self.clock
        up_s = float((self.clock - self.down_s).sum())
        live_honest = np.flatnonzero(~still_away & s.honest)
        models = self.x[torch.from_numpy(live_honest)]
        final = s.loss(models) if live_honest.size else float("nan")
        return TrainingResult(
            system=f"moshpit-{c.mode}", config=_config_dict(c), rounds=self.round, sim_seconds=end,
            goodput=float(self.useful.sum() / up_s) if up_s > 0 else 0.0, useful_s=float(self.useful.sum()),
            up_s=up_s, lost_s=float(self.lost.sum()), wait_s=float(self.wait.sum()), comm_s=float(self.comm.sum()),
            stalls=self.stalls, failures=self.failures, final_loss=final, loss_floor=s.loss_floor(),
            initial_loss=self.initial_loss, bytes_per_peer=float(self.sent.mean()),
            final_spread=s.spread(models) if live_honest.size else float("nan"),
            mean_group_size=float(np.mean(self.group_sizes)) if self.group_sizes else 0.0,
            alone_fraction=self.alone / max(self.participations, 1), catch_ups=self.catch_ups, curve=self.curve)


# ---- the synchronous baseline -----------------------------------------------------------------------


class SyncTraining:
    """Synchronous data parallelism on the same swarm: every step everybody computes its minibatch, one
    all-reduce averages the gradients (`ring_allreduce_seconds`), one SGD step. A checkpoint every
    `checkpoint_every` steps (`checkpoint_s` each; None: Young's optimal interval sqrt(2 checkpoint_s MTBF) for the
    swarm's mean time between failures, so the baseline is not handicapped by a bad setting). A failure anywhere
    stalls the step until `timeout_s`, then the job restarts from the last checkpoint (`restart_s` plus the state
    download) without the failed peer,
    losing the steps since the checkpoint; a returning peer is added at the next checkpoint (no stall: generous
    to the baseline). Runs until it has taken `steps` steps or its clock passes `max_seconds`.

    The model is one vector (every peer holds the same); hostile peers are not modelled here.
    """

    def __init__(self, config: TrainingConfig, seed: int = 0, *, checkpoint_every: Optional[int] = None,
                 checkpoint_s: float = 5.0, timeout_s: float = 60.0, restart_s: float = 60.0):
        if (checkpoint_every is not None and checkpoint_every < 1) or not (
                checkpoint_s >= 0 and timeout_s >= 0 and restart_s >= 0):
            raise ValueError("need checkpoint_every >= 1 and non-negative checkpoint_s, timeout_s, restart_s")
        self.swarm = s = _Swarm(config, seed)
        if checkpoint_every is None:
            step_s = float((config.workload.batch / s.speed).max()) + ring_allreduce_seconds(
                config.model_params, config.peers, float(s.uplink.min()), float(s.downlink.min()), float(s.rtt.max()),
                config.bytes_per_value)
            rate = config.failure_rate_per_hour / HOUR * config.peers
            interval = math.sqrt(2 * max(checkpoint_s, 1e-3) / rate) if rate > 0 else 1e9
            checkpoint_every = int(min(max(1, round(interval / step_s)), 1 << 30))
        self.config = config
        self.checkpoint_every, self.checkpoint_s = checkpoint_every, checkpoint_s
        self.timeout_s, self.restart_s = timeout_s, restart_s

    def run(self, steps: int, max_seconds: float = math.inf) -> TrainingResult:
        """Run; the figures of the whole run. ValueError for steps < 1."""
        if steps < 1:
            raise ValueError("steps must be >= 1")
        s, c = self.swarm, self.config
        w = c.workload
        n = c.peers
        x = s.start.clone()
        ckpt_x, ckpt_step, ckpt_useful = x.clone(), 0, 0.0
        t = 0.0
        fail_at = s.next_failure(np.zeros(n))
        member = np.ones(n, dtype=bool)
        back_at = np.zeros(n)  # when an away peer is back (inf: gone)
        away_since = np.zeros(n)
        away = np.zeros(n)
        useful = lost = wait = comm = 0.0
        stalls = failures = 0
        step = 0
        sent = 0.0
        curve = [(0.0, s.loss(x[None]))]
        honest_rows = torch.from_numpy(np.flatnonzero(s.honest))
        while step < steps and t < max_seconds:
            peers = np.flatnonzero(member)
            if peers.size == 0:
                break
            compute = w.batch / s.speed[peers]
            ar = ring_allreduce_seconds(c.model_params, peers.size, float(s.uplink[peers].min()),
                                        float(s.downlink[peers].min()), float(s.rtt[peers].max()), c.bytes_per_value)
            step_s = float(compute.max()) + ar
            first = int(peers[np.argmin(fail_at[peers])])
            if fail_at[first] < t + step_s:
                # The step hangs until the timeout, then a restart from the checkpoint without the failed peer.
                failures += 1
                stalls += 1
                f = float(fail_at[first])
                useful_lost = useful - ckpt_useful
                useful = ckpt_useful
                lost += useful_lost + float(np.minimum(compute, f - t).clip(0).sum())
                reload = c.model_params * 4 / float(s.downlink[peers].min())
                pause = (f - t) + self.timeout_s + self.restart_s + reload
                wait += pause * (peers.size - 1) - float(np.minimum(compute, f - t).clip(0).sum())
                t = f + self.timeout_s + self.restart_s + reload
                member[first] = False
                away_since[first] = f
                gone = s.fail_rng.random() < c.never_return
                back_at[first] = math.inf if gone else f + s.fail_rng.exponential(c.rejoin_s)
                fail_at[first] = math.inf
                x, step = ckpt_x.clone(), ckpt_step
                curve.append((t, s.loss(x[None])))
                continue
            # The mean of the members' minibatch gradients, drawn directly (same distribution, O(dim)).
            center = s.centers[torch.from_numpy(peers)].mean(dim=0)
            noise = torch.randn(w.dim, generator=s.noise_gen).mul_(w.noise / math.sqrt(w.batch * peers.size))
            g = (x - center).mul_(s.curvature).add_(noise)
            x = x - w.lr * g
            step += 1
            t += step_s
            useful += float(compute.sum())
            wait += float((compute.max() - compute).sum())
            comm += ar * peers.size
            sent += 2 * (peers.size - 1) / peers.size * c.model_params * c.bytes_per_value * peers.size
            if step % self.checkpoint_every == 0:
                t += self.checkpoint_s
                wait += self.checkpoint_s * peers.size
                ckpt_x, ckpt_step, ckpt_useful = x.clone(), step, useful
                returning = np.flatnonzero(~member & (back_at <= t))
                if returning.size:
                    away[returning] += back_at[returning] - away_since[returning]
                    member[returning] = True
                    fail_at[returning] = s.next_failure(back_at[returning])
            if step % self.checkpoint_every == 0 or step % 25 == 0:
                curve.append((t, s.loss(x[None])))
        still = ~member
        away_total = away + np.where(still, t - np.minimum(away_since, t), 0.0)
        up_s = float(n * t - away_total.sum())
        final = s.loss(x[None])
        return TrainingResult(
            system="sync", config=dict(_config_dict(c), checkpoint_every=self.checkpoint_every,
                                       checkpoint_s=self.checkpoint_s, timeout_s=self.timeout_s,
                                       restart_s=self.restart_s),
            rounds=step, sim_seconds=t, goodput=useful / up_s if up_s > 0 else 0.0, useful_s=useful, up_s=up_s,
            lost_s=lost, wait_s=wait, comm_s=comm, stalls=stalls, failures=failures, final_loss=final,
            loss_floor=s.loss_floor(), initial_loss=curve[0][1], bytes_per_peer=sent / n, curve=curve)


def _config_dict(config: TrainingConfig) -> dict:
    out = asdict(config)
    out["workload"] = asdict(config.workload)
    return out


def run_training(config: TrainingConfig, seed: int = 0) -> TrainingResult:
    """One Moshpit training run (`MoshpitTraining(config, seed).run()`). ValueError for a bad config."""
    return MoshpitTraining(config, seed).run()


def run_sync(config: TrainingConfig, seed: int = 0, *, seconds: Optional[float] = None, steps: Optional[int] = None,
             **options: float) -> TrainingResult:
    """The synchronous baseline for `seconds` of simulated time (or `steps` steps). ValueError for a bad config,
    or when neither limit is given."""
    if seconds is None and steps is None:
        raise ValueError("give seconds or steps")
    return SyncTraining(config, seed, **options).run(steps if steps is not None else 1 << 62,
                                                     seconds if seconds is not None else math.inf)
