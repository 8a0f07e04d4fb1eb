"""A checkpoint directory as readers see it: file names, headers, listing and loading (no writing: store.py).

Files are named `ckpt-<seq>-epoch<E>-step<S>.mpck`; a write in progress is the same name plus a temp suffix.
Readers never take the writer's lock. Damaged or unreadable files are reported per file (`CheckpointInfo`),
never raised, by `inspect_file` and `list_checkpoints`; `load_checkpoint` raises `CheckpointError`s.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from moshpeer.errors import UserError
from moshpeer.peer.checkpoint.filewriter import TEMP_SUFFIX
from moshpeer.peer.checkpoint.format import (
    CheckpointError,
    CorruptCheckpoint,
    Header,
    UnsupportedCheckpointVersion,
    read_header,
    read_verified,
    verify_payload_streaming,
)

PathLike = Union[str, os.PathLike]

CHECKPOINT_SUFFIX = ".mpck"
LOCK_FILE_NAME = ".moshpeer-checkpoints.lock"
_CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{8,})-epoch(\d+)-step(\d+)\.mpck$")


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint's header says about it."""

    path: Path
    seq: int
    step: int
    epoch: int
    created: float  # unix time at which the state was captured
    moshpeer_version: str
    torch_version: str
    format_version: int
    parts: Dict[str, int]  # part name -> bytes of tensor data in it
    extra: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_header(cls, path: PathLike, header: Header) -> "CheckpointMeta":
        meta = header.meta
        try:
            return cls(
                path=Path(path),
                seq=int(meta["seq"]),
                step=int(meta["step"]),
                epoch=int(meta["epoch"]),
                created=float(meta["created"]),
                moshpeer_version=str(meta["moshpeer_version"]),
                torch_version=str(meta["torch_version"]),
                format_version=header.format_version,
                parts={str(name): int(size) for name, size in meta["parts"].items()},
                extra=dict(meta.get("extra") or {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CorruptCheckpoint(path, "damaged header (metadata fields)") from None


@dataclass(frozen=True)
class CheckpointInfo:
    """One file of a checkpoint directory, as `list()` and `moshpeer checkpoint inspect` show it."""

    path: Path
    size: int
    valid: bool
    reason: Optional[str] = None  # why it is not valid
    meta: Optional[CheckpointMeta] = None

    @property
    def name(self) -> str:
        return self.path.name

    def to_json(self) -> Dict[str, Any]:
        meta = self.meta
        return {
            "file": self.name,
            "valid": self.valid,
            "reason": self.reason,
            "size": self.size,
            "seq": meta.seq if meta else None,
            "epoch": meta.epoch if meta else None,
            "step": meta.step if meta else None,
            "created": meta.created if meta else None,
            "parts": meta.parts if meta else None,
            "moshpeer_version": meta.moshpeer_version if meta else None,
            "format_version": meta.format_version if meta else None,
            "extra": meta.extra if meta else None,
        }


@dataclass
class DirectoryListing:
    """The files of a checkpoint directory, by kind."""

    checkpoints: List[Tuple[int, Path]]  # (seq, path), oldest first
    temp_files: List[Path]
    misnamed: List[Path]


def scan_directory(directory: Path) -> DirectoryListing:
    """Checkpoints (oldest first), temp files and misnamed files in `directory`; OSError if it cannot be read."""
    checkpoints, temp_files, misnamed = [], [], []
    for entry in os.scandir(directory):
        name = entry.name
        if name.endswith(CHECKPOINT_SUFFIX + TEMP_SUFFIX):
            temp_files.append(Path(entry.path))
        elif name.endswith(CHECKPOINT_SUFFIX):
            match = _CHECKPOINT_NAME.match(name)
            if match and entry.is_file():
                checkpoints.append((int(match.group(1)), Path(entry.path)))
            else:
                misnamed.append(Path(entry.path))
    checkpoints.sort()
    return DirectoryListing(checkpoints, sorted(temp_files), sorted(misnamed))


def newest_on_disk(directory: Path) -> str:
    """What a resume would start from, in words, for messages about a failed write: the newest checkpoint file's
    name (unverified), or that there is none."""
    try:
        checkpoints = scan_directory(directory).checkpoints
    except OSError as e:
        return f"the checkpoint directory cannot be read ({e.strerror or e})"
    return f"the newest checkpoint is {checkpoints[-1][1].name}" if checkpoints else "there is no checkpoint yet"


def inspect_file(path: PathLike, *, verify: bool = True) -> CheckpointInfo:
    """Check one checkpoint file: header, size, and (if `verify`) the payload checksum."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header = read_header(f, path, size)
            if verify:
                verify_payload_streaming(f, path, header)
            meta = CheckpointMeta.from_header(path, header)
    except CorruptCheckpoint as e:
        return CheckpointInfo(path, _size_or_zero(path), False, e.reason)
    except UnsupportedCheckpointVersion as e:
        return CheckpointInfo(path, _size_or_zero(path), False, f"unknown format version {e.version}")
    except OSError as e:
        return CheckpointInfo(path, _size_or_zero(path), False, f"unreadable: {e.strerror or e}")
    return CheckpointInfo(path, size, True, None, meta)


def active_writer_pid(directory: Path) -> Optional[int]:
    """The pid of another live process that holds this directory's writer lock, if any.

    Read from the lock file without locking (a reader must never make a writer's lock attempt
    fail). A dead writer's pid may have been reused, so this only serves to word messages.
    """
    try:
        pid = int((directory / LOCK_FILE_NAME).read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    if pid <= 0 or pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid  # alive, owned by someone else
    return pid


def temp_file_reason(writer_pid: Optional[int]) -> str:
    """Why a temp file is in the directory, as listings word it."""
    if writer_pid is not None:
        return f"being written (or left by an interrupted write); pid {writer_pid} is writing here"
    return "leftover temp file of an interrupted write"


def _size_or_zero(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def list_checkpoints(
    directory: PathLike, *, verify: bool = True, in_flight: Optional[Path] = None
) -> List[CheckpointInfo]:
    """Every checkpoint-like file in `directory`, oldest first, then temp and misnamed files.

    Raises `UserError` if the directory does not exist or cannot be read.
    """
    directory = Path(directory)
    try:
        listing = scan_directory(directory)
    except FileNotFoundError:
        raise UserError(f"checkpoint directory {directory} does not exist") from None
    except NotADirectoryError:
        raise UserError(f"{directory} is not a directory") from None
    except PermissionError:
        raise UserError(f"cannot read checkpoint directory {directory}: permission denied") from None
    infos = [inspect_file(path, verify=verify) for _, path in listing.checkpoints]
    writer_pid = active_writer_pid(directory) if listing.temp_files else None
    for path in listing.temp_files:
        being_written = in_flight is not None and path.name == in_flight.name + TEMP_SUFFIX
        reason = "being written" if being_written else temp_file_reason(writer_pid)
        infos.append(CheckpointInfo(path, _size_or_zero(path), False, reason))
    for path in listing.misnamed:
        reason = "name is not ckpt-<seq>-epoch<E>-step<S>.mpck: ignored"
        infos.append(CheckpointInfo(path, _size_or_zero(path), False, reason))
    return infos


def load_checkpoint(
    path: PathLike, *, map_location: Any = "cpu", weights_only: bool = True
) -> Tuple[Dict[str, Any], CheckpointMeta]:
    """Verify one checkpoint file, then load it: `(state, meta)`.

    Raises `CorruptCheckpoint` (damaged), `UnsupportedCheckpointVersion` (newer format), or
    `CheckpointError` (intact file that torch cannot load, e.g. objects `weights_only` refuses).
    """
    header, data = read_verified(path)
    meta = CheckpointMeta.from_header(path, header)
    buffer = io.BytesIO(data)  # shares `data`, no copy
    buffer.seek(header.header_size)  # torch reads the zip relative to the current position
    try:
        state = torch.load(buffer, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path}: checksum is valid but torch.load(weights_only={weights_only}) refused it: {first_line}"
        ) from e
    except (RuntimeError, EOFError) as e:
        raise CheckpointError(f"{path}: checksum is valid but torch cannot read the payload: {e}") from e
    return state, meta


