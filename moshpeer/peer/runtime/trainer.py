"""The training peer: the loop `moshpeer join` runs for a task, on top of `CollaborativeOptimizer`.

    daemon = PeerDaemon(run_id, initial_peers=[...]); daemon.start()
    summary = run_training(daemon, load_task("digits"), TrainerConfig(max_epochs=30))

It prints one JSON line per collaborative epoch on stdout (`{"event": "epoch", ...}`: epoch,
loss, metric, samples/s, group size, lost chunks, parameter spread, swarm progress) and one
`{"event": "done", ...}` line at the end, for tests, benchmarks and `moshpeer demo` to parse.
Other events: "state_loaded" (after a state download), "training" (once, with the settings).

With a checkpoint policy (`moshpeer join --checkpoint-dir`): "resumed" (started from a checkpoint:
file, epoch, step, digests), "checkpoint_stale" (the swarm is further ahead than the staleness limit:
the peer downloads state instead), "checkpoint" (kind "periodic" when a background write starts,
"final" once the checkpoint on the way out is durable). See docs/checkpoints.md.

Each peer reads its own shuffle of the training data (seeded by its peer id), so peers contribute
different samples. Stop conditions: `max_epochs`, `max_seconds`, `target_metric`, or the daemon's
stop request (SIGTERM), checked between micro-batches so a stop is never delayed by more than one
micro-batch plus one bounded averaging round. With a grace period (checkpoints on), the averaging
round in flight at a stop is finished if it fits before the daemon's deadline with time left for the
final checkpoint, and abandoned otherwise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Optional, Union

import torch

from moshpeer.dht.local_address import ALL_INTERFACES, listens_on_all_interfaces, remote_hosts, visible_host
from moshpeer.peer.accountability import AssignedBatches, SpotChecker
from moshpeer.peer.accountability.spot_checks import FAILED, PASSED
from moshpeer.peer.checkpoint.directory import newest_on_disk
from moshpeer.peer.checkpoint.staleness import Start, start_decision
from moshpeer.peer.checkpoint.store import SaveHandle
from moshpeer.peer.checkpoint.training import CheckpointPolicy, PeerCheckpointer, ResumePoint, state_digest
from moshpeer.peer.optimizer.dropcompute import BudgetSetting
from moshpeer.peer.runtime.straggler import StragglerDelay
from moshpeer.peer.runtime.health import round_health
from moshpeer.peer.runtime.metrics import PeerMetrics
from moshpeer.peer.optimizer import CollaborativeOptimizer
from moshpeer.peer.optimizer.rounds import CollaborativeRound
from moshpeer.peer.strategies.base import AveragingStrategy
from moshpeer.peer.tasks import Task

logger = logging.getLogger(__name__)

# How long a starting peer retries reading the swarm's progress before it decides whether to download state.
STARTUP_VIEW_TIMEOUT_S = 20.0
# An aux learns that the trainers are done from their records' epoch. Trainers withdraw their records right
# after their last epoch, so an aux waiting in matchmaking then may never see that epoch: one epoch short of
# --max-epochs, with no trainer visible for this long (after it saw some), it is done too.
AUX_ORPHANED_S = 5.0

Emit = Callable[[Dict[str, Any]], None]


@dataclass
class TrainerConfig:
    """Settings of one training peer (CLI flags of `moshpeer join`)."""

    target_batch_size: Optional[int] = None  # default: the task's
    batch_size: Optional[int] = None  # micro-batch; default: the task's
    # A strategy name (default options) or an `AveragingStrategy` carrying its options, e.g.
    # DiLoCoStrategy(inner_steps=50); the CLI builds one from its flags (cli/join.py).
    averaging: Union[str, AveragingStrategy] = "gradients"
    compression: str = "none"
    error_feedback: bool = False  # EF21M state around a sparsifying codec (arc-topk)
    group_size: int = 4
    compute_budget: BudgetSetting = None
    role: str = "trainer"
    max_epochs: Optional[int] = None
    max_seconds: Optional[float] = None
    target_metric: Optional[float] = None
    eval_every: int = 1  # epochs between evaluations (always at the end)
    min_peers: int = 1  # wait (bounded) until this many trainers are visible before training
    wait_peers_timeout: float = 60.0
    matchmaking_time: float = 1.0
    round_timeout: float = 10.0
    seed: Optional[int] = None  # data shuffle seed; default: derived from the peer id
    straggler: Optional[StragglerDelay] = None  # injected compute delay per micro-batch (tests, benchmarks)
    state_bytes_per_second: Optional[float] = None  # throttle this peer's state donations (tests)
    loss_budget: Any = None  # DBLP: None/"fixed" (baseline), P, "P_LOW,P_HIGH" or "phase"; see loss_budget.py
    phase_threshold: float = 0.5  # relative change of the gradient norm that marks a critical phase
    phase_window: Optional[int] = None  # collaborative epochs per phase-signal window (None: the default, 5)
    show_progress: bool = False
    checkpoint: Optional[CheckpointPolicy] = None  # periodic checkpoints, resume, final checkpoint
    averager_kwargs: Dict[str, Any] = field(default_factory=dict)
    # Train on this peer's data assignment and spot-check a sampled contribution with this probability after each
    # round (moshpeer/peer/accountability/); None: off.
    spot_checks: Optional[float] = None


@dataclass
class TrainingSummary:
    epochs: int
    samples: int
    seconds: float
    metrics: Dict[str, float]
    reason: str


def params_digest(model: torch.nn.Module) -> str:
    """A short digest of the model's parameters (to check that peers hold identical state)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        # Raw bytes, whatever the dtype (numpy has no bfloat16).
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def emit_json(event: Dict[str, Any]) -> None:
    """Write one JSON progress line to stdout, flushed at once."""
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def run_training(daemon: Any, task: Task, config: TrainerConfig, emit: Emit = emit_json,
                 peer_metrics: Optional[PeerMetrics] = None) -> TrainingSummary:
    """Train `task` as a peer of `daemon`'s run until a stop condition; see the module docstring.
    With `peer_metrics`, every round, epoch, state download and checkpoint write updates them."""
    model = task.model
    model.train()
    target = config.target_batch_size or task.target_batch_size
    micro = config.batch_size or task.batch_size
    started = time.monotonic()
    checkpointer = resume = None
    averager_kwargs = dict(config.averager_kwargs)
    if config.checkpoint is not None:
        checkpointer = PeerCheckpointer(config.checkpoint, task_name=task.name, fingerprint=task.fingerprint)
        resume = checkpointer.load()
        if resume is not None and resume.group_bits is not None:
            averager_kwargs.setdefault("grid_bits", resume.group_bits)  # back to its place in the grid
    in_step = threading.Event()  # set while the optimizer may be averaging (see _round_may_finish)
    assigned = config.spot_checks is not None and config.role == "trainer"
    optimizer = CollaborativeOptimizer(
        task.make_optimizer(model.parameters()), run_id=daemon.run_id, daemon=daemon, model=model,
        target_batch_size=target, batch_size_per_step=micro, averaging=config.averaging,
        compression=config.compression, error_feedback=config.error_feedback, group_size=config.group_size,
        compute_budget=config.compute_budget, loss_budget=config.loss_budget, phase_threshold=config.phase_threshold,
        phase_window=config.phase_window,
        role=config.role, matchmaking_time=config.matchmaking_time, round_timeout=config.round_timeout,
        state_bytes_per_second=config.state_bytes_per_second, show_progress=config.show_progress,
        should_stop=lambda: daemon.stop_requested and not _round_may_finish(daemon, checkpointer, in_step),
        averager_kwargs=averager_kwargs, host=_listen_host(daemon), assigned_data=assigned,
        **({"max_epoch_lag": max(config.checkpoint.max_staleness, 1)} if config.checkpoint else {}),
    )
    daemon.add_shutdown_hook(optimizer.shutdown, name="collaborative optimizer")
    seed = config.seed if config.seed is not None else int(hashlib.sha256(daemon.peer_id.encode()).hexdigest()[:8], 16)
    stream = checker = None
    if assigned:  # the data follows from the run, the peer id and the epoch (accountability/assignment.py)
        stream = AssignedBatches(task, micro, daemon.run_id, daemon.peer_id, lambda: optimizer.local_epoch)
        checker = SpotChecker(task, daemon.run_id, optimizer.params, config.spot_checks)
    elif config.role == "trainer":
        stream = task.open_batches(micro, seed=seed)
    micro_steps = 0  # micro-batches computed by this peer: the `step` of its checkpoints
    if checkpointer is not None:
        checkpointer.attach(model, optimizer, stream)
        if resume is not None:
            checkpointer.restore(resume)
            micro_steps = resume.step
            emit({"event": "resumed", "file": resume.meta.path.name, "epoch": optimizer.local_epoch,
                  "step": micro_steps, "params_digest": params_digest(model),
                  "state_digest": state_digest(checkpointer.capture(micro_steps)),
                  "time": round(time.monotonic() - started, 3)})
        # Registered after the optimizer's hook, so it runs before it (hooks run newest first): if the
        # training loop did not get to its final checkpoint in time, it is written here. Registered only
        # once the state is restored, so a failed restore never saves a fresh model over the checkpoint.
        daemon.add_shutdown_hook(lambda: _final_checkpoint(checkpointer, micro_steps, daemon, emit),
                                 name="final checkpoint")
    emit({"event": "training", "task": task.name, "peer_id": daemon.peer_id, "role": config.role,
          "device": str(task.device), "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
          "target_batch_size": target, "batch_size": micro, "averaging": optimizer.averaging,
          "group_size": config.group_size, "compression": config.compression,
          "compute_budget": config.compute_budget, "fingerprint": task.fingerprint,
          "loss_budget": optimizer.loss_budget.describe(), **optimizer.strategy.settings()})

    _wait_for_peers(daemon, optimizer, config)
    # Whether to download decides on a view of the swarm, not on a DHT read that timed out under load.
    snapshot = optimizer.progress.refresh_now(retry_for=STARTUP_VIEW_TIMEOUT_S,
                                              should_stop=lambda: daemon.stop_requested)
    if _should_download(snapshot.global_epoch, optimizer.local_epoch, resume, config, emit) \
            and not daemon.stop_requested:
        downloaded = optimizer.catch_up(min_epoch=max(snapshot.global_epoch - optimizer.max_epoch_lag, 1))
        if downloaded is None and resume is not None:
            logger.warning(f"no peer delivered fresher state: training on from the checkpoint (epoch {resume.epoch})")
        if downloaded is not None:
            emit({"event": "state_loaded", "epoch": downloaded.epoch, "donor": downloaded.donor,
                  "sha256": downloaded.sha256, "bytes": downloaded.nbytes, "seconds": round(downloaded.seconds, 3),
                  "params_digest": params_digest(model), "failed_donors": [d for d, _ in downloaded.failed_donors],
                  "confirmation": downloaded.confirmation,
                  "time": round(time.monotonic() - started, 3)})
            if peer_metrics is not None:
                peer_metrics.observe_state_download(seconds=downloaded.seconds, nbytes=downloaded.nbytes,
                                                    failed_donors=len(downloaded.failed_donors))

    train_started = time.monotonic()  # after waiting for peers and catching up: time spent training
    emit({"event": "started", "epoch": optimizer.local_epoch, "step": micro_steps,
          "time": round(train_started - started, 3)})
    metrics: Dict[str, float] = {}
    reason = "stopped"
    loss_sum, loss_count = 0.0, 0
    trainers_seen_at: Optional[float] = None  # an aux: when it last saw a live trainer
    writing: Optional[SaveHandle] = None  # the periodic checkpoint being written in the background
    while True:
        if daemon.stop_requested:
            reason = "stopped"
            break
        if config.max_seconds is not None and time.monotonic() - started >= config.max_seconds:
            reason = "max_seconds"
            break
        epoch_before = optimizer.local_epoch
        if stream is not None:
            if checker is not None:
                checker.start_epoch(optimizer.local_epoch)
            batch = next(stream)
            if config.straggler is not None:
                config.straggler()
            loss, count = task.loss(model, batch)
            loss.backward()
            loss_sum += loss.item() * count
            loss_count += count
            _optimizer_call(lambda: optimizer.step(batch_size=count), checkpointer, in_step)
            optimizer.zero_grad()
            micro_steps += 1
        else:
            _optimizer_call(lambda: optimizer.wait_and_average(timeout=1.0), checkpointer, in_step)
            if optimizer.progress.snapshot().num_trainers > 0:
                trainers_seen_at = time.monotonic()
        # The record of the epoch this call ended; with an overlapping strategy (DiLoCo with overlap) the round
        # resolved now, the previous epoch's (a "round in flight" record at the first epoch end).
        round_ = optimizer.ended_round
        if checkpointer is not None and not daemon.stop_requested:
            writing = _announce_written(writing, emit) or checkpointer.maybe_save(micro_steps)
        if peer_metrics is not None and checkpointer is not None:
            peer_metrics.observe_checkpoints(checkpointer.store.stats)  # background writes that finished
        if round_ is None and optimizer.local_epoch == epoch_before:
            if stream is None and (_reached_limit(optimizer, config) or _trainers_finished(
                    optimizer.local_epoch, config.max_epochs, trainers_seen_at, time.monotonic())):
                reason = "max_epochs"  # an aux peer follows the trainers' epoch: they are done
                break
            continue
        if round_ is None:  # the epoch moved without a record of ours: an aux peer followed the trainers' epoch
            round_ = CollaborativeRound(epoch=epoch_before, samples=0, error="round in flight",
                                        settings=optimizer.strategy.settings())
        if checker is not None:
            _spot_check(checker, round_, optimizer, emit)
        evaluate = optimizer.local_epoch % max(config.eval_every, 1) == 0 or _reached_limit(optimizer, config)
        if evaluate:
            metrics = task.metrics(model)
        # Metrics and the record first: whoever reads the epoch line finds them up to date.
        daemon.update_record(round_health=round_health(optimizer.rounds), target_batch_size=target)  # for status
        if peer_metrics is not None:
            peer_metrics.observe_round(round_)
            peer_metrics.observe_refusals(daemon.dht.admission.refused)
            peer_metrics.observe_training(samples_per_second=optimizer.samples_per_second,
                                          loss=loss_sum / loss_count if loss_count else None,
                                          metrics=metrics if evaluate else None)
        emit({  # the epoch's record and its round result, serialised here, once
            **round_.to_dict(),
            "event": "epoch", "epoch": optimizer.local_epoch, "previous_epoch": epoch_before,
            "time": round(time.monotonic() - started, 3),
            "train_time": round(time.monotonic() - train_started, 3),
            "loss": round(loss_sum / loss_count, 5) if loss_count else None,
            "metric": metrics.get(task.metric) if evaluate else None,
            "metric_name": task.metric, "eval_loss": metrics.get("loss") if evaluate else None,
            "samples_total": optimizer.total_samples, "samples_per_second": round(optimizer.samples_per_second, 1),
            "params_digest": params_digest(model),
            **({"refused": daemon.dht.admission.refused} if daemon.dht.admission.private else {}),
        })
        loss_sum, loss_count = 0.0, 0
        if config.max_epochs is not None and optimizer.local_epoch >= config.max_epochs:
            reason = "max_epochs"
            break
        if (evaluate and config.target_metric is not None
                and not task.is_better(config.target_metric, metrics[task.metric])):
            reason = "target_metric"
            break
    settled = optimizer.settle()  # the last round of an overlapping strategy: its outer step counts
    if settled is not None:
        emit({"event": "settled", "epoch": optimizer.local_epoch, "time": round(time.monotonic() - started, 3),
              "train_time": round(time.monotonic() - train_started, 3), **settled.to_dict()})
    if checkpointer is not None:
        _final_checkpoint(checkpointer, micro_steps, daemon, emit, reason=None if daemon.stop_requested else reason)
    if not daemon.stop_requested or not metrics:
        metrics = task.metrics(model)
    summary = TrainingSummary(epochs=optimizer.local_epoch, samples=optimizer.total_samples,
                              seconds=time.monotonic() - started, metrics=metrics, reason=reason)
    emit({"event": "done", **asdict(summary), "params_digest": params_digest(model),
          "rounds_ok": optimizer.epochs.rounds_ok, "rounds": optimizer.epochs.rounds_total,
          "downloads": len(optimizer.downloads)})
    return summary


