"""`EpochLoop`: a trainer's collaborative epochs: progress toward the target batch, rounds, catch-up, ending an epoch.

Life of an epoch (all from the training thread):

    step(n) / account(n) after each micro-batch of n samples: add its gradients (x n) to `counters.grad_sums`
                        when the strategy averages gradients (or the loss budget watches them), let a local
                        strategy take its inner step, publish progress; if `epoch_is_over()`, `end_epoch()`
    epoch_is_over()     this peer computed its share of `target_batch_size` (target / contributing trainers),
                        or the swarm reached the target, or the DropCompute budget is spent (round_timing.py);
                        a strategy that counts its own epochs (DiLoCo's H inner steps) decides instead
    end_epoch()         behind the swarm by more than `max_epoch_lag`: adopt a donor's state instead of
                        averaging stale gradients. Otherwise plan a round (the strategy fills its buffer),
                        run it in the averager within the round's window, apply the group's average, or the
                        peer's own step when no group formed, and start the next epoch
    settle()            an overlapping strategy's round runs while the peer computes the next epoch; it is
                        resolved at the next epoch end (or by this call after the last one)

Failure: a round that fails, is abandoned (deadline, stop request) or finds no group ends the epoch with the peer's
own step and a record whose `error` says why ("alone", "abandoned", the round's error): training never stops for
lack of peers. A strategy that rejoins by update (DiLoCo, gradients) takes the others' update instead when they
averaged its round without it, fetched from one of them, without a search when every other trainer is past its
epoch (missed_round.py); its own work is carried into its next contribution (`carried_samples`, weighed there:
`samples_carried_in`; dropped with spot checks, which cannot recompute it). Failing that, DiLoCo takes their whole
state (a catch-up, which drops that work: `dropped_samples`); without a donor the epoch ends as usual. A peer whose
group averaged a later epoch than its own takes the group's count (`joined_epoch`, epoch_agreement.py) and the step
it missed before that round, or else the group's state; an overlapped Δ that came pending with an adopted state is
stepped on alone, then again on the group's update (lone_step_fetch.py). Nothing here raises for network trouble.

The loop keeps no socket of its own: the host (`EpochHost`, in practice the `CollaborativeOptimizer`) gives
it the averager, the swarm link, the strategy, the round timing and the state catch-up.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from typing import Any, ContextManager, Deque, Dict, Iterator, List, Optional, Protocol, Tuple

import torch

from moshpeer.averaging.loss_budget import LossBudget
from moshpeer.averaging.report import RoundResult
from moshpeer.compression.feedback import ErrorFeedback
from moshpeer.errors import UserError
from moshpeer.peer.optimizer.counters import EpochCounters
from moshpeer.peer.optimizer.epoch_agreement import agreed_epoch
from moshpeer.peer.optimizer.lone_step_fetch import LoneStepFetch
from moshpeer.peer.optimizer.loss_phase import LossPhaseTracker, epoch_gradient
from moshpeer.peer.optimizer.missed_round import MISSED_ROUND_UPDATE, ROUND_OVER, MissedRound
from moshpeer.peer.optimizer.progress import ProgressSnapshot
from moshpeer.peer.optimizer.round_timing import RoundTiming, quorum_eta_s, stragglers_eta_s
from moshpeer.peer.optimizer.rounds import CollaborativeRound
from moshpeer.peer.optimizer.speed_meter import SpeedMeter
from moshpeer.peer.optimizer.trained_apart import TrainedApart
from moshpeer.peer.strategies.base import AveragingStrategy, RoundPlan
from moshpeer.peer.optimizer.swarm_link import SwarmLink

logger = logging.getLogger(__name__)

# The error of an epoch stepped alone because no complete read of the swarm's progress came in (a stale view).
NO_FRESH_VIEW = "no fresh view of the swarm"
NO_DONOR = "behind the swarm, and no donor delivered its state"  # stepped alone: TrainedApart.holds_stale_work
# How an epoch that took a donor's state says so: behind the swarm, back from an outage ahead of it, after missing its
# round, or after meeting a later epoch's round with parameters still apart from the group's (MissedRound.steps_apart).
CAUGHT_UP, REJOINED = "caught up", "back from an outage; took the swarm's state"
MISSED_CAUGHT_UP = "missed round; caught up"
MET_A_LATER_ROUND = "met a later epoch's round; took the group's state"

# A catch-up while training waits this long for a donor in range to be on offer, then trains on and asks again at its
# next epoch end: the most advanced peer may offer nothing (behind a NAT), and waiting out the download's whole
# timeout (60 s) stopped training that long at every epoch end (measured in netlab).
OFFER_WAIT_S = 5.0

# Records kept in `EpochLoop.rounds`, bounded for long runs (round health reads the last 20; `rounds_total` counts all).
ROUND_HISTORY = 256


class RoundRunner(Protocol):
    """What the loop uses of `MoshpitAverager`."""

    min_group_size: int
    loss_budget: Any
    upload_bandwidth: Optional[float]
    flagged_peers: Dict[str, int]
    error_feedback: Optional[ErrorFeedback]  # a round's residual counts only once the loop takes the round

    def step(self, **kwargs: Any) -> Any: ...

    def get_tensors(self) -> ContextManager: ...


class EpochHost(Protocol):
    """What an `EpochLoop` needs from its optimizer."""

    params: List[torch.nn.Parameter]
    lock: threading.RLock  # held while the training state changes (the state server reads under it)
    counters: EpochCounters
    strategy: AveragingStrategy
    averager: RoundRunner
    swarm: SwarmLink
    timing: RoundTiming

    def should_stop(self) -> bool: ...

    def inner_step(self) -> None:
        """One step of the wrapped optimizer, counted in `counters.steps`."""

    def catch_up(self, min_epoch: int, max_epoch: Optional[int] = None,
                 offer_wait_s: Optional[float] = None) -> Optional[Any]:
        """Adopt a donor's state of `min_epoch` or later (up to `max_epoch`; default: just past the swarm epoch);
        None if none delivered, or none in range was on offer within `offer_wait_s`."""

    def fetch_updates(self, epoch: int) -> Iterator[Any]:
        """Updates other peers kept of their round of `epoch` (`AveragingStrategy.kept_update`), one per donor
        that delivered one, until the caller stops asking or the fetch's deadline passes."""

    def advertise(self, force: bool = False) -> None:
        """Offer this peer's state to newcomers (throttled unless `force`)."""


