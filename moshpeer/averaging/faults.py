"""Fault injection as a wrapper around the real transport: dropped, delayed and burst-lost chunks, a peer
that goes silent, a hostile (byzantine) peer.

`FaultyLinks(FaultConfig(...))` is a `moshpeer.averaging.links.Links`: it wraps each chunk stream of a round
(`FaultyStream`: decides per chunk, with `ChunkFaults`, whether to pass it to the real stream now, later or
never), the codec this peer's contributions are encoded with (`HostileCodec`), and the weight it declares.
The all-reduce and the averager contain no fault logic: they use whatever `Links` they were handed. Without
one (the default) nothing is wrapped and normal runs pay nothing. Decisions come from a seeded RNG per
(round, sender, receiver, phase), so a test can replay a run exactly.

Faults are always configured explicitly: `MoshpitAverager(links=FaultyLinks(FaultConfig(...)))`, or
`moshpeer join --faults drop=0.1,delay=0.002,phases=reduce` (`FaultConfig.parse`). Production code reads
no environment variable for them.

A byzantine peer (`byzantine=-100,weight=1e6`) runs the real protocol but sends `scale` x its own
contribution (or the constant `byzantine_value`) in the reduce phase and declares `weight` in
matchmaking; as a part's owner it stays honest (see docs/security.md: a hostile owner is out of the
aggregators' reach).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import dataclass, fields
from typing import List, Optional, Tuple

import torch

from moshpeer.averaging.links import ChunkStream, Links, StreamSpec
from moshpeer.errors import UserError

PHASES = ("reduce", "gather")
# Short names accepted by `FaultConfig.parse` (CLI: `moshpeer join --faults drop=0.1,delay=0.05`).
ALIASES = {"drop": "drop_prob", "delay": "delay_s", "jitter": "jitter_s", "burst": "burst_prob",
           "stop": "stop_after_chunks", "retransmit": "retransmit_s", "byzantine": "byzantine_scale",
           "weight": "byzantine_weight", "value": "byzantine_value", "chunks": "byzantine_chunks"}


@dataclass(frozen=True)
class FaultConfig:
    """What to inject into this peer's outgoing chunks.

    :param drop_prob: probability that a chunk is silently not sent (i.i.d. per chunk)
    :param delay_s: fixed delay before each chunk; jitter_s: plus a uniform random delay in [0, jitter_s]
    :param burst_prob: per-chunk probability that a loss burst starts; burst_len chunks are then dropped
    :param burst_loss: loss probability of each chunk inside a burst (1.0: all of them; microbursts: 0.6-0.9)
    :param retransmit_s: None: a lost chunk is gone (the receiver learns it from the end-of-phase marker).
        A number: the link is reliable, like TCP: a lost chunk is sent again after this retransmission
        timeout (each resend may be lost again). With a budget P = 0 (the baseline) the link is TCP-like:
        in order, so a resend holds back every later chunk of the stream. With P > 0 the link is DBLP's
        bounded-loss transport: the sender leaves its share of the receiver's allowance, floor(P x the
        chunks the receiver expects in the phase), lost, and resends later losses selectively, after the
        timeout, without holding back the chunks behind them
    :param stop_after_chunks: after this many chunks sent in a round, the peer goes silent (no more chunks,
        no end-of-phase markers) until the round ends, like a peer that hangs
    :param phases: which phases the faults apply to ("reduce", "gather")
    :param seed: base seed of the fault RNG
    :param byzantine_scale: multiply this peer's reduce contributions by this factor (e.g. -100)
    :param byzantine_value: send this constant as every reduce contribution instead (e.g. 3e38)
    :param byzantine_weight: declare this averaging weight in matchmaking instead of the real one
    :param byzantine_chunks: the share of reduce chunks the byzantine contribution replaces (1.0: all of them);
        which ones follows from each chunk's codec seed, so a round's choice is spread over every part
    """

    drop_prob: float = 0.0
    delay_s: float = 0.0
    jitter_s: float = 0.0
    burst_prob: float = 0.0
    burst_len: int = 0
    burst_loss: float = 1.0
    retransmit_s: Optional[float] = None
    stop_after_chunks: Optional[int] = None
    phases: Tuple[str, ...] = PHASES
    seed: int = 0
    byzantine_scale: Optional[float] = None
    byzantine_value: Optional[float] = None
    byzantine_weight: Optional[float] = None
    byzantine_chunks: float = 1.0

    def __post_init__(self):
        for name in ("drop_prob", "burst_prob", "burst_loss", "byzantine_chunks"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise UserError(f"fault {name} must be within [0, 1], got {value}")
        if self.retransmit_s is not None and self.retransmit_s < 0:
            raise UserError("fault retransmit_s must be non-negative")
        for name in ("delay_s", "jitter_s", "retransmit_s", "byzantine_scale", "byzantine_value", "byzantine_weight"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                unit = " of seconds" if name.endswith("_s") else ""
                raise UserError(f"fault {name} must be a finite number{unit}, got {value}")
        if self.delay_s < 0 or self.jitter_s < 0 or self.burst_len < 0:
            raise UserError("fault delays and burst length must be non-negative")
        if self.stop_after_chunks is not None and self.stop_after_chunks < 0:
            raise UserError("stop_after_chunks must be non-negative")
        phases = (self.phases,) if isinstance(self.phases, str) else tuple(self.phases)
        if any(phase not in PHASES for phase in phases):
            raise UserError(f"fault phases must be among {PHASES}, got {phases}")
        object.__setattr__(self, "phases", phases)

    @classmethod
    def parse(cls, text: str) -> "FaultConfig":
        """`drop_prob=0.1,delay_s=0.01,phases=reduce+gather` -> FaultConfig (the CLI's syntax).

        Keys are FaultConfig's field names or their short ALIASES (drop, delay, jitter, burst, stop,
        retransmit, byzantine, weight, value, chunks). Raises UserError, with one line that says what is wrong,
        on a malformed spec.
        """
        kinds = {f.name: f for f in fields(cls)}
        values = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            key = ALIASES.get(key.strip(), key.strip())
            raw = raw.strip()
            if not sep or key not in kinds:
                known = ", ".join([*kinds, *ALIASES])
                raise UserError(f"bad fault setting {item!r} (expected key=value); known keys: {known}")
            if key in values:
                raise UserError(f"fault {key} given twice in {text!r}")
            try:
                if key == "phases":
                    values[key] = tuple(raw.split("+"))
                elif key in ("burst_len", "seed", "stop_after_chunks"):
                    values[key] = int(raw)
                else:
                    values[key] = float(raw)
            except ValueError:
                raise UserError(f"bad value for fault {key}: {raw!r}") from None
        return cls(**values)

    def hostile(self, values: torch.Tensor) -> torch.Tensor:
        """What a byzantine peer sends instead of its contribution `values` (`values` itself if not byzantine)."""
        if self.byzantine_value is not None:
            return torch.full_like(values, self.byzantine_value)
        if self.byzantine_scale is not None:
            return values * self.byzantine_scale
        return values

    def attacks_chunk(self, seed: int) -> bool:
        """Does the byzantine contribution replace the chunk with this codec seed (`byzantine_chunks` of them)?"""
        if self.byzantine_chunks >= 1.0:
            return True
        return random.Random(f"{self.seed}:{seed}").random() < self.byzantine_chunks

    def declared_weight(self, weight: float) -> float:
        """The averaging weight this peer announces (a byzantine peer lies about it)."""
        return self.byzantine_weight if self.byzantine_weight is not None else weight


# A reliable link gives up resending one chunk after this many tries (the round deadline ends it anyway).
MAX_RETRANSMISSIONS = 16


class ChunkFaults:
    """Per-stream fault decisions: `before_chunk()` before each chunk says whether it is lost and how long to wait.

    :param droppable: with `retransmit_s`, how many chunks of this stream the sender may leave lost
        instead of resending them (this stream's share of the receiver's loss allowance)
    :param selective: a loss budget > 0 is in force: later losses are resent selectively (`resend_after`)
    """

    def __init__(self, config: FaultConfig, phase: str, stream_seed: int, shared_counter: list,
                 droppable: int = 0, selective: bool = False):
        self.config = config
        self.active = phase in config.phases
        self.rng = random.Random(config.seed * 1_000_003 + stream_seed)
        self.burst_left = 0
        self.sent_in_round = shared_counter  # [count], shared by every connection of this peer in the round
        self.droppable = int(droppable)
        self.selective = selective  # DBLP's transport: a resend does not hold back later chunks
        self.left_lost = 0
        self.retransmissions = 0
        # After before_chunk() said drop: 0.0 if the chunk stays lost, else the seconds after which the
        # (selective) sender must send it again.
        self.resend_after = 0.0

    def silenced(self) -> bool:
        """True once this peer has sent `stop_after_chunks` chunks in the round: it sends nothing more."""
        limit = self.config.stop_after_chunks
        return limit is not None and self.sent_in_round[0] >= limit

    def before_chunk(self) -> Tuple[bool, float]:
        """(drop this chunk?, seconds to wait before sending it)."""
        if not self.active:
            return False, 0.0
        cfg = self.config
        delay = cfg.delay_s + (self.rng.uniform(0.0, cfg.jitter_s) if cfg.jitter_s else 0.0)
        self.resend_after = 0.0
        lost = self._lost()
        if not lost or cfg.retransmit_s is None:
            return lost, delay
        if self.left_lost < self.droppable:
            self.left_lost += 1  # within the loss budget: a bounded-loss sender does not resend
            return True, delay
        if self.selective:
            # Resent after the timeout; the chunks behind it go on now (and move the burst on: a resend
            # is lost or not when it is sent, see resend_lost()).
            self.resend_after = cfg.retransmit_s
            return True, delay
        # A TCP-like sender waits a retransmission timeout per try, holding back everything behind the
        # chunk; a try inside a burst may be lost too.
        for _ in range(MAX_RETRANSMISSIONS):
            delay += cfg.retransmit_s
            self.retransmissions += 1
            if not self._lost():
                break
        return False, delay

    def resend_lost(self) -> bool:
        """A selective resend goes out now: is it lost again (then it is due one more timeout later)?"""
        self.retransmissions += 1
        return self.active and self._lost()

    def _lost(self) -> bool:
        """Is the next transmission lost? Advances the burst state by one transmission."""
        cfg = self.config
        if self.burst_left > 0:
            self.burst_left -= 1
            return cfg.burst_loss >= 1.0 or self.rng.random() < cfg.burst_loss
        if cfg.burst_prob and self.rng.random() < cfg.burst_prob:
            self.burst_left = max(cfg.burst_len - 1, 0)
            return cfg.burst_loss >= 1.0 or self.rng.random() < cfg.burst_loss
        return cfg.drop_prob > 0 and self.rng.random() < cfg.drop_prob


class HostileCodec:
    """A reduce codec that encodes `config.hostile(values)` instead of this peer's contribution (a byzantine
    sender); everything else is the wrapped codec's, except batching: its chunks go one `encode` at a time (the
    wrapped codec's `encode_chunks`, or a raw codec's view of the vector, would send the true values)."""

    batched = False
    raw = False

    def __init__(self, codec, config: FaultConfig):
        self.codec, self.config = codec, config

    def encode(self, chunk: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
        values = self.config.hostile(chunk) if self.config.attacks_chunk(seed) else chunk
        return self.codec.encode(values, seed=seed)

    def __getattr__(self, name):
        return getattr(self.codec, name)


class FaultyStream:
    """Wraps the real stream of one phase to one member: each chunk is passed on now (after the configured
    delay), dropped, or, on a selective (DBLP) link, kept and resent after its retransmission timeout, before
    the end-of-phase marker. A silenced peer passes nothing on, markers included."""

    def __init__(self, inner: ChunkStream, faults: ChunkFaults, deadline: float):
        self.inner, self.faults, self.deadline = inner, faults, deadline
        self.stats = inner.stats
        # (due time, order, header, a copy of the payload: the vector it came from changes in the gather)
        self._resends: List[Tuple[float, int, bytes, bytes]] = []

    def closing(self) -> bool:
        return self.inner.closing()

    def send(self, header: bytes, data) -> None:
        if self.faults.silenced():
            return
        drop, delay = self.faults.before_chunk()
        if delay > 0:
            time.sleep(delay)
        if not drop:
            return self._transmit(header, data)
        self.stats.chunks_dropped_by_faults += 1
        if self.faults.resend_after > 0:  # selective resend: keep the bytes, send them when due
            due = time.monotonic() + self.faults.resend_after
            self._resends.append((due, len(self._resends), header, bytes(data)))

    def end(self, marker: bytes) -> None:
        self._send_resends()
        if not self.faults.silenced():
            self.inner.end(marker)

    def _transmit(self, header: bytes, data) -> None:
        self.inner.send(header, data)
        self.faults.sent_in_round[0] += 1

    def _send_resends(self) -> None:
        """DBLP's selective resends, each when its timeout is due (the receiver waits for them, within its
        budget and the deadline); a resend lost again is due one more timeout later."""
        queue, budget = list(self._resends), MAX_RETRANSMISSIONS * len(self._resends)
        heapq.heapify(queue)
        while queue and budget > 0:
            due, order, header, data = heapq.heappop(queue)
            if due > self.deadline or self.closing() or self.faults.silenced():
                return
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            budget -= 1
            if self.faults.resend_lost():
                heapq.heappush(queue, (time.monotonic() + self.faults.config.retransmit_s, order, header, data))
                continue
            self._transmit(header, data)


class FaultyLinks(Links):
    """The real transport with `config`'s faults injected into this peer's outgoing chunks (see module doc)."""

    def __init__(self, config: FaultConfig, _sent_in_round: Optional[list] = None):
        self.config = config
        self._sent_in_round = _sent_in_round if _sent_in_round is not None else [0]

    @classmethod
    def parse(cls, text: str) -> "FaultyLinks":
        """`FaultyLinks(FaultConfig.parse(text))`: the CLI's syntax; UserError with one line on a bad spec."""
        return cls(FaultConfig.parse(text))

    def declared_weight(self, weight: float) -> float:
        return self.config.declared_weight(weight)

    def contribution_codec(self, codec):
        hostile = self.config.byzantine_value is not None or self.config.byzantine_scale is not None
        return HostileCodec(codec, self.config) if hostile else codec

    def for_allreduce(self) -> "FaultyLinks":
        # `stop_after_chunks` counts every chunk this peer sends in the all-reduce, over all its streams.
        return FaultyLinks(self.config, [0])

    def stream(self, inner: ChunkStream, spec: StreamSpec) -> ChunkStream:
        seed = spec.round_seed * 64 + spec.sender * 8 + spec.receiver * 2 + (spec.phase == "gather")
        faults = ChunkFaults(self.config, spec.phase, seed, self._sent_in_round, droppable=spec.droppable,
                             selective=spec.selective)
        return FaultyStream(inner, faults, spec.deadline)
