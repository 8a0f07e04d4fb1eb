"""Adaptive averaging deadlines: how long to wait for a group, and for a round, from what was measured.

Fixed timeouts are wrong both ways: long enough for the slowest round a loaded machine ever sees,
they make every survivor wait that long whenever a group member dies mid-round; short enough to
make deaths cheap, they cut healthy rounds short (hivemind #676 asks for this). Here each peer
keeps the durations it measured recently and sets the next deadline to

    clamp(max(median + k * 1.4826 * MAD, ratio * median) * growth ** streak, floor, cap)

- median and MAD (median absolute deviation, scaled to a standard deviation for normal data) are
  robust: a few outliers (a round that ran into a dead member) barely move them;
- `ratio * median` is a margin when the spread is tiny (rounds of identical length);
- `streak` counts the rounds in a row that ran into their deadline although every member was alive
  (the machine or the network got slower): each one doubles the next deadline, so a slowdown costs
  one cut-short round per doubling instead of a whole history of them. A round in which a member
  died (it sent nothing) is not recorded at all: its length says when the others gave up on it, not
  how long rounds take;
- floor and cap are the user's bounds (`moshpeer join --min-round-timeout / --round-timeout`,
  `--min-matchmaking-time / --matchmaking-time`). With fewer than `min_samples` measurements the
  cap is used, so a new peer starts with the patient setting and tightens as it learns.

A round's duration is the budget it needed (`budget_needed`): its data plane's time, or its reduce-scatter's
over the share of the budget that phase gets, whichever is longer.

Round durations depend on the group size and the payload, so `DeadlineLearner` keeps one history per
(group size, payload size class) and falls back to all group sizes of that payload class while a
group size has too few measurements. Assembly times are kept per target group size; the peer side reads
the fastest recent one (`fastest_assembly_s`) instead of keeping a history of its own.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Deque, Dict, Iterable, List, Optional, Tuple

from moshpeer.averaging.deadline import REDUCE_SCATTER_SHARE, RoundDeadline
from moshpeer.errors import UserError

if TYPE_CHECKING:
    from moshpeer.averaging.report import RoundResult

MAD_TO_SIGMA = 1.4826  # MAD of normally distributed data x this = its standard deviation
DEFAULT_K = 4.0
DEFAULT_RATIO = 1.5
DEFAULT_HISTORY = 32
DEFAULT_MIN_SAMPLES = 4
DEFAULT_GROWTH = 2.0
DEFAULT_MIN_ROUND_S = 1.0
# A data plane that took this much of its budget ran into its deadline (its owners stopped waiting for
# contributions at deadline.REDUCE_SCATTER_SHARE of it).
DEADLINE_HIT_FRACTION = 0.9
# `fastest_assembly_s` looks at this many of the latest full-group assemblies (older ones describe a swarm
# that may have changed).
FASTEST_ASSEMBLY_RECENT = 8


@dataclass(frozen=True)
class MarginPolicy:
    """How a deadline is derived from measured durations (see the module docstring)."""

    k: float = DEFAULT_K
    ratio: float = DEFAULT_RATIO
    min_samples: int = DEFAULT_MIN_SAMPLES
    growth: float = DEFAULT_GROWTH

    def __post_init__(self) -> None:
        if not (self.k >= 0 and self.ratio >= 1 and self.min_samples >= 1 and self.growth >= 1):
            raise ValueError(f"need k >= 0, ratio >= 1, min_samples >= 1, growth >= 1; got {self}")


def robust_deadline(samples: Iterable[float], policy: MarginPolicy) -> Optional[float]:
    """median + k * sigma (from the MAD), at least ratio * median; None with fewer than min_samples."""
    values = [float(v) for v in samples if math.isfinite(v) and v >= 0]
    if len(values) < policy.min_samples:
        return None
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    return max(median + policy.k * MAD_TO_SIGMA * mad, policy.ratio * median)


class AdaptiveDeadline:
    """One adaptive timeout over a sliding window of durations; thread-safe.

    :param floor, cap: bounds of the deadline (seconds, 0 < floor <= cap); the cap is used until
        `policy.min_samples` durations were observed
    :raises ValueError: on bounds that are not 0 < floor <= cap
    """

    def __init__(self, floor: float, cap: float, *, policy: MarginPolicy = MarginPolicy(),
                 history: int = DEFAULT_HISTORY):
        if not (0 < floor <= cap and math.isfinite(cap)):
            raise ValueError(f"need 0 < floor <= cap < inf, got floor={floor}, cap={cap}")
        self.floor, self.cap, self.policy = float(floor), float(cap), policy
        self._samples: Deque[float] = deque(maxlen=history)
        self._streak = 0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        """A duration that finished before its deadline (ends a streak of deadline hits)."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        with self._lock:
            self._samples.append(float(seconds))
            self._streak = 0

    def observe_deadline_hit(self) -> None:
        """The operation ran into its deadline for no known reason (nobody died): it may need longer."""
        with self._lock:
            self._streak += 1

    def current(self) -> float:
        """The deadline to use next (seconds)."""
        with self._lock:
            samples, streak = list(self._samples), self._streak
        return self._bounded(robust_deadline(samples, self.policy), streak)

    def _bounded(self, estimate: Optional[float], streak: int) -> float:
        if estimate is None:
            return self.cap
        grown = estimate * self.policy.growth ** min(streak, 64)
        return min(self.cap, max(self.floor, grown))

    @property
    def samples(self) -> List[float]:
        with self._lock:
            return list(self._samples)

    @property
    def streak(self) -> int:
        return self._streak


