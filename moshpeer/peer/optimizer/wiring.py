"""How a `CollaborativeOptimizer` is put together from its parts, in two steps (collaborative.py calls both).

    prepare(optimizer, settings)        check the settings and derive what the optimizer owns, before anything
                                        starts: its parameters, the strategy (unbound), the averager's options,
                                        the epoch counters (`Prepared`)
    assemble(host, prepared, settings)  join the swarm (`SwarmLink`), bind the strategy, start the
                                        `MoshpitAverager`, the `StateExchange` (and its state server), the
                                        `EpochLoop` and, on an aux peer, the `AuxPeer` (`Parts`)

`Settings` is the constructor's keyword arguments, by name. Between the two steps the optimizer takes on what
`prepare` returned (and its lock and wrapped optimizer), because the parts read those from their host while
they are built: a strategy's `bind` reads `params` and `error_feedback`, the epoch loop and the state exchange
keep `counters` and `lock`. The host is the optimizer (`OptimizerHost`: `StrategyHost`, `EpochHost` and
`StateHost` together). What spans several parts (catching up, loading a checkpoint, shutting down) is a method
of `Parts`; `delegate` makes a part's method the optimizer's.

Failure: `prepare` raises `UserError` (one line) for settings that cannot work, with nothing started;
`assemble` raises `UserError` when the swarm cannot be reached as configured (`link_to_swarm`) and lets the
averager's and the state server's start errors through.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Union

import torch

from moshpeer.averaging.averager import MoshpitAverager
from moshpeer.averaging.loss_budget import DEFAULT_WINDOW, LossBudget, parse_loss_budget
from moshpeer.dht import Admission, SwarmDHT, validate_run_id
from moshpeer.dht.local_address import announced_host
from moshpeer.errors import UserError
from moshpeer.peer.optimizer.aux_peer import AuxPeer
from moshpeer.peer.optimizer.dropcompute import BudgetSetting
from moshpeer.peer.optimizer.counters import EpochCounters
from moshpeer.peer.optimizer.epoch_loop import EpochHost, EpochLoop
from moshpeer.peer.optimizer.round_timing import RoundTiming
from moshpeer.peer.optimizer.settings import averager_options, checked_params
from moshpeer.peer.optimizer.state_exchange import StateExchange, StateHost
from moshpeer.peer.optimizer.swarm_link import SwarmLink, link_to_swarm
from moshpeer.peer.state.sync import DownloadedState
from moshpeer.peer.strategies import make_strategy
from moshpeer.peer.strategies.base import AveragingStrategy, StrategyHost

logger = logging.getLogger(__name__)


class OptimizerHost(StrategyHost, EpochHost, StateHost, Protocol):
    """What the parts call back into: the optimizer, holding `Prepared`'s fields and `lock` before `assemble`."""

    averager: MoshpitAverager  # the round timing and the clipped sample count ask it (set from `Parts`)


@dataclass(frozen=True)
class Settings:
    """`CollaborativeOptimizer`'s keyword arguments (their defaults and meaning: its signature and docstring)."""

    run_id: str
    target_batch_size: int
    batch_size_per_step: Optional[int]
    daemon: Any
    dht: Optional[SwarmDHT]
    initial_peers: Sequence[str]
    host: str  # the address this peer listens on
    averaging: Union[str, AveragingStrategy]
    compression: str
    group_size: int
    min_group_size: int
    compute_budget: BudgetSetting
    error_feedback: bool
    role: str
    matchmaking_time: float
    round_timeout: float
    max_epoch_lag: int
    serve_state: bool
    state_download_timeout: float
    state_bytes_per_second: Optional[float]
    progress_refresh: float
    show_progress: bool
    should_stop: Optional[Callable[[], bool]]
    model: Optional[torch.nn.Module]
    averager_kwargs: Optional[Dict[str, Any]]
    loss_budget: Any
    phase_threshold: float
    phase_window: Optional[int]
    swarm_key: Optional[bytes]
    allow_peers: Optional[Sequence[str]]
    assigned_data: bool

    @classmethod
    def of(cls, arguments: Dict[str, Any]) -> "Settings":
        """The settings among the constructor's `locals()` (read first thing, so they are its arguments);
        TypeError when an argument has no field here or a field no argument, so the two cannot drift apart."""
        names = {f.name for f in fields(cls)}
        unmatched = names.symmetric_difference(arguments.keys() - {"self", "optimizer", "__class__"})
        if unmatched:
            raise TypeError(f"Settings and CollaborativeOptimizer's arguments differ: {sorted(unmatched)}")
        return cls(**{name: arguments[name] for name in names})


