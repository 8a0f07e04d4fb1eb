"""`CollaborativeOptimizer`: a torch optimizer whose steps are taken by a whole swarm (docs/training.md).

    opt = CollaborativeOptimizer(torch.optim.AdamW(model.parameters()), run_id="my-run", target_batch_size=4096,
                                 batch_size_per_step=32, initial_peers=[...], averaging=DiLoCoStrategy(inner_steps=50))
    for batch in data:
        loss_fn(model, batch).backward()
        opt.step(); opt.zero_grad()          # local accumulation; a swarm step when the epoch is over

It is a `torch.optim.Optimizer` whose `param_groups` and `state` are the wrapped optimizer's (the same objects,
also after `load_state_dict`), so LR schedulers and `transformers.Trainer(optimizers=(opt, sched))` work. It
wires its parts together: `EpochLoop` (epochs, rounds, catch-up) or, on an aux peer, `AuxPeer`; the averaging
`AveragingStrategy` (an instance carries its options); `StateExchange` (state dicts, checkpoints, donating and
downloading state); `RoundTiming`; `SwarmLink` (the DHT record and the swarm's progress); `MoshpitAverager`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, ContextManager, Dict, Optional, Sequence, Union

import torch

from moshpeer.averaging.averager import MoshpitAverager
from moshpeer.averaging.loss_budget import DEFAULT_WINDOW, parse_loss_budget
from moshpeer.dht import Admission, SwarmDHT, validate_run_id
from moshpeer.errors import UserError
from moshpeer.peer.optimizer.aux_peer import AuxPeer
from moshpeer.peer.optimizer.dropcompute import BudgetSetting
from moshpeer.peer.optimizer.epoch_loop import EpochCounters, EpochLoop
from moshpeer.peer.optimizer.round_timing import RoundTiming
from moshpeer.peer.optimizer.rounds import CollaborativeRound
from moshpeer.peer.optimizer.settings import averager_options, checked_params
from moshpeer.peer.optimizer.state_exchange import StateExchange
from moshpeer.peer.optimizer.swarm_link import link_to_swarm
from moshpeer.peer.state.sync import DownloadedState
from moshpeer.peer.strategies import make_strategy
from moshpeer.peer.strategies.base import AveragingStrategy

logger = logging.getLogger(__name__)


class CollaborativeOptimizer(torch.optim.Optimizer):
    """Wraps a local optimizer so that a swarm of peers trains one model; see the module docstring.

    :param optimizer, model: the local optimizer; the model (optional: downloaded states then carry its buffers)
    :param run_id, target_batch_size: the run; samples the swarm gathers per epoch. batch_size_per_step: samples
        behind a `step()` without `batch_size=`
    :param daemon / dht / initial_peers: a started `PeerDaemon`, a running `SwarmDHT`, or multiaddrs for a DHT
        node of this optimizer's own; host: the address this peer's data plane and state server listen on
    :param averaging: an `AveragingStrategy` instance (with its options), or a name in `strategies.STRATEGIES`
    :param compression, group_size, min_group_size, matchmaking_time, round_timeout, averager_kwargs: the
        rounds' codec, group sizes, deadlines (seconds) and further `MoshpitAverager` arguments
    :param compute_budget: DropCompute threshold per epoch (None, seconds, "auto"); max_epoch_lag: download
        state when the swarm is further ahead; role: "trainer" or "aux" (weight 0, no compute)
    :param error_feedback: EF21M state around a sparsifying codec; loss_budget, phase_threshold, phase_window:
        the rounds' DBLP loss budget; swarm_key, allow_peers: a private run (docs/security.md)
    :param serve_state, state_download_timeout, state_bytes_per_second, show_progress: donating and downloading
        state; should_stop: polled while a round is in flight (True abandons it)

    Bad settings raise `UserError` with one line. A round that fails or finds no group is logged and the epoch
    ends with this peer's own step (its record says why).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, run_id: str, target_batch_size: int,
                 batch_size_per_step: Optional[int] = None, daemon: Any = None, dht: Optional[SwarmDHT] = None,
                 initial_peers: Sequence[str] = (), host: str = "127.0.0.1",
                 averaging: Union[str, AveragingStrategy] = "gradients", compression: str = "none",
                 group_size: int = 4, min_group_size: int = 2, compute_budget: BudgetSetting = None,
                 error_feedback: bool = False, role: str = "trainer", matchmaking_time: float = 1.0,
                 round_timeout: float = 10.0, max_epoch_lag: int = 1, serve_state: bool = True,
                 state_download_timeout: float = 60.0, state_bytes_per_second: Optional[float] = None,
                 progress_refresh: float = 0.3, show_progress: bool = False,
                 should_stop: Optional[Callable[[], bool]] = None, model: Optional[torch.nn.Module] = None,
                 averager_kwargs: Optional[Dict[str, Any]] = None, loss_budget: Any = None,
                 phase_threshold: float = 0.5, phase_window: Optional[int] = None,
                 swarm_key: Optional[bytes] = None, allow_peers: Optional[Sequence[str]] = None):
        self.params = checked_params(optimizer, role=role, target_batch_size=target_batch_size,
                                     batch_size_per_step=batch_size_per_step, group_size=group_size)
        self.strategy, self.role, self.model = make_strategy(averaging), role, model
        self.run_id, self.averaging = validate_run_id(run_id), self.strategy.name
        budget_setting = parse_loss_budget(loss_budget, eta=phase_threshold, window=phase_window or DEFAULT_WINDOW)
        options = averager_options(optimizer, averaging=self.averaging, role=role, compression=compression,
                                   error_feedback=error_feedback, loss_budget=budget_setting,
                                   averager_kwargs=averager_kwargs)
        self.error_feedback = options.get("error_feedback")
        # torch's own setup (hooks, step patching) over the wrapped optimizer's groups; then its very objects,
        # re-shared whenever the wrapped optimizer loads a state dict (which replaces them).
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.inner = optimizer
        self._share_inner_state(optimizer)
        optimizer.register_load_state_dict_post_hook(self._share_inner_state)
        self.batch_size_per_step, self.compression, self.group_size = batch_size_per_step, compression, group_size
        self.max_epoch_lag = max_epoch_lag
        self.should_stop: Callable[[], bool] = should_stop or (lambda: False)
        self.lock = threading.RLock()  # held while the training state changes (the state server reads under it)
        # fp32 whatever the parameters' dtype: summed in bf16, 256 + 1 is 256.
        self.counters = EpochCounters([torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                                       for p in self.params])
        self.timing = RoundTiming(matchmaking_time, compute_budget, group_size, round_timeout=round_timeout,
                                  fastest_assembly=lambda size: self.averager.fastest_assembly_s(size))
        admission = Admission(swarm_key, allow_peers) if swarm_key is not None or allow_peers is not None else None
        self.swarm = link_to_swarm(run_id, role, int(target_batch_size), daemon=daemon, dht=dht,
                                   initial_peers=initial_peers, host=host, progress_refresh=progress_refresh,
                                   admission=admission)
        self.dht, self.progress, self.peer_id = self.swarm.dht, self.swarm.progress, self.swarm.dht.identity.peer_id
        self.strategy.bind(self)
        self.averager = MoshpitAverager(
            [self.strategy.buffer], dht=self.dht, run_id=f"{run_id}.{self.averaging}", target_group_size=group_size,
            min_group_size=min_group_size, compression=compression, matchmaking_time=matchmaking_time,
            round_timeout=round_timeout, host=host, **options)
        if self.averager.aggregation == "clipped":  # samples whose gradients are weighed at zero do not count
            self.progress.count_samples_except(lambda: self.averager.suspects.suspects)
        self.exchange = StateExchange(self, dht=self.dht, run_id=run_id, role=role, serve=serve_state, address=host,
                                      download_timeout=state_download_timeout, show_progress=show_progress,
                                      bytes_per_second=state_bytes_per_second)
        self.epochs = EpochLoop(self, target_batch_size=int(target_batch_size), group_size=group_size,
                                max_epoch_lag=max_epoch_lag, loss_budget=budget_setting,
                                batch_size_per_step=batch_size_per_step)
        self.aux = AuxPeer(self.epochs, round_timeout=round_timeout, should_stop=self.should_stop) \
            if role == "aux" else None
        self._stepper = self.aux or self.epochs  # what step() does: a trainer's epochs, or an aux's rounds
        self.ended_round: Optional[CollaborativeRound] = None  # what the last step() ended (None: no epoch)
        self.exchange.advertise(force=True)
        self.epochs.report_progress(force=True)
        self.timing.begin_epoch()  # the first epoch's budget starts now, not before the setup above

    def __repr__(self) -> str:
        return f"CollaborativeOptimizer({self.inner!r}, run_id={self.run_id!r}, averaging={self.averaging!r})"

    def _share_inner_state(self, inner: torch.optim.Optimizer) -> None:
        self.param_groups, self.state = inner.param_groups, inner.state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, batch_size: Optional[int] = None) -> Any:
        """Account for the gradients in `.grad` (computed from `batch_size` samples); when that ends the epoch,
        the swarm step happens inside and `ended_round` holds the epoch's record (else None). On an aux peer:
        wait for one round (`wait_and_average`). Returns the closure's loss, if any. UserError without a batch
        size (neither `batch_size` nor `batch_size_per_step`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.ended_round = self._stepper.step(batch_size)
        return loss

    def wait_and_average(self, timeout: Optional[float] = None) -> Optional[CollaborativeRound]:
        """Aux peers: join the swarm's next round with weight 0 (aux_peer.py); the round's record, or None if no
        group formed by `timeout`. UserError on a trainer (trainers call step())."""
        if self.aux is None:
            raise UserError("wait_and_average is for aux peers; trainers call step()")
        self.ended_round = self.aux.wait_and_average(timeout)
        return self.ended_round

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def inner_step(self) -> None:
        """One step of the wrapped optimizer on the current `.grad`s (strategies call it), counted."""
        self.inner.step()
        self.counters.steps += 1

    def settle(self) -> Optional[CollaborativeRound]:
        """Resolve an overlapping strategy's round still in flight (epoch_loop.py); None if none runs."""
        return self.epochs.settle()

    def wait_for_peers(self, min_trainers: int, timeout: float) -> int:
        """Wait (bounded by `timeout`) until `min_trainers` trainers are visible; returns how many are."""
        return self.epochs.wait_for_peers(min_trainers, timeout)

    def catch_up(self, min_epoch: int = 0) -> Optional[DownloadedState]:
        """Settle any round in flight, then download the most advanced donor's state (no further than the swarm
        epoch this peer confirms, plus one) and adopt it; None (logged) if no donor delivered."""
        self.epochs.settle()
        swarm_epoch = self.progress.refresh_now(timeout=2.0).global_epoch
        downloaded = self.exchange.download(min_epoch, max_epoch=swarm_epoch + 1)
        if downloaded is not None:
            self.epochs.report_progress(force=True)
        return downloaded

    # State: state_exchange.py does the work (and documents what each raises when a state does not fit).
    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict plus epoch, steps, error-feedback and strategy state."""
        return self.exchange.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Inverse of `state_dict` (a plain torch optimizer state dict loads too); raises what torch raises."""
        self.exchange.load_state_dict(state_dict)

    def collaborative_state(self) -> Dict[str, Any]:
        """Everything a newcomer downloads (parameters, optimizer, epoch, strategy state), as copies."""
        return self.exchange.collaborative_state()

    def load_collaborative_state(self, state: Dict[str, Any]) -> None:
        """Adopt a `collaborative_state()`; ValueError, with nothing changed, when it does not fit."""
        self.exchange.load_collaborative_state(state)

    def checkpoint_state(self) -> Dict[str, Any]:
        """This peer's own training state for a local checkpoint (live tensors: snapshot them)."""
        return self.exchange.checkpoint_state()

    def load_checkpoint_state(self, state: Dict[str, Any]) -> None:
        """Continue from a `checkpoint_state()`; ValueError when it does not fit this model."""
        self.exchange.load_checkpoint_state(state)
        self.epochs.report_progress(force=True)
        self.exchange.advertise(force=True)

    # What the parts ask of their host (StrategyHost, EpochHost, StateHost).
    def restart_epoch(self) -> None:
        self.epochs.restart_epoch()

    def advertise(self, force: bool = False) -> None:
        self.exchange.advertise(force)

    def averaging_paused(self) -> ContextManager:
        return self.averager.get_tensors()

    grad_sums = property(lambda self: self.counters.grad_sums)
    local_epoch = property(lambda self: self.counters.epoch, doc="this peer's collaborative epoch")
    local_steps = property(lambda self: self.counters.steps, doc="inner optimizer steps taken")
    samples_accumulated = property(lambda self: self.counters.samples, doc="samples of this epoch")
    total_samples = property(lambda self: self.counters.total_samples, doc="samples this peer ever computed")
    dropped_samples = property(lambda self: self.counters.dropped_samples, doc="left out of the swarm's average")
    rounds = property(lambda self: self.epochs.rounds, doc="the recent epochs' records, oldest first (bounded)")
    downloads = property(lambda self: self.exchange.downloads, doc="the states this peer downloaded")
    samples_per_second = property(lambda self: self.epochs.speed.rate(), doc="this peer's recent throughput")
    loss_budget = property(lambda self: self.averager.loss_budget, doc="the averager's `LossBudget`")

    def shutdown(self, close_averager: bool = True) -> None:
        """Stop the state server, the averager, the progress thread and (if it is ours) the DHT. Idempotent; a
        failing stop is logged (debug) and the others still run. `close_averager=False` leaves the averager's
        loop to die with the process (stopping it while hivemind's P2P replica has pending tasks prints
        asyncio tracebacks, which a process about to exit can do without)."""
        self.exchange.shutdown()
        if close_averager:
            try:
                self.averager.shutdown()
            except Exception:
                logger.debug("shutting down the averager failed", exc_info=True)
        self.swarm.close()
