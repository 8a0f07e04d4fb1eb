"""`StateExchange`: what a `CollaborativeOptimizer` saves and adopts, and how it gives and gets state.

- `state_dict()` / `load_state_dict()`: the wrapped optimizer's state plus epoch, steps, the error-feedback
  state and the strategy's state (what `torch.save(opt.state_dict())` users expect);
- `collaborative_state()` / `load_collaborative_state()`: everything a newcomer downloads from a donor
  (parameters, optimizer, epoch, error feedback, the averaging strategy's own state), checked in full by
  `check_state_fits` before anything is adopted;
- `download(min_epoch, max_epoch)`: fetch a donor's collaborative state and adopt it; `advertise()`: offer
  ours through a `StateServer` (donors serve one snapshot per epoch, `serialized_state`);
- `fetch_updates(epoch)`: the update other peers' group applied in a round this peer missed (the strategy's
  `kept_update`, which our server serves too: peer/state/updates.py);
- `checkpoint_state()` / `load_checkpoint_state()`: this peer's own progress for a local checkpoint.

Failure: a state that does not fit raises ValueError before anything changes (`check_state_fits`); a download
that no donor delivers is logged and returns None, leaving the peer as it was.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Mapping, Optional, Protocol, Tuple

import torch

from moshpeer.peer.optimizer.counters import EpochCounters
from moshpeer.peer.optimizer.error_feedback import (error_feedback_state, fresh_error_feedback_state,
                                                    shared_error_feedback_state)
from moshpeer.peer.state.donors import MisfitDonors
from moshpeer.peer.state.framing import serialize_state
from moshpeer.peer.state.sync import DownloadedState, StateDownloadFailed, StateServer, download_state
from moshpeer.peer.state.updates import UPDATE_OP, fetch_updates, update_handler
from moshpeer.peer.state.validation import MAX_COUNTER, validate_counters, validate_model_state
from moshpeer.peer.strategies.base import AveragingStrategy
from moshpeer.peer.tensor_checks import validate_optimizer_state
from moshpeer.ratelimited_log import RateLimitedLog

logger = logging.getLogger(__name__)

# A donor's state may take at most this many times our own serialized state (Adam keeps two tensors per
# parameter that a fresh optimizer has not allocated yet).
STATE_SIZE_FACTOR = 4
SNAPSHOT_WAIT_S = 10.0  # the longest a donor's first snapshot waits for the optimizer's lock
UPDATE_FETCH_TIMEOUT_S = 20.0  # the longest a missed round's update is sought before a state download
ADVERTISE_EVERY_S = 5.0  # re-advertise a donor's offer at least this often (it expires in the DHT)


class StateHost(Protocol):
    """What a `StateExchange` needs from its optimizer."""

    params: List[torch.nn.Parameter]
    inner: torch.optim.Optimizer
    model: Optional[torch.nn.Module]
    strategy: AveragingStrategy
    error_feedback: Any  # an EF21M state or None
    lock: threading.RLock
    counters: EpochCounters

    def restart_epoch(self) -> None:
        """Forget the current epoch's accumulators (an adopted state starts a fresh epoch)."""

    def averaging_paused(self) -> ContextManager:
        """Hold off averaging rounds while the error-feedback state changes."""