@dataclass(frozen=True)
class Prepared:
    """What `prepare` derived from the settings; nothing has started yet."""

    params: List[torch.nn.Parameter]  # the wrapped optimizer's, in group order
    strategy: AveragingStrategy  # not bound yet
    run_id: str
    loss_budget: LossBudget  # the setting (`parse_loss_budget`)
    averager_options: Dict[str, Any]  # further `MoshpitAverager` arguments (settings.averager_options)
    counters: EpochCounters
    admission: Optional[Admission]  # a private run's policy, or None

    @property
    def error_feedback(self) -> Any:
        """The EF21M state the averager keeps, or None."""
        return self.averager_options.get("error_feedback")


def prepare(optimizer: torch.optim.Optimizer, s: Settings) -> Prepared:
    """Check the settings (UserError, one line) and derive what the optimizer owns; see the module docstring."""
    params = checked_params(optimizer, role=s.role, target_batch_size=s.target_batch_size,
                            batch_size_per_step=s.batch_size_per_step, group_size=s.group_size)
    strategy, run_id = make_strategy(s.averaging), validate_run_id(s.run_id)
    if s.assigned_data and (strategy.name != "gradients" or s.error_feedback or not s.batch_size_per_step):
        raise UserError("assigned data (spot checks) needs averaging='gradients' without error feedback, and "
                        "batch_size_per_step")
    budget_setting = parse_loss_budget(s.loss_budget, eta=s.phase_threshold,
                                       window=s.phase_window or DEFAULT_WINDOW)
    options = averager_options(optimizer, averaging=strategy.name, role=s.role, compression=s.compression,
                               error_feedback=s.error_feedback, loss_budget=budget_setting,
                               averager_kwargs=s.averager_kwargs)
    # fp32 whatever the parameters' dtype: summed in bf16, 256 + 1 is 256.
    counters = EpochCounters([torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                              for p in params])
    private = s.swarm_key is not None or s.allow_peers is not None
    admission = Admission(s.swarm_key, s.allow_peers) if private else None
    return Prepared(params, strategy, run_id, budget_setting, options, counters, admission)


@dataclass(frozen=True)
class Parts:
    """The running parts `assemble` started; the optimizer keeps each as its attribute of the same name."""

    timing: RoundTiming
    swarm: SwarmLink
    averager: MoshpitAverager
    exchange: StateExchange
    epochs: EpochLoop
    aux: Optional[AuxPeer]  # an aux peer's rounds (None on a trainer)

    def begin(self) -> None:
        """Announce the new optimizer (its state offer, its progress) and start the first epoch's budget now,
        not before the setup."""
        self.exchange.advertise(force=True)
        self.epochs.report_progress(force=True)
        self.timing.begin_epoch()

    def catch_up(self, min_epoch: int = 0, max_epoch: Optional[int] = None,
                 offer_wait_s: Optional[float] = None) -> Optional[DownloadedState]:
        """Settle any round in flight, then download the most advanced donor's state up to `max_epoch` (default:
        the swarm epoch this peer confirms, plus one) and adopt it; None (logged) if no donor delivered, or none
        in range was on offer within `offer_wait_s` (default: the whole download timeout)."""
        self.epochs.settle()
        if max_epoch is None:
            max_epoch = self.swarm.progress.refresh_now(timeout=2.0).global_epoch + 1
        downloaded = self.exchange.download(min_epoch, max_epoch=max_epoch, offer_wait_s=offer_wait_s)
        if downloaded is not None:
            self.epochs.report_progress(force=True)
        return downloaded

    def load_checkpoint_state(self, state: Dict[str, Any]) -> None:
        """Continue exactly from a `checkpoint_state()` (the model's parameters are the caller's to load) and
        announce it; ValueError when its gradient accumulators do not match this model (nothing changed then)."""
        self.exchange.load_checkpoint_state(state)
        self.epochs.report_progress(force=True)
        self.exchange.advertise(force=True)

    def shutdown(self) -> None:
        """Stop the state server, the averager, the progress thread and (if it is ours) the DHT. Idempotent; a
        failing stop is logged (debug) and the others still run."""
        self.exchange.shutdown()
        try:
            self.averager.shutdown()
        except Exception:
            logger.debug("shutting down the averager failed", exc_info=True)
        self.swarm.close()


