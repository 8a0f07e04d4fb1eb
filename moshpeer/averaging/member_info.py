"""What each member tells its group in matchmaking, and its validation: `MemberInfo`.

Each member's `data_for_gather` (msgpack: protocol version, data-plane address, weight, random nonce, loss
budget, upload bandwidth, a private run's membership tag, the span it would spread its upload over, the relay
holding its slot when it is behind NAT, its configured group size, the training epoch its contribution belongs
to, the work it claims to hold for a spot check: its epoch and micro-batch size, moshpeer/peer/accountability/,
how long it waits for a leader's first answer in matchmaking, and a digest of the values its group should already
hold alike) travels inside matchmaking over
libp2p's encrypted channel. It came from another peer: `parse_member_info` checks every field before anything uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import msgpack

from moshpeer.dht import admission as private_runs
from moshpeer.errors import ProtocolError
from moshpeer.version import PROTOCOL_VERSION

MAX_GATHERED_BYTES = 1024  # one member's matchmaking metadata; anything larger is rejected
NONCE_BYTES = 16
MAX_BANDWIDTH = 1e12  # bytes/s; a member announcing more is rejected
MAX_PACE_S = 3600.0  # a member announcing a longer upload spread is rejected
MAX_GROUP_SIZE = 1 << 16
MAX_EPOCH = 1 << 62
MAX_BATCH_SIZE = 1 << 24
MAX_ANSWER_WAIT_S = 3600.0
MAX_DIGEST_BYTES = 32


@dataclass(frozen=True)
class MemberInfo:
    """One member's metadata as gathered in matchmaking (validated by `parse_member_info`)."""

    host: str  # "" and port 0: no direct address (reach it over libp2p)
    port: int
    weight: float
    nonce: bytes
    # The loss budget P and phase this member would apply; the group applies the smallest (loss_budget.py).
    loss_budget: Optional[Tuple[float, str]] = None
    # Upload bytes/s for sizing parts (0: unknown or equal parts wanted; the group then splits equally).
    bandwidth: float = 0.0
    tag: bytes = b""  # a private run's membership tag (moshpeer/dht/admission.py); b"" in open runs
    # Seconds this member's round budget grants to spreading its upload (pacing.py); the group paces by the
    # smallest, so that every member's deadline has room for it (0: this member does not pace).
    pace_s: float = 0.0
    relay: Optional[Tuple[str, int]] = None  # behind NAT: the relay through which to reach it (tcp_relay/)
    # Its configured group size (hivemind's key manager places it among that many buckets and fails on a larger
    # group, so a leader aiming higher refuses it); 0: not said.
    group_size: int = 0
    # (epoch, micro-batch size) of the data assignment its contribution was computed on (spot checks); None: none.
    work: Optional[Tuple[int, int]] = None
    # Seconds it waits for a leader's first answer to its join request this round (its request timeout); a leader
    # withdraws an acceptance it could only give late in that wait (matchmaking_adapter.py). 0: not said.
    answer_wait_s: float = 0.0
    # The training epoch its contribution belongs to (a collaborative peer's count; epoch_agreement.py); None: not said.
    epoch: Optional[int] = None
    # A digest of values of this round that the members should already hold alike (a collaborative strategy's
    # θ_outer: strategies/base.py, RoundPlan.digest); b"": not said.
    digest: bytes = b""


def pack_member_info(host: str, port: int, weight: float, nonce: bytes,
                      loss_budget: Optional[Tuple[float, str]] = None, bandwidth: float = 0.0,
                      tag: bytes = b"", pace_s: float = 0.0, relay: Optional[Tuple[str, int]] = None,
                      group_size: int = 0, work: Optional[Tuple[int, int]] = None, answer_wait_s: float = 0.0,
                      epoch: Optional[int] = None, digest: bytes = b"") -> bytes:
    """This peer's metadata for matchmaking's gather (msgpack), parsed by every member with `parse_member_info`."""
    info = {"v": PROTOCOL_VERSION, "host": host, "port": port, "weight": weight, "nonce": nonce}
    if loss_budget is not None:
        info["budget"], info["phase"] = float(loss_budget[0]), str(loss_budget[1])
    if bandwidth > 0:
        info["bw"] = float(bandwidth)
    if tag:
        info["tag"] = tag
    if pace_s > 0:
        info["pace"] = float(pace_s)
    if relay is not None:
        info["relay"] = [relay[0], int(relay[1])]
    if group_size > 0:
        info["gs"] = int(group_size)
    if work is not None:
        info["work"] = [int(work[0]), int(work[1])]
    if answer_wait_s > 0:
        info["wait"] = float(answer_wait_s)
    if epoch is not None:
        info["epoch"] = int(epoch)
    if digest:
        info["digest"] = bytes(digest)
    return msgpack.packb(info)