def budget_needed(result: "RoundResult") -> float:
    """The data-plane budget a round needed: its whole time, or its reduce-scatter over the share of the budget that
    phase gets (owners stop waiting for contributions at deadline.REDUCE_SCATTER_SHARE of it), whichever is longer.
    The round's time alone is not enough where the reduce-scatter is nearly all of it: on netlab, a 20 Mbit/s peer
    200 ms away behind a symmetric NAT reduced its part in 1.8 s of a 1.9 s round, learned a 2.8 s budget, stopped
    waiting at 1.7 s, and lost the chunks of its slowest members in every other round (the doubled budget of the
    round after fit, and the next one fell back)."""
    return max(result.total_s, result.reduce_scatter_s / REDUCE_SCATTER_SHARE)


def payload_bytes(tensors: Iterable) -> int:
    """fp32 bytes a round averages (of these tensors), before compression: what its deadline's history is
    keyed by."""
    return 4 * sum(t.numel() for t in tensors)


def payload_class(nbytes: int) -> int:
    """Payload size class: rounds whose payloads are within a factor of two share a history."""
    return max(int(nbytes), 1).bit_length()


class DeadlineLearner:
    """Learns, from the rounds a peer measured, the matchmaking window and data-plane deadline (seconds) of its
    next averaging round; `MoshpitAverager.step()` turns them into that round's absolute `RoundDeadline`
    (deadline.py).

    :param matchmaking_floor, matchmaking_cap: bounds of the matchmaking window (seconds)
    :param round_floor, round_cap: bounds of the data-plane deadline of a round (seconds)
    :raises ValueError: on bounds that are not 0 < floor <= cap
    """

    @classmethod
    def for_settings(cls, matchmaking_time: float, round_timeout: float, min_matchmaking_time: Optional[float] = None,
                     min_round_timeout: Optional[float] = None) -> "DeadlineLearner":
        """The averager's settings: caps `matchmaking_time` / `round_timeout`, floors the `min_*` ones (None: that
        deadline stays at its cap). UserError unless 0 < floor <= cap."""
        try:
            return cls(matchmaking_floor=min_matchmaking_time or matchmaking_time, matchmaking_cap=matchmaking_time,
                       round_floor=min_round_timeout or round_timeout, round_cap=round_timeout)
        except ValueError:
            raise UserError(f"need 0 < min_matchmaking_time <= matchmaking_time ({matchmaking_time:g}) and "
                            f"0 < min_round_timeout <= round_timeout ({round_timeout:g})") from None

    def __init__(self, *, matchmaking_floor: float, matchmaking_cap: float, round_floor: float, round_cap: float,
                 policy: MarginPolicy = MarginPolicy(), history: int = DEFAULT_HISTORY):
        # Checked once here, so the per-key histories below cannot fail later.
        AdaptiveDeadline(matchmaking_floor, matchmaking_cap)
        AdaptiveDeadline(round_floor, round_cap)
        self._mm_bounds, self._round_bounds = (matchmaking_floor, matchmaking_cap), (round_floor, round_cap)
        self.policy, self.history = policy, history
        self._assembly: Dict[int, AdaptiveDeadline] = {}
        self._rounds: Dict[Tuple[int, int], AdaptiveDeadline] = {}
        self._lock = threading.Lock()

    def _assembly_for(self, group_size: int) -> AdaptiveDeadline:
        with self._lock:
            if group_size not in self._assembly:
                self._assembly[group_size] = AdaptiveDeadline(*self._mm_bounds, policy=self.policy,
                                                              history=self.history)
            return self._assembly[group_size]

    def _round_for(self, group_size: int, payload_bytes: int) -> AdaptiveDeadline:
        key = (int(group_size), payload_class(payload_bytes))
        with self._lock:
            if key not in self._rounds:
                self._rounds[key] = AdaptiveDeadline(*self._round_bounds, policy=self.policy, history=self.history)
            return self._rounds[key]

    # -- what the next round uses --

    def matchmaking_window(self, group_size: int) -> float:
        """How long the next round waits for a group of `group_size` to fill."""
        return self._assembly_for(group_size).current()

    def round_deadline(self, group_size: int, payload_bytes: int) -> float:
        """Data-plane deadline of the next round of `group_size` members averaging `payload_bytes`. While
        this group size has too few measurements, the other sizes of the same payload class stand in."""
        own = self._round_for(group_size, payload_bytes)
        if len(own.samples) >= self.policy.min_samples:
            return own.current()
        pooled = [s for (size, cls), d in list(self._rounds.items()) if cls == payload_class(payload_bytes)
                  for s in d.samples]
        return own._bounded(robust_deadline(pooled, self.policy), own.streak)

    def fastest_assembly_s(self, group_size: int, recent: int = FASTEST_ASSEMBLY_RECENT) -> Optional[float]:
        """The shortest time a full group of `group_size` took to assemble among the `recent` latest ones
        (seconds; no member was late), or None before any full group of that size formed."""
        samples = self._assembly_for(group_size).samples[-recent:]
        return min(samples) if samples else None

    # -- what rounds measured --

    def observe_assembly(self, target_size: int, seconds: float, *, full: bool) -> None:
        """A group search for `target_size` ended after `seconds`; only full groups tell how long
        assembly takes (a smaller group may just mean that peers are gone)."""
        if full:
            self._assembly_for(target_size).observe(seconds)

    def observe_round(self, group_size: int, payload_bytes: int, seconds: float, *, hit_deadline: bool,
                      member_died: bool) -> None:
        """A round's data plane took `seconds`. `hit_deadline`: it was cut short by its deadline;
        `member_died`: some member sent nothing at all. Such a round is not recorded: how long it took
        depends on when the others gave up on the silent member (the owners stop waiting at a fixed
        share of the deadline), not on how long rounds take."""
        if member_died:
            return
        deadline = self._round_for(group_size, payload_bytes)
        if hit_deadline:
            deadline.observe_deadline_hit()
        else:
            deadline.observe(seconds)

    def next_round(self, target: int, payload_bytes: int, round_timeout: float, *, grace_s: float,
                   timeout: Optional[float] = None, window_cap: Optional[float] = None,
                   spread_s: float = 0.0, hold_s: float = 0.0) -> Tuple[float, RoundDeadline]:
        """The matchmaking window (seconds) and the `RoundDeadline` of a round starting now: the learned window,
        at most `window_cap` (a caller's, e.g. up to a compute-budget deadline) and at least `hold_s` (a caller
        that knows members are still on their way: the learned window is how long a group takes to assemble
        once its members are ready, not how long they take to get ready), `hold_s` itself at most `window_cap`;
        a search of `timeout` (default 5 windows, at least one); `grace_s` longer while committed to a group;
        then the learned data-plane budget plus an upload spread of `spread_s` (pacing.py), `round_timeout` at
        most."""
        window = self.matchmaking_window(target)
        if window_cap is not None:
            window, hold_s = min(window, window_cap), min(hold_s, window_cap)
        window = max(window, hold_s)
        search_s = max(timeout if timeout is not None else 5 * window, window)
        return window, RoundDeadline.starting_now(search_s, grace_s, round_timeout,
                                                  data_s=self.round_deadline(target, payload_bytes), spread_s=spread_s)

    def observe_result(self, result: "RoundResult", *, target: int, payload_bytes: int) -> None:
        """Learn from a finished round: its assembly time (a full group only; nothing when no group formed:
        the window ran out, which says nothing about how long assembly takes) and its data-plane time (not
        when a member sent nothing at all: that says when the others gave up, not how long rounds take). A member
        whose chunk came after we stopped waiting for it (`late`) was alive: the round ran into its deadline, even
        if that member had been counted departed (on netlab, 200 ms apart, two relayed peers' chunks came late in
        most rounds, and the deadline never grew, those rounds being taken for a member's death)."""
        if not result.group_id:
            return
        self.observe_assembly(target, result.matchmaking_s, full=result.group_size >= target)
        if result.ok:
            late = set(result.late)
            ran_out = result.total_s >= DEADLINE_HIT_FRACTION * result.data_deadline_s
            self.observe_round(result.group_size, payload_bytes, budget_needed(result),
                               hit_deadline=ran_out or bool(late),
                               member_died=bool(set(result.departed) - late or result.absent))

    def round_deadline_samples(self, group_size: int, payload_bytes: int) -> List[float]:
        """The round durations measured for this group size and payload class (oldest first)."""
        return self._round_for(group_size, payload_bytes).samples

    def describe(self) -> Dict[str, object]:
        """Samples per history (for logs and tests)."""
        with self._lock:
            return {"assembly": {size: len(d.samples) for size, d in self._assembly.items()},
                    "rounds": {f"{size}x{cls}": len(d.samples) for (size, cls), d in self._rounds.items()}}