def _spot_check(checker: SpotChecker, round_: CollaborativeRound, optimizer: CollaborativeOptimizer,
                emit: Emit) -> None:
    """Maybe check the contribution the round sampled; a verdict goes to the averager's suspects (suspects.py)."""
    check = checker.after_round(round_)
    if check is None:
        return
    if check.outcome in (PASSED, FAILED):
        optimizer.averager.suspects.record_spot_check(check.peer_id, check.outcome == PASSED)
    if check.outcome == FAILED:
        logger.warning(f"spot check of {check.peer_id[-8:]} (epoch {check.epoch}) failed: {check.reason}")
    emit({"event": "spot_check", **check.to_dict(), "samples_checked": checker.samples_checked,
          "samples_trained": optimizer.total_samples})


def _optimizer_call(call: Callable[[], Any], checkpointer: Optional[PeerCheckpointer],
                    in_step: threading.Event) -> None:
    """Run an optimizer call that may average, with `in_step` set meanwhile (see _round_may_finish).
    A periodic checkpoint's copy must be done before the state changes: fence it first."""
    if checkpointer is not None:
        checkpointer.fence()
    in_step.set()
    try:
        call()
    finally:
        in_step.clear()


def _round_may_finish(daemon: Any, checkpointer: Optional[PeerCheckpointer], in_step: threading.Event) -> bool:
    """After a stop: whether the averaging round in flight may still run to its end. Only with
    checkpoints on (a grace period), only inside an optimizer step, and only while there is time left
    for the final checkpoint after it; otherwise the round is abandoned at once."""
    if checkpointer is None or not in_step.is_set():
        return False
    return daemon.seconds_left_for_work() > checkpointer.estimated_save_s() + 0.5


