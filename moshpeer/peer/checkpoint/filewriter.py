"""Writing one checkpoint file atomically, checksumming the bytes as they stream out.

The sequence (see docs/checkpoints.md for why it is crash-safe):
1. create `<name>.tmp` in the checkpoint directory, skip the header region;
2. stream the `torch.save` bytes of the state through `ChecksummingSink`, which writes them,
   folds them into a running CRC32 (on a helper thread, in parallel with the write) and asks the
   kernel to start writing them back to disk every 32 MB, so the final fsync has little left;
3. write the header (which holds the payload size and CRC32) at offset 0;
4. fsync the file, rename it to its final name, fsync the directory.

A reader never sees a file under a final name whose bytes are not all on disk; a crash at any
point leaves at most a `.tmp` file, which readers skip and the next writer deletes.

Speed: `torch.save` already computes a CRC32 of every record (inside its zip writer). Our
whole-payload CRC32 makes that one redundant, so when torch's (private) building blocks are
available we serialize with the per-record CRC turned off; the result is a standard torch zip
stream that `torch.load` reads. If those internals change, we fall back to `torch.save`.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import os
import pickle
import sys
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.serialization

from moshpeer.peer.checkpoint.format import CheckpointError, encode_header, header_size_for

logger = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"
# Bytes per write syscall; an abort request is honoured between two pieces.
_WRITE_PIECE = 32 << 20
# Start kernel writeback after this many new bytes.
_WRITEBACK_EVERY = 32 << 20
# Buffers at least this large are checksummed on the helper thread while they are written.
_PARALLEL_CRC_MIN = 4 << 20


class WriteAborted(CheckpointError):
    """The write was abandoned on request (a newer checkpoint superseded it)."""


def temp_path_for(path: Path) -> Path:
    """Where the file for `path` is written before it is renamed into place."""
    return path.with_name(path.name + TEMP_SUFFIX)


def fsync_directory(directory: Path) -> None:
    """Make a rename or unlink inside `directory` durable (no-op where directories cannot be opened)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(directory, flags)
    except OSError:  # e.g. Windows: directory entries are durable with the file
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def lower_current_thread_priority(increment: int) -> None:
    """Raise the calling thread's nice value by `increment` (Linux: nice is per thread).

    Background checkpoint writes then yield the CPU to the training threads when cores are busy.
    Best effort: silently does nothing where per-thread priorities are not available.
    """
    if increment <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + increment))
    except (OSError, AttributeError):
        pass


