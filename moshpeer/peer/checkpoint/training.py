"""Checkpoints of a training peer: what `moshpeer join --checkpoint-dir` saves, and resuming from it.

    policy = CheckpointPolicy("ckpt/", every_steps=200, every_seconds=600, keep_last=3)
    checkpointer = PeerCheckpointer(policy, task_name="digits", fingerprint=task.fingerprint)
    resume = checkpointer.load()                         # before the optimizer exists (grid bits)
    ... build the CollaborativeOptimizer with grid_bits=resume.group_bits ...
    checkpointer.attach(model, optimizer, stream)
    checkpointer.restore(resume)                         # model, optimizer, progress, EF, RNG, data
    while training:
        ...; checkpointer.maybe_save(step)               # periodic, written off this thread
    checkpointer.save_final(step, reason="SIGTERM")      # synchronous, supersedes a write in flight

A checkpoint holds (see `Parts`): the model's state_dict; the local optimizer's state; the
collaborative progress (epoch, optimizer steps, samples, the gradient accumulators of the epoch in
progress, micro-batches computed); the averager's error-feedback state when its codec has one; the
Moshpit group bits; every process-wide RNG; and the data stream's position. Restoring all of it
continues exactly where the peer stopped.

`step` in a checkpoint's name and metadata counts this peer's micro-batches; `epoch` is the
collaborative epoch.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional

import torch

from moshpeer.errors import UserError
from moshpeer.peer.checkpoint.format import CheckpointError, UnsupportedCheckpointVersion
from moshpeer.peer.checkpoint.staleness import DEFAULT_MAX_STALENESS
from moshpeer.peer.checkpoint.rng import capture_rng_state, restore_rng_state
from moshpeer.peer.checkpoint.directory import CheckpointMeta
from moshpeer.peer.checkpoint.store import CheckpointStore, Parts, SaveHandle

logger = logging.getLogger(__name__)

# Assumed write speed before the first checkpoint of a run has been timed (a slow disk, a busy CPU).
_ASSUMED_BYTES_PER_SECOND = 100e6


@dataclass
class CheckpointPolicy:
    """Where and how often a training peer checkpoints (`moshpeer join` flags)."""

    directory: Path
    every_steps: Optional[int] = None  # micro-batches between periodic checkpoints
    every_seconds: Optional[float] = None  # seconds between periodic checkpoints
    keep_last: int = 3
    max_staleness: int = DEFAULT_MAX_STALENESS  # epochs behind the swarm beyond which a peer downloads instead

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        if self.every_steps is not None and self.every_steps < 1:
            raise UserError("--checkpoint-every-steps must be positive")
        if self.every_seconds is not None and not self.every_seconds > 0:
            raise UserError("--checkpoint-every-seconds must be positive")
        if self.keep_last < 1:
            raise UserError("--keep must be at least 1")
        if self.max_staleness < 0:
            raise UserError("--max-staleness must be 0 or more")


@dataclass
class ResumePoint:
    """The newest valid checkpoint of a directory, loaded."""

    state: Dict[str, Any]
    meta: CheckpointMeta

    @property
    def epoch(self) -> int:
        return self.meta.epoch

    @property
    def step(self) -> int:
        return self.meta.step

    @property
    def group_bits(self) -> Optional[str]:
        grid = self.state.get(Parts.GRID) or {}
        bits = grid.get("group_bits")
        return bits if isinstance(bits, str) and set(bits) <= {"0", "1"} else None


def state_digest(parts: Mapping[str, Any]) -> str:
    """A short digest of a checkpoint's model, optimizer and collaborative parts (tensors and numbers,
    in a fixed order): equal digests mean bit-identical training state. Works on a live `capture()`
    and on a loaded checkpoint alike."""
    digest = hashlib.sha256()

    def fold(name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(name.encode())
            digest.update(str(value.dtype).encode())
            digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, Mapping):
            for key in sorted(value, key=str):
                fold(f"{name}.{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                fold(f"{name}.{index}", item)
        else:
            digest.update(f"{name}={value!r}".encode())

    for part in (Parts.MODEL, Parts.OPTIMIZER, Parts.COLLABORATIVE, Parts.ERROR_FEEDBACK):
        if part in parts:
            fold(part, parts[part])
    return digest.hexdigest()[:16]


class PeerCheckpointer:
    """Saves and restores a training peer's complete state; see the module docstring."""

    def __init__(self, policy: CheckpointPolicy, *, task_name: str = "", fingerprint: str = ""):
        self.policy = policy
        self.task_name = task_name
        self.fingerprint = fingerprint
        self.store = CheckpointStore(policy.directory, keep_last=policy.keep_last)
        self.model: Optional[torch.nn.Module] = None
        self.optimizer: Any = None  # a CollaborativeOptimizer
        self.stream: Optional[Iterator[Any]] = None
        self.final_path: Optional[Path] = None
        self.final_error: Optional[BaseException] = None  # why the final checkpoint could not be written
        self._final_lock = threading.Lock()
        self._last_step = 0
        self._last_time = time.monotonic()

    # ---- resume ---------------------------------------------------------------------------------

    def load(self) -> Optional[ResumePoint]:
        """The newest valid checkpoint, or None. Corrupt files are skipped with one log line each.

        :raises UserError: a checkpoint of a newer format, one torch refuses to load, or one written
            for another task (resuming from it would be wrong; another --checkpoint-dir is the fix)
        """
        try:
            loaded = self.store.load_latest()
        except UnsupportedCheckpointVersion as e:
            raise UserError(str(e)) from None
        except CheckpointError as e:
            raise UserError(f"cannot resume: {e}") from None
        if loaded is None:
            return None
        state, meta = loaded
        theirs = meta.extra.get("fingerprint", "")
        if self.fingerprint and theirs and theirs != self.fingerprint:
            raise UserError(
                f"{meta.path} was written for task {meta.extra.get('task', '?')!r} with fingerprint {theirs}, "
                f"this peer trains {self.task_name!r} ({self.fingerprint}): use another --checkpoint-dir"
            )
        self._last_step = meta.step
        return ResumePoint(state, meta)

    def attach(self, model: torch.nn.Module, optimizer: Any, stream: Optional[Iterator[Any]]) -> None:
        """The live objects whose state is saved and restored."""
        self.model, self.optimizer, self.stream = model, optimizer, stream

    def restore(self, resume: ResumePoint) -> None:
        """Put the whole saved state back: model, optimizer, progress, error feedback, RNG, data position."""
        from moshpeer.peer.tasks.protocol import restore_stream_position

        state = resume.state
        try:
            self.model.load_state_dict(state[Parts.MODEL])
            collaborative = dict(state[Parts.COLLABORATIVE])
            collaborative["optimizer"] = state[Parts.OPTIMIZER]
            self.optimizer.load_checkpoint_state(collaborative)
        except (KeyError, RuntimeError, ValueError) as e:
            raise UserError(f"{resume.meta.path} does not fit this model or optimizer: {e}") from None
        feedback = self._error_feedback()
        if feedback is not None and state.get(Parts.ERROR_FEEDBACK) is not None:
            feedback.load_state_dict(state[Parts.ERROR_FEEDBACK])  # before any round: nothing reads it yet
        if Parts.RNG in state:
            restore_rng_state(state[Parts.RNG])
        position = state.get(Parts.DATA)
        if position is not None and self.stream is not None:
            restore_stream_position(self.stream, position)
        self._last_step = resume.step
        self._last_time = time.monotonic()

    # ---- saving ---------------------------------------------------------------------------------

    def capture(self, step: int, *, clone_buffers: bool = False) -> Dict[str, Any]:
        """The live state as checkpoint parts (references, not copies: the store snapshots them).

        `clone_buffers`: copy the model's buffers now (a forward pass may update them in place, e.g.
        BatchNorm statistics), for a background snapshot that copies the rest during forward/backward.
        """
        from moshpeer.peer.tasks.protocol import stream_position

        model_state = self.model.state_dict()
        if clone_buffers:
            buffers = {name for name, _ in self.model.named_buffers()}
            metadata = getattr(model_state, "_metadata", None)
            model_state = type(model_state)(
                (name, value.clone() if name in buffers else value) for name, value in model_state.items()
            )
            if metadata is not None:
                model_state._metadata = metadata
        collaborative = self.optimizer.checkpoint_state()
        optimizer_state = collaborative.pop("optimizer")
        collaborative["micro_steps"] = int(step)
        parts: Dict[str, Any] = {
            Parts.MODEL: model_state,
            Parts.OPTIMIZER: optimizer_state,
            Parts.COLLABORATIVE: collaborative,
            Parts.GRID: {"group_bits": self.optimizer.averager.group_bits},
            Parts.RNG: capture_rng_state(),
            Parts.DATA: stream_position(self.stream) if self.stream is not None else None,
        }
        feedback = self._error_feedback()
        if feedback is not None:
            parts[Parts.ERROR_FEEDBACK] = feedback.state_dict()
        return parts

    def due(self, step: int) -> bool:
        """Whether a periodic checkpoint is due at this step."""
        policy = self.policy
        if policy.every_steps is not None and step - self._last_step >= policy.every_steps:
            return True
        return policy.every_seconds is not None and time.monotonic() - self._last_time >= policy.every_seconds

    def maybe_save(self, step: int) -> Optional[SaveHandle]:
        """A periodic checkpoint if one is due: snapshot now, write in the background. Its handle (`done()`,
        `exception()`: a write may fail, e.g. on a full disk, which the store logs), or None (not due, or the
        previous write is still running)."""
        if not self.due(step):
            return None
        self._last_step, self._last_time = step, time.monotonic()
        # The memcpy of the snapshot runs on the writer thread while the next micro-batch computes;
        # the training loop calls `fence()` before its next optimizer step (see CheckpointStore.save_async).
        handle = self.store.save_async(self.capture(step, clone_buffers=True), step=step,
                                       epoch=self.optimizer.local_epoch, extra=self._extra("periodic"),
                                       copy_in_background=True)
        return handle

    def fence(self) -> None:
        """Call before changing the training state (the optimizer step): waits until a periodic
        checkpoint's background copy no longer reads it (usually done already)."""
        self.store.fence()

    def save_final(self, step: int, reason: str) -> Optional[Path]:
        """The checkpoint on the way out, written now and durable on return; a background write in
        flight is abandoned (this one supersedes it). Runs once: a second call returns the first's path, or
        raises the first's error again (`final_error`; a full disk stays full) without writing.

        Safe to call from another thread than the training loop's (the shutdown path does when the loop
        did not finish in time): the optimizer's lock keeps the state still while it is captured and
        written. Raises what the write raised (OSError: no space, no permission); the previous checkpoint
        stays the newest valid one.
        """
        with self._final_lock:
            if self.final_error is not None:
                raise self.final_error
            if self.final_path is not None:
                return self.final_path
            try:
                with self.optimizer.lock:
                    state = self.capture(step)
                    self.final_path = self.store.save(state, step=step, epoch=self.optimizer.local_epoch,
                                                      extra=self._extra(reason), abort_in_flight=True)
            except Exception as e:
                self.final_error = e
                raise
            return self.final_path

    def estimated_save_s(self) -> float:
        """How long the final checkpoint will take to write (from the last write, or a guess)."""
        stats = self.store.stats
        if stats.saved and stats.last_write_s > 0:
            return 1.5 * stats.last_write_s + 0.2
        nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters()) if self.model else 0
        return 0.5 + 4 * nbytes / _ASSUMED_BYTES_PER_SECOND  # params, Adam's two moments, accumulators

    def close(self, timeout: Optional[float] = None) -> None:
        self.store.close(timeout=timeout)

    def _error_feedback(self) -> Any:
        """The EF21M state the optimizer's averaging keeps (`moshpeer join --error-feedback`), if any."""
        return getattr(self.optimizer, "error_feedback", None) or getattr(self.optimizer.averager, "error_feedback", None)

    def _extra(self, reason: str) -> Dict[str, Any]:
        return {"reason": reason, "task": self.task_name, "fingerprint": self.fingerprint,
                "peer_id": getattr(self.optimizer, "peer_id", "")}