def _should_download(swarm_epoch: int, local_epoch: int, resume: Optional[ResumePoint], config: TrainerConfig,
                     emit: Emit) -> bool:
    """At start: production's start rule (`checkpoint.staleness.start_decision`): a new peer downloads the
    swarm's state whenever the swarm has moved on; a peer that resumed from a checkpoint only when the swarm is
    more than `max_staleness` epochs ahead. Says which it did."""
    limit = config.checkpoint.max_staleness if resume is not None else 0  # no checkpoint: not used
    decision = start_decision(swarm_epoch, local_epoch, resume is not None, limit)
    lag = swarm_epoch - local_epoch
    if decision is Start.RESUME:
        logger.info(f"resuming from the checkpoint: {lag} epoch(s) behind the swarm (limit {limit})")
    elif decision is Start.DOWNLOAD and resume is not None:
        logger.warning(f"checkpoint {resume.meta.path.name} is at epoch {local_epoch}, the swarm at {swarm_epoch}: "
                       f"{lag} epochs behind (limit {limit}); downloading fresher state from peers instead")
        emit({"event": "checkpoint_stale", "file": resume.meta.path.name, "checkpoint_epoch": local_epoch,
              "swarm_epoch": swarm_epoch, "max_staleness": limit})
    return decision is Start.DOWNLOAD


