"""The training peer: the loop `moshpeer join` runs for a task, on top of `CollaborativeOptimizer`.

    daemon = PeerDaemon(run_id, initial_peers=[...]); daemon.start()
    summary = run_training(daemon, load_task("digits"), TrainerConfig(max_epochs=30))

It prints one JSON line per collaborative epoch on stdout (`{"event": "epoch", ...}`: epoch,
loss, metric, samples/s, group size, lost chunks, parameter spread, swarm progress) and one
`{"event": "done", ...}` line at the end, for tests, benchmarks and `moshpeer demo` to parse.
Other events: "state_loaded" (after a state download), "training" (once, with the settings).

Each peer reads its own shuffle of the training data (seeded by its peer id), so peers contribute
different samples. Stop conditions: `max_epochs`, `max_seconds`, `target_metric`, or the daemon's
stop request (SIGTERM), checked between micro-batches so a stop is never delayed by more than one
micro-batch plus one bounded averaging round.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Optional

import torch

from moshpeer.peer.dropcompute import BudgetSetting, StragglerDelay
from moshpeer.peer.optimizer import CollaborativeOptimizer
from moshpeer.peer.tasks import Task

logger = logging.getLogger(__name__)

Emit = Callable[[Dict[str, Any]], None]


@dataclass
class TrainerConfig:
    """Settings of one training peer (CLI flags of `moshpeer join`)."""

    target_batch_size: Optional[int] = None  # default: the task's
    batch_size: Optional[int] = None  # micro-batch; default: the task's
    averaging: str = "gradients"
    compression: str = "none"
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
    show_progress: bool = False
    averager_kwargs: Dict[str, Any] = field(default_factory=dict)


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
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def emit_json(event: Dict[str, Any]) -> None:
    """Write one JSON progress line to stdout, flushed at once."""
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def run_training(daemon: Any, task: Task, config: TrainerConfig, emit: Emit = emit_json) -> TrainingSummary:
    """Train `task` as a peer of `daemon`'s run until a stop condition; see the module docstring."""
    model = task.model
    model.train()
    target = config.target_batch_size or task.target_batch_size
    micro = config.batch_size or task.batch_size
    started = time.monotonic()
    optimizer = CollaborativeOptimizer(
        task.make_optimizer(model.parameters()), run_id=daemon.run_id, daemon=daemon, model=model,
        target_batch_size=target, batch_size_per_step=micro, averaging=config.averaging,
        compression=config.compression, group_size=config.group_size, compute_budget=config.compute_budget,
        loss_budget=config.loss_budget, phase_threshold=config.phase_threshold,
        role=config.role, matchmaking_time=config.matchmaking_time, round_timeout=config.round_timeout,
        state_bytes_per_second=config.state_bytes_per_second, show_progress=config.show_progress,
        should_stop=lambda: daemon.stop_requested, averager_kwargs=config.averager_kwargs,
        host=_loopback_or_any(daemon),
    )
    # The process exits right after the daemon's shutdown: see CollaborativeOptimizer.shutdown.
    daemon.add_shutdown_hook(lambda: optimizer.shutdown(close_averager=False), name="collaborative optimizer")
    emit({"event": "training", "task": task.name, "peer_id": daemon.peer_id, "role": config.role,
          "target_batch_size": target, "batch_size": micro, "averaging": config.averaging,
          "group_size": config.group_size, "compression": config.compression,
          "compute_budget": config.compute_budget, "fingerprint": task.fingerprint,
          "loss_budget": optimizer.loss_budget.describe()})

    _wait_for_peers(daemon, optimizer, config)
    snapshot = optimizer.progress.refresh_now()
    if snapshot.global_epoch > optimizer.local_epoch and not daemon.stop_requested:
        downloaded = optimizer.catch_up(min_epoch=max(snapshot.global_epoch - optimizer.max_epoch_lag, 1))
        if downloaded is not None:
            emit({"event": "state_loaded", "epoch": downloaded.epoch, "donor": downloaded.donor,
                  "sha256": downloaded.sha256, "bytes": downloaded.nbytes, "seconds": round(downloaded.seconds, 3),
                  "params_digest": params_digest(model), "failed_donors": [d for d, _ in downloaded.failed_donors],
                  "time": round(time.monotonic() - started, 3)})

    train_started = time.monotonic()  # after waiting for peers and catching up: time spent training
    emit({"event": "started", "epoch": optimizer.local_epoch, "time": round(train_started - started, 3)})
    seed = config.seed if config.seed is not None else int(hashlib.sha256(daemon.peer_id.encode()).hexdigest()[:8], 16)
    stream = task.open_batches(micro, seed=seed) if config.role == "trainer" else None
    metrics: Dict[str, float] = {}
    reason = "stopped"
    loss_sum, loss_count = 0.0, 0
    while True:
        if daemon.stop_requested:
            reason = "stopped"
            break
        if config.max_seconds is not None and time.monotonic() - started >= config.max_seconds:
            reason = "max_seconds"
            break
        epoch_before, rounds_before = optimizer.local_epoch, len(optimizer.rounds)
        if stream is not None:
            batch = next(stream)
            if config.straggler is not None:
                config.straggler()
            loss, count = task.loss(model, batch)
            loss.backward()
            loss_sum += loss.item() * count
            loss_count += count
            optimizer.step(batch_size=count)
            optimizer.zero_grad()
        else:
            optimizer.wait_and_average(timeout=1.0)
        if len(optimizer.rounds) == rounds_before:
            continue
        round_ = optimizer.rounds[-1]
        evaluate = optimizer.local_epoch % max(config.eval_every, 1) == 0 or _reached_limit(optimizer, config)
        if evaluate:
            metrics = task.metrics(model)
        emit({
            "event": "epoch", "epoch": optimizer.local_epoch, "previous_epoch": epoch_before,
            "time": round(time.monotonic() - started, 3),
            "train_time": round(time.monotonic() - train_started, 3),
            "loss": round(loss_sum / loss_count, 5) if loss_count else None,
            "metric": metrics.get(task.metric) if evaluate else None,
            "metric_name": task.metric, "eval_loss": metrics.get("loss") if evaluate else None,
            "samples": round_.samples, "samples_total": optimizer.total_samples,
            "samples_per_second": round(optimizer._speed.rate(), 1),
            "group_size": round_.group_size, "ok": round_.ok, "chunks_lost": round_.chunks_lost,
            "lost_fraction": round(round_.lost_fraction, 5), "param_spread": round_.param_spread,
            "matchmaking_s": round(round_.matchmaking_s, 3), "averaging_s": round(round_.averaging_s, 3),
            "stopped_by_budget": round_.stopped_by_budget, "swarm_samples": round_.swarm_samples,
            "num_trainers": round_.num_trainers, "error": round_.error,
            "loss_phase": round_.loss_phase, "loss_budget": round_.loss_budget,
            "grad_norm": round(round_.grad_norm, 6) if round_.grad_norm is not None else None,
            "params_digest": params_digest(model),
        })
        loss_sum, loss_count = 0.0, 0
        if config.max_epochs is not None and optimizer.local_epoch >= config.max_epochs:
            reason = "max_epochs"
            break
        if (evaluate and config.target_metric is not None
                and not task.is_better(config.target_metric, metrics[task.metric])):
            reason = "target_metric"
            break
    if not daemon.stop_requested or not metrics:
        metrics = task.metrics(model)
    summary = TrainingSummary(epochs=optimizer.local_epoch, samples=optimizer.total_samples,
                              seconds=time.monotonic() - started, metrics=metrics, reason=reason)
    emit({"event": "done", **asdict(summary), "params_digest": params_digest(model),
          "rounds_ok": sum(r.ok for r in optimizer.rounds), "rounds": len(optimizer.rounds),
          "downloads": len(optimizer.downloads)})
    return summary


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


def _loopback_or_any(daemon: Any) -> str:
    """The IPv4 address others reach this peer at (from its DHT's visible multiaddrs) for averaging and
    state donations; 127.0.0.1 in local swarms."""
    for maddr in daemon.visible_maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] == "ip4" and parts[2] != "0.0.0.0":
            return parts[2]
    return "127.0.0.1"