def _find_sync_file_range() -> Optional[Callable[[int, int, int], None]]:
    """`sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)` from libc, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    sync_file_range_write = 2  # SYNC_FILE_RANGE_WRITE: start writeback, do not wait for it

    def start_writeback(fd: int, offset: int, nbytes: int) -> None:
        if function(fd, offset, nbytes, sync_file_range_write) != 0:
            raise OSError(ctypes.get_errno(), "sync_file_range failed")

    return start_writeback


_start_writeback = _find_sync_file_range()


class ChecksummingSink:
    """A write-only file object for torch's serializer: writes at the fd's position, keeps a CRC32.

    `write` may be handed a memoryview straight into a tensor's storage that is only valid during
    the call, so both the write and the checksum of a buffer finish before `write` returns; for
    large buffers they run in parallel (zlib and os.write both release the GIL).
    """

    def __init__(self, fd: int, *, abort: Optional[threading.Event] = None, helper_nice: int = 0):
        self._fd = fd
        self._abort = abort
        self._helper_nice = helper_nice
        self._helper: Optional[ThreadPoolExecutor] = None
        self._position = os.lseek(fd, 0, os.SEEK_CUR)
        self._writeback_from = self._position
        self._writeback = _start_writeback
        self._closed = False
        self.crc32 = 0
        self.nbytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if self._closed:
            return size  # the write was given up; the temp file is being deleted
        if size >= _PARALLEL_CRC_MIN:
            pending: Future = self._helper_pool().submit(zlib.crc32, view, self.crc32)
            try:
                self._write_all(view)
            finally:
                crc = pending.result()  # `view` must not outlive this call, even on error
            self.crc32 = crc
        else:
            self.crc32 = zlib.crc32(view, self.crc32)
            self._write_all(view)
        self.nbytes += size
        return size

    def flush(self) -> None:
        """Nothing is buffered here; durability is the caller's fsync."""

    def close(self) -> None:
        """Stop writing: later `write` calls are ignored (see `write`)."""
        self._closed = True
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None

    def _helper_pool(self) -> ThreadPoolExecutor:
        if self._helper is None:
            nice = self._helper_nice
            self._helper = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="moshpeer-checkpoint-crc",
                initializer=lower_current_thread_priority,
                initargs=(nice,),
            )
        return self._helper

    def _write_all(self, view: memoryview) -> None:
        for start in range(0, len(view), _WRITE_PIECE):
            if self._abort is not None and self._abort.is_set():
                raise WriteAborted("checkpoint write abandoned: superseded by a newer one")
            piece = view[start : start + _WRITE_PIECE]
            while piece:
                written = os.write(self._fd, piece)
                piece = piece[written:]
                self._position += written
            self._maybe_start_writeback()

    def _maybe_start_writeback(self) -> None:
        if self._writeback is None or self._position - self._writeback_from < _WRITEBACK_EVERY:
            return
        try:
            self._writeback(self._fd, self._writeback_from, self._position - self._writeback_from)
        except OSError as e:  # e.g. a filesystem without support: the final fsync does all the work
            logger.debug(f"early writeback unavailable ({e}); relying on fsync alone")
            self._writeback = None
        self._writeback_from = self._position


def _torch_internals_usable() -> bool:
    save = getattr(torch.serialization, "_save", None)
    if save is None or not hasattr(torch._C, "PyTorchFileWriter"):
        return False
    try:
        names = list(inspect.signature(save).parameters)
    except (TypeError, ValueError):
        return False
    return names == ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]


_fast_serializer = _torch_internals_usable()


def serialize_state(state: Any, sink: ChecksummingSink) -> None:
    """Write `state` to `sink` as a `torch.save` zip stream (without torch's redundant per-record CRC)."""
    global _fast_serializer
    if _fast_serializer:
        alignment_getter = getattr(torch.serialization, "_get_storage_alignment", lambda: 64)
        try:
            writer = torch._C.PyTorchFileWriter(sink, False, alignment_getter())
        except TypeError:  # the constructor changed; nothing was written yet
            logger.debug("torch internals changed; checkpoints use torch.save (slower)")
            _fast_serializer = False
        else:
            try:
                torch.serialization._save(state, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
            except BaseException:
                # Unless told it is finished, the writer completes the archive in its C++
                # destructor; after a failure mid-record that throws inside a destructor and
                # aborts the process. Finishing it here marks it finished even if this throws.
                try:
                    writer.write_end_of_file()
                except Exception:
                    pass
                raise
            writer.write_end_of_file()
            return
    torch.save(state, sink)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_checkpoint_file(
    path: Path,
    state: Any,
    meta_json: bytes,
    *,
    abort: Optional[threading.Event] = None,
    helper_nice: int = 0,
) -> int:
    """Write `state` to `path` atomically (temp file, fsync, rename, fsync dir); return the file size.

    On any error, including `WriteAborted`, the temp file is removed and `path` is untouched.
    """
    temp = temp_path_for(path)
    header_size = header_size_for(meta_json)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        os.lseek(fd, header_size, os.SEEK_SET)
        sink = ChecksummingSink(fd, abort=abort, helper_nice=helper_nice)
        try:
            serialize_state(state, sink)
        finally:
            sink.close()
        header = encode_header(meta_json, header_size=header_size, payload_size=sink.nbytes, payload_crc32=sink.crc32)
        _pwrite_all(fd, header, 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quietly(temp)
        raise
    os.close(fd)
    try:
        os.replace(temp, path)
    except BaseException:
        unlink_quietly(temp)
        raise
    fsync_directory(path.parent)
    return header_size + sink.nbytes
