"""`RoundTiming`: the peer side's one owner of round timing.

It answers, for the epoch loop and the aux peer: when this epoch's compute must stop (the DropCompute
budget, dropcompute.py), how long this epoch's round waits for its group to fill (`matchmaking_window`) and
searches for one at all (`search_time_for`), how long an aux waits as a follower (`aux_window`), how long a
peer whose round failed watches for the others having finished it (`missed_round_grace`), and it waits for a
started round within the round's own deadline (`await_result`).

With a budget, the swarm waits for nobody past the budget deadline of the epoch (a straggler still inside a
micro-batch is left out), but at least the time a complete group needs to assemble (`assembly_floor`).
Without a budget a round waits `matchmaking_time`.

What the averager times and learns itself is not repeated here: the round's absolute deadlines
(`averaging/deadline.py`), the matchmaking windows and data-plane deadlines learned per group size, and the
fastest recent assembly of a full group (`averaging/adaptive_deadlines.py`, read through
`MoshpitAverager.fastest_assembly_s`, which `assembly_floor` asks). The window computed here is the cap the
averager's own deadlines work within.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Tuple

from moshpeer.averaging.report import RoundResult
from moshpeer.dht.records import PeerRecord
from moshpeer.peer.optimizer.dropcompute import BudgetedStep, BudgetSetting, ComputeBudget

# With a compute budget, how long a peer waits for its group at least (finding each other over the DHT
# takes a few round trips), even when the budget deadline is closer than this. Under load or far apart the round
# trips take longer: the floor is then ASSEMBLY_MARGIN x the fastest recent assembly of a full group (which
# the averager learns: `MoshpitAverager.fastest_assembly_s`), and the whole matchmaking time before one formed.
MIN_BUDGET_WINDOW_S = 0.2
ASSEMBLY_MARGIN = 3.0
STOP_POLL_S = 0.1  # how often a round in flight checks `should_stop`
# A round looks for a group for this many matchmaking windows (the averager's `timeout`; its assembly and data
# plane have their own deadlines after that).
SEARCH_WINDOWS = 2
# An aux waits in matchmaking this many matchmaking times: it never leads (the trainers' leader decides
# when the group is complete), and a leader accepts only followers whose window outlasts its own.
AUX_WINDOW_FACTOR = 10
# Every trainer ends its epoch when its own work is done (its share of the target batch, or DiLoCo's H inner
# steps), so the swarm's epoch ends drift apart by more than a window (bench_diloco, 4 peers on 2 cores: up to
# 2.4 s against a 2 s window), and its rounds split into partial groups and leave the last peer out. A round
# waits for the trainers still computing its epoch, as long as their records say they need, plus one window for
# the last of them to find the group: at most this many windows (a group still assembles the moment it is full).
STRAGGLER_WAIT_WINDOWS = 4
# A strategy that must not step alone while others averaged (DiLoCo) watches this long, at most, for the
# swarm's records to show that the others finished the round it missed.
MISSED_ROUND_GRACE_S = 5.0
# A paced round (pacing.py) spreads its upload over this share of the epoch that just computed: the next epoch,
# which the round overlaps, should take as long, and the rest is margin for the round to end before it does.
PACE_SHARE = 0.7

logger = logging.getLogger(__name__)


class RoundTiming:
    """The compute budget of the current epoch and the waiting times of its round (see the module docstring).

    :param matchmaking_time: the longest a round waits for its group (seconds)
    :param budget: DropCompute threshold per epoch: None, seconds, or "auto" ("auto" simulates a synchronous
        group of `group_size` workers from this peer's own times)
    :param round_timeout: the averager's cap on one round (seconds), bounding `missed_round_grace`
    :param fastest_assembly: group size -> the fastest recent assembly of a full group of that size (seconds),
        or None before one formed: the averager's `fastest_assembly_s` (default: nothing learned)
    :param clock: monotonic seconds for the compute budget (tests pass a fake one)
    """

    def __init__(self, matchmaking_time: float, budget: BudgetSetting, group_size: int, *,
                 round_timeout: float = 10.0,
                 fastest_assembly: Callable[[int], Optional[float]] = lambda group_size: None,
                 clock: Callable[[], float] = time.perf_counter):
        self.matchmaking_time, self.round_timeout, self.group_size = matchmaking_time, round_timeout, group_size
        self.fastest_assembly, self.clock = fastest_assembly, clock
        self.last_compute_s = 0.0  # the last ended epoch's compute (begin_epoch to end_compute)
        self.compute_budget = ComputeBudget(budget, num_workers=group_size, clock=clock) \
            if budget is not None else None
        self.epoch_budget: Optional[BudgetedStep] = None  # the current epoch's compute, with a budget
        self.begin_epoch()

    # ---- the epoch's compute ------------------------------------------------------------------

    def begin_epoch(self) -> None:
        """The DropCompute clock of an epoch starts when the previous epoch ended."""
        self.epoch_started = self.clock()
        self.epoch_budget = self.compute_budget.begin_step(None) if self.compute_budget is not None else None

    def record_micro_batch(self, batch_size: int) -> None:
        """A micro-batch of `batch_size` samples was computed (its time counts toward the budget)."""
        if self.epoch_budget is not None:
            self.epoch_budget.record(batch_size)

    def budget_spent(self) -> bool:
        """Whether this epoch's compute budget is used up (False without a budget)."""
        return self.epoch_budget is not None and not self.epoch_budget.should_continue()

    def end_compute(self) -> bool:
        """End the epoch's compute; True if the budget stopped it."""
        self.last_compute_s = self.clock() - self.epoch_started
        return self.epoch_budget.finish().stopped_by_budget if self.epoch_budget is not None else False

    def upload_spread(self) -> float:
        """Seconds a paced round started now spreads its upload over (`MoshpitAverager.step`'s
        `upload_spread_s`): PACE_SHARE of the epoch whose compute just ended."""
        return PACE_SHARE * self.last_compute_s

    # ---- the round's waiting times ----------------------------------------------------------------

    def matchmaking_window(self, target: Optional[int] = None, stragglers_eta_s: float = 0.0) -> float:
        """How long this epoch's round (for a group of `target`, default `group_size`) waits for its group to fill
        (see the module docstring). `stragglers_eta_s`: without a budget, the round waits that much longer for
        trainers still computing its epoch (`stragglers_eta_s()`), up to STRAGGLER_WAIT_WINDOWS windows."""
        epoch = self.epoch_budget
        if epoch is None or epoch.tau_s is None:
            return min(self.matchmaking_time + stragglers_eta_s, STRAGGLER_WAIT_WINDOWS * self.matchmaking_time)
        return min(self.matchmaking_time, max(epoch.tau_s - epoch.elapsed_s, self.assembly_floor(target)))

    def straggler_hold(self, stragglers_eta_s: float) -> float:
        """How long a round must keep its group open, at least, for trainers still computing its epoch: their
        whole `matchmaking_window` when some need longer than one `matchmaking_time` (and no compute budget
        decides instead), else 0. The averager's learned window is how long a group takes to assemble once its
        members are ready, so alone it closes the group before a straggler is ready. A straggler due within one
        window is left to the learned window: holding for it too made two fast-cycling peers (Streaming DiLoCo,
        0.5 s epochs) disagree on a group in 1 of 4 runs of tests/swarm/test_diloco_streaming.py (0 of 6
        without), for a reason not traced yet."""
        if stragglers_eta_s <= self.matchmaking_time or \
                (self.epoch_budget is not None and self.epoch_budget.tau_s is not None):
            return 0.0
        return self.matchmaking_window(stragglers_eta_s=stragglers_eta_s)

    def assembly_floor(self, target: Optional[int] = None) -> float:
        """The shortest matchmaking window worth trying: the fastest recent assembly of a full group of `target`
        (default `group_size`; no member was late), as the averager learned it, with a margin; at least
        MIN_BUDGET_WINDOW_S. Before any full group of that size assembled, the whole matchmaking time: nothing says
        a shorter window can hold one, and a window too short for any group never learns otherwise (200 ms apart,
        a budget of 0.25 s kept every window at 0.2 s, where a group takes 1.1 s: 48 of 55 rounds found no group)."""
        fastest = self.fastest_assembly(target or self.group_size)
        if fastest is None:
            return self.matchmaking_time
        return min(self.matchmaking_time, max(MIN_BUDGET_WINDOW_S, ASSEMBLY_MARGIN * fastest))

    def aux_window(self) -> float:
        """How long an aux peer waits in matchmaking as a follower."""
        return AUX_WINDOW_FACTOR * self.matchmaking_time

    @staticmethod
    def search_time_for(window: float) -> float:
        """How long a round with a matchmaking `window` looks for a group (`MoshpitAverager.step`'s timeout)."""
        return SEARCH_WINDOWS * window

    def missed_round_grace(self) -> float:
        """How long a peer whose round failed watches the swarm for the others having finished it."""
        return min(self.round_timeout, MISSED_ROUND_GRACE_S)

    def too_late_for_round(self) -> bool:
        """With a budget: has every window of this epoch closed (the peer is too late for its round)?"""
        epoch = self.epoch_budget
        return epoch is not None and epoch.tau_s is not None and \
            epoch.elapsed_s >= epoch.tau_s + self.assembly_floor()

    # ---- a round in flight ------------------------------------------------------------------------

    @staticmethod
    def await_result(future: Any, should_stop: Callable[[], bool]) -> Optional[RoundResult]:
        """A started round's `RoundResult` (from its `RoundFuture`); None if it failed (logged), or if it is
        abandoned (cancelled) because `should_stop()` or its own deadline passed. (The averager learns the
        round's timings itself, in its round thread, before the future resolves.) The wait wakes every
        STOP_POLL_S to ask `should_stop`, but returns as soon as the result is set."""
        while True:
            try:
                return future.result(timeout=STOP_POLL_S)
            except concurrent.futures.TimeoutError:
                if should_stop() or future.deadline.remaining() == 0.0:
                    future.cancel()
                    return None
            except Exception as e:
                logger.warning(f"averaging round failed: {type(e).__name__}: {e}")
                return None


def stragglers_eta_s(peers: Iterable[PeerRecord], epoch: int, epoch_samples: int, own_peer_id: str,
                     now: Optional[float] = None) -> float:
    """Seconds until the slowest other trainer still in `epoch` has computed `epoch_samples` samples toward it,
    by its record (samples so far and rate, advanced by the time since it counted them: a peer that stopped counts
    less the longer it is silent); 0 when none is still computing. Every trainer computes the same samples per
    epoch (its share of the target batch, or a strategy's own count)."""
    now = time.time() if now is None else now
    eta = 0.0
    for record in other_trainers(peers, own_peer_id):
        if record.epoch == epoch and record.samples_per_second > 0:
            eta = max(eta, _seconds_to_go(record, epoch_samples, now))
    return eta


def other_trainers(peers: Iterable[PeerRecord], own_peer_id: str) -> Iterator[PeerRecord]:
    """The records of the live trainers other than this peer (not aux peers, not ones withdrawing)."""
    return (r for r in peers if r.peer_id != own_peer_id and r.role == "trainer" and not r.leaving)


def _seconds_to_go(record: PeerRecord, epoch_samples: int, now: float) -> float:
    """Seconds until a trainer in the epoch (rate > 0) has computed `epoch_samples`, by its record: samples still
    to compute over its rate, less the time since it counted them (negative: it should be done by now). A
    heartbeat re-publishes a stalled peer's record with a fresh `updated_at` and the same count: taken from
    there, a peer stuck in one long micro-batch looked due in full for as long as it stalled, and held the
    others' round open for it up to STRAGGLER_WAIT_WINDOWS."""
    missing = epoch_samples - record.samples_accumulated
    counted_at = record.samples_counted_at or record.updated_at
    return missing / record.samples_per_second - max(0.0, now - counted_at)


def quorum_eta_s(peers: Iterable[PeerRecord], epoch: int, epoch_samples: int, own_peer_id: str, own_eta_s: float,
                 own_rate: float, quorum: float, now: Optional[float] = None) -> float:
    """Seconds until trainers holding at least `quorum` of the swarm's compute rate have computed `epoch_samples`
    samples toward `epoch`: each other trainer by its record as in `stragglers_eta_s` (one past `epoch` is done,
    one behind it or with no rate never is), this peer by `own_eta_s` and `own_rate`. 0: the quorum is in; inf:
    it never will be by these records. Rates weigh the trainers: a quorum of compute (tokens), not of heads."""
    now = time.time() if now is None else now
    entries = [(max(own_eta_s, 0.0), max(own_rate, 0.0))]
    for record in other_trainers(peers, own_peer_id):
        rate = max(record.samples_per_second, 0.0)
        if record.epoch > epoch:
            entries.append((0.0, rate))
        elif record.epoch < epoch or rate == 0:
            entries.append((math.inf, rate))
        else:
            entries.append((max(0.0, _seconds_to_go(record, epoch_samples, now)), rate))
    return quorum_time(entries, quorum)


def quorum_time(entries: Iterable[Tuple[float, float]], quorum: float) -> float:
    """The first of the `(time, rate)` entries' times by which trainers holding at least `quorum` of their summed
    rate are done (each entry: when one trainer is done, and its compute rate); inf if that never happens (no
    rate at all, or the quorum needs trainers that never finish). Times may be seconds from now (`quorum_eta_s`)
    or a simulated clock (`moshpeer simulate`)."""
    entries = list(entries)
    total = sum(rate for _, rate in entries)
    done = 0.0
    for eta, rate in sorted(entries):
        done += rate
        if total > 0 and done >= quorum * total * (1 - 1e-9):
            return eta
    return math.inf
