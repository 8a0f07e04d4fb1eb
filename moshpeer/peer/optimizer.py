"""`CollaborativeOptimizer`: a torch optimizer whose steps are taken by a whole swarm.

    opt = CollaborativeOptimizer(torch.optim.Adam(model.parameters()), run_id="my-run",
                                 target_batch_size=4096, batch_size_per_step=32,
                                 initial_peers=["/ip4/.../p2p/Qm..."])
    for batch in data:
        loss = loss_fn(model, batch); loss.backward()
        opt.step(); opt.zero_grad()          # local accumulation; a swarm step when the swarm is ready

It *is* a `torch.optim.Optimizer` (its `param_groups` and `state` are the wrapped optimizer's), so LR
schedulers and `transformers.Trainer(optimizers=(opt, scheduler))` work unchanged.

Three concepts, each in one place:
- Epochs and progress (this module): every peer publishes (epoch, samples) in its signed DHT record.
  The epoch ends when this peer has computed its share of `target_batch_size` (target / live
  trainers), or the swarm reports the target reached, or the DropCompute budget is spent
  (round_timing.py). A peer behind the swarm by more than `max_epoch_lag` epochs downloads a donor's
  state instead of averaging stale gradients. A peer that finds no group steps on its own data:
  training never stops for lack of peers.
- The averaging mode (strategies/): what a round averages and how its average is applied:
  "gradients", "parameters", or any `AveragingStrategy` instance.
- Rounds behind a future: `MoshpitAverager.step(wait=False)` returns a future of one `RoundResult`,
  awaited within its own deadline (round_timing.py) and kept unchanged in the epoch's `CollaborativeRound`.

State (state_dict, catch-up, donating, checkpoints): optimizer_state.py; aux peers: aux_rounds.py.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from moshpeer.averaging.averager import MoshpitAverager
from moshpeer.averaging.loss_budget import DEFAULT_WINDOW, parse_loss_budget
from moshpeer.averaging.report import RoundResult
from moshpeer.dht import Admission, SwarmDHT, validate_run_id
from moshpeer.errors import UserError
from moshpeer.peer.dropcompute import BudgetSetting
from moshpeer.peer.error_feedback import ERROR_FEEDBACK_MODES, make_error_feedback
from moshpeer.peer.loss_phase import LossPhaseTracker, epoch_gradient
from moshpeer.peer.aux_rounds import AuxRounds
from moshpeer.peer.optimizer_state import OptimizerState
from moshpeer.peer.progress import ProgressSnapshot
from moshpeer.peer.round_timing import RoundTiming
from moshpeer.peer.rounds import CollaborativeRound  # also imported from here: keep this path
from moshpeer.peer.speed_meter import SpeedMeter
from moshpeer.peer.state_sync import DownloadedState, StateServer
from moshpeer.peer.strategies import make_strategy
from moshpeer.peer.strategies.base import AveragingStrategy, RoundPlan
from moshpeer.peer.swarm_link import link_to_swarm

logger = logging.getLogger(__name__)

# A strategy that must not step alone while others averaged (DiLoCo) watches this long, at most, for the
# swarm's records to show that the others finished the round it missed.
MISSED_ROUND_GRACE_S = 5.0


class CollaborativeOptimizer(OptimizerState, AuxRounds, torch.optim.Optimizer):
    """Wraps a local optimizer so that a swarm of peers trains one model; see the module docstring.

    :param optimizer: the local optimizer over the model's parameters (Adam, SGD, ...)
    :param run_id: the training run; peers of one run share it
    :param target_batch_size: samples the swarm gathers per collaborative epoch
    :param batch_size_per_step: samples behind one `step()` call when `step(batch_size=...)` is not given
    :param daemon / dht / initial_peers: a started `PeerDaemon`; or a running `SwarmDHT`; or multiaddrs of a
        swarm, for a DHT node of this optimizer's own (see swarm_link.py)
    :param averaging: a strategy name ("gradients", "parameters": `strategies.STRATEGIES`) or an
        `AveragingStrategy` instance; average_parameters, params_every, average_optimizer_state, inner_steps,
        outer_optimizer, overlap: options of the named strategies (None: the strategy's default)
    :param compression: codec name for averaging ("none", "fp16", ...); group_size: target Moshpit group size
    :param compute_budget: DropCompute threshold per epoch: None, seconds, or "auto"
    :param error_feedback: gradients mode with a sparsifying codec (arc-topk): keep EF21M state (part of
        `state_dict()` and of the downloaded state); an `EF21M` in `averager_kwargs["error_feedback"]` too
    :param role: "trainer" or "aux" (aux peers average with weight 0 and never compute)
    :param matchmaking_time, round_timeout: averaging deadlines (seconds)
    :param max_epoch_lag: download state when the swarm's epoch is ahead by more than this
    :param serve_state: run a state donor for newcomers
    :param should_stop: polled while a round is in flight; True abandons it (for prompt shutdown)
    :param averager_kwargs: more arguments for `MoshpitAverager` (links, chunk_bytes, ...)
    :param swarm_key, allow_peers: a private run (a pre-shared secret, bytes; and/or admitted peer ids): set as
        the DHT node's `moshpeer.dht.Admission`, which refuses others' records, matchmaking, data-plane
        connections and state requests (counted in `dht.admission.refused`; docs/security.md)
    :param loss_budget, phase_threshold, phase_window: DBLP loss budget of the rounds (see loss_budget.py)

    Bad settings raise `UserError` with one line; a failed round is logged and the epoch steps alone.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: Optional[int] = None,
        daemon: Any = None,
        dht: Optional[SwarmDHT] = None,
        initial_peers: Sequence[str] = (),
        host: str = "127.0.0.1",
        averaging: Union[str, AveragingStrategy] = "gradients",
        compression: str = "none",
        group_size: int = 4,
        min_group_size: int = 2,
        compute_budget: BudgetSetting = None,
        error_feedback: bool = False,
        role: str = "trainer",
        average_parameters: Union[bool, str] = "auto",
        average_optimizer_state: bool = True,
        params_every: Optional[int] = None,
        inner_steps: Optional[int] = None,
        outer_optimizer: Any = None,
        overlap: Optional[bool] = None,
        matchmaking_time: float = 1.0,
        round_timeout: float = 10.0,
        max_epoch_lag: int = 1,
        serve_state: bool = True,
        state_download_timeout: float = 60.0,
        state_bytes_per_second: Optional[float] = None,
        progress_refresh: float = 0.3,
        show_progress: bool = False,
        should_stop: Optional[Callable[[], bool]] = None,
        model: Optional[torch.nn.Module] = None,
        averager_kwargs: Optional[Dict[str, Any]] = None,
        loss_budget: Any = None,
        phase_threshold: float = 0.5,
        phase_window: Optional[int] = None,
        swarm_key: Optional[bytes] = None,
        allow_peers: Optional[Sequence[str]] = None,
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(f"CollaborativeOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.strategy = make_strategy(averaging, average_parameters=average_parameters, params_every=params_every,
                                      average_optimizer_state=average_optimizer_state, inner_steps=inner_steps,
                                      outer_optimizer=outer_optimizer, overlap=overlap)
        if role not in ("trainer", "aux"):
            raise UserError(f"role must be 'trainer' or 'aux', got {role!r}")
        if target_batch_size < 1 or (batch_size_per_step is not None and batch_size_per_step < 1):
            raise UserError("target_batch_size and batch_size_per_step must be positive")
        if group_size < 2:
            raise UserError(f"group size must be at least 2, got {group_size}")
        self._loss_budget_setting = parse_loss_budget(loss_budget, eta=phase_threshold,
                                                      window=phase_window or DEFAULT_WINDOW)
        self.inner, self.model, self.role = optimizer, model, role
        self.run_id, self.averaging = validate_run_id(run_id), self.strategy.name
        self.target_batch_size, self.batch_size_per_step = int(target_batch_size), batch_size_per_step
        self.compression, self.group_size = compression, group_size
        self.matchmaking_time, self.round_timeout = matchmaking_time, round_timeout
        self.max_epoch_lag, self.state_download_timeout = max_epoch_lag, state_download_timeout
        self.show_progress = show_progress
        self._should_stop = should_stop or (lambda: False)
        averager_kwargs = dict(averager_kwargs or {})
        if role == "aux":  # an aux never leads: it sits in matchmaking far longer than any trainer would wait
            averager_kwargs.setdefault("client_mode", True)
        if error_feedback and averager_kwargs.get("error_feedback") is None:
            averager_kwargs["error_feedback"] = make_error_feedback(optimizer, self.averaging, compression)
        # Error feedback replaces the averaged vector by its own estimate: (pseudo-)gradients, never parameters.
        self.error_feedback = averager_kwargs.get("error_feedback")
        if self.error_feedback is not None and self.averaging not in ERROR_FEEDBACK_MODES:
            raise UserError(f"error feedback needs averaging in {ERROR_FEEDBACK_MODES}")
        self._init_torch_optimizer(optimizer)

        self.params: List[torch.nn.Parameter] = [p for group in optimizer.param_groups for p in group["params"]]
        if not self.params:
            raise UserError("the wrapped optimizer has no parameters")
        self.local_epoch = self.local_steps = 0
        self.samples_accumulated, self.total_samples = 0, 0  # this epoch / ever, this peer
        self.dropped_samples = 0  # computed but left out of the swarm's average (missed rounds)
        self.failed_rounds = 0  # aux peers: rounds that found no group (the aux retries them)
        self.rounds: List[CollaborativeRound] = []
        self._in_flight: Optional[tuple] = None  # (round future, plan, facts): overlapping strategies
        self.downloads: List[DownloadedState] = []
        self.lock = threading.RLock()  # held while the state changes (state server reads under it)
        # Per parameter: gradients x samples, summed over this epoch (the strategies' `grad_sums`). fp32 whatever
        # the parameters' dtype: summed in bf16, 256 + 1 is 256. The mean is cast to the parameter's dtype once.
        self.grad_sums = [torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                          for p in self.params]
        self._loss_phase, self._speed = LossPhaseTracker(), SpeedMeter()
        self.timing = RoundTiming(matchmaking_time, compute_budget, group_size)

        admission = Admission(swarm_key, allow_peers) if swarm_key is not None or allow_peers is not None else None
        self._swarm = link_to_swarm(run_id, role, self.target_batch_size, daemon=daemon, dht=dht,
                                    initial_peers=initial_peers, host=host, progress_refresh=progress_refresh,
                                    admission=admission)
        self.daemon, self.dht, self.progress = daemon, self._swarm.dht, self._swarm.progress
        self.peer_id = self.dht.identity.peer_id

        self.strategy.bind(self)
        averager_kwargs.setdefault("loss_budget", self._loss_budget_setting)
        self.averager = MoshpitAverager(
            [self.strategy.buffer], dht=self.dht, run_id=f"{run_id}.{self.averaging}", target_group_size=group_size,
            min_group_size=min_group_size, compression=compression, matchmaking_time=matchmaking_time,
            round_timeout=round_timeout, host=host, **averager_kwargs)
        if self.averager.aggregation == "clipped":  # samples whose gradients are weighed at zero do not count
            self.progress.count_samples_except(lambda: self.averager.suspects.suspects)

        self.state_server: Optional[StateServer] = None
        self._advertised_at = 0.0
        if serve_state:
            self.state_server = StateServer(self._serialized_state, run_id=run_id, identity=self.dht.identity,
                                            host=host, bytes_per_second=state_bytes_per_second,
                                            admission=self.dht.admission)
            self._advertise()
        self._report_progress(force=True)
        self.timing.begin_epoch()  # the first epoch's budget starts now, not before the setup above

    def __repr__(self) -> str:
        return f"CollaborativeOptimizer({self.inner!r}, run_id={self.run_id!r}, averaging={self.averaging!r})"

    @property
    def loss_budget(self) -> Any:
        """The averager's `LossBudget` (phase, current budget P)."""
        return self.averager.loss_budget

    # ---- epochs and progress ------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, batch_size: Optional[int] = None) -> Any:
        """Account for the gradients in `.grad` (computed from `batch_size` samples); a collaborative
        step happens inside when the epoch is over. Returns the closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.role == "aux":
            self.wait_and_average()
            return loss
        batch_size = batch_size if batch_size is not None else self.batch_size_per_step
        if batch_size is None:
            raise UserError("pass step(batch_size=...) or set batch_size_per_step")
        with self.lock:
            # Gradient sums are what the gradients strategy averages; the others keep them only as the
            # phase signal of a phase-aware loss budget.
            if self.strategy.accumulates_gradients or self._loss_budget_setting.phase_aware:
                for acc, p in zip(self.grad_sums, self.params):
                    if p.grad is not None:
                        acc.add_(p.grad, alpha=float(batch_size))
            if self.strategy.steps_locally:
                self.inner_step()
            self.samples_accumulated += int(batch_size)
            self.total_samples += int(batch_size)
            self.strategy.on_micro_batch(int(batch_size))
        self._speed.add(batch_size)
        self.timing.record(batch_size)
        self._report_progress()
        if self.epoch_is_over():
            self.collaborative_step()
        return loss

    def inner_step(self) -> None:
        """One step of the wrapped optimizer on the current `.grad`s (strategies call it), counted."""
        self.inner.step()
        self.local_steps += 1

    def epoch_is_over(self) -> bool:
        """Whether this peer should average now: its share is done, the swarm reached the target,
        or the DropCompute budget for this epoch is spent; a strategy that counts its epochs itself
        (DiLoCo's H inner steps) decides instead of the share and the target."""
        counted = self.strategy.epoch_is_over()
        if self.timing.budget_spent() or counted is not None:
            return self.timing.budget_spent() or counted
        snapshot = self.progress.snapshot()
        return snapshot.ready or self.samples_accumulated >= self.share(snapshot)

    def wait_for_peers(self, min_trainers: int, timeout: float) -> int:
        """Block until at least `min_trainers` trainers (this one included) are visible, or `timeout`
        passes, or a stop is requested; returns how many are visible. Peers started together call it
        so that nobody races ahead alone before the others show up."""
        visible = self._swarm.wait_for_trainers(min_trainers, timeout, self._should_stop)
        if self.samples_accumulated == 0:
            self.timing.begin_epoch()  # waiting for peers is not this epoch's compute time
        return visible

    def share(self, snapshot: Optional[ProgressSnapshot] = None) -> int:
        """This peer's share of the target batch: target / live trainers whose samples count, rounded up."""
        snapshot = snapshot or self.progress.snapshot()
        return math.ceil(self.target_batch_size / max(snapshot.contributing_trainers, 1))

    def group_target(self, snapshot: Optional[ProgressSnapshot] = None) -> int:
        """This round's group size: `group_size`, or the number of live peers (trainers and aux, from
        their DHT records) when the swarm is smaller, so a small swarm does not wait the whole
        matchmaking time for members that do not exist."""
        snapshot = snapshot or self.progress.snapshot()
        live = snapshot.num_trainers + snapshot.num_aux
        return max(self.averager.min_group_size, min(self.group_size, live))

    def collaborative_step(self) -> Optional[CollaborativeRound]:
        """End this peer's epoch now: catch up if behind, else average and step (alone if no group). Returns
        the epoch's record; with an overlapping strategy (its round runs in the background while the peer
        computes) the record of the round resolved now, the previous epoch's (None at the first epoch end)."""
        snapshot = self.progress.snapshot()
        facts = dict(stopped_by_budget=self.timing.finish(), swarm_samples=snapshot.samples_accumulated,
                     num_trainers=snapshot.num_trainers)
        if snapshot.global_epoch > self.local_epoch + self.max_epoch_lag:
            # Behind: our gradients are for stale parameters. Adopt a donor's state instead.
            caught = self._catch_up_instead(snapshot.global_epoch - self.max_epoch_lag, "caught up", facts)
            if caught is not None:
                return caught
        alone = snapshot.num_trainers + snapshot.num_aux <= 1
        # With a budget, a peer that arrives after every window of its epoch closed while the swarm moved on
        # would find nobody, or mix gradients of stale parameters into the next epoch.
        if not alone and self.timing.every_window_closed() and self._swarm.moved_past(self.local_epoch, 0.0, self._should_stop):
            missed = self._catch_up_instead(self.local_epoch + 1, "missed round; caught up", facts)
            if missed is not None:
                return missed
        resolved = self.settle() if self.strategy.overlaps else None
        target, plan = self.group_target(snapshot), self._plan_round(snapshot)
        facts.update(epoch=self.local_epoch, samples=self.samples_accumulated, group_target=target)
        if alone:  # a lone peer does not wait for a group that cannot form: it steps on its own data
            return self._end_epoch(plan, None, "alone", wait_s=0.0, **facts)
        future = self._start_round(plan, float(self.samples_accumulated), target, self.timing.window())
        if self.strategy.overlaps:  # resolved at the next epoch end (settle), while the peer computes
            self._in_flight = (future, plan, facts)
            with self.lock:
                self._next_epoch()
            return resolved
        started = time.monotonic()
        result = self.timing.await_result(future, target, self._should_stop)
        if not (result is not None and result.ok) and self.strategy.catches_up_after_missed_round \
                and self._swarm.moved_past(self.local_epoch, min(self.round_timeout, MISSED_ROUND_GRACE_S),
                                         self._should_stop):
            missed = self._catch_up_instead(self.local_epoch + 1, "missed round; caught up", facts)
            if missed is not None:
                return missed
        return self._end_epoch(plan, result, None, wait_s=time.monotonic() - started, **facts)

    def settle(self) -> Optional[CollaborativeRound]:
        """Resolve the round still running in the background (overlapping strategies): wait for it within its
        deadline, apply its outcome, append its record to `rounds` and return it; None if none runs. The
        training loop calls it once more after its last epoch, so that the last outer step is applied."""
        if self._in_flight is None:
            return None
        (future, plan, facts), self._in_flight = self._in_flight, None
        waited = time.monotonic()
        result = self.timing.await_result(future, facts["group_target"], self._should_stop)
        with self.lock:
            record = self._resolve(plan, result, None, wait_s=time.monotonic() - waited, **facts)
        self.rounds.append(record)
        return record

    # ---- rounds -------------------------------------------------------------------------------

    def _plan_round(self, snapshot: ProgressSnapshot) -> RoundPlan:
        # The averager's lock: a round abandoned earlier may still be writing into the buffer.
        with self.lock, self.averager.get_tensors():
            return self.strategy.plan_round(self.local_epoch, snapshot)

    def _start_round(self, plan: RoundPlan, weight: float, target: int, window: float) -> Any:
        """Start one averaging round in the averager's round thread; its `RoundFuture`."""
        return self.averager.step(weight=weight, timeout=2 * window, target_group_size=target,
                                  matchmaking_time=window, tensors=plan.tensors, averaged=plan.averages, wait=False)

    def _end_epoch(self, plan: RoundPlan, result: Optional[RoundResult], error: Optional[str],
                   **facts: Any) -> CollaborativeRound:
        """Apply the round's outcome, record the epoch and start the next one."""
        with self.lock:
            record = self._resolve(plan, result, error, **facts)
            self._next_epoch()
        self.rounds.append(record)
        return record

    @torch.no_grad()
    def _resolve(self, plan: RoundPlan, result: Optional[RoundResult], error: Optional[str],
                 **facts: Any) -> CollaborativeRound:
        """Apply a round's outcome: the group's average, or this peer's own step (caller holds the lock)."""
        ok = result is not None and result.ok
        spread = self.strategy.apply_averaged(plan) if ok else self.strategy.apply_alone(plan)
        if not ok:
            error = error or (result.error if result is not None else "abandoned")
        grads = epoch_gradient(self.strategy.averaged_gradient(plan) if ok else None, self.grad_sums,
                               self.samples_accumulated)
        phase, budget, norm = self._loss_phase.after_round(facts["epoch"], result, self.loss_budget, grads)
        return CollaborativeRound(result=result, error=error, param_spread=spread, loss_phase=phase,
                                  loss_budget=budget, grad_norm=norm, settings=self.strategy.settings(), **facts)

    def _next_epoch(self) -> None:
        self.local_epoch += 1
        self._reset_accumulators()
        self._report_progress(force=True)
        self._advertise()

    def _reset_accumulators(self) -> None:
        for acc in self.grad_sums:
            acc.zero_()
        self.samples_accumulated = 0
        self.timing.begin_epoch()

    # ---- presence -----------------------------------------------------------------------------

    def _report_progress(self, force: bool = False) -> None:
        self.progress.report(epoch=self.local_epoch, samples_accumulated=self.samples_accumulated,
                             samples_per_second=self._speed.rate(), step=self.local_steps, force=force,
                             upload_bps=self.averager.upload_bandwidth or 0.0)
        self._swarm.publish_flagged(self.averager.flagged_peers)
        if self.state_server is not None and time.monotonic() - self._advertised_at > 5.0:
            self._advertise()

    def shutdown(self, close_averager: bool = True) -> None:
        """Stop the averager, state server, progress thread and (if it is ours) the DHT. Idempotent.

        `close_averager=False` leaves the averager's background loop to die with the process: stopping
        its event loop while hivemind's P2P replica still has pending tasks prints asyncio tracebacks,
        which a process about to exit can do without.
        """
        stops = [self.state_server.shutdown] if self.state_server is not None else []
        for stop in stops + ([self.averager.shutdown] if close_averager else []):
            try:
                stop()
            except Exception:
                logger.debug(f"shutting down {stop} failed", exc_info=True)
        self.state_server = None
        self._swarm.close()