def parse_member_info(data: bytes) -> MemberInfo:
    """Validate one member's gathered metadata (untrusted: it came from another peer); ProtocolError if bad."""
    if not isinstance(data, bytes) or len(data) > MAX_GATHERED_BYTES:
        raise ProtocolError("gathered metadata missing or too large")
    try:
        info = msgpack.unpackb(data, raw=False, max_bin_len=MAX_GATHERED_BYTES, max_str_len=MAX_GATHERED_BYTES)
    except Exception as e:
        raise ProtocolError(f"undecodable gathered metadata: {e}") from None
    if not isinstance(info, dict) or info.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("gathered metadata of another protocol version")
    host, port, weight, nonce = info.get("host"), info.get("port"), info.get("weight"), info.get("nonce")
    if not isinstance(host, str) or not len(host) <= 255:
        raise ProtocolError("bad data-plane host")
    if not isinstance(port, int) or not 0 <= port < 65536 or (port == 0) != (host == ""):
        raise ProtocolError("bad data-plane port")
    if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise ProtocolError("bad weight")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ProtocolError("bad nonce")
    budget, phase = info.get("budget"), info.get("phase")
    declared = None
    if budget is not None:  # optional: a member without one leaves the decision to the others
        if not isinstance(budget, (int, float)) or not 0.0 <= budget < 1.0 or not isinstance(phase, str) \
                or len(phase) > 16:
            raise ProtocolError("bad loss budget")
        declared = (float(budget), phase)
    bandwidth = info.get("bw", 0.0)
    if not isinstance(bandwidth, (int, float)) or not 0 <= bandwidth <= MAX_BANDWIDTH:
        raise ProtocolError("bad bandwidth")
    tag = info.get("tag", b"")
    if not isinstance(tag, bytes) or len(tag) > private_runs.MAX_PROOF_BYTES:
        raise ProtocolError("bad membership tag")
    pace = info.get("pace", 0.0)
    if not isinstance(pace, (int, float)) or not 0 <= pace <= MAX_PACE_S:
        raise ProtocolError("bad upload pace")
    relay = info.get("relay")
    if relay is not None:
        if not (isinstance(relay, list) and len(relay) == 2 and isinstance(relay[0], str) and 0 < len(relay[0]) <= 255
                and isinstance(relay[1], int) and 0 < relay[1] < 65536):
            raise ProtocolError("bad relay address")
        relay = (relay[0], relay[1])
    group_size = info.get("gs", 0)
    if not isinstance(group_size, int) or not 0 <= group_size <= MAX_GROUP_SIZE:
        raise ProtocolError("bad group size")
    work = info.get("work")
    if work is not None:
        if not (isinstance(work, list) and len(work) == 2 and all(type(x) is int for x in work)
                and 0 <= work[0] < MAX_EPOCH and 0 < work[1] <= MAX_BATCH_SIZE):
            raise ProtocolError("bad declared work")
        work = (work[0], work[1])
    answer_wait = info.get("wait", 0.0)
    if not isinstance(answer_wait, (int, float)) or not 0 <= answer_wait <= MAX_ANSWER_WAIT_S:
        raise ProtocolError("bad answer wait")
    epoch = info.get("epoch")
    if epoch is not None and not (type(epoch) is int and 0 <= epoch < MAX_EPOCH):
        raise ProtocolError("bad epoch")
    digest = info.get("digest", b"")
    if not isinstance(digest, bytes) or len(digest) > MAX_DIGEST_BYTES:
        raise ProtocolError("bad digest")
    return MemberInfo(host, port, float(weight), nonce, declared, float(bandwidth), tag, float(pace), relay,
                      group_size, work, float(answer_wait), epoch, digest)