def _final_checkpoint(checkpointer: PeerCheckpointer, step: int, daemon: Any, emit: Emit,
                      reason: Optional[str] = None) -> None:
    """Write the checkpoint on the way out (once) and say so. If it cannot be written, say what a restart would
    resume from, and make the process exit with code 1: whatever supervises it must not take the stop for a clean
    one (the previous checkpoint stays the newest valid one)."""
    if checkpointer.final_path is not None or checkpointer.final_error is not None:
        return
    why = reason or daemon.stop_reason or "stopped"
    started = time.monotonic()
    try:
        path = checkpointer.save_final(step, reason=why)
    except Exception as e:
        logger.error(f"final checkpoint failed: {type(e).__name__}: {e}; the training since the last checkpoint is "
                     f"lost ({newest_on_disk(checkpointer.store.directory)}); exiting with code 1")
        daemon.fail(exit_code=1)
        return
    left = daemon.seconds_left_for_work()
    emit({"event": "checkpoint", "kind": "final", "file": path.name, "step": step,
          "epoch": checkpointer.optimizer.local_epoch, "reason": why, "write_s": round(time.monotonic() - started, 3),
          "state_digest": state_digest(checkpointer.capture(step)),
          "params_digest": params_digest(checkpointer.model),
          "seconds_left": None if left == float("inf") else round(left, 3)})