class StateExchange:
    """Saving, adopting, donating and downloading this peer's state; see the module docstring.

    :param host: the optimizer (`StateHost`)
    :param dht: the swarm's DHT (offers and downloads); run_id: the training run
    :param serve: run a `StateServer` that donates our state to newcomers (trainers only advertise it)
    :param address: the address the state server listens on; announce_host: asked for the address to offer it at
        instead (a server on every interface: moshpeer/dht/local_address.py)
    :param download_timeout: seconds a download may take in all
    :param bytes_per_second: throttle our donations (None: as fast as the link goes)
    """

    def __init__(self, host: StateHost, *, dht: Any, run_id: str, role: str, serve: bool, address: str,
                 download_timeout: float, bytes_per_second: Optional[float] = None, show_progress: bool = False,
                 announce_host: Optional[Callable[[], str]] = None):
        self.host, self.counters = host, host.counters
        self.dht, self.run_id, self.role = dht, run_id, role
        self.download_timeout, self.show_progress = download_timeout, show_progress
        self.downloads: List[DownloadedState] = []
        self._misfits = MisfitDonors()  # donors whose state does not fit our model: not asked for a while
        # A peer that cannot catch up tries at every epoch end: a few lines a minute say so, not one per epoch.
        self._catch_up_failures = RateLimitedLog(logger, interval_s=60.0, per_interval=3)
        self._cache: Optional[Tuple[int, bytes]] = None  # (epoch, serialized state) served to newcomers
        self._advertised_at = 0.0
        self._announce_host = announce_host
        self.server: Optional[StateServer] = None
        if serve:
            self.server = StateServer(self.serialized_state, run_id=run_id, identity=dht.identity, host=address,
                                      bytes_per_second=bytes_per_second, admission=dht.admission,
                                      handlers={UPDATE_OP: update_handler(self.serialized_update)})

    # ---- torch's state dict ---------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict plus a "collaborative" entry: epoch, steps, the error-feedback state
        (None without error feedback) and the strategy's state."""
        host = self.host
        with host.lock:
            state = host.inner.state_dict()
            state["collaborative"] = {"epoch": self.counters.epoch, "steps": self.counters.steps,
                                      "error_feedback": error_feedback_state(host.error_feedback),
                                      "strategy": host.strategy.state_dict()}
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Inverse of `state_dict` (a plain optimizer state dict, without "collaborative", loads too). A state
        that does not fit raises what torch or the strategy raise (ValueError, KeyError)."""
        state_dict = dict(state_dict)
        collaborative = state_dict.pop("collaborative", None)
        with self.host.lock:
            if collaborative and collaborative.get("error_feedback") is not None:
                self._load_error_feedback(collaborative["error_feedback"])
            self.host.inner.load_state_dict(state_dict)
            if collaborative and collaborative.get("strategy"):
                self.host.strategy.load_state_dict(collaborative["strategy"])
            if collaborative:
                self.counters.epoch = int(collaborative.get("epoch", self.counters.epoch))
                self.counters.steps = int(collaborative.get("steps", self.counters.steps))

    # ---- a newcomer's download --------------------------------------------------------------------

    def collaborative_state(self) -> Dict[str, Any]:
        """Everything a newcomer needs: parameters (and buffers), optimizer state, epoch (tensors are copies)."""
        host = self.host
        with host.lock:
            if host.model is not None:
                model_state = {k: v.detach().clone() for k, v in host.model.state_dict().items()}
            else:
                model_state = {str(i): p.detach().clone() for i, p in enumerate(host.params)}
            return {"format": 1, "epoch": self.counters.epoch, "steps": self.counters.steps, "model": model_state,
                    "optimizer": host.inner.state_dict(), "has_model": host.model is not None,
                    "error_feedback": shared_error_feedback_state(host.error_feedback),
                    "strategy": host.strategy.state_dict()}

    def load_collaborative_state(self, state: Dict[str, Any]) -> None:
        """Adopt a state from `collaborative_state` (e.g. downloaded): parameters, optimizer, epoch. ValueError,
        with nothing changed, when it does not fit (`check_state_fits`)."""
        self.check_state_fits(state)
        host = self.host
        with host.lock, torch.no_grad():
            host.strategy.load_state_dict(state.get("strategy") or {})  # checked: it changes nothing if it fails
            if state["has_model"]:
                host.model.load_state_dict(state["model"])
            else:
                for i, p in enumerate(host.params):
                    p.copy_(state["model"][str(i)])
            host.inner.load_state_dict(state["optimizer"])
            if state.get("error_feedback") is not None:
                self._load_error_feedback(state["error_feedback"])
            elif host.error_feedback is not None:
                # The donor keeps none: start ours afresh rather than keep an estimate of other parameters.
                self._load_error_feedback(fresh_error_feedback_state(host.error_feedback))
            self.counters.epoch = int(state["epoch"])
            self.counters.steps = int(state["steps"])
            self._cache = None  # an adopted state is served afresh even at the epoch of the last snapshot
            host.restart_epoch()

    def check_state_fits(self, state: Dict[str, Any], max_epoch: int = MAX_COUNTER) -> None:
        """Raise ValueError unless `state` is a complete, plausible state of our model (state/validation.py)."""
        host = self.host
        if state.get("format") != 1 or not isinstance(state.get("epoch"), int):
            raise ValueError("unknown state format")
        if bool(state.get("has_model")) != (host.model is not None):
            raise ValueError("state was saved with a different layout (model vs parameter list)")
        ours = host.model.state_dict() if host.model is not None else {str(i): p for i, p in enumerate(host.params)}
        validate_model_state(ours, state["model"])
        validate_optimizer_state(host.inner.state_dict(), [p for g in host.inner.param_groups for p in g["params"]],
                                 state.get("optimizer"))
        validate_counters(state["epoch"], state.get("steps"), max_epoch=max_epoch)
        feedback = state.get("error_feedback")
        if feedback is not None and host.error_feedback is not None:
            host.error_feedback.check_state(feedback)
        host.strategy.check_state_dict(state.get("strategy") or {})

    def download(self, min_epoch: int, max_epoch: int, offer_wait_s: Optional[float] = None
                 ) -> Optional[DownloadedState]:
        """Download the state of the most advanced donor at `min_epoch`..`max_epoch` and adopt it; None (logged)
        if no donor delivered a state that fits, or none in range was on offer within `offer_wait_s` (default:
        the download timeout). Peers back from an outage (their records' `apart_since`) are not asked: they
        trained alone. The caller makes sure no round is in flight."""
        # Never more bytes than a state of our model plausibly takes (ours, with room for optimizer state that
        # ours has not built yet).
        max_bytes = STATE_SIZE_FACTOR * len(self.serialized_state()[1]) + (1 << 20)
        try:
            apart = tuple(r.peer_id for r in self.host.swarm.progress.snapshot().peers if r.apart_since is not None)
            misfits = self._misfits.excluded(time.monotonic())
            downloaded = download_state(self.dht, self.run_id, exclude=(self.dht.identity.peer_id, *apart, *misfits),
                                        prefer=self.host.swarm.progress.corroborated_peers(),
                                        min_epoch=min_epoch, max_epoch=max_epoch, max_bytes=max_bytes,
                                        timeout=self.download_timeout, show_progress=self.show_progress,
                                        offer_wait_s=offer_wait_s,
                                        # A donor may move on one epoch between its offer and its manifest.
                                        validate=lambda state: self.check_state_fits(state, max_epoch=max_epoch + 1),
                                        agreed=self._agreed_tensors)
        except StateDownloadFailed as e:
            new = self._misfits.note(e.misfits, time.monotonic())
            if new:
                logger.error(f"the state of {len(new)} donor(s) does not fit this peer's model "
                             f"({e.misfits[new[0]]}): does this peer run the swarm's --task and --task-arg? "
                             f"Not asking them again for {self._misfits.set_aside_s / 60:g} min")
            self._catch_up_failures.warning(f"could not catch up: {e}; training on from epoch {self.counters.epoch}")
            return None
        with self.host.lock:
            self.load_collaborative_state(downloaded.state)
        self.downloads.append(downloaded)
        logger.info(f"caught up: epoch {downloaded.epoch} from {downloaded.donor[-8:]} "
                    f"({downloaded.nbytes} bytes in {downloaded.seconds:.2f} s, {downloaded.confirmation})")
        return downloaded

    def _agreed_tensors(self, state: Dict[str, Any]) -> Mapping[str, torch.Tensor]:
        """What the download's cross-check compares of a (checked) state: the strategy's say, else the parameters."""
        agreed = self.host.strategy.agreed_tensors(state.get("strategy") or {})
        return state["model"] if agreed is None else agreed

    def fetch_updates(self, epoch: int) -> Iterator[Dict[str, Any]]:
        """Other peers' kept updates of the round of `epoch` (updates.py's `fetch_updates`), within
        UPDATE_FETCH_TIMEOUT_S (or the download timeout, if shorter)."""
        # An update is at most the model in fp32, with its framing.
        max_bytes = 4 * sum(p.numel() for p in self.host.params) + (1 << 20)
        return fetch_updates(self.dht, self.run_id, epoch, timeout=min(self.download_timeout, UPDATE_FETCH_TIMEOUT_S),
                             max_bytes=max_bytes, exclude=(self.dht.identity.peer_id,))

    # ---- donating ---------------------------------------------------------------------------------

    def serialized_update(self, epoch: int) -> Optional[bytes]:
        """The strategy's kept update of the round of `epoch`, serialized (None if it keeps none). Read under the
        optimizer's lock (a strategy may keep it in a buffer its next plan overwrites), waited for at most
        SNAPSHOT_WAIT_S (then TimeoutError: the server logs one line, the client asks another donor)."""
        if not self.host.lock.acquire(timeout=SNAPSHOT_WAIT_S):
            raise TimeoutError(f"the optimizer's lock stayed busy for {SNAPSHOT_WAIT_S} s")
        try:
            update = self.host.strategy.kept_update(epoch)
        finally:
            self.host.lock.release()
        return None if update is None else serialize_state(update)

    def serialized_state(self) -> Tuple[int, bytes]:
        """(epoch, bytes) a donor serves: one snapshot per epoch, taken under the lock (never a torn state), so
        that every piece of a multi-donor download comes from the same bytes however many inner steps the donor
        takes meanwhile. While an epoch's end holds the lock (applying a round, stepping), the previous epoch's
        snapshot is served at once instead of making the newcomer wait; an older one (or none) is never served:
        the wait for a fresh one is bounded by SNAPSHOT_WAIT_S and then raises TimeoutError (the server logs one
        line, the client moves on). A snapshot from a donor's first epochs, served while it advertised a much
        later one, once set a newcomer 16 epochs back under load."""
        cached = self._cache
        if cached is not None and cached[0] == self.counters.epoch:
            return cached
        previous = cached if cached is not None and cached[0] >= self.counters.epoch - 1 else None
        lock = self.host.lock
        if not lock.acquire(timeout=0 if previous is not None else SNAPSHOT_WAIT_S):
            if previous is None:
                raise TimeoutError(f"the optimizer's lock stayed busy for {SNAPSHOT_WAIT_S} s")
            return previous
        try:
            if self._cache is None or self._cache[0] != self.counters.epoch:
                self._cache = (self.counters.epoch, serialize_state(self.collaborative_state()))
            return self._cache
        finally:
            lock.release()

    def advertise(self, force: bool = False) -> None:
        """Offer our state in the DHT (trainers with a state server only); unless `force`, at most every
        ADVERTISE_EVERY_S seconds."""
        if self.server is None or self.role != "trainer":
            return
        if force or time.monotonic() - self._advertised_at > ADVERTISE_EVERY_S:
            self.server.advertise(self.dht, self.counters.epoch,
                                  host=self._announce_host() if self._announce_host else None)
            self._advertised_at = time.monotonic()

    def shutdown(self) -> None:
        """Stop donating. Idempotent; a failing stop is logged (debug)."""
        server, self.server = self.server, None
        if server is not None:
            try:
                server.shutdown()
            except Exception:
                logger.debug("shutting down the state server failed", exc_info=True)

    # ---- a local checkpoint -----------------------------------------------------------------------

    def checkpoint_state(self) -> Dict[str, Any]:
        """This peer's own training state for a local checkpoint (moshpeer.peer.checkpoint): the wrapped
        optimizer's state, epoch, steps, the progress of the current epoch (gradient accumulators, samples) and
        the strategy's state (e.g. DiLoCo's outer parameters and momentum). The tensors are the live ones, not
        copies: snapshot them before training goes on."""
        counters = self.counters
        with self.host.lock:
            return {"epoch": counters.epoch, "steps": counters.steps, "samples_accumulated": counters.samples,
                    "total_samples": counters.total_samples, "grad_accumulators": list(counters.grad_sums),
                    "optimizer": self.host.inner.state_dict(), "strategy": self.host.strategy.state_dict()}

    def load_checkpoint_state(self, state: Dict[str, Any]) -> None:
        """Continue exactly from a `checkpoint_state()` (the model's parameters are the caller's to load).
        ValueError when its gradient accumulators do not match this model (nothing changed then)."""
        counters = self.counters
        saved = state["grad_accumulators"]
        if len(saved) != len(counters.grad_sums) or any(s.shape != a.shape for s, a in zip(saved, counters.grad_sums)):
            raise ValueError("checkpoint's gradient accumulators do not match this model")
        with self.host.lock, torch.no_grad():
            self.host.inner.load_state_dict(state["optimizer"])
            self.host.strategy.load_state_dict(state.get("strategy") or {})
            for acc, value in zip(counters.grad_sums, saved):
                acc.copy_(value)
            counters.epoch, counters.steps = int(state["epoch"]), int(state["steps"])
            self._cache = None
            counters.samples = int(state["samples_accumulated"])
            counters.total_samples = int(state["total_samples"])

    def _load_error_feedback(self, feedback: Dict[str, Any]) -> None:
        if self.host.error_feedback is None:
            logger.info("ignoring an error-feedback state: this optimizer keeps none")
            return
        with self.host.averaging_paused():  # no round may use the state while it changes
            self.host.error_feedback.load_state_dict(feedback)
