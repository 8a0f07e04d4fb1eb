"""The data plane of one round with an assembled group: `GroupDataPlane` runs the round's all-reduces.

A round averages one flat fp32 vector (`flatten`). Dense codecs run one `GroupAllReduce` on it; ARC-Top-K
runs two (a sketch, then the selected rows) through its sparsifier, or through the round's error feedback
(EF21M for gradients, residual feedback for a DiLoCo pseudo-gradient). Every all-reduce of the round shares the
group's members, secret, signed credentials and loss budget; each gets its own tag (its sequence number in the
round). Their stats are added up into one `DataPlaneStats`.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Coroutine, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch

from moshpeer.averaging import wire
from moshpeer.averaging.allreduce import GroupAllReduce, GroupMember, RelayConnect
from moshpeer.averaging.dataplane import DataPlane
from moshpeer.averaging.handshake import RoundCredentials
from moshpeer.averaging.kept_links import KeptLinks
from moshpeer.averaging.links import Links
from moshpeer.averaging.partition import bandwidth_part_sizes
from moshpeer.averaging.member_info import MemberInfo
from moshpeer.averaging.report import ContributionSample, DataPlaneStats
from moshpeer.averaging.scratch import ScratchPool
from moshpeer.compression.codec import Compression
from moshpeer.compression.feedback import ErrorFeedback
from moshpeer.errors import UserError

logger = logging.getLogger(__name__)
T = TypeVar("T")

ROUND_DEVICE_TYPES = ("cpu", "cuda")  # where a round's vector may live (averaging/staging.py); else on the CPU


@dataclass
class GroupDataPlane:
    """Everything the all-reduces of one round with one group share; `average(flat)` runs them.

    :param bandwidths: per member, its announced upload (bytes/s); parts are sized by them if every one is
        positive, else equal
    :param relay: opens libp2p streams to members; force_relay: send everything over it
    :param sampled_member: a robust owner keeps a copy of this member's contribution to its part
        (`DataPlaneStats.member_sample`); only a dense round's single all-reduce does (a sparse round's are a sketch
        and selected rows)
    :param kept: direct connections kept between all-reduces (kept_links.py); None: new ones every all-reduce
    """

    plane: DataPlane
    members: List[GroupMember]
    my_index: int
    group_id: bytes
    secret: bytes
    credentials: RoundCredentials
    compression: Compression
    chunk_numel: int
    deadline: float
    links: Links
    loss_budget: float
    bandwidths: Sequence[float]
    aggregation: str
    distrusted: Sequence[int]
    scratch: Optional[ScratchPool] = None
    relay: Optional[RelayConnect] = None
    force_relay: bool = False
    sampled_member: Optional[int] = None
    kept: Optional[KeptLinks] = None
    results: List[DataPlaneStats] = field(default_factory=list)

    def part_sizes(self, numel: int) -> Optional[List[int]]:
        """Values per member's part for a vector of `numel` values; None = equal parts."""
        if all(b > 0 for b in self.bandwidths):
            return bandwidth_part_sizes(numel, self.bandwidths)
        return None

    def allreduce(self, flat: torch.Tensor, compression: Optional[Compression] = None) -> torch.Tensor:
        """Average one contiguous fp32 vector in place with this group (the round's next all-reduce), sent with
        `compression` (default: the round's); -> flat. Raises ValueError for a vector the data plane cannot
        average (see `GroupAllReduce`)."""
        allreduce = GroupAllReduce(
            self.plane, flat, members=self.members, my_index=self.my_index,
            tag=wire.allreduce_tag(self.group_id, len(self.results)), secret=self.secret,
            credentials=self.credentials, compression=compression or self.compression, chunk_numel=self.chunk_numel,
            deadline=self.deadline, links=self.links, loss_budget=self.loss_budget, relay=self.relay,
            force_relay=self.force_relay, part_sizes=self.part_sizes(flat.numel()), aggregation=self.aggregation,
            distrusted=self.distrusted, scratch=self.scratch,
            sampled_member=self.sampled_member if self.compression.sparsifier is None else None, kept=self.kept)
        self.results.append(allreduce.run())
        return flat

    def average(self, flat: torch.Tensor, error_feedback: Optional[ErrorFeedback] = None) -> DataPlaneStats:
        """Average `flat` in place with the group; -> the stats of the round's all-reduces, added up.

        With a sparsifying codec, `error_feedback` makes what it returns the result; without it (parameters), rows
        the sparsifier did not select keep their values (a zero there would destroy them).
        """
        sparsifier = self.compression.sparsifier
        if sparsifier is None:
            self.allreduce(flat)
        else:
            # ARC-Top-K runs two dense all-reduces (sketch, selected rows) within this group. Its code takes an
            # async callback; ours blocks (the round thread is this all-reduce's thread), so the coroutines
            # never suspend and run to completion here, without an event loop.
            async def dense_allreduce(t: torch.Tensor, compression: Optional[Compression] = None) -> torch.Tensor:
                return self.allreduce(t.detach().to(torch.float32).contiguous().clone(), compression)

            seed = int.from_bytes(self.group_id[:8], "big") & 0x7FFFFFFF
            if error_feedback is not None:
                flat.copy_(run_to_completion(error_feedback.step(flat, seed, dense_allreduce)))
            else:
                run_to_completion(sparsifier.allreduce_inplace(flat, seed, dense_allreduce))
        return sum(self.results, DataPlaneStats())