def _announce_written(writing: Optional[SaveHandle], emit: Emit) -> Optional[SaveHandle]:
    """A periodic checkpoint's event once its background write is durable (one that failed is logged by the store
    and counted in the metrics, not announced) -> the handle while the write is still running, else None."""
    if writing is None or not writing.done():
        return writing
    if writing.exception() is None:
        emit({"event": "checkpoint", "kind": "periodic", "file": writing.path.name, "step": writing.step,
              "epoch": writing.epoch, "snapshot_s": round(writing.snapshot_s, 4),
              "write_s": round(writing.write_s or 0.0, 4)})
    return None


def _trainers_finished(local_epoch: int, max_epochs: Optional[int], trainers_seen_at: Optional[float],
                       now: float) -> bool:
    """For an aux: the trainers it followed finished their last epoch and left before it saw that epoch (see
    AUX_ORPHANED_S): it is one epoch short of `max_epochs` and has seen no trainer for AUX_ORPHANED_S."""
    return (max_epochs is not None and local_epoch >= max_epochs - 1 and trainers_seen_at is not None
            and now - trainers_seen_at > AUX_ORPHANED_S)


def _reached_limit(optimizer: CollaborativeOptimizer, config: TrainerConfig) -> bool:
    return config.max_epochs is not None and optimizer.local_epoch >= config.max_epochs


def _wait_for_peers(daemon: Any, optimizer: CollaborativeOptimizer, config: TrainerConfig) -> None:
    """Wait (bounded) until `min_peers` trainers are visible, so peers started together begin together."""
    if config.min_peers <= 1:
        return
    visible = optimizer.wait_for_peers(config.min_peers, config.wait_peers_timeout)
    if visible < config.min_peers and not daemon.stop_requested:
        logger.warning(f"only {visible} of {config.min_peers} trainers showed up within "
                       f"{config.wait_peers_timeout:g} s; training anyway")


def _listen_host(daemon: Any) -> str:
    """Where this peer's data plane and state server listen: on every interface when its DHT does and it joined
    through a peer beyond loopback (they then announce the address the machine reaches that peer from, asked anew:
    it may change mid-run, moshpeer/dht/local_address.py), else on one address (`visible_host`)."""
    listen = [str(m) for m in getattr(daemon.dht, "kwargs", {}).get("host_maddrs") or ()]
    beyond_loopback = remote_hosts(daemon.dht.initial_peers or ())
    if listens_on_all_interfaces(listen) and beyond_loopback:
        return ALL_INTERFACES
    return visible_host(daemon.visible_maddrs)
