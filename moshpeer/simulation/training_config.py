"""The training level's inputs: the run's configuration (`TrainingConfig`) and what it trains (`Workload`: the
problem's kind and knobs; the problems themselves are in problems.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from moshpeer.averaging import grid
from moshpeer.averaging.aggregation import AGGREGATIONS
from moshpeer.peer.checkpoint.staleness import DEFAULT_MAX_STALENESS
from moshpeer.peer.optimizer.progress_cadence import ProgressCadence
from moshpeer.peer.strategies.diloco import DEFAULT_OUTER_PARAMS_EVERY
from moshpeer.peer.strategies.diloco_outer import parse_outer_optimizer
from moshpeer.simulation.time_model import INITIAL_WINDOW_SEGMENTS, MAX_INITIAL_WINDOW_SEGMENTS

MODES = ("gradients", "parameters", "diloco")
KINDS = ("quadratic", "mlp")
# Per kind: the inner SGD learning rate and the noise (quadratic: of a gradient; mlp: of a label) when not given.
DEFAULT_LR = {"quadratic": 0.003, "mlp": 0.1}
DEFAULT_NOISE = {"quadratic": 1.0, "mlp": 0.1}
PARTITIONS = ("bandwidth", "equal")


@dataclass
class Workload:
    """What the swarm trains (problems.py): `kind` quadratic (convex; `dim` values, `condition`) or mlp (a tanh
    network learning a teacher; `dim` inputs, `hidden` units). `heterogeneity` makes the shards non-IID, `noise`
    is a gradient's (quadratic) or a label's (mlp) noise; `lr` and `noise` default per kind (DEFAULT_LR,
    DEFAULT_NOISE). `check()` raises ValueError naming the first bad field."""

    kind: str = "quadratic"
    dim: int = 256
    condition: float = 10.0
    hidden: int = 32
    heterogeneity: float = 0.3
    noise: Optional[float] = None
    batch: int = 32
    lr: Optional[float] = None

    def __post_init__(self) -> None:
        if self.lr is None:
            self.lr = DEFAULT_LR.get(self.kind, DEFAULT_LR["quadratic"])
        if self.noise is None:
            self.noise = DEFAULT_NOISE.get(self.kind, DEFAULT_NOISE["quadratic"])

    def check(self) -> "Workload":
        if self.kind not in KINDS:
            raise ValueError(f"workload kind must be one of {KINDS}, got {self.kind!r}")
        if self.dim < 1:
            raise ValueError(f"dim must be >= 1, got {self.dim}")
        if self.hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {self.hidden}")
        if not self.condition >= 1:
            raise ValueError(f"condition must be >= 1, got {self.condition}")
        for name in ("heterogeneity", "noise"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if not 0 < self.lr <= 1:
            raise ValueError(f"lr must be in (0, 1], got {self.lr}")
        return self

    def parameters(self) -> int:
        """Values of one model of this workload (the vector the peers average)."""
        return self.dim if self.kind == "quadratic" else self.hidden * self.dim + 2 * self.hidden + 1


@dataclass
class TrainingConfig:
    """One simulated training run. `check()` raises ValueError naming the first bad field.

    Links are per peer: the value given, times a lognormal factor of sd `link_spread` (0 = all equal); compute
    speeds likewise with `speed_spread`. Times in seconds, bandwidths in bytes/s, failure rate per peer per hour.

    :param model_params: values of the model the time model moves (the workload's parameters are what the math
        trains: a small stand-in; bytes and round times are those of a model of `model_params` values)
    :param bytes_per_value: wire bytes per value (4 = fp32, 2 = fp16, 1 = int8)
    :param inner_steps: H (diloco); gradients and parameters rounds are one step
    :param outer_params_every: diloco: every K-th round the group also averages θ_outer and its members adopt the
        average before the outer step (production `DiLoCoStrategy(outer_params_every=K)`, default 4, and its
        `carries_outer_params`); 0 = never, as `DiLoCoStrategy` did before it had them
    :param hostile_replay: R > 0: a hostile peer sends the contribution it computed R of its rounds earlier
        (stale work), times `hostile_scale`; 0 = its current one
    :param quorum: diloco: Q > 0 ends a peer's epoch early, after the inner step that passes the moment trainers
        holding Q of the swarm's compute rate are done (production `DiLoCoStrategy(quorum=Q)` and its
        `round_timing.quorum_time`); the round weighs each Δ by its samples; 0 = every peer takes H steps
    :param initial_window: TCP's initial window on every peer's routes, in segments (Linux's 10, or what an operator
        set with `ip route ... initcwnd`): where a round's fresh connections start their slow start
    :param matchmaking_window_s: how long the first ready member of a group waits for the others
    :param straggler_hold: a group stays open longer for trainers still computing the round's epoch, as
        production's `RoundTiming.straggler_hold` decides from their records; False = the plain window
    :param round_timeout_s: cap of the adaptive round deadline (`DeadlineLearner`, floor `min_round_timeout_s`)
    :param rejoin_s: mean time a failed peer stays away (exponential)
    :param never_return: probability that a failed peer never comes back
    :param resume_fraction: probability that a failed peer keeps a checkpoint of the epoch it failed in (a
        preemption it checkpointed on); the others lose their state (rejoin.py)
    :param max_staleness: a rejoining peer resumes from its checkpoint while the swarm is at most this many epochs
        ahead, else downloads (production `moshpeer join --max-staleness`, `checkpoint.staleness.start_decision`)
    :param chunk_loss: probability that one chunk on one link is lost (both phases)
    :param loss_budget: production's fixed loss budget P (`LossBudget.fixed(P)`): a receiver that lost chunks stops
        once (1 - P) of them arrived and arrivals stalled (round_losses.py); 0 = it waits for the round's deadline
        (phase-aware budgets are not modelled)
    :param chunk_numel: values per chunk of the workload vector
    :param progress_budget_bps: the byte budget of production's progress cadence (`ProgressCadence.budget_bps`),
        whose reads and publications in the DHT the control plane models (control_plane.py); 0 = leave the
        control plane out
    """

    peers: int = 1000
    mode: str = "diloco"
    rounds: int = 200
    inner_steps: int = 50
    outer_optimizer: str = "nesterov:lr=0.7,momentum=0.9"
    outer_params_every: int = DEFAULT_OUTER_PARAMS_EVERY
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
    initial_window: int = INITIAL_WINDOW_SEGMENTS
    link_spread: float = 0.0
    speed: float = 16.0
    speed_spread: float = 0.0
    failure_rate_per_hour: float = 0.0
    rejoin_s: float = 600.0
    never_return: float = 0.0
    resume_fraction: float = 0.0
    max_staleness: int = DEFAULT_MAX_STALENESS
    chunk_loss: float = 0.0
    loss_budget: float = 0.0
    chunk_numel: int = 1024
    hostile_fraction: float = 0.0
    hostile_scale: float = -100.0
    hostile_weight: float = 1.0
    hostile_replay: int = 0
    quorum: float = 0.0
    matchmaking_window_s: float = 30.0
    straggler_hold: bool = True
    round_timeout_s: float = 120.0
    min_round_timeout_s: float = 5.0
    progress_budget_bps: float = ProgressCadence().budget_bps
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
        need(1 <= self.initial_window <= MAX_INITIAL_WINDOW_SEGMENTS,
             f"initial_window must be 1 to {MAX_INITIAL_WINDOW_SEGMENTS} segments, got {self.initial_window}")
        for name in ("rtt_s", "link_spread", "speed_spread", "failure_rate_per_hour"):
            value = getattr(self, name)
            need(0 <= value < math.inf, f"{name} must be finite and >= 0, got {value}")
        for name in ("never_return", "chunk_loss", "loss_budget"):
            value = getattr(self, name)
            need(0 <= value < 1, f"{name} must be in [0, 1), got {value}")
        need(0 <= self.resume_fraction <= 1, f"resume_fraction must be in [0, 1], got {self.resume_fraction}")
        need(self.max_staleness >= 0, f"max_staleness must be >= 0, got {self.max_staleness}")
        need(0 <= self.hostile_fraction < 1, f"hostile_fraction must be in [0, 1), got {self.hostile_fraction}")
        need(math.isfinite(self.hostile_scale), f"hostile_scale must be finite, got {self.hostile_scale}")
        need(0 < self.hostile_weight < math.inf, f"hostile_weight must be positive, got {self.hostile_weight}")
        need(0 <= self.quorum <= 1, f"quorum must be in [0, 1], got {self.quorum}")
        need(self.quorum == 0 or self.mode == "diloco", "quorum is a diloco setting (mode diloco)")
        need(self.hostile_replay >= 0, f"hostile_replay must be >= 0, got {self.hostile_replay}")
        need(0 <= self.progress_budget_bps < math.inf,
             f"progress_budget_bps must be finite and >= 0, got {self.progress_budget_bps}")
        need(self.chunk_numel >= 1, f"chunk_numel must be >= 1, got {self.chunk_numel}")
        self.workload.check()
        return self

    def resolved_key_bits(self) -> int:
        return grid.default_key_bits(self.peers, self.group_size) if self.key_bits is None else self.key_bits

    def steps_per_round(self) -> int:
        return self.inner_steps if self.mode == "diloco" else 1


def config_dict(config: TrainingConfig) -> dict:
    """The config as a JSON-ready dict (a result's `config`)."""
    out = asdict(config)
    out["workload"] = asdict(config.workload)
    return out