def assemble(host: OptimizerHost, prepared: Prepared, s: Settings) -> Parts:
    """Start the parts for `host` (which holds `prepared`'s fields and its lock already), in the order the module
    docstring gives."""
    run_id, strategy, round_timeout = prepared.run_id, prepared.strategy, s.round_timeout
    # Both lambdas look up the host's averager when called (it has one by then: the optimizer keeps `Parts`).
    timing = RoundTiming(s.matchmaking_time, s.compute_budget, s.group_size, round_timeout=round_timeout,
                         fastest_assembly=lambda size: host.averager.fastest_assembly_s(size))
    swarm = link_to_swarm(run_id, s.role, int(s.target_batch_size), daemon=s.daemon, dht=s.dht,
                          initial_peers=s.initial_peers, host=s.host, progress_refresh=s.progress_refresh,
                          admission=prepared.admission)
    strategy.bind(host)
    # Listeners on every interface announce the address the machine reaches the swarm from, asked anew (it may
    # change mid-run: dht/local_address.py); on one address, that address.
    announce = announced_host(s.host, swarm.dht)
    averager = MoshpitAverager(
        [strategy.buffer], dht=swarm.dht, run_id=f"{run_id}.{strategy.name}", target_group_size=s.group_size,
        min_group_size=s.min_group_size, compression=s.compression, matchmaking_time=s.matchmaking_time,
        round_timeout=round_timeout, host=s.host, announce_host=announce, **prepared.averager_options)
    if averager.aggregation == "clipped":  # samples whose gradients are weighed at zero do not count
        swarm.progress.count_samples_except(lambda: host.averager.suspects.suspects)
    # Nobody can dial a peer behind a NAT (its DHT's `behind_nat`): it downloads state but offers none (an offer
    # others cannot reach made every catch-up from it fail with "Network is unreachable", measured in netlab).
    serve = s.serve_state and not getattr(swarm.dht, "behind_nat", False)
    exchange = StateExchange(host, dht=swarm.dht, run_id=run_id, role=s.role, serve=serve, address=s.host,
                             announce_host=announce,
                             download_timeout=s.state_download_timeout, show_progress=s.show_progress,
                             bytes_per_second=s.state_bytes_per_second)
    epochs = EpochLoop(host, target_batch_size=int(s.target_batch_size), group_size=s.group_size,
                       max_epoch_lag=s.max_epoch_lag, loss_budget=prepared.loss_budget,
                       batch_size_per_step=s.batch_size_per_step, declares_work=s.assigned_data)
    aux = AuxPeer(epochs, round_timeout=round_timeout, should_stop=host.should_stop) if s.role == "aux" else None
    return Parts(timing, swarm, averager, exchange, epochs, aux)


def delegate(part: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """An optimizer method that calls the same-named method of its attribute `part` (looked up at each call);
    its name, signature and docstring (which says what it raises) are `method`'s."""
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, part), method.__name__)(*args, **kwargs)
    return call
