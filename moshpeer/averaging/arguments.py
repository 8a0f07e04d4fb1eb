"""The checks of `MoshpitAverager`'s settings and of each `step()`'s arguments: UserError naming the first bad one."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from moshpeer.averaging.member_info import MAX_DIGEST_BYTES
from moshpeer.dht.keys import validate_run_id
from moshpeer.errors import UserError


def check_round_args(min_group_size: int, *, target_group_size: Optional[int], matchmaking_time: Optional[float],
                     digest: bytes = b"", **non_negative: float) -> None:
    """`MoshpitAverager.step`'s arguments: UserError naming the first bad one."""
    if not isinstance(digest, bytes) or len(digest) > MAX_DIGEST_BYTES:
        raise UserError(f"digest must be at most {MAX_DIGEST_BYTES} bytes, got {digest!r:.80}")
    for name, value in non_negative.items():
        if not (math.isfinite(value) and value >= 0):
            raise UserError(f"{name} must be finite and >= 0, got {value}")
    if target_group_size is not None and not min_group_size <= target_group_size:
        raise UserError(f"target_group_size must be at least min_group_size ({min_group_size})")
    if matchmaking_time is not None and not matchmaking_time > 0:
        raise UserError(f"matchmaking_time must be positive, got {matchmaking_time}")


def check_settings(run_id: str, tensors: Sequence[torch.Tensor], target_group_size: int, min_group_size: int,
                   chunk_bytes: int, matchmaking_time: float, round_timeout: float, transport: str,
                   partition: str) -> None:
    """UserError for the first setting of a `MoshpitAverager` that cannot work."""
    validate_run_id(run_id)
    if not tensors:
        raise UserError("MoshpitAverager needs at least one tensor")
    if any(not t.is_floating_point() for t in tensors):
        raise UserError("MoshpitAverager averages floating-point tensors only")
    if target_group_size < 2 or min_group_size < 2 or min_group_size > target_group_size:
        raise UserError("need 2 <= min_group_size <= target_group_size")
    if chunk_bytes < 64 or matchmaking_time <= 0 or round_timeout <= 0:
        raise UserError("chunk_bytes >= 64, matchmaking_time > 0 and round_timeout > 0 are required")
    for name, value, allowed in (("transport", transport, ("auto", "libp2p")),
                                 ("partition", partition, ("equal", "bandwidth"))):
        if value not in allowed:
            raise UserError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