class EpochLoop:
    """A trainer's epochs; see the module docstring.

    :param host: the optimizer (`EpochHost`)
    :param target_batch_size: samples the swarm gathers per epoch
    :param group_size: the largest group a round aims for
    :param max_epoch_lag: adopt a donor's state when the swarm's epoch is ahead by more than this
    :param loss_budget: the loss-budget setting (`parse_loss_budget`; a phase-aware one watches the gradients)
    :param batch_size_per_step: samples behind a `step()` that names none
    :param declares_work: this peer's micro-batches are its data assignment: a round tells its group the epoch and
        `batch_size_per_step`, so that an owner can spot-check it (moshpeer/peer/accountability/)
    """

    def __init__(self, host: EpochHost, *, target_batch_size: int, group_size: int, max_epoch_lag: int,
                 loss_budget: LossBudget, batch_size_per_step: Optional[int] = None, declares_work: bool = False):
        self.host, self.counters, self.lock = host, host.counters, host.lock
        self.target_batch_size, self.group_size = target_batch_size, group_size
        self.max_epoch_lag, self.batch_size_per_step = max_epoch_lag, batch_size_per_step
        self.loss_budget_setting, self.declares_work = loss_budget, declares_work
        self.rounds: Deque[CollaborativeRound] = collections.deque(maxlen=ROUND_HISTORY)
        self.rounds_total = self.rounds_ok = 0
        self.speed, self._loss_phase = SpeedMeter(), LossPhaseTracker()
        self.apart = TrainedApart()  # epochs trained cut off from the swarm (an outage)
        self._apart_published: Optional[int] = None  # what our record's `apart_since` says
        self.missed_round, self.lone_step = MissedRound(host), LoneStepFetch(host)
        # Overlapping strategies: (round future or None if alone, plan, facts, error) of the round to settle.
        self._in_flight: Optional[tuple] = None

    # ---- micro-batches ------------------------------------------------------------------------

    def step(self, batch_size: Optional[int] = None) -> Optional[CollaborativeRound]:
        """What `optimizer.step()` does on a trainer: `account` for `batch_size` samples (default:
        `batch_size_per_step`); UserError when neither is given."""
        batch_size = batch_size if batch_size is not None else self.batch_size_per_step
        if batch_size is None:
            raise UserError("pass step(batch_size=...) or set batch_size_per_step")
        return self.account(int(batch_size))

    @torch.no_grad()
    def account(self, batch_size: int) -> Optional[CollaborativeRound]:
        """Account for the gradients in `.grad`, computed from `batch_size` samples, and end the epoch if it is
        over; returns what `end_epoch` returned then, else None."""
        host, counters = self.host, self.counters
        with host.lock:
            # Gradient sums are what the gradients strategy averages; the others keep them only as the phase
            # signal of a phase-aware loss budget.
            if host.strategy.accumulates_gradients or self.loss_budget_setting.phase_aware:
                for acc, p in zip(counters.grad_sums, host.params):
                    if p.grad is not None:
                        acc.add_(p.grad, alpha=float(batch_size))
            if host.strategy.steps_locally:
                host.inner_step()
            counters.samples += batch_size
            counters.total_samples += batch_size
            host.strategy.on_micro_batch(batch_size)
        self.speed.add(batch_size)
        host.timing.record_micro_batch(batch_size)
        self.report_progress()
        return self.end_epoch() if self.epoch_is_over() else None

    def epoch_is_over(self) -> bool:
        """Whether this peer should average now (see the module docstring)."""
        counted = self.host.strategy.epoch_is_over()
        if self.host.timing.budget_spent() or counted:
            return True
        if counted is not None:  # the strategy's own count says not yet; its quorum may end the epoch early
            return self._quorum_eta_s() == 0.0
        snapshot = self.host.swarm.progress.snapshot()
        return snapshot.ready or self.counters.samples + self.host.strategy.head_start() >= self.share(snapshot)

    def share(self, snapshot: Optional[ProgressSnapshot] = None) -> int:
        """This peer's share of the target batch: target / live trainers whose samples count, rounded up."""
        snapshot = snapshot or self.host.swarm.progress.snapshot()
        return math.ceil(self.target_batch_size / max(snapshot.contributing_trainers, 1))

    def group_target(self, snapshot: Optional[ProgressSnapshot] = None) -> int:
        """This round's group size: `group_size`, or the number of live peers (trainers and aux) when the swarm
        is smaller, so a small swarm does not wait the whole matchmaking time for members that do not exist.
        Trainers count once this peer has evidence that they average (witnesses.py), and one more without it: a
        newcomer is seen averaging only once a group takes it in, but records of trainers that never average
        (Sybils, issue 26) would make every round wait out its window for them."""
        snapshot = snapshot or self.host.swarm.progress.snapshot()
        unproven = snapshot.num_trainers - snapshot.contributing_trainers
        live = snapshot.contributing_trainers + min(unproven, 1) + snapshot.num_aux
        return max(self.host.averager.min_group_size, min(self.group_size, live))

    # ---- the end of an epoch ------------------------------------------------------------------

    def end_epoch(self) -> CollaborativeRound:
        """End this peer's epoch now: catch up if behind, else average and step (alone if no group). Returns the
        epoch's record; with an overlapping strategy the record of the round resolved now (the previous epoch's,
        a lone step included: it too is taken at the next epoch end), or at the first epoch end, whose round is
        still in flight, a record with error "round in flight" that `rounds` does not keep. SwarmLost when this
        peer's DHT process is gone (swarm_link.py)."""
        host = self.host
        host.swarm.check_alive()
        snapshot = host.swarm.progress.current()  # read again if the view is stale (a pause, failed reads)
        facts = dict(stopped_by_budget=host.timing.end_compute(), swarm_samples=snapshot.samples_accumulated,
                     swarm_samples_capped=snapshot.samples_capped, num_trainers=snapshot.num_trainers)
        epoch = self.counters.epoch
        back = self._rejoin_after_outage(snapshot, facts)
        if back is not None:
            return back
        in_step_from = snapshot.global_epoch - self.max_epoch_lag  # behind it, our gradients are for stale parameters
        caught = self._catch_up_instead(in_step_from, CAUGHT_UP, facts) if in_step_from > epoch else None
        if caught is not None:
            return caught
        self.apart.note_behind(in_step_from > epoch)  # and no donor delivered (trained_apart.py)
        # On a stale view (progress.py's `current`) this peer may be far behind without knowing it: it averages nothing.
        alone = snapshot.num_trainers + snapshot.num_aux <= 1 or snapshot.stale
        lone_why = NO_FRESH_VIEW if snapshot.stale else "alone"
        # With a budget, one that came after every window of its epoch closed would find nobody, or mix stale work in.
        if not alone and host.timing.too_late_for_round() and host.swarm.moved_past(epoch, 0.0, host.should_stop):
            missed = self._catch_up_instead(epoch + 1, MISSED_CAUGHT_UP, facts)
            if missed is not None:
                return missed
        resolved = self.settle() if host.strategy.overlaps else None
        target = self.group_target(snapshot)
        stragglers = self._stragglers(snapshot)
        window = host.timing.matchmaking_window(target, stragglers)
        plan = self.plan_round(snapshot)
        carried_in = self.counters.carried.get(plan.fragment, 0)
        facts.update(epoch=epoch, samples=self.counters.samples, samples_carried_in=carried_in, group_target=target,
                     matchmaking_window_s=window, stragglers_eta_s=stragglers)
        over = not alone and self.missed_round.round_over(epoch, snapshot.peers)  # it stalled through the others' round
        if not (alone or over or host.strategy.overlaps) and self.apart.holds_stale_work:  # work no donor replaced
            alone, lone_why = True, NO_DONOR
        if alone and not host.strategy.overlaps:  # a lone peer does not wait for a group that cannot form
            return self.finish_round(plan, None, lone_why, wait_s=0.0, **facts)
        # Weight: the samples this contribution holds. Work carried in from an earlier epoch is not checkable.
        work = (epoch, self.batch_size_per_step) if self.declares_work and not carried_in else None
        future = None if alone or over else self.start_round(plan, float(self.counters.samples + carried_in), target,
                                                             window, hold_s=host.timing.straggler_hold(stragglers),
                                                             work=work)
        if host.strategy.overlaps:
            # Resolved at the next epoch end (settle), as is a lone peer's step on its own Δ: one round per epoch end.
            self._in_flight = (future, plan, facts, lone_why if alone else None)
            self.lone_step.start(future)  # the plan stepped alone on a Δ pending in an adopted state: find the group's
            with host.lock:
                self._next_epoch()
            return resolved or CollaborativeRound(epoch=epoch, samples=0, error="round in flight",
                                                  settings=host.strategy.settings())
        started = time.monotonic()
        result = RoundResult(ok=False, error=ROUND_OVER) if over else host.timing.await_result(future, host.should_stop)
        if over or self.missed_round.missed(result, plan):  # (over: the records said so already)
            update = self.missed_round.fetch_update(plan)
            if update is not None:
                return self.finish_round(plan, result, MISSED_ROUND_UPDATE, update=update,
                                         wait_s=time.monotonic() - started, **facts)
            missed = self._catch_up_instead(epoch + 1, MISSED_CAUGHT_UP, facts) \
                if host.strategy.needs_state_after_missing(plan) else None
            if missed is not None:
                return missed
        step_before = self.missed_round.step_before(plan, result)
        record = self.finish_round(plan, result, None, step_before=step_before, wait_s=time.monotonic() - started,
                                   **facts)
        if self.missed_round.steps_apart(plan, record.joined_epoch, step_before is not None):
            # Its parameters lack steps the group took (it met a round two or more epochs on, or nobody served the
            # step it missed): the group's state instead; the round's record stands (its work went into the average).
            self._catch_up_instead(record.joined_epoch + 1, MET_A_LATER_ROUND, dict(facts, samples=0))
        return record

    def _stragglers(self, snapshot: ProgressSnapshot) -> float:
        """How long the trainers still computing this epoch need, by their records (round_timing.stragglers_eta_s):
        to reach this peer's own count for a strategy that counts its own epochs, else to reach the share of the
        target batch that every trainer computes (0 once the swarm reached the target): a trainer that ends its
        share just before a slower mate keeps its group open for it instead of averaging without it."""
        if self.host.strategy.epoch_is_over() is not None:
            epoch_samples = self.counters.samples
        elif snapshot.ready:
            return 0.0
        else:
            epoch_samples = self.share(snapshot)
        return stragglers_eta_s(snapshot.peers, self.counters.epoch, epoch_samples, self.host.swarm.peer_id)

    def _quorum_eta_s(self) -> float:
        """For a strategy with a quorum (DiLoCo's `quorum`): seconds until trainers holding that share of the
        swarm's compute have ended this epoch, by their records (round_timing.quorum_eta_s); inf without a
        quorum, or before this peer has computed anything this epoch (a round needs its Δ)."""
        strategy = self.host.strategy
        steps_left = strategy.steps_to_epoch_end()
        if not strategy.quorum or steps_left is None or self.counters.samples == 0:
            return math.inf
        epoch_samples = self.counters.samples + round(steps_left * self.speed.mean_batch())
        return quorum_eta_s(self.snapshot().peers, self.counters.epoch, epoch_samples, self.host.swarm.peer_id,
                            self.speed.seconds_for(steps_left), self.speed.rate(), strategy.quorum)

    def settle(self) -> Optional[CollaborativeRound]:
        """Resolve the round still running in the background (overlapping strategies): wait for it within its
        deadline, apply its outcome, record it and return it; None if none runs. The training loop calls it once
        more after its last epoch, so that the last outer step is applied."""
        if self._in_flight is None:
            return None
        (future, plan, facts, error), self._in_flight = self._in_flight, None
        waited = time.monotonic()
        result = self.host.timing.await_result(future, self.host.should_stop) if future is not None else None
        self.lone_step.settle(result)  # before the round's outcome: it was sent from where that step left θ_outer
        missed = future is not None and self.missed_round.missed(result, plan)
        update = self.missed_round.fetch_update(plan) if missed else None
        if update is not None:
            error = MISSED_ROUND_UPDATE
        with self.host.lock:
            record = self._resolve(plan, result, error, update=update, wait_s=time.monotonic() - waited, **facts)
        self._remember(record)
        return record

    def plan_round(self, snapshot: ProgressSnapshot) -> RoundPlan:
        """The strategy fills its buffer for this epoch's round."""
        # The averager's lock: a round abandoned earlier may still be writing into the buffer.
        with self.host.lock, self.host.averager.get_tensors():
            return self.host.strategy.plan_round(self.counters.epoch, snapshot)

    def start_round(self, plan: RoundPlan, weight: float, target: int, window: float, hold_s: float = 0.0,
                    work: Optional[Tuple[int, int]] = None) -> Any:
        """Start one averaging round in the averager's round thread; its `RoundFuture`. The group waits up to
        `window` to fill, and at least `hold_s` (members known to be on their way)."""
        timing = self.host.timing
        spread = timing.upload_spread() if self.host.strategy.paces_uploads else 0.0
        return self.host.averager.step(weight=weight, timeout=timing.search_time_for(window),
                                       target_group_size=target, matchmaking_time=window, tensors=plan.tensors,
                                       averaged=plan.averages, upload_spread_s=spread, hold_s=hold_s, work=work,
                                       epoch=plan.epoch, digest=plan.digest, wait=False)

    def finish_round(self, plan: RoundPlan, result: Optional[RoundResult], error: Optional[str],
                     update: Optional[Any] = None, step_before: Optional[Any] = None, **facts: Any
                     ) -> CollaborativeRound:
        """Apply the round's outcome (`result` None or failed: the fitted `update` of the others' round if one
        came, else the peer's own step; `step_before`: a fitted update to apply before the group's average, see
        `MissedRound.step_before`), record the epoch and start the next one."""
        with self.host.lock:
            record = self._resolve(plan, result, error, update=update, step_before=step_before, **facts)
            self._next_epoch()
        if record.ok:
            self.apart.synced(self.counters.epoch, self.counters.total_samples)
        self._remember(record)
        return record

    @torch.no_grad()
    def _resolve(self, plan: RoundPlan, result: Optional[RoundResult], error: Optional[str],
                 update: Optional[Any] = None, step_before: Optional[Any] = None, **facts: Any) -> CollaborativeRound:
        """Apply a round's outcome: the group's average, the others' fitted `update` (this peer missed their round: its
        own work is carried into its next contribution, or dropped with spot checks), or its own step (lock held)."""
        strategy, ok = self.host.strategy, result is not None and result.ok
        carry = update is not None and not self.declares_work  # spot checks cannot recompute carried work
        if ok:
            self.host.swarm.progress.note_round(facts["epoch"], result.contributors)
            if self.host.averager.error_feedback is not None:
                self.host.averager.error_feedback.commit()
            joined = facts["joined_epoch"] = agreed_epoch(plan.epoch, result.member_epochs)
            if joined is not None:  # the group's round was of a later epoch: take its count (epoch_agreement.py),
                step = f" and the step of epoch {plan.epoch} before it" if step_before is not None else ""
                logger.info(f"the group of this peer's round of epoch {plan.epoch} averaged epoch {joined}: taking "
                            f"that count{step}")
                if step_before is not None:  # the others' step of our epoch first, as they took it
                    strategy.apply_update(plan, step_before, carry=False)
                self.counters.epoch += joined - plan.epoch
                plan = dataclasses.replace(plan, epoch=joined)  # and keep its update under that epoch
            spread = strategy.apply_averaged(plan, result.members_diverged)
        elif update is not None:
            spread = strategy.apply_update(plan, update, carry=carry)
            own = facts["samples"] + facts.get("samples_carried_in", 0)
            self.counters.dropped_samples += 0 if carry else own
            facts.update(samples=0, **{"carried_samples" if carry else "dropped_samples": own})
        else:
            spread = strategy.apply_alone(plan)
        if carry:
            self.counters.carried[plan.fragment] = facts["carried_samples"]
        else:  # averaged or stepped alone (the carried work went into that step), or dropped with this epoch's
            self.counters.carried.pop(plan.fragment, None)
        if not ok:
            error = error or (result.error if result is not None else "abandoned")
        grads = epoch_gradient(strategy.averaged_gradient(plan) if ok else None, self.counters.grad_sums,
                               self.counters.samples)
        phase, budget, norm = self._loss_phase.after_round(facts["epoch"], result, self.host.averager.loss_budget,
                                                           grads)
        return CollaborativeRound(result=result, error=error, param_spread=spread, loss_phase=phase,
                                  loss_budget=budget, grad_norm=norm, settings=strategy.settings(), **facts)

    def _catch_up_instead(self, min_epoch: int, why: str, facts: dict, max_epoch: Optional[int] = None,
                          earlier_dropped: int = 0) -> Optional[CollaborativeRound]:
        """Drop this epoch's samples (and `earlier_dropped` more, of earlier epochs) and adopt a donor's state of
        `min_epoch` or later (up to `max_epoch`); None if no donor."""
        stale, epoch = self.counters.samples + earlier_dropped, self.counters.epoch
        self.settle()  # a round still in the background must not land on the downloaded state
        if self.host.catch_up(min_epoch, max_epoch, offer_wait_s=OFFER_WAIT_S) is None:
            return None
        stale += sum(self.counters.carried.values())  # the downloaded parameters replace the carried work too
        self.counters.carried.clear()
        self.apart.synced(self.counters.epoch, self.counters.total_samples - self.counters.samples)
        self.counters.dropped_samples += stale
        self.report_progress(force=True)
        record = CollaborativeRound(**{**facts, "epoch": epoch, "samples": 0, "error": why, "dropped_samples": stale,
                                       "settings": self.host.strategy.settings()})
        self._remember(record)
        return record

    def _rejoin_after_outage(self, snapshot: ProgressSnapshot, facts: dict) -> Optional[CollaborativeRound]:
        """Back from an outage it trained through alone: adopt the other trainers' state instead of pulling them to
        its lone epochs or averaging its lone parameters into theirs (trained_apart.py); None when that is not the
        case or no donor delivered. Without a fresh view of the swarm (its DHT stalled) its epochs end alone too: that
        is an outage as well."""
        apart, epoch = self.apart, self.counters.epoch
        out_of_touch = self.host.swarm.cut_off() or snapshot.stale  # no DHT neighbour, or no fresh read of the swarm
        apart.observe(out_of_touch, epoch, self.counters.total_samples - self.counters.samples)
        target = apart.rejoin_epoch(epoch, snapshot.others_epoch, self.max_epoch_lag, out_of_touch)
        back = None
        if target is not None:
            solo = apart.samples_apart(self.counters.total_samples)
            logger.warning(f"back from an outage at epoch {epoch}, the other trainers at {target}: this peer trained "
                           f"alone since epoch {apart.since_epoch}; taking their state ({solo} samples of its own "
                           f"dropped)")
            back = self._catch_up_instead(target - self.max_epoch_lag, REJOINED, facts, max_epoch=max(epoch, target),
                                          earlier_dropped=max(0, solo - self.counters.samples))
            if apart.attempted(back is not None) and back is None:
                logger.warning(f"no donor at the others' epoch after {apart.max_attempts} tries: training on from "
                               f"epoch {epoch}; the others will follow this peer")
        if apart.since_epoch != self._apart_published:  # readers leave our epochs out while we are apart
            self._apart_published = apart.since_epoch
            self.host.swarm.publish(apart_since=apart.since_epoch)
        return back

    def _next_epoch(self) -> None:
        self.counters.epoch += 1
        self.restart_epoch()
        self.report_progress(force=True)
        self.host.advertise(force=True)

    def restart_epoch(self) -> None:
        """Forget this epoch's accumulators; its compute budget starts now."""
        self.counters.reset_epoch()
        self.host.timing.begin_epoch()

    def _remember(self, record: CollaborativeRound) -> None:
        self.rounds.append(record)
        self.rounds_total, self.rounds_ok = self.rounds_total + 1, self.rounds_ok + record.ok

    # ---- presence -----------------------------------------------------------------------------

    def report_progress(self, force: bool = False) -> None:
        """Publish this peer's epoch, samples and speed (throttled unless `force`), and whom its averaging flagged."""
        host = self.host
        rate, steps_left = self.speed.rate(), host.strategy.steps_to_epoch_end()
        epoch_eta_s = None if steps_left is None else min(self.speed.seconds_for(steps_left), self._quorum_eta_s())
        host.swarm.progress.report(epoch=self.counters.epoch, samples_accumulated=self.counters.samples,
                                   samples_per_second=rate, step=self.counters.steps, force=force,
                                   upload_bps=host.averager.upload_bandwidth or 0.0, epoch_eta_s=epoch_eta_s)
        host.swarm.publish_flagged(host.averager.flagged_peers)
        host.advertise()

    def snapshot(self) -> ProgressSnapshot:
        """The swarm's progress as last read (no DHT access)."""
        return self.host.swarm.progress.snapshot()

    def swarm_epoch_reached(self) -> int:
        """The highest epoch this peer saw the swarm reach, kept after its trainers withdrew."""
        return self.host.swarm.progress.swarm_epoch_reached

    def wait_for_refresh(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the next read of the swarm's progress."""
        self.host.swarm.progress.wait_for_refresh(timeout=timeout)

    def await_result(self, future: Any) -> Optional[RoundResult]:
        """A started round's result within its deadline; None if it failed or was abandoned (round_timing.py)."""
        return self.host.timing.await_result(future, self.host.should_stop)

    def aux_window(self) -> float:
        """How long an aux peer waits in matchmaking (round_timing.py)."""
        return self.host.timing.aux_window()

    def wait_for_peers(self, min_trainers: int, timeout: float) -> int:
        """Block until at least `min_trainers` trainers (this one included) are visible, or `timeout` passes, or
        a stop is requested; returns how many are visible."""
        visible = self.host.swarm.wait_for_trainers(min_trainers, timeout, self.host.should_stop)
        if self.counters.samples == 0:
            self.host.timing.begin_epoch()  # waiting for peers is not this epoch's compute time
        return visible