def run_to_completion(coroutine: Coroutine[Any, Any, T]) -> T:
    """The value of a coroutine that never suspends (it awaits only callbacks that return at once); RuntimeError
    (the coroutine closed) if it does suspend, i.e. it needs an event loop after all."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("a data-plane coroutine suspended: it needs an event loop, the round thread has none")


def round_tensors(tensors: Optional[Sequence[torch.Tensor]], default: List[torch.Tensor],
                  numel: Optional[int] = None) -> List[torch.Tensor]:
    """The tensors a round averages: `tensors`, or `default` when None. UserError unless they are one or more
    floating-point tensors with, if `numel` is given (error feedback averages every value), that many values."""
    if tensors is None:
        return default
    tensors = list(tensors)
    if not tensors or any(not t.is_floating_point() for t in tensors):
        raise UserError("a round averages one or more floating-point tensors")
    if numel is not None and sum(t.numel() for t in tensors) != numel:
        raise UserError("with error feedback every round averages all the averager's values")
    return tensors


def flatten(tensors: List[torch.Tensor]) -> Tuple[torch.Tensor, Callable[[], None]]:
    """A flat fp32 vector of `tensors` and a write-back. It lives on the first tensor's device, so a round
    encodes and decodes there and only encoded bytes cross PCIe (staging.py); zero-copy for one contiguous
    fp32 tensor (what `CollaborativeOptimizer` passes: its buffers are views of one such tensor)."""
    device = tensors[0].device
    if device.type not in ROUND_DEVICE_TYPES:  # the data plane stages CPU and CUDA memory only
        device = torch.device("cpu")
    if len(tensors) == 1 and tensors[0].dtype == torch.float32 and tensors[0].is_contiguous() \
            and tensors[0].device == device:
        return tensors[0].detach().view(-1), lambda: None
    flat = torch.cat([t.detach().reshape(-1).to(device=device, dtype=torch.float32) for t in tensors])

    def write_back() -> None:
        offset = 0
        for t in tensors:
            n = t.numel()
            t.data.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    return flat, write_back


def member_to_sample(my_index: int, group_size: int, aggregation: str) -> Optional[int]:
    """Which other member's contribution a robust owner keeps for a spot check: drawn in secret (the OS's randomness),
    so that no member knows whether it is the one; None in "mean" mode (contributions are summed, not kept)."""
    if aggregation == "mean" or group_size < 2:
        return None
    return secrets.choice([i for i in range(group_size) if i != my_index])


def round_facts(stats: DataPlaneStats, peer_ids: Sequence[str], members: Sequence[MemberInfo], my_index: int,
                sampled: Optional[int]) -> Tuple[DataPlaneStats, Dict[str, Any]]:
    """What a round's data plane tells about its members, as `RoundResult` fields: `flagged` (peer id -> chunks of
    our part robust aggregation clipped or trimmed), `contributors` (members whose contribution reached our part),
    `sample` (member `sampled`'s contribution, for a spot check), `member_epochs` (the epochs members declared) and
    `members_diverged` (those that declared a digest declared different ones); -> (the stats without the sample's
    values, the fields)."""
    evidence = stats.evidence_by_index
    sample = None
    if stats.member_sample is not None and sampled is not None:
        member = members[sampled]
        sample = ContributionSample(peer_ids[sampled], member.work, member.weight, stats.member_sample_start,
                                    stats.member_sample.cpu())
    return replace(stats, member_sample=None), dict(
        flagged={peer_ids[i]: e.flagged for i, e in enumerate(evidence) if e.flagged},
        contributors=[peer_ids[i] for i, e in enumerate(evidence) if e.contributed and i != my_index], sample=sample,
        member_epochs=[m.epoch for m in members if m.epoch is not None],
        members_diverged=len({m.digest for m in members if m.digest}) > 1)


def log_round(tag: str, result: DataPlaneStats, flagged: dict, aggregation: str, diverged: bool = False) -> None:
    """Warn about what a round lost, refused or flagged, and say (info) when its members had drifted apart
    (`diverged`: RoundResult.members_diverged); nothing when it went clean."""
    if diverged:  # the strategy brings them back together: worth a line, not a warning
        logger.info(f"round {tag}: members held different copies of values they should hold alike (their digests "
                    f"differ: a missed step, a lost chunk); each adopts the group's mean of them")
    if result.absent:
        logger.warning(
            f"round {tag}: members {result.absent} were not in this round (they refused or failed "
            f"our authenticated connection, or were unreachable: group assembly disagreed); averaged without them"
        )
    if result.robust_too_few:
        logger.warning(f"round {tag}: {aggregation} aggregation kept this peer's own value in {result.robust_too_few} "
                       f"chunks of its part: fewer than 3 contributions arrived, too few to outvote a hostile one")
    if flagged:
        logger.warning(f"round {tag}: {aggregation} aggregation flagged contributions of "
                       + ", ".join(f"{peer[-8:]} in {n} chunks" for peer, n in flagged.items()))
    if result.chunks_lost or result.departed or result.rejected_messages or result.rejected_connections:
        logger.warning(
            f"round {tag}: lost {result.reduce.chunks_lost}/{result.reduce.chunks_expected} "
            f"reduce and {result.gather.chunks_lost}/{result.gather.chunks_expected} gather chunks, "
            f"departed members {result.departed}, rejected {result.rejected_messages} messages and "
            f"{result.rejected_connections} connections" + (f"; late members {result.late}" if result.late else "")
        )
