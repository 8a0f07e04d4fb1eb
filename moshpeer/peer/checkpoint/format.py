"""On-disk layout of one checkpoint file, and its verification.

A checkpoint file is a fixed-size header followed by the payload, which is the byte stream of
`torch.save` (a zip archive) of the state:

    offset  size  field
    0       8     magic b"MOSHCKPT"
    8       4     format version (u32, little endian)                  \\ the first 20 bytes keep
    12      4     header size H (u32, a multiple of 4096)               |  this layout in every
    16      4     CRC32 of header bytes [0, 16) + [20, H)              /   format version
    20      8     payload size P (u64)                       \\
    28      4     CRC32 of the payload (u32)                  |  format version 1
    32      4     metadata length M (u32)                     |
    36      M     metadata, JSON (step, epoch, created, ...) /
    36+M    ...   zeros up to H
    H       P     payload: torch.save stream

Why this shape:
- The header checksum sits at a fixed place and covers the format version, so a bit flip in
  the version field reads as corruption (skipped), while a genuinely newer file reads as "unknown
  format version" (refused with a clear error rather than silently skipped).
- The payload starts on a 4096-byte boundary, so torch's 64-byte storage alignment inside the
  zip stays aligned on disk.
- The payload checksum is computed while the bytes stream out (see `filewriter`), then the header
  is written last; the file only gets its final name after both are on disk.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Dict

from moshpeer.errors import MoshpeerError, UserError

MAGIC = b"MOSHCKPT"
FORMAT_VERSION = 1
HEADER_ALIGNMENT = 4096
# Sanity bound checked before allocating anything a header asks for.
MAX_HEADER_SIZE = 1 << 20

# Layout shared by every format version: magic, format version, header size, header CRC32.
_STABLE_PREFIX = struct.Struct("<8sIII")
# Format version 1 fields that follow the stable prefix: payload size, payload CRC32, meta length.
_V1_FIELDS = struct.Struct("<QII")
_V1_FIXED_SIZE = _STABLE_PREFIX.size + _V1_FIELDS.size
_CRC_OFFSET = 16  # where the header CRC32 sits inside the stable prefix

# Chunk size for streaming verification: large enough for zlib to run at full speed.
_VERIFY_CHUNK = 16 << 20


class CheckpointError(MoshpeerError):
    """A checkpoint could not be written or read."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file is truncated, damaged, or not a checkpoint; `reason` says which."""

    def __init__(self, path: os.PathLike | str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


class UnsupportedCheckpointVersion(UserError):
    """A valid checkpoint written in a format version this moshpeer cannot read."""

    def __init__(self, path: os.PathLike | str, version: int):
        super().__init__(
            f"checkpoint {path} has format version {version}, this moshpeer reads version {FORMAT_VERSION}: "
            "upgrade moshpeer, or move the file out of the checkpoint directory"
        )
        self.path = str(path)
        self.version = version


@dataclass(frozen=True)
class Header:
    """The decoded, checksum-verified header of a checkpoint file."""

    format_version: int
    header_size: int
    payload_size: int
    payload_crc32: int
    meta: Dict[str, Any]

    @property
    def file_size(self) -> int:
        return self.header_size + self.payload_size


def encode_meta(meta: Dict[str, Any]) -> bytes:
    """Metadata as compact JSON bytes (what `encode_header` embeds)."""
    return json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()


def header_size_for(meta_json: bytes) -> int:
    """Size of the header region that holds `meta_json`, rounded up to `HEADER_ALIGNMENT`."""
    needed = _V1_FIXED_SIZE + len(meta_json)
    size = -(-needed // HEADER_ALIGNMENT) * HEADER_ALIGNMENT
    if size > MAX_HEADER_SIZE:
        raise CheckpointError(f"checkpoint metadata is too large ({len(meta_json)} bytes)")
    return size


def encode_header(meta_json: bytes, *, header_size: int, payload_size: int, payload_crc32: int) -> bytes:
    """The full header region (exactly `header_size` bytes) for a payload already written."""
    body = _V1_FIELDS.pack(payload_size, payload_crc32, len(meta_json)) + meta_json
    padding_size = header_size - _STABLE_PREFIX.size - len(body)
    if padding_size < 0 or header_size % HEADER_ALIGNMENT:
        raise CheckpointError(f"header size {header_size} does not fit {len(meta_json)} bytes of metadata")
    padding = bytes(padding_size)
    head = MAGIC + struct.pack("<II", FORMAT_VERSION, header_size)
    header_crc = zlib.crc32(body + padding, zlib.crc32(head))
    return head + struct.pack("<I", header_crc) + body + padding


def read_header(f: BinaryIO, path: os.PathLike | str, file_size: int) -> Header:
    """Read and verify the header of an open checkpoint file (positioned anywhere).

    Raises `CorruptCheckpoint` for anything damaged or truncated, `UnsupportedCheckpointVersion`
    for an intact header of another format version. Does not read the payload, but checks that the
    file has exactly the size the header announces (this catches truncation cheaply).
    """
    f.seek(0)
    prefix = f.read(_STABLE_PREFIX.size)
    if len(prefix) < _STABLE_PREFIX.size:
        raise CorruptCheckpoint(path, f"truncated header ({file_size} bytes)")
    magic, version, header_size, header_crc = _STABLE_PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CorruptCheckpoint(path, "not a moshpeer checkpoint (bad magic bytes)")
    if not (_V1_FIXED_SIZE <= header_size <= MAX_HEADER_SIZE) or header_size % HEADER_ALIGNMENT:
        raise CorruptCheckpoint(path, f"damaged header (header size {header_size})")
    if file_size < header_size:
        raise CorruptCheckpoint(path, f"truncated header ({file_size} of {header_size} bytes)")
    rest = f.read(header_size - _STABLE_PREFIX.size)
    if len(rest) != header_size - _STABLE_PREFIX.size:
        raise CorruptCheckpoint(path, "truncated header")
    if zlib.crc32(rest, zlib.crc32(prefix[:_CRC_OFFSET])) != header_crc:
        raise CorruptCheckpoint(path, "header checksum mismatch")
    if version != FORMAT_VERSION:
        raise UnsupportedCheckpointVersion(path, version)
    payload_size, payload_crc, meta_len = _V1_FIELDS.unpack_from(rest)
    meta_start = _V1_FIELDS.size
    if meta_len > len(rest) - meta_start:
        raise CorruptCheckpoint(path, "damaged header (metadata length)")
    try:
        meta = json.loads(rest[meta_start : meta_start + meta_len])
    except ValueError:
        raise CorruptCheckpoint(path, "damaged header (metadata is not JSON)") from None
    if not isinstance(meta, dict):
        raise CorruptCheckpoint(path, "damaged header (metadata is not an object)")
    header = Header(version, header_size, payload_size, payload_crc, meta)
    if file_size < header.file_size:
        raise CorruptCheckpoint(path, f"truncated: {file_size - header_size} of {payload_size} payload bytes")
    if file_size > header.file_size:
        raise CorruptCheckpoint(path, f"{file_size - header.file_size} unexpected bytes after the payload")
    return header


def verify_payload_streaming(f: BinaryIO, path: os.PathLike | str, header: Header) -> None:
    """Check the payload checksum, reading in chunks (constant memory); raises `CorruptCheckpoint`."""
    f.seek(header.header_size)
    buffer = bytearray(min(_VERIFY_CHUNK, max(header.payload_size, 1)))
    view = memoryview(buffer)
    crc, remaining = 0, header.payload_size
    while remaining:
        n = f.readinto(view[: min(len(view), remaining)])
        if not n:
            raise CorruptCheckpoint(path, "truncated payload")
        crc = zlib.crc32(view[:n], crc)
        remaining -= n
    if crc != header.payload_crc32:
        raise CorruptCheckpoint(path, "payload checksum mismatch")


def read_verified(path: os.PathLike | str) -> tuple[Header, bytes]:
    """Read a whole checkpoint file into memory and verify it.

    Returns the header and the file's bytes; the payload is `data[header.header_size:]`. Reading
    everything once means the bytes handed to `torch.load` are exactly the bytes that were checked.
    """
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        header = read_header(f, path, file_size)
        f.seek(0)
        data = f.read()
    if len(data) != header.file_size:
        raise CorruptCheckpoint(path, "file changed while it was read")
    if zlib.crc32(memoryview(data)[header.header_size :]) != header.payload_crc32:
        raise CorruptCheckpoint(path, "payload checksum mismatch")
    return header, data
