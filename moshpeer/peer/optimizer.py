"""`CollaborativeOptimizer`: a torch optimizer whose steps are taken by a whole swarm.

    opt = CollaborativeOptimizer(torch.optim.Adam(model.parameters()), run_id="my-run",
                                 target_batch_size=4096, batch_size_per_step=32,
                                 initial_peers=["/ip4/.../p2p/Qm..."])
    for batch in data:
        loss = loss_fn(model, batch); loss.backward()
        opt.step(); opt.zero_grad()          # local accumulation; a swarm step when the swarm is ready

It *is* a `torch.optim.Optimizer` (its `param_groups` and `state` are the wrapped optimizer's),
so LR schedulers and `transformers.Trainer(optimizers=(opt, scheduler))` work unchanged.

The collaborative epoch ends when this peer has computed its share of `target_batch_size`
(target / live trainers), or the swarm as a whole reports the target reached, or the DropCompute
budget for the epoch is spent. Then the peer averages with a Moshpit group. What a round averages
and how the average is applied is the averaging strategy's job (moshpeer/peer/strategies/):
"gradients" (large-batch training: the epoch's mean gradient, weighted by samples, then one inner
step on the group's average), "parameters" (Moshpit SGD / local SGD: local steps, then the
parameters and optimizer statistics are averaged), or any `AveragingStrategy` instance.

Epochs: every peer publishes (epoch, samples) in its signed DHT record (`SwarmProgress`). A peer
whose epoch is behind the swarm's by more than `max_epoch_lag` downloads the state of the most
advanced donor (`state_sync`) instead of averaging stale gradients. A peer that finds no group
(alone, or everyone else timed out) steps on its own gradients: training never stops for lack of
peers. Every wait is bounded (matchmaking time, round timeout, download timeout).

This module runs the epochs; its helpers each do one job: strategies/ (what a round averages and how
it is applied), rounds.py (`CollaborativeRound`, the record of one epoch), loss_phase.py (the DBLP
phase signal), error_feedback.py (EF21M state), speed_meter.py (samples per second), and progress.py /
state_sync.py / dropcompute.py (swarm progress, state download, compute budget).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from moshpeer.dht import SwarmDHT, start_dht, validate_run_id
from moshpeer.dht.records import MAX_FLAGGED_PEERS
from moshpeer.errors import UserError
from moshpeer.peer.dropcompute import BudgetedStep, BudgetSetting, ComputeBudget
from moshpeer.peer.error_feedback import (
    ERROR_FEEDBACK_MODES,
    check_error_feedback_state,
    error_feedback_state,
    fresh_error_feedback_state,
    make_error_feedback,
)
from moshpeer.peer.loss_phase import LossPhaseTracker, epoch_gradient
from moshpeer.peer.progress import ProgressSnapshot, RecordPublisher, SwarmProgress
from moshpeer.peer.rounds import CollaborativeRound  # also imported from here: keep this path
from moshpeer.peer.speed_meter import SpeedMeter
from moshpeer.peer.strategies import make_strategy
from moshpeer.peer.strategies.base import AveragingStrategy, RoundPlan
from moshpeer.peer.state_sync import (
    DownloadedState,
    StateDownloadFailed,
    StateServer,
    download_state,
    serialize_state,
)

logger = logging.getLogger(__name__)

# With a compute budget, how long a peer waits for its group at least (finding each other over the DHT
# takes a few round trips), even when the budget deadline is closer than this. Under load the round
# trips take longer: the floor is then ASSEMBLY_MARGIN x the fastest recent assembly of a full group.
MIN_BUDGET_WINDOW_S = 0.2
ASSEMBLY_MARGIN = 3.0
ASSEMBLY_HISTORY = 8
# An aux peer waits in matchmaking this many matchmaking times: it never leads a group (the trainers'
# leader decides when the group is complete), and a follower is only accepted by a leader whose window
# ends before the follower's, so the aux's window must outlast the trainers' next one.
AUX_WINDOW_FACTOR = 10
# A strategy that must not step alone while others averaged (DiLoCo) watches this long, at most, for the
# swarm's records to show that the others finished the round it missed.
MISSED_ROUND_GRACE_S = 5.0


class CollaborativeOptimizer(torch.optim.Optimizer):
    """Wraps a local optimizer so that a swarm of peers trains one model; see the module docstring.

    :param optimizer: the local optimizer over the model's parameters (Adam, SGD, ...)
    :param run_id: the training run; peers of one run share it
    :param target_batch_size: samples the swarm gathers per collaborative epoch
    :param batch_size_per_step: samples behind one `step()` call when `step(batch_size=...)` is not given
    :param daemon: a started `PeerDaemon` (membership, heartbeat); or
    :param dht: a running `SwarmDHT` (this optimizer then publishes its own record); or
    :param initial_peers: multiaddrs of a swarm; this optimizer starts its own DHT node
    :param averaging: a strategy name from `STRATEGIES` ("gradients", "parameters") or an
        `AveragingStrategy` instance (then average_parameters / average_optimizer_state are its own)
    :param compression: codec name for averaging ("none", "fp16", ...)
    :param group_size: target Moshpit group size
    :param compute_budget: DropCompute threshold per epoch: None, seconds, or "auto"
    :param error_feedback: gradients mode with a sparsifying codec (arc-topk): keep EF21M error-feedback
        state (momentum, what the group knows, the update estimate). It is part of `state_dict()` and of
        the state a newcomer downloads. Only gradients are averaged then (parameters are not adopted:
        EF21M's estimate is meaningful for gradients only). An `EF21M` given in
        `averager_kwargs["error_feedback"]` is used the same way.
    :param role: "trainer" or "aux" (aux peers average with weight 0 and never compute)
    :param average_parameters, params_every, average_optimizer_state: options of the "gradients" and
        "parameters" strategies (see GradientsStrategy, ParametersStrategy; None: the strategy's default)
    :param inner_steps, outer_optimizer, overlap: options of the "diloco" strategy (DiLoCoStrategy: H, the
        outer optimizer factory, the one-outer-step delay; None: its default)
    :param matchmaking_time, round_timeout: averaging deadlines (seconds)
    :param max_epoch_lag: download state when the swarm's epoch is ahead by more than this
    :param serve_state: run a state donor for newcomers
    :param should_stop: polled while waiting; True abandons a round (for prompt shutdown)
    :param averager_kwargs: more arguments for `MoshpitAverager` (faults, chunk_bytes, ...)
    :param loss_budget: DBLP loss budget of the averaging rounds: None / "fixed" (wait for everything
        until the round deadline), a fraction P (fixed), "P_LOW,P_HIGH" or "phase" (phase-aware: the
        gradient norm of each epoch, averaged in gradients mode and local in parameters mode, sets the
        next round's phase), or a `LossBudget`; phase_threshold: Accordion's eta for the phase signal;
        phase_window: collaborative epochs per signal window (default 5; see loss_budget.py)
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
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(f"CollaborativeOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.strategy = make_strategy(averaging, average_parameters=average_parameters, params_every=params_every,
                                      average_optimizer_state=average_optimizer_state, inner_steps=inner_steps,
                                      outer_optimizer=outer_optimizer, overlap=overlap)
        averaging = self.strategy.name
        if role not in ("trainer", "aux"):
            raise UserError(f"role must be 'trainer' or 'aux', got {role!r}")
        if target_batch_size < 1 or (batch_size_per_step is not None and batch_size_per_step < 1):
            raise UserError("target_batch_size and batch_size_per_step must be positive")
        if group_size < 2:
            raise UserError(f"group size must be at least 2, got {group_size}")
        from moshpeer.averaging.loss_budget import DEFAULT_WINDOW, parse_loss_budget  # bad settings fail early

        self._loss_budget_setting = parse_loss_budget(loss_budget, eta=phase_threshold,
                                                      window=phase_window if phase_window else DEFAULT_WINDOW)
        self.inner = optimizer
        self.run_id = validate_run_id(run_id)
        self.target_batch_size = int(target_batch_size)
        self.batch_size_per_step = batch_size_per_step
        self.averaging = averaging
        self.compression = compression
        self.group_size = group_size
        self.role = role
        self.matchmaking_time = matchmaking_time
        self.round_timeout = round_timeout
        self.max_epoch_lag = max_epoch_lag
        self.state_download_timeout = state_download_timeout
        self.show_progress = show_progress
        self.model = model
        self._should_stop = should_stop or (lambda: False)
        averager_kwargs = dict(averager_kwargs or {})
        if role == "aux":
            # An aux never leads: a leader's window decides when a group gives up on missing members, and
            # the aux sits in matchmaking far longer than any trainer would wait.
            averager_kwargs.setdefault("client_mode", True)
        if error_feedback and averager_kwargs.get("error_feedback") is None:
            averager_kwargs["error_feedback"] = make_error_feedback(optimizer, averaging, compression)
        # Error feedback replaces the averaged vector by its own estimate: gradients or DiLoCo's pseudo-gradient
        # only, never parameters.
        self.error_feedback = averager_kwargs.get("error_feedback")
        if self.error_feedback is not None and averaging not in ERROR_FEEDBACK_MODES:
            raise UserError(f"error feedback needs averaging in {ERROR_FEEDBACK_MODES}")

        # torch.optim.Optimizer's own machinery, without its __init__ (param_groups live in `inner`).
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"

        self.params: List[torch.nn.Parameter] = [p for group in optimizer.param_groups for p in group["params"]]
        if not self.params:
            raise UserError("the wrapped optimizer has no parameters")
        self.local_epoch = 0
        self.local_steps = 0
        self.samples_accumulated = 0  # this epoch, this peer
        self.total_samples = 0
        self.dropped_samples = 0  # computed but left out of the swarm's average (missed rounds)
        self.failed_rounds = 0  # aux peers: rounds that found no group (the aux retries them)
        self._assembly_s: List[float] = []  # matchmaking times of recent rounds whose group was complete
        self.rounds: List[CollaborativeRound] = []
        self._in_flight: Optional[tuple] = None  # (running round, its record, its plan): overlapping strategies
        self.downloads: List[DownloadedState] = []
        self.lock = threading.RLock()  # held while the state changes (state server reads under it)
        # Per parameter: gradients x samples, summed over this epoch (the strategies' `grad_sums`).
        self.grad_sums = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        self._loss_phase = LossPhaseTracker()
        self._speed = SpeedMeter()
        # "auto" simulates a synchronous group of `group_size` workers from this peer's own times.
        self.budget = ComputeBudget(compute_budget, num_workers=group_size) if compute_budget is not None else None
        self._budget_step: Optional[BudgetedStep] = None
        self._begin_budget_step()

        # ---- membership: daemon, bare DHT, or our own DHT node ----
        self._own_dht: Optional[SwarmDHT] = None
        self._publisher: Optional[RecordPublisher] = None
        self.daemon = daemon
        if daemon is not None:
            self.dht = daemon.dht
            own_record, publish, on_refresh = (lambda: daemon.record), (lambda **f: daemon.update_record(
                publish_now=True, **f)), None
        else:
            if dht is None:
                if not initial_peers:
                    raise UserError("give the optimizer daemon=, dht= or initial_peers=")
                dht = self._own_dht = start_dht(initial_peers=initial_peers, run_ids=[run_id],
                                                host_maddrs=[f"/ip4/{host}/tcp/0"])
            self.dht = dht
            self._publisher = RecordPublisher(dht, run_id, role=role)
            self._publisher.publish()
            own_record, publish, on_refresh = (lambda: self._publisher.record), self._publisher.update, \
                self._publisher.refresh_if_stale
        self.peer_id = self.dht.identity.peer_id
        self._publish_record, self._published_flagged = publish, {}
        self.progress = SwarmProgress(self.dht, run_id, target_batch_size=self.target_batch_size,
                                      own_record=own_record, publish=publish, refresh_interval=progress_refresh,
                                      on_refresh=on_refresh)

        # ---- averaging: the strategy's buffer, one Moshpit averager over it ----
        self.strategy.bind(self)
        from moshpeer.averaging import MoshpitAverager  # peer > averaging: allowed, imported late (heavy)

        averager_kwargs.setdefault("loss_budget", self._loss_budget_setting)

        self.averager = MoshpitAverager(
            [self.strategy.buffer], dht=self.dht, run_id=f"{run_id}.{averaging}", target_group_size=group_size,
            min_group_size=min_group_size, compression=compression, matchmaking_time=matchmaking_time,
            round_timeout=round_timeout, host=host, **averager_kwargs)

        # ---- state donor ----
        self._state_cache: Optional[tuple] = None
        self.state_server: Optional[StateServer] = None
        if serve_state:
            self.state_server = StateServer(self._serialized_state, run_id=run_id, host=host,
                                            bytes_per_second=state_bytes_per_second)
            self._advertised_at = 0.0
            self._advertise()
        self._report_progress(force=True)
        self._begin_budget_step()  # the first epoch's budget starts now, not before the setup above

    # ---- torch.optim.Optimizer surface --------------------------------------------------------

    @property
    def param_groups(self) -> List[dict]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: List[dict]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Dict[Any, Any]:  # type: ignore[override]
        return self.inner.state

    @state.setter
    def state(self, value: Dict[Any, Any]) -> None:
        self.inner.state = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict plus a "collaborative" entry: epoch, steps, the
        error-feedback state (None without error feedback) and the strategy's state."""
        with self.lock:
            state = self.inner.state_dict()
            state["collaborative"] = {"epoch": self.local_epoch, "steps": self.local_steps,
                                      "error_feedback": error_feedback_state(self.error_feedback),
                                      "strategy": self.strategy.state_dict()}
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Inverse of `state_dict` (a plain optimizer state dict, without "collaborative", loads too)."""
        state_dict = dict(state_dict)
        collaborative = state_dict.pop("collaborative", None)
        with self.lock:
            if collaborative and collaborative.get("error_feedback") is not None:
                self._load_error_feedback(collaborative["error_feedback"])
            self.inner.load_state_dict(state_dict)
            if collaborative and collaborative.get("strategy"):
                self.strategy.load_state_dict(collaborative["strategy"])
            if collaborative:
                self.local_epoch = int(collaborative.get("epoch", self.local_epoch))
                self.local_steps = int(collaborative.get("steps", self.local_steps))

    def __repr__(self) -> str:
        return f"CollaborativeOptimizer({self.inner!r}, run_id={self.run_id!r}, averaging={self.averaging!r})"

    # ---- training -----------------------------------------------------------------------------

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
        self._record_micro_batch(batch_size)
        self._report_progress()
        if self.epoch_is_over():
            self.collaborative_step()
        return loss

    def epoch_is_over(self) -> bool:
        """Whether this peer should average now: its share is done, the swarm reached the target,
        or the DropCompute budget for this epoch is spent; a strategy that counts its epochs itself
        (DiLoCo's H inner steps) decides instead of the share and the target."""
        if self._budget_step is not None and not self._budget_step.should_continue():
            return True
        counted = self.strategy.epoch_is_over()
        if counted is not None:
            return counted
        snapshot = self.progress.snapshot()
        if snapshot.ready:
            return True
        return self.samples_accumulated >= self.share(snapshot)

    def wait_for_peers(self, min_trainers: int, timeout: float) -> int:
        """Block until at least `min_trainers` trainers (this one included) are visible, or `timeout`
        passes, or a stop is requested; returns how many are visible. Peers started together call it
        so that nobody races ahead alone before the others show up."""
        deadline = time.monotonic() + timeout
        while True:
            visible = self.progress.refresh_now().num_trainers
            if visible >= min_trainers or time.monotonic() >= deadline or self._should_stop():
                if self.samples_accumulated == 0:
                    self._begin_budget_step()  # waiting for peers is not this epoch's compute time
                return visible
            self.progress.wait_for_refresh(timeout=min(0.5, max(0.0, deadline - time.monotonic())))

    def share(self, snapshot: Optional[ProgressSnapshot] = None) -> int:
        """This peer's share of the target batch: target / live trainers, rounded up."""
        snapshot = snapshot or self.progress.snapshot()
        return math.ceil(self.target_batch_size / max(snapshot.num_trainers, 1))

    def collaborative_step(self) -> Optional[CollaborativeRound]:
        """End this peer's epoch now: catch up if behind, else average and step (alone if no group).
        Returns the round's record; with an overlapping strategy the record of the round resolved now (the
        previous epoch's), None at the first epoch end."""
        snapshot = self.progress.snapshot()
        stopped_by_budget = False
        if self._budget_step is not None:
            stopped_by_budget = self._budget_step.finish().stopped_by_budget
        if snapshot.global_epoch > self.local_epoch + self.max_epoch_lag:
            # Behind: our gradients are for stale parameters. Adopt a donor's state instead.
            stale_samples = self.samples_accumulated
            downloaded = self.catch_up(min_epoch=snapshot.global_epoch - self.max_epoch_lag)
            if downloaded is not None:
                self.dropped_samples += stale_samples
                caught = self._new_round(epoch=downloaded.epoch, samples=0, ok=False, error="caught up",
                                         stopped_by_budget=stopped_by_budget, dropped_samples=stale_samples,
                                         swarm_samples=snapshot.samples_accumulated,
                                         num_trainers=snapshot.num_trainers)
                self.rounds.append(caught)
                return caught
        alone = snapshot.num_trainers + snapshot.num_aux <= 1
        if not alone and self._missed_round():
            missed = self._catch_up_after_missed_round(stopped_by_budget)
            if missed is not None:
                return missed
        round_ = self._new_round(epoch=self.local_epoch, samples=self.samples_accumulated, ok=False,
                                 stopped_by_budget=stopped_by_budget, swarm_samples=snapshot.samples_accumulated,
                                 num_trainers=snapshot.num_trainers, group_target=self.group_target(snapshot))
        if self.strategy.overlaps:
            return self._overlapped_step(round_, snapshot, alone)
        with self.lock:
            plan = self.strategy.plan_round(self.local_epoch, snapshot)
        # A lone peer does not wait for a group that cannot form: it steps on its own gradients.
        report = None if alone else self._run_round(plan, weight=float(self.samples_accumulated),
                                                    target_group_size=round_.group_target,
                                                    matchmaking_time=self._matchmaking_window())
        self._note_assembly(report, round_.group_target)
        if not alone and not getattr(report, "ok", False) and self.strategy.catches_up_after_missed_round \
                and self._swarm_moved_on(within=min(self.round_timeout, MISSED_ROUND_GRACE_S)):
            missed = self._catch_up_after_missed_round(stopped_by_budget)
            if missed is not None:
                return missed
        round_.result = report
        with self.lock:
            self._resolve(round_, report, plan, alone)
            self._finish_epoch()
        round_.wait_s = round_.matchmaking_s + round_.averaging_s
        self.rounds.append(round_)
        return round_

    def _resolve(self, round_: CollaborativeRound, report: Any, plan: RoundPlan, alone: bool) -> None:
        """Apply a round's outcome: the group's average, or this peer's own step (caller holds the lock)."""
        if report is not None and getattr(report, "ok", False):
            self._adopt_round(round_, report, plan)
        else:
            round_.error = "alone" if alone else (getattr(report, "error", None) if report is not None
                                                  else "abandoned")
            if report is not None:
                round_.matchmaking_s = float(report.matchmaking_s)
            self.strategy.apply_alone(plan)
        self._update_loss_phase(round_, report, plan)

    def _overlapped_step(self, round_: CollaborativeRound, snapshot: ProgressSnapshot, alone: bool) -> Optional[CollaborativeRound]:
        """End the epoch of a strategy that overlaps rounds with compute: resolve the round started at the
        previous epoch end (waiting for it if it still runs: that wait is the communication compute did not
        hide), start this epoch's round in the background, and go on at once. Returns the resolved round
        (also appended to `rounds`), None at the first epoch end."""
        resolved = self.settle()
        with self.lock:
            plan = self.strategy.plan_round(self.local_epoch, snapshot)
            if alone:  # nobody to average with: this epoch's step is taken now, on local data
                round_.error = "alone"
                self.strategy.apply_alone(plan)
            self._finish_epoch()
        if alone:
            round_.wait_s = 0.0
            self.rounds.append(round_)
            return round_
        self._in_flight = (self._start_round(plan, weight=float(round_.samples), target_group_size=round_.group_target,
                                             matchmaking_time=self._matchmaking_window()), round_, plan)
        return resolved

    def settle(self) -> Optional[CollaborativeRound]:
        """Resolve the round still running in the background (overlapping strategies): wait for it within its
        deadline, apply its outcome, append its record to `rounds` and return it; None if none runs. The
        training loop calls it once more after its last epoch, so that the last outer step is applied."""
        if self._in_flight is None:
            return None
        running, round_, plan = self._in_flight
        self._in_flight = None
        waited = time.monotonic()
        report = self._await_round(running)
        round_.wait_s = time.monotonic() - waited
        self._note_assembly(report, round_.group_target)
        with self.lock:
            self._resolve(round_, report, plan, alone=False)
        self.rounds.append(round_)
        return round_

    def group_target(self, snapshot: Optional[ProgressSnapshot] = None) -> int:
        """This round's group size: `group_size`, or the number of live peers (trainers and aux, from
        their DHT records) when the swarm is smaller, so a small swarm does not wait the whole
        matchmaking time for members that do not exist."""
        snapshot = snapshot or self.progress.snapshot()
        live = snapshot.num_trainers + snapshot.num_aux
        return max(self.averager.min_group_size, min(self.group_size, live))

    def _matchmaking_window(self) -> float:
        """How long this round waits for its group to fill. With a DropCompute budget the swarm waits
        for nobody past the budget deadline of the epoch (a straggler still inside a micro-batch is
        left out), but at least `_window_floor()` (the time a complete group needs to assemble);
        otherwise `matchmaking_time`."""
        step = self._budget_step
        if step is None or step.tau_s is None:
            return self.matchmaking_time
        return min(self.matchmaking_time, max(step.tau_s - step.elapsed_s, self._window_floor()))

    def _window_floor(self) -> float:
        """The shortest matchmaking window worth trying: how long a complete group took to assemble
        recently (its fastest case, i.e. no member was late), with a margin; at least MIN_BUDGET_WINDOW_S."""
        fastest = min(self._assembly_s, default=0.0)
        return min(self.matchmaking_time, max(MIN_BUDGET_WINDOW_S, ASSEMBLY_MARGIN * fastest))

    def _note_assembly(self, report: Any, target: int) -> None:
        if getattr(report, "ok", False) and int(report.group_size) >= target:
            self._assembly_s = (self._assembly_s + [float(report.matchmaking_s)])[-ASSEMBLY_HISTORY:]

    def _missed_round(self) -> bool:
        """With a budget: this peer arrives after every window of its epoch has closed and the swarm has
        moved on (a fresh read of the DHT shows a later epoch). Averaging now would find nobody, or
        mix gradients of stale parameters into the next epoch."""
        step = self._budget_step
        if step is None or step.tau_s is None:
            return False
        if step.elapsed_s < step.tau_s + self._window_floor():
            return False
        return self.progress.refresh_now(timeout=1.0).global_epoch > self.local_epoch

    def _new_round(self, **fields: Any) -> CollaborativeRound:
        """A round record (CollaborativeRound's fields) that carries the strategy's settings."""
        return CollaborativeRound(settings=self.strategy.settings(), **fields)

    def _swarm_moved_on(self, within: float) -> bool:
        """Whether a trainer's record shows an epoch past ours within `within` seconds: the others averaged
        this epoch without us (their round may still be finishing when ours gives up)."""
        deadline = time.monotonic() + within
        while not self._should_stop():
            if self.progress.refresh_now(timeout=1.0).global_epoch > self.local_epoch:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.progress.wait_for_refresh(timeout=min(0.5, left))
        return False

    def _catch_up_after_missed_round(self, stopped_by_budget: bool) -> Optional[CollaborativeRound]:
        """Drop this epoch's late samples and adopt the state the swarm reached without them."""
        late_samples, epoch = self.samples_accumulated, self.local_epoch
        downloaded = self.catch_up(min_epoch=self.local_epoch + 1)
        if downloaded is None:
            return None  # no donor: average as usual (alone if nobody is left)
        self.dropped_samples += late_samples
        missed = self._new_round(epoch=epoch, samples=0, ok=False, error="missed round; caught up",
                                 stopped_by_budget=stopped_by_budget, dropped_samples=late_samples)
        self.rounds.append(missed)
        return missed

    @property
    def loss_budget(self) -> Any:
        """The averager's `LossBudget` (phase, current budget P)."""
        return self.averager.loss_budget

    def _update_loss_phase(self, round_: CollaborativeRound, report: Any, plan: RoundPlan) -> None:
        """Let the loss budget see this epoch's gradient: the round's average if the strategy averaged one,
        else this peer's mean local gradient."""
        averaged = self.strategy.averaged_gradient(plan) if round_.ok else None
        self._loss_phase.after_round(round_, report, self.averager.loss_budget,
                                     epoch_gradient(averaged, self.grad_sums, self.samples_accumulated))

    def wait_and_average(self, timeout: Optional[float] = None) -> Optional[CollaborativeRound]:
        """Aux peers: take part in the swarm's next averaging round with weight 0.

        The aux follows the trainers' epoch (it computes nothing, so there is nothing of its own to
        keep for an epoch the swarm has finished) and waits in matchmaking as a follower whenever
        trainers are alive, so the trainers' leader finds it already there and the group is complete
        as soon as the trainers arrive: the aux owns a part of every reduce-scatter and all-gather of
        its group (bandwidth) and adds no samples and no weight to any average. Returns the round if it
        averaged with a group, None if no group formed or no trainer showed up before `timeout`.
        """
        if self.role != "aux":
            raise UserError("wait_and_average is for aux peers; trainers call step()")
        deadline = time.monotonic() + (timeout if timeout is not None else self.round_timeout * 3)
        while time.monotonic() < deadline and not self._should_stop():
            snapshot = self.progress.snapshot()
            if snapshot.num_trainers > 0:
                if snapshot.global_epoch > self.local_epoch:
                    with self.lock:
                        self.local_epoch = snapshot.global_epoch
                    self._report_progress(force=True)
                return self._aux_round(snapshot)
            self.progress.wait_for_refresh(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        return None

    @torch.no_grad()
    def _adopt_round(self, round_: CollaborativeRound, report: Any, plan: RoundPlan) -> None:
        """Apply a successful round's averages and copy its report into `round_` (caller holds the lock)."""
        round_.ok = True
        round_.result = report
        round_.group_size = int(report.group_size)
        round_.chunks_lost = int(report.chunks_lost)
        round_.lost_fraction = float(report.lost_fraction)
        round_.matchmaking_s = float(report.matchmaking_s)
        round_.averaging_s = float(report.total_s)
        round_.bytes_sent = int(report.bytes_sent)
        round_.averaged = plan.averages
        round_.param_spread = self.strategy.apply_averaged(plan)

    def _aux_round(self, snapshot: ProgressSnapshot) -> Optional[CollaborativeRound]:
        """One weight-0 round of an aux peer; it advances its epoch only when it averaged."""
        round_ = self._new_round(epoch=self.local_epoch, samples=0, ok=False,
                                 swarm_samples=snapshot.samples_accumulated, num_trainers=snapshot.num_trainers,
                                 group_target=self.group_target(snapshot))
        with self.lock:
            plan = self.strategy.plan_round(self.local_epoch, snapshot)
        report = self._run_round(plan, weight=0.0, target_group_size=round_.group_target,
                                 matchmaking_time=AUX_WINDOW_FACTOR * self.matchmaking_time)
        if report is None or not getattr(report, "ok", False):
            self.failed_rounds += 1
            return None
        with self.lock:
            self._adopt_round(round_, report, plan)
            self._finish_epoch()
        self.rounds.append(round_)
        return round_

    def catch_up(self, min_epoch: int = 0) -> Optional[DownloadedState]:
        """Download the state of the most advanced donor and adopt it; None if no donor delivered."""
        self.settle()  # a round still in the background must not land on the downloaded state
        try:
            downloaded = download_state(self.dht, self.run_id, exclude=(self.peer_id,), min_epoch=min_epoch,
                                        timeout=self.state_download_timeout, show_progress=self.show_progress,
                                        validate=self._check_state_fits)
        except StateDownloadFailed as e:
            logger.warning(f"could not catch up: {e}; training on from epoch {self.local_epoch}")
            return None
        with self.lock:
            self.load_collaborative_state(downloaded.state)
        self.downloads.append(downloaded)
        logger.info(f"caught up: epoch {downloaded.epoch} from {downloaded.donor[-8:]} "
                    f"({downloaded.nbytes} bytes in {downloaded.seconds:.2f} s)")
        self._report_progress(force=True)
        return downloaded

    # ---- state --------------------------------------------------------------------------------

    def collaborative_state(self) -> Dict[str, Any]:
        """Everything a newcomer needs: parameters (and buffers), optimizer state, epoch."""
        with self.lock:
            if self.model is not None:
                model_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            else:
                model_state = {str(i): p.detach().clone() for i, p in enumerate(self.params)}
            return {"format": 1, "epoch": self.local_epoch, "steps": self.local_steps, "model": model_state,
                    "optimizer": self.inner.state_dict(), "has_model": self.model is not None,
                    "error_feedback": error_feedback_state(self.error_feedback),
                    "strategy": self.strategy.state_dict()}

    def load_collaborative_state(self, state: Dict[str, Any]) -> None:
        """Adopt a state from `collaborative_state` (e.g. downloaded): parameters, optimizer, epoch."""
        self._check_state_fits(state)
        with self.lock, torch.no_grad():
            self.strategy.load_state_dict(state.get("strategy") or {})  # checked: it changes nothing if it fails
            if state["has_model"]:
                self.model.load_state_dict(state["model"])
            else:
                for i, p in enumerate(self.params):
                    p.copy_(state["model"][str(i)])
            self.inner.load_state_dict(state["optimizer"])
            if state.get("error_feedback") is not None:
                self._load_error_feedback(state["error_feedback"])
            elif self.error_feedback is not None:
                # The donor keeps none: start ours afresh rather than keep an estimate of other parameters.
                self._load_error_feedback(fresh_error_feedback_state(self.error_feedback))
            self.local_epoch = int(state["epoch"])
            self.local_steps = int(state["steps"])
            self._reset_accumulators()

    def checkpoint_state(self) -> Dict[str, Any]:
        """This peer's own training state for a local checkpoint (moshpeer.peer.checkpoint): the wrapped
        optimizer's state, epoch, steps, the progress of the current epoch (gradient accumulators,
        samples) and the strategy's state (e.g. DiLoCo's outer parameters and momentum). The tensors are the live ones, not copies: snapshot them before training goes on."""
        with self.lock:
            return {"epoch": self.local_epoch, "steps": self.local_steps,
                    "samples_accumulated": self.samples_accumulated, "total_samples": self.total_samples,
                    "grad_accumulators": list(self.grad_sums), "optimizer": self.inner.state_dict(),
                    "strategy": self.strategy.state_dict()}

    def load_checkpoint_state(self, state: Dict[str, Any]) -> None:
        """Continue exactly from a `checkpoint_state()` (the model's parameters are the caller's to load)."""
        saved = state["grad_accumulators"]
        if len(saved) != len(self.grad_sums) or any(
                s.shape != a.shape for s, a in zip(saved, self.grad_sums)):
            raise ValueError("checkpoint's gradient accumulators do not match this model")
        with self.lock, torch.no_grad():
            self.inner.load_state_dict(state["optimizer"])
            self.strategy.load_state_dict(state.get("strategy") or {})
            for acc, value in zip(self.grad_sums, saved):
                acc.copy_(value)
            self.local_epoch, self.local_steps = int(state["epoch"]), int(state["steps"])
            self.samples_accumulated = int(state["samples_accumulated"])
            self.total_samples = int(state["total_samples"])
        self._report_progress(force=True)
        self._advertise()

    def _check_state_fits(self, state: Dict[str, Any]) -> None:
        if state.get("format") != 1 or not isinstance(state.get("epoch"), int):
            raise ValueError("unknown state format")
        if bool(state.get("has_model")) != (self.model is not None):
            raise ValueError("state was saved with a different layout (model vs parameter list)")
        ours = self.model.state_dict() if self.model is not None else {str(i): p for i, p in enumerate(self.params)}
        theirs = state["model"]
        if set(ours) != set(theirs):
            raise ValueError("state has different parameter names")
        for name, tensor in ours.items():
            other = theirs[name]
            if not isinstance(other, torch.Tensor) or other.shape != tensor.shape or other.dtype != tensor.dtype:
                raise ValueError(f"state tensor {name} does not match the model")
            if other.is_floating_point() and not torch.isfinite(other).all():
                raise ValueError(f"state tensor {name} has non-finite values")
        feedback = state.get("error_feedback")
        if feedback is not None and self.error_feedback is not None:
            check_error_feedback_state(self.error_feedback, feedback)
        self.strategy.check_state_dict(state.get("strategy") or {})

    # ---- error feedback -----------------------------------------------------------------------

    def _load_error_feedback(self, feedback: Dict[str, Any]) -> None:
        if self.error_feedback is None:
            logger.info("ignoring an error-feedback state: this optimizer keeps none")
            return
        with self.averager.get_tensors():  # no round may use the state while it changes
            self.error_feedback.load_state_dict(feedback)

    def _serialized_state(self) -> tuple:
        with self.lock:
            if self._state_cache is None or self._state_cache[0] != (self.local_epoch, self.local_steps):
                self._state_cache = ((self.local_epoch, self.local_steps),
                                     serialize_state(self.collaborative_state()))
            return self.local_epoch, self._state_cache[1]

    def _advertise(self) -> None:
        if self.state_server is not None and self.role == "trainer":
            self.state_server.advertise(self.dht, self.local_epoch)
            self._advertised_at = time.monotonic()

    # ---- internals ----------------------------------------------------------------------------

    def _run_round(self, plan: RoundPlan, weight: float, target_group_size: Optional[int] = None,
                   matchmaking_time: Optional[float] = None) -> Any:
        """Run one averaging round in a helper thread; abandon it if a stop is requested."""
        return self._await_round(self._start_round(plan, weight, target_group_size, matchmaking_time))

    def _start_round(self, plan: RoundPlan, weight: float, target_group_size: Optional[int] = None,
                     matchmaking_time: Optional[float] = None) -> tuple:
        """Start one averaging round in a helper thread; `_await_round` gets its report."""
        result: Dict[str, Any] = {}
        window = matchmaking_time if matchmaking_time is not None else self.matchmaking_time

        def target() -> None:
            try:
                result["report"] = self.averager.step(weight=weight, timeout=2 * window,
                                                      target_group_size=target_group_size, matchmaking_time=window,
                                                      tensors=plan.tensors)
            except Exception as e:
                logger.warning(f"averaging round failed: {type(e).__name__}: {e}")
                result["error"] = e

        thread = threading.Thread(target=target, name="moshpeer-round", daemon=True)
        thread.start()
        return thread, result, time.monotonic() + 2 * window + self.round_timeout + 5.0

    def _await_round(self, running: tuple) -> Any:
        """The report of a round from `_start_round`; None if it failed, ran past its deadline or a stop
        was requested meanwhile (the round is then abandoned)."""
        thread, result, deadline = running
        while thread.is_alive():
            thread.join(timeout=0.1)
            if self._should_stop() or time.monotonic() > deadline:
                return None
        return result.get("report")

    def inner_step(self) -> None:
        """One step of the wrapped optimizer on the current `.grad`s (strategies call it), counted."""
        self.inner.step()
        self.local_steps += 1

    def _finish_epoch(self) -> None:
        self.local_epoch += 1
        self._reset_accumulators()
        self._report_progress(force=True)
        self._advertise()

    def _reset_accumulators(self) -> None:
        for acc in self.grad_sums:
            acc.zero_()
        self.samples_accumulated = 0
        self._begin_budget_step()

    def _record_micro_batch(self, batch_size: int) -> None:
        if self._budget_step is not None:
            self._budget_step.record(batch_size)

    def _begin_budget_step(self) -> None:
        """The DropCompute clock of an epoch starts when the previous epoch ended."""
        self._budget_step = self.budget.begin_step(None) if self.budget is not None else None

    def _report_progress(self, force: bool = False) -> None:
        self.progress.report(epoch=self.local_epoch, samples_accumulated=self.samples_accumulated,
                             samples_per_second=self._speed.rate(), step=self.local_steps, force=force,
                             upload_bps=self.averager.upload_bandwidth or 0.0)
        flagged = self.averager.flagged_peers
        if flagged != self._published_flagged:  # robust aggregation clipped someone: say so in our record
            self._published_flagged = dict(flagged)
            self._publish_record(flagged=dict(sorted(flagged.items(), key=lambda kv: -kv[1])[:MAX_FLAGGED_PEERS]))
        if self.state_server is not None and time.monotonic() - getattr(self, "_advertised_at", 0.0) > 5.0:
            self._advertise()

    def shutdown(self, close_averager: bool = True) -> None:
        """Stop the averager, state server, progress thread and (if it is ours) the DHT. Idempotent.

        `close_averager=False` leaves the averager's background loop to die with the process: stopping
        its event loop while hivemind's P2P replica still has pending tasks prints asyncio tracebacks,
        which a process about to exit can do without.
        """
        self._close_averager = close_averager
        for name, stop in (("state server", getattr(self.state_server, "shutdown", None)),
                           ("progress", self.progress.shutdown),
                           ("averager", self._shutdown_averager),
                           ("record", getattr(self._publisher, "withdraw", None) if self._own_dht else None),
                           ("dht", getattr(self._own_dht, "stop", None))):
            if stop is None:
                continue
            try:
                stop()
            except Exception:
                logger.debug(f"shutting down {name} failed", exc_info=True)
        self.state_server = None
        self._own_dht = None

    def _shutdown_averager(self) -> None:
        if self._close_averager:
            self.averager.shutdown()
