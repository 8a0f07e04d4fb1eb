"""What a `CollaborativeOptimizer` saves and adopts, and the `torch.optim.Optimizer` surface around it.

- `state_dict()` / `load_state_dict()`: the wrapped optimizer's state plus epoch, steps and the
  error-feedback state (what `torch.save(opt.state_dict())` users expect);
- `collaborative_state()` / `load_collaborative_state()`: everything a newcomer downloads from a donor
  (parameters, optimizer, epoch, error feedback, the averaging strategy's own state), checked in full
  by `_check_state_fits` before anything is adopted;
- `catch_up()`: download a donor's collaborative state and adopt it; `_advertise()`: offer ours;
- `checkpoint_state()` / `load_checkpoint_state()`: this peer's own progress for a local checkpoint.

`OptimizerState` is a mixin of `CollaborativeOptimizer` (it uses its `inner`, `params`, `model`, `lock`,
`strategy`, `error_feedback`, `averager`, epoch counters and accumulators).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional

import torch

from moshpeer.peer.error_feedback import check_error_feedback_state, error_feedback_state, fresh_error_feedback_state
from moshpeer.peer.rounds import CollaborativeRound
from moshpeer.peer.state_sync import DownloadedState, StateDownloadFailed, download_state, serialize_state
from moshpeer.peer.state_validation import (MAX_COUNTER, validate_counters, validate_model_state,
                                            validate_optimizer_state)

logger = logging.getLogger(__name__)

# A donor's state may take at most this many times our own serialized state (Adam keeps two tensors per
# parameter that a fresh optimizer has not allocated yet).
STATE_SIZE_FACTOR = 4
SNAPSHOT_WAIT_S = 10.0  # the longest a donor's first snapshot waits for the optimizer's lock


class OptimizerState:
    """State handling of `CollaborativeOptimizer` (see the module docstring)."""

    def _init_torch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """torch.optim.Optimizer's own machinery, without its __init__ (param_groups live in `inner`)."""
        self.defaults = optimizer.defaults
        for name in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                     "load_state_dict_post"):
            setattr(self, f"_optimizer_{name}_hooks", OrderedDict())
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"
        self._state_cache = None

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
            self._state_cache = None  # an adopted state is served afresh even at the epoch of the last snapshot
            self._reset_accumulators()

    def checkpoint_state(self) -> Dict[str, Any]:
        """This peer's own training state for a local checkpoint (moshpeer.peer.checkpoint): the wrapped
        optimizer's state, epoch, steps, the progress of the current epoch (gradient accumulators,
        samples) and the strategy's state (e.g. DiLoCo's outer parameters and momentum). The tensors are
        the live ones, not copies: snapshot them before training goes on."""
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
            self._state_cache = None
            self.samples_accumulated = int(state["samples_accumulated"])
            self.total_samples = int(state["total_samples"])
        self._report_progress(force=True)
        self._advertise()

    def _check_state_fits(self, state: Dict[str, Any], max_epoch: int = MAX_COUNTER) -> None:
        """Raise ValueError unless `state` is a complete, plausible state of our model (state_validation.py)."""
        if state.get("format") != 1 or not isinstance(state.get("epoch"), int):
            raise ValueError("unknown state format")
        if bool(state.get("has_model")) != (self.model is not None):
            raise ValueError("state was saved with a different layout (model vs parameter list)")
        ours = self.model.state_dict() if self.model is not None else {str(i): p for i, p in enumerate(self.params)}
        validate_model_state(ours, state["model"])
        validate_optimizer_state(self.inner.state_dict(), [p for g in self.inner.param_groups for p in g["params"]],
                                 state.get("optimizer"))
        validate_counters(state["epoch"], state.get("steps"), max_epoch=max_epoch)
        feedback = state.get("error_feedback")
        if feedback is not None and self.error_feedback is not None:
            check_error_feedback_state(self.error_feedback, feedback)
        self.strategy.check_state_dict(state.get("strategy") or {})

    def _load_error_feedback(self, feedback: Dict[str, Any]) -> None:
        if self.error_feedback is None:
            logger.info("ignoring an error-feedback state: this optimizer keeps none")
            return
        with self.averager.get_tensors():  # no round may use the state while it changes
            self.error_feedback.load_state_dict(feedback)

    def _serialized_state(self) -> tuple:
        """(epoch, bytes) a donor serves: one snapshot per epoch, taken under the lock (never a torn state), so
        that every piece of a multi-donor download comes from the same bytes however many inner steps the
        donor takes meanwhile. While an epoch's end holds the lock (applying a round, stepping), the previous
        snapshot is served at once instead of making the newcomer wait, if it is the previous epoch's; an older
        one (or none) is never served: the wait for a fresh one is bounded by SNAPSHOT_WAIT_S and then raises
        TimeoutError (the server logs one line, the client moves on). A snapshot from a donor's first epochs,
        served while it advertises a much later one, set a newcomer 16 epochs back under load."""
        cached = self._state_cache
        if cached is not None and cached[0] == self.local_epoch:
            return cached
        previous = cached if cached is not None and cached[0] >= self.local_epoch - 1 else None
        if not self.lock.acquire(timeout=0 if previous is not None else SNAPSHOT_WAIT_S):
            if previous is None:
                raise TimeoutError(f"the optimizer's lock stayed busy for {SNAPSHOT_WAIT_S} s")
            return previous
        try:
            if self._state_cache is None or self._state_cache[0] != self.local_epoch:
                self._state_cache = (self.local_epoch, serialize_state(self.collaborative_state()))
            return self._state_cache
        finally:
            self.lock.release()

    def catch_up(self, min_epoch: int = 0) -> Optional[DownloadedState]:
        """Download the state of the most advanced donor and adopt it; None if no donor delivered."""
        self.settle()  # a round still in the background must not land on the downloaded state
        # Only donors whose epoch the robust swarm view confirms, and never more bytes than a state of our model
        # plausibly takes (ours, with room for optimizer state that ours has not built yet).
        max_epoch = self.progress.refresh_now(timeout=2.0).global_epoch + 1
        max_bytes = STATE_SIZE_FACTOR * len(self._serialized_state()[1]) + (1 << 20)
        try:
            downloaded = download_state(self.dht, self.run_id, exclude=(self.peer_id,), min_epoch=min_epoch,
                                        max_epoch=max_epoch, max_bytes=max_bytes,
                                        timeout=self.state_download_timeout, show_progress=self.show_progress,
                                        # A donor may move on one epoch between its offer and its manifest.
                                        validate=lambda state: self._check_state_fits(state, max_epoch=max_epoch + 1))
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

    def _catch_up_instead(self, min_epoch: int, why: str, facts: dict) -> Optional[CollaborativeRound]:
        """Drop this epoch's samples and adopt a donor's state of `min_epoch` or later; None if no donor."""
        stale, epoch = self.samples_accumulated, self.local_epoch
        if self.catch_up(min_epoch=min_epoch) is None:
            return None
        self.dropped_samples += stale
        record = CollaborativeRound(**{**facts, "epoch": epoch, "samples": 0, "error": why, "dropped_samples": stale,
                                       "settings": self.strategy.settings()})
        self.rounds.append(record)
        return record

    def _advertise(self) -> None:
        if self.state_server is not None and self.role == "trainer":
            self.state_server.advertise(self.dht, self.local_epoch)
            self._advertised_at = time.monotonic()
