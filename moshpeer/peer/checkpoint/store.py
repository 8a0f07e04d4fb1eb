"""`CheckpointStore`: a directory of atomic, checksummed checkpoints, written in the background.

A checkpoint is a dict of named parts (see `Parts` for the names the training loop uses) plus
metadata. Files are named `ckpt-<seq>-epoch<E>-step<S>.mpck`; `seq` grows by one per save in
the directory, so "newest" never depends on clocks or on step counters that a fresh run resets.

One process writes to a directory at a time (an advisory lock enforces it); any number may read.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from moshpeer.errors import UserError
from moshpeer.peer.checkpoint.directory import (
    CHECKPOINT_SUFFIX,
    LOCK_FILE_NAME,
    CheckpointInfo,
    CheckpointMeta,
    PathLike,
    active_writer_pid,
    list_checkpoints,
    load_checkpoint,
    newest_on_disk,
    scan_directory,
    temp_file_reason,
)
from moshpeer.peer.checkpoint.filewriter import (
    TEMP_SUFFIX,
    WriteAborted,
    lower_current_thread_priority,
    unlink_quietly,
    write_checkpoint_file,
)
from moshpeer.peer.checkpoint.format import CorruptCheckpoint, encode_meta
from moshpeer.peer.checkpoint.snapshot import PendingCopies, SnapshotBuffers, wait_until_ready
from moshpeer.version import __version__

try:  # advisory locking is POSIX-only; elsewhere "one writer per directory" is on the user
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

logger = logging.getLogger(__name__)


class Parts:
    """Names of the checkpoint parts, shared by the training loop, resume and `inspect`.

    A checkpoint need not have all of them; it may have others.
    """

    MODEL = "model"  # model.state_dict()
    OPTIMIZER = "optimizer"  # local optimizer.state_dict()
    ERROR_FEEDBACK = "error_feedback"  # compression residuals: dict of tensors
    COLLABORATIVE = "collaborative"  # collaborative epoch, samples accumulated toward the target batch
    GRID = "grid"  # Moshpit grid coordinates / group bits
    RNG = "rng"  # capture_rng_state()
    DATA = "data"  # position of the data stream (BatchStream.state_dict())


@dataclass
class StoreStats:
    """Counters and timings of one store, for logs and benchmarks."""

    saved: int = 0
    skipped_busy: int = 0  # save_async calls dropped because a write was in flight
    aborted: int = 0
    failed: int = 0
    last_snapshot_s: float = 0.0  # time the caller was blocked by the last save_async
    last_write_s: float = 0.0
    last_size: int = 0


class SaveHandle:
    """The pending result of `save_async`: the final path once the write has finished."""

    def __init__(
        self, path: Path, *, step: int, epoch: int, snapshot_s: float, copied: Optional[threading.Event] = None
    ):
        self.path = path
        self.step = step
        self.epoch = epoch
        self.snapshot_s = snapshot_s
        self.write_s: Optional[float] = None
        self.finished_at: Optional[float] = None  # time.monotonic() when the write ended
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._abort = threading.Event()
        # Set once the snapshot holds its own copy of every tensor (at once unless copied in the background).
        if copied is None:
            copied = threading.Event()
            copied.set()
        self._copied = copied

    def wait_copied(self, timeout: Optional[float] = None) -> bool:
        """Wait until the snapshot no longer reads the caller's tensors (at once unless the save was
        made with `copy_in_background`); False if `timeout` passed first."""
        return self._copied.wait(timeout)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the write to end (successfully or not); False if `timeout` passed first."""
        return self._done.wait(timeout)

    def result(self, timeout: Optional[float] = None) -> Path:
        """The checkpoint's path; raises the write's error, or `TimeoutError`."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint for step {self.step} still being written")
        if self._error is not None:
            raise self._error
        return self.path

    def exception(self) -> Optional[BaseException]:
        return self._error

    def _finish(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        self.finished_at = time.monotonic()
        self._done.set()


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(_tensor_bytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(value) for value in obj)
    return 0


class CheckpointStore:
    """Atomic, checksummed checkpoints in one directory, keeping the newest `keep_last`.

    Synchronous `save` writes from the caller's thread. `save_async` copies the state's tensors
    into reusable CPU buffers (a memcpy) and writes from a background thread; at most one write is
    in flight, and a `save_async` call meanwhile either skips (`if_busy="skip"`, the default:
    right for periodic checkpoints, the next period catches up) or waits for it
    (`if_busy="wait"`). Calls are not coalesced: that would need a second full copy of the state.

    Args:
        directory: created on the first save.
        keep_last: how many checkpoints to keep (older ones are deleted only after a new one is
            durable); None keeps all.
        background_nice: how much lower than the training threads background writes run
            (Linux per-thread nice); 0 to disable.
        reuse_snapshot_buffers: keep the CPU copy between async saves (costs one state's worth of
            RAM, saves re-allocating and page-faulting it every time).
    """

    def __init__(
        self,
        directory: PathLike,
        keep_last: Optional[int] = 3,
        *,
        background_nice: int = 10,
        reuse_snapshot_buffers: bool = True,
    ):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.background_nice = background_nice
        self.stats = StoreStats()
        self._snapshots = SnapshotBuffers(reuse=reuse_snapshot_buffers)
        self._in_flight: Optional[SaveHandle] = None
        self._lock = threading.Lock()  # guards _in_flight and _next_seq
        self._lock_fd: Optional[int] = None
        self._pruners: List[threading.Thread] = []
        self._next_seq = 0
        self._closed = False

    # --- writing ---------------------------------------------------------------------------------

    def save(
        self,
        state: Mapping[str, Any],
        *,
        step: int,
        epoch: int,
        extra: Optional[Dict[str, Any]] = None,
        abort_in_flight: bool = False,
    ) -> Path:
        """Write a checkpoint now, from this thread; returns its path once it is durable.

        A background write in flight is waited for first, or abandoned if `abort_in_flight` (the
        new checkpoint supersedes it: what a preemption handler wants when time is short).
        """
        self._check_open()
        self._settle_in_flight(abort=abort_in_flight)
        path, meta_json = self._prepare(state, step=step, epoch=epoch, extra=extra)
        started = time.perf_counter()
        try:
            size = write_checkpoint_file(path, state, meta_json)
        except BaseException:
            self.stats.failed += 1
            raise
        self._after_write(path, size, time.perf_counter() - started, step=step, epoch=epoch)
        return path

    def save_async(
        self,
        state: Mapping[str, Any],
        *,
        step: int,
        epoch: int,
        extra: Optional[Dict[str, Any]] = None,
        if_busy: str = "skip",
        copy_in_background: bool = False,
    ) -> Optional[SaveHandle]:
        """Snapshot `state` now and write it in the background; None if skipped (busy).

        When this returns, the caller may modify every tensor and object in `state`: the
        checkpoint holds their values at the time of the call.

        With `copy_in_background`, the bytes of CPU tensors are copied by the writer thread instead,
        so this returns after building the snapshot's structure (what is not a tensor is still copied
        here). The caller may go on with work that only reads the tensors (forward and backward
        passes) but must call `fence()` (or `handle.wait_copied()`) before changing any of them (the
        optimizer step): that takes the memcpy off the training thread, overlapped with compute.
        """
        if if_busy not in ("skip", "wait"):
            raise ValueError(f"if_busy must be 'skip' or 'wait', got {if_busy!r}")
        self._check_open()
        in_flight = self._in_flight
        if in_flight is not None and not in_flight.done():
            if if_busy == "skip":
                self.stats.skipped_busy += 1
                logger.warning(
                    f"checkpoint for step {step} skipped: the one for step {in_flight.step} is still being "
                    "written (writes take longer than the checkpoint interval)"
                )
                return None
            in_flight.wait()
        started = time.perf_counter()
        pending = None
        if copy_in_background:
            snapshot, ready_events, pending = self._snapshots.take_deferred(state)
        else:
            snapshot, ready_events = self._snapshots.take(state)
        snapshot_s = time.perf_counter() - started
        path, meta_json = self._prepare(snapshot, step=step, epoch=epoch, extra=extra)
        copied = pending.done if pending is not None else None
        handle = SaveHandle(path, step=step, epoch=epoch, snapshot_s=snapshot_s, copied=copied)
        self.stats.last_snapshot_s = snapshot_s
        writer = threading.Thread(
            target=self._write_in_background,
            args=(handle, snapshot, ready_events, meta_json, pending),
            name=f"moshpeer-checkpoint-writer-{step}",
            daemon=True,  # a process that must exit does not wait for it; the write is atomic anyway
        )
        with self._lock:
            self._in_flight = handle
        writer.start()
        return handle

    def wait(self, *, timeout: Optional[float] = None, deadline: Optional[float] = None) -> bool:
        """Wait for background work (the write in flight, then old-checkpoint deletion), until
        `timeout` seconds or the `time.monotonic()` `deadline`, whichever comes first.

        Returns True if all of it has finished.
        """
        limit = timeout
        if deadline is not None:
            until_deadline = max(0.0, deadline - time.monotonic())
            limit = until_deadline if limit is None else min(limit, until_deadline)
        until = None if limit is None else time.monotonic() + limit
        in_flight = self._in_flight
        if in_flight is not None and not in_flight.wait(limit):
            return False
        return self._wait_for_pruners(None if until is None else max(0.0, until - time.monotonic()))

    def fence(self, timeout: Optional[float] = None) -> bool:
        """Wait until no background save reads the caller's tensors any more (see `save_async`'s
        `copy_in_background`); True at once when none does. Call before changing saved tensors."""
        handle = self._in_flight
        return handle is None or handle.wait_copied(timeout)

    @property
    def in_flight(self) -> Optional[SaveHandle]:
        """The background write in progress, if any."""
        handle = self._in_flight
        return handle if handle is not None and not handle.done() else None

    def close(self, timeout: Optional[float] = None) -> None:
        """Wait (up to `timeout`) for the write in flight, release the directory and the buffers."""
        if self._closed:
            return
        if not self.wait(timeout=timeout):
            logger.warning(
                "closing the checkpoint store with background work unfinished (an unfinished write stays a temp file)"
            )
        self._closed = True
        self._snapshots.release()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the advisory lock
            self._lock_fd = None

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # --- reading ---------------------------------------------------------------------------------

    def load_latest(
        self, *, map_location: Any = "cpu", weights_only: bool = True
    ) -> Optional[Tuple[Dict[str, Any], CheckpointMeta]]:
        """The newest valid checkpoint as `(state, meta)`, or None if there is none.

        Damaged files (truncated, bit flips, not checkpoints) are each reported in one log line
        and skipped; they are never loaded. A checkpoint of an unknown format version raises
        `UnsupportedCheckpointVersion` instead of being skipped, so newer progress is not lost.
        """
        try:
            listing = scan_directory(self.directory)
        except FileNotFoundError:
            return None
        in_flight = self.in_flight
        writer_pid = active_writer_pid(self.directory) if listing.temp_files else None
        for temp in listing.temp_files:
            if in_flight is None or temp.name != in_flight.path.name + TEMP_SUFFIX:
                logger.warning(f"ignoring {temp.name}: {temp_file_reason(writer_pid)}")
        for path in listing.misnamed:
            logger.warning(f"ignoring {path.name}: not a checkpoint name (ckpt-<seq>-epoch<E>-step<S>.mpck)")
        for _, path in reversed(listing.checkpoints):
            try:
                state, meta = load_checkpoint(path, map_location=map_location, weights_only=weights_only)
            except CorruptCheckpoint as e:
                logger.warning(f"skipping corrupt checkpoint {path.name}: {e.reason}")
                continue
            except FileNotFoundError:
                continue  # pruned while we were listing
            logger.info(f"loaded checkpoint {path.name} (epoch {meta.epoch}, step {meta.step})")
            return state, meta
        return None

    def list(self, *, verify: bool = True) -> List[CheckpointInfo]:
        """Every checkpoint file here, oldest first, valid or not (see `list_checkpoints`)."""
        if not self.directory.exists():
            return []
        in_flight = self.in_flight
        return list_checkpoints(self.directory, verify=verify, in_flight=in_flight.path if in_flight else None)

    # --- internals -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("checkpoint store is closed")

    def _settle_in_flight(self, *, abort: bool) -> None:
        in_flight = self._in_flight
        if in_flight is None or in_flight.done():
            return
        if abort:
            in_flight._abort.set()
        in_flight.wait()

    def _prepare(
        self, state: Mapping[str, Any], *, step: int, epoch: int, extra: Optional[Dict[str, Any]]
    ) -> Tuple[Path, bytes]:
        if not isinstance(state, Mapping) or not all(isinstance(name, str) for name in state):
            raise TypeError("a checkpoint state must be a dict of named parts (str keys)")
        self._acquire_directory()
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
        meta = {
            "seq": seq,
            "step": int(step),
            "epoch": int(epoch),
            "created": time.time(),
            "moshpeer_version": __version__,
            "torch_version": torch.__version__,
            "parts": {name: _tensor_bytes(value) for name, value in state.items()},
            "extra": extra or {},
        }
        path = self.directory / f"ckpt-{seq:08d}-epoch{int(epoch)}-step{int(step)}{CHECKPOINT_SUFFIX}"
        return path, encode_meta(meta)

    def _acquire_directory(self) -> None:
        """On first write: create the directory, lock it, clean leftovers, find the next seq."""
        if self._lock_fd is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        lock_path = self.directory / LOCK_FILE_NAME
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise UserError(
                    f"another process (pid {holder}) is writing checkpoints to {self.directory}: "
                    "use one checkpoint directory per peer"
                ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        # We are the only writer now: any temp file is the remains of a writer that died.
        listing = scan_directory(self.directory)
        for temp in listing.temp_files:
            logger.info(f"removing {temp.name}: leftover temp file of an interrupted write")
            unlink_quietly(temp)
        seqs = [seq for seq, _ in listing.checkpoints]
        with self._lock:
            self._next_seq = max(seqs, default=0) + 1

    def _write_in_background(
        self,
        handle: SaveHandle,
        snapshot: Dict[str, Any],
        ready_events: List[Any],
        meta_json: bytes,
        pending: Optional[PendingCopies] = None,
    ) -> None:
        started = time.perf_counter()
        try:
            if pending is not None:
                # At normal priority: the training loop may be waiting for it at its next update.
                pending.run()
            lower_current_thread_priority(self.background_nice)
            wait_until_ready(ready_events)
            size = write_checkpoint_file(
                handle.path, snapshot, meta_json, abort=handle._abort, helper_nice=self.background_nice
            )
            handle.write_s = time.perf_counter() - started
            self._after_write(handle.path, size, handle.write_s, step=handle.step, epoch=handle.epoch)
        except WriteAborted as e:
            self.stats.aborted += 1
            logger.info(f"background checkpoint for step {handle.step} abandoned: a newer one supersedes it")
            handle._finish(e)
        except BaseException as e:  # reported through the handle; the training thread keeps going
            self.stats.failed += 1
            logger.error(f"background checkpoint for step {handle.step} failed: {type(e).__name__}: {e} "
                         f"({newest_on_disk(self.directory)}; training goes on)")
            handle._finish(e)
        else:
            handle._finish()

    def _after_write(self, path: Path, size: int, seconds: float, *, step: int, epoch: int) -> None:
        self.stats.saved += 1
        self.stats.last_write_s = seconds
        self.stats.last_size = size
        logger.info(f"checkpoint {path.name} saved: epoch {epoch}, step {step}, {size / 1e6:.1f} MB in {seconds:.2f} s")
        if self.keep_last is not None:
            # Deleting a multi-GB file costs a noticeable fraction of writing it (the kernel frees
            # its pages and extents): do it off the caller's thread. Safe to lose to a crash: the
            # next prune finishes the job.
            pruner = threading.Thread(target=self._prune, name="moshpeer-checkpoint-prune", daemon=True)
            with self._lock:
                self._pruners = [thread for thread in self._pruners if thread.is_alive()] + [pruner]
            pruner.start()

    def _prune(self) -> None:
        """Delete checkpoints older than the newest `keep_last` (the newest is already durable)."""
        lower_current_thread_priority(self.background_nice)
        try:
            checkpoints = scan_directory(self.directory).checkpoints
            for _, path in checkpoints[: -self.keep_last]:
                unlink_quietly(path)
                logger.debug(f"removed old checkpoint {path.name}")
        except OSError as e:
            logger.warning(f"could not remove old checkpoints in {self.directory}: {e}")

    def _wait_for_pruners(self, limit: Optional[float]) -> bool:
        until = None if limit is None else time.monotonic() + limit
        with self._lock:
            pruners = list(self._pruners)
        for pruner in pruners:
            pruner.join(None if until is None else max(0.0, until - time.monotonic()))
            if pruner.is_alive():
                return False
        return True
