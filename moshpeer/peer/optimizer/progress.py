"""Swarm progress: how many samples the swarm has gathered toward the current collaborative epoch.

Every peer publishes its own progress in its signed peer record (`epoch`, `samples_accumulated`
for that epoch, `samples_per_second`) and reads everyone else's from the run's membership
dictionary. From those records each peer derives the same view:

- the collaborative epoch is a robust statistic of the other live trainers' epochs (those this peer counts,
  below), their upper median, or this peer's own epoch if that is higher (a peer that is behind it must catch
  up by downloading state, not average stale gradients): fewer than half of the trainers cannot raise it,
  however far they claim to be ahead, and a minority of laggards cannot hold it back. A trainer back from an
  outage (its record's `apart_since`) is left out until it has taken the swarm's state (trained_apart.py);
- claims only move forward by plausible steps (`EpochCredit`, epoch_credit.py): across refreshes, a record is
  credited with at most one epoch beyond the swarm epoch or beyond what it was credited before
  (so catching up to the swarm is fine, jumping past it is not), and this peer's view of the swarm
  epoch itself rises by at most one per refresh or `MAX_EPOCHS_PER_SECOND`, whichever is more (a majority
  of fresh identities claiming epoch 2^62 gains a few epochs per second, not 2^62), from the first view that
  holds another peer's record. A record credited with less than it claims counts no
  samples;
- the swarm's progress is the sum of `samples_accumulated` over trainers at that epoch, which
  the optimizer compares with `target_batch_size`; with robust aggregation, the trainers this peer's
  averager weighs at zero (suspects) are left out of that sum: their samples never reach the model;
- a trainer's samples count only once this peer, or a peer it averaged with, saw it average
  (`TrainerWitnesses`, witnesses.py): a record that claims samples and never averages ends no epoch;
- each other trainer's count is believed only up to what it could have computed since this peer saw the
  epoch begin, at a few times the swarm's median witnessed rate (`SampleCredit`, sample_credit.py): a peer
  claiming the target at every refresh cannot end every epoch at once; the refused samples are counted
  (`ProgressSnapshot.samples_capped`);
- the estimated time to the target comes from the summed `samples_per_second`.

An epoch's end decides on `current()`: the view, and after a pause of this process (SIGSTOP, a suspended VM, a
laptop asleep: pause_watch.py) first a complete read begun after it. Deciding on the view from before the pause, a
peer 60-90 epochs behind took itself for one in step and averaged its stale gradients with the swarm.

A read that does not return this peer's own record (`holds_own_record`) is incomplete and leaves the view as it
was: the record is republished every heartbeat, so a read without it is one whose requests timed out, not a swarm
that left. hivemind's `get` merges what its own node stores with what the nodes it reached answered, so in a small
swarm, where every node stores every record, a read is rarely incomplete; in a large one the run's key lives on a
few nodes far from most peers, and a read whose requests time out answers None or part of the dictionary. Taken as
the swarm, such a read makes a peer think it is alone (it ends its epoch without its group) or that others left.

Reading the DHT costs a round trip and bytes on every link, so a background thread refreshes the view on a
`ProgressCadence` (progress_cadence.py: often near an epoch's end, seldom in between, within a byte budget),
and a caller that waits for a refresh (`wait_for_refresh`) asks for one at once. Publications follow the same
cadence in an epoch the swarm's target batch ends (the others' sums of samples decide it). In an epoch of the
peer's own count (DiLoCo's inner steps) they come at the cadence's longest interval, plus the epoch's start and
end at once: readers advance a record's count by its rate (`round_timing._seconds_to_go`), so publishing faster
near the end tells them nothing new, and every publication costs a read too (hivemind's store first asks the
nodes near the key, and each answers with the whole dictionary). The training loop only reads the cached
`ProgressSnapshot`, with this peer's own numbers always taken from local state (the DHT copy of them lags).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Callable, Collection, FrozenSet, Mapping, Optional, Sequence, Tuple

from hivemind.utils import get_dht_time

from moshpeer.dht import PeerRecord, SwarmDHT, list_peers
from moshpeer.peer.optimizer.epoch_credit import EpochCredit, epoch_sources, robust_epoch
from moshpeer.peer.optimizer.pause_watch import PauseWatch
from moshpeer.peer.optimizer.progress_cadence import ProgressCadence
from moshpeer.peer.optimizer.sample_credit import SampleCredit
from moshpeer.peer.optimizer.witnesses import TrainerWitnesses

logger = logging.getLogger(__name__)

Publish = Callable[..., None]


@dataclass(frozen=True)
class ProgressSnapshot:
    """The swarm's progress as this peer sees it at `fetched_at` (monotonic seconds)."""

    global_epoch: int
    samples_accumulated: int  # by trainers at `global_epoch`, this peer included
    target_batch_size: int
    num_trainers: int  # live trainers, this peer included if it trains
    num_aux: int
    samples_per_second: float  # sum over the counted trainers
    fetched_at: float
    peers: Tuple[PeerRecord, ...] = field(default=(), repr=False)
    # Trainers whose samples count toward the target (live ones not weighed at zero); None: all of them.
    counted_trainers: Optional[int] = None
    # Samples the counted trainers at `global_epoch` claimed beyond what this peer found credible (SampleCredit).
    samples_capped: int = 0
    # Live trainers past their startup (`PeerRecord.training`), this peer included if it is; None: all of them.
    started_trainers: Optional[int] = None
    # Where the other peers are: `global_epoch` before this peer's own epoch raised it; None when no other peer's
    # epoch counts (a peer back from an outage compares its own with it: trained_apart.py).
    others_epoch: Optional[int] = None
    # No complete read came in after a pause of this process or after `STALE_VIEW_INTERVALS` of failed reads
    # (`SwarmProgress.current`): where the swarm is may be long past this view, and nothing is averaged on it.
    stale: bool = False

    @property
    def contributing_trainers(self) -> int:
        """How many trainers share the target batch (each peer's share is target / this)."""
        return self.num_trainers if self.counted_trainers is None else self.counted_trainers

    @property
    def trainers_past_startup(self) -> int:
        """How many live trainers `--min-peers` counts (`PeerRecord.training`; all of them when unknown)."""
        return self.num_trainers if self.started_trainers is None else self.started_trainers

    @property
    def ready(self) -> bool:
        """The swarm has gathered the target batch for `global_epoch`."""
        return self.samples_accumulated >= self.target_batch_size

    @property
    def eta_s(self) -> float:
        """Estimated seconds until the target batch is gathered (0 if ready, inf if nobody computes)."""
        missing = self.target_batch_size - self.samples_accumulated
        if missing <= 0:
            return 0.0
        return missing / self.samples_per_second if self.samples_per_second > 0 else float("inf")

    def to_json(self) -> dict:
        return {
            "global_epoch": self.global_epoch,
            "samples_accumulated": self.samples_accumulated,
            "target_batch_size": self.target_batch_size,
            "num_trainers": self.num_trainers,
            "num_aux": self.num_aux,
            "samples_per_second": round(self.samples_per_second, 2),
        }


# How long `SwarmProgress.current` waits for a complete read after a pause of this process: its own record may have
# expired from the DHT meanwhile, and reads lacking it are incomplete until its next heartbeat (5 s by default).
PAUSED_READ_WAIT_S = 10.0
# A view whose read began more than this many of the cadence's longest intervals ago is stale too: reads failed in a
# row meanwhile (the DHT process or its p2pd stalled, a machine starved of CPU), and the swarm ran on without this
# peer seeing it. Measured (session 39): a peer whose p2pd was stopped for 20 s averaged the gradients of epochs
# 10-15 with a swarm at epoch 26 for 1.4 s before its first read after the stall made it catch up.
STALE_VIEW_INTERVALS = 3
# Once a stale view was waited on in full, later epoch ends on the same view wait this long only (they step alone).
STALE_REWAIT_S = 1.0


def summarize(
    records: Tuple[PeerRecord, ...],
    *,
    own: Optional[PeerRecord],
    target_batch_size: int,
    now: float,
    max_epoch: Optional[int] = None,
    uncounted: Collection[str] = (),
    capped: Mapping[str, int] = MappingProxyType({}),
) -> ProgressSnapshot:
    """The swarm view from (credited) peer records; `own` (this peer's live local record) replaces its DHT
    copy; `max_epoch` caps the swarm epoch (`EpochCredit.swarm_epoch`: one step per refresh); the samples,
    speed and epochs of the trainers in `uncounted` (peer ids whose contributions this peer's averaging discards,
    or that nobody it averaged with saw average) are left out of the epoch's progress (never this peer's own);
    `capped` says how many samples of each peer's claim `SampleCredit` refused (reported as `samples_capped`,
    already taken out of the records)."""
    by_id = {record.peer_id: record for record in records}
    if own is not None:
        by_id[own.peer_id] = own
    trainers = [r for r in by_id.values() if r.role == "trainer"]
    aux = [r for r in by_id.values() if r.role == "aux"]
    sources = epoch_sources([r for r in by_id.values() if r.peer_id not in uncounted],
                            own.peer_id if own is not None else None)
    global_epoch = robust_epoch([r.epoch for r in sources]) if sources else 0
    if max_epoch is not None:
        global_epoch = min(global_epoch, max_epoch)
    own_id = own.peer_id if own is not None else None
    others_epoch = global_epoch if any(r.peer_id != own_id for r in sources) else None
    if own is not None:  # this peer's own epoch is no claim: the swarm is at least where it is
        global_epoch = max(global_epoch, own.epoch)
    counted = [r for r in trainers if r.peer_id not in uncounted or r.peer_id == own_id]
    at_epoch = [r for r in counted if r.epoch == global_epoch]
    samples = sum(r.samples_accumulated for r in at_epoch)
    speed = sum(r.samples_per_second for r in counted)
    return ProgressSnapshot(
        global_epoch=global_epoch,
        samples_accumulated=samples,
        target_batch_size=target_batch_size,
        num_trainers=len(trainers),
        num_aux=len(aux),
        samples_per_second=speed,
        fetched_at=now,
        peers=tuple(sorted(by_id.values(), key=lambda r: r.peer_id)),
        counted_trainers=len(counted),
        samples_capped=sum(capped.get(r.peer_id, 0) for r in at_epoch if r.peer_id != own_id),
        started_trainers=sum(r.training for r in trainers),
        others_epoch=others_epoch,
    )


def holds_own_record(listed: Sequence[PeerRecord], own_peer_id: str) -> bool:
    """Whether a read of the membership dictionary is complete enough to be a view of the swarm: it holds this
    peer's own record (live or leaving), which this peer republishes every heartbeat."""
    return any(r.peer_id == own_peer_id for r in listed)


class SwarmProgress:
    """This peer's view of swarm progress, refreshed in the background; see the module docstring.

    :param own_record: returns this peer's current record (local, not the DHT copy)
    :param publish: `publish(**fields)` sends this peer's progress fields out (throttled here)
    :param cadence: when to read and publish (default: `ProgressCadence()`)
    :param on_refresh: called in the refresh thread after every fetch (e.g. re-publish heartbeats)
    :param pauses: notices this process's pauses (default: a `PauseWatch` of its own); its ticker runs here
    """

    def __init__(
        self,
        dht: SwarmDHT,
        run_id: str,
        *,
        target_batch_size: int,
        own_record: Callable[[], PeerRecord],
        publish: Publish,
        cadence: ProgressCadence = ProgressCadence(),
        on_refresh: Optional[Callable[[], None]] = None,
        pauses: Optional[PauseWatch] = None,
    ):
        self.dht, self.run_id = dht, run_id
        self.target_batch_size = target_batch_size
        self.cadence = cadence
        self._own_record = own_record
        self._publish = publish
        self._on_refresh = on_refresh
        self._records: Tuple[PeerRecord, ...] = ()
        self._credit = EpochCredit()
        self._samples = SampleCredit()
        self._witnesses = TrainerWitnesses()
        self._unwitnessed: FrozenSet[str] = frozenset()  # of the records read last (at each read and round)
        self._uncounted: Callable[[], Collection[str]] = tuple
        self._lock = threading.Lock()
        self._fetched = threading.Condition(self._lock)
        self._fetch_count = 0
        self._last_publish = 0.0
        self._last_published_epoch = -1
        self._last_fetch = 0.0
        self._pauses = pauses or PauseWatch()
        self._view_started = -math.inf  # when the read behind the current view began (by the pause watch's clock)
        self._stale_view: Optional[float] = None  # `_view_started` of the last stale view `current` waited on in full
        self._epoch_eta: Optional[Tuple[float, float]] = None  # (seconds left in this peer's epoch, as of when)
        self._stop = threading.Event()
        self._wanted = threading.Event()  # someone waits for a refresh: fetch now (within the byte budget)
        self._thread = threading.Thread(target=self._refresh_loop, name="moshpeer-progress", daemon=True)
        self._thread.start()
        self._ticker = threading.Thread(target=self._pauses.run, args=(self._stop,), name="moshpeer-pause-watch",
                                        daemon=True)
        self._ticker.start()

    # ---- local progress -------------------------------------------------------------------------

    def report(self, *, epoch: int, samples_accumulated: int, samples_per_second: float, step: int,
               force: bool = False, upload_bps: float = 0.0, epoch_eta_s: Optional[float] = None) -> None:
        """Publish this peer's progress (and upload bandwidth, bytes/s); throttled to one DHT store per
        `publish_interval` unless the epoch changed, it ends now, or `force`. `epoch_eta_s`: seconds until this
        peer's epoch ends by its strategy's own count (None: the swarm's target batch ends it; 0: it ends now),
        which sets the cadence. The record of an epoch's end goes out at once: the others' straggler waits and
        quorums read it."""
        now = time.monotonic()
        self._epoch_eta = None if epoch_eta_s is None else (epoch_eta_s, now)
        force = force or (epoch_eta_s is not None and epoch_eta_s <= 0)
        if not force and epoch == self._last_published_epoch:
            since = now - self._last_publish
            # The cheap test first: report() runs every micro-batch, next_interval() may summarize every record.
            if since < self.cadence.min_interval_s or since < self.publish_interval():
                return
        self._last_publish, self._last_published_epoch = now, epoch
        with self._lock:
            witnessed = self._witnesses.tags(epoch)
        self._publish(epoch=epoch, samples_accumulated=samples_accumulated, samples_counted_at=get_dht_time(),
                      samples_per_second=float(max(samples_per_second, 0.0)), step=step,
                      upload_bps=float(max(upload_bps, 0.0)), witnessed=witnessed)

    def note_round(self, epoch: int, contributors: Collection[str]) -> None:
        """This peer's round of `epoch` averaged with `contributors` (`RoundResult.contributors`): their samples,
        and those of the trainers they witnessed, count from now on (witnesses.py)."""
        own = self._own_record()
        with self._lock:
            self._witnesses.note_round(epoch, contributors)
            self._unwitnessed = self._witnesses.uncounted(self._records, own_peer_id=own.peer_id, epoch=own.epoch)

    def count_samples_except(self, peers: Callable[[], Collection[str]]) -> None:
        """From now on, every view leaves out the samples of the trainers `peers()` names (asked at each
        snapshot; e.g. the averager's suspects, whose contributions robust aggregation weighs at zero): a
        hostile peer must not shorten the honest peers' epochs with samples that never reach the model."""
        self._uncounted = peers

    # ---- swarm view -----------------------------------------------------------------------------

    def snapshot(self) -> ProgressSnapshot:
        """The latest view (DHT records from the last refresh, this peer's own numbers live)."""
        with self._lock:
            records, last, capped = self._records, self._credit.swarm_epoch, self._samples.capped
            unwitnessed = self._unwitnessed
        return summarize(records, own=self._own_record(), target_batch_size=self.target_batch_size,
                         now=time.monotonic(), max_epoch=last, uncounted=unwitnessed | frozenset(self._uncounted()),
                         capped=capped)

    def current(self, timeout: float = PAUSED_READ_WAIT_S) -> ProgressSnapshot:
        """`snapshot`, unless the read behind it is stale: this process was paused since (pause_watch.py), or the
        read began more than STALE_VIEW_INTERVALS of the cadence's longest intervals ago (reads failed meanwhile).
        Then first a complete read begun now, waiting up to `timeout` (STALE_REWAIT_S once a wait on the same view
        came to nothing): the view from before is where the swarm was, and a peer that decides on it mixes stale
        work into the swarm. If none comes in time, the last view with `stale` set (logged once per view)."""
        with self._lock:
            behind, peers = self._view_started, len(self._records)
        now = self._pauses.now()
        paused = self._pauses.paused_since(behind)
        # The longest interval between two reads: the byte budget stretches it in a large swarm.
        if not paused and now - behind <= STALE_VIEW_INTERVALS * self.cadence.interval(math.inf, peers):
            return self.snapshot()
        first_wait = self._stale_view != behind
        if first_wait:
            logger.info("back from a pause: reading the swarm's progress again before deciding anything" if paused
                        else f"the swarm's progress was last read {now - behind:.0f} s ago: reading it again before "
                             f"deciding anything")
        deadline = time.monotonic() + (timeout if first_wait else min(timeout, STALE_REWAIT_S))
        with self._fetched:
            while self._view_started < now:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wanted.set()  # again after an incomplete read: the refresh thread reads once per request
                self._fetched.wait(min(remaining, 0.5))
            fresh = self._view_started >= now
        if fresh:
            return self.snapshot()
        if first_wait:
            logger.warning(f"no complete read of the swarm's progress within {timeout:g} s; averaging nothing until "
                           f"one comes in")
            self._stale_view = behind
        return replace(self.snapshot(), stale=True)

    def corroborated_peers(self) -> Optional[FrozenSet[str]]:
        """The peers this peer has evidence for from its rounds (witnesses.py: it or a peer it averaged with saw
        them average), or before it has any, the largest group of peers whose records name each other; None while
        neither can tell (witnesses.py). A state download asks them first."""
        own = self._own_record()
        with self._lock:
            return self._witnesses.evidence(self._records, own.epoch)

    @property
    def swarm_epoch_reached(self) -> int:
        """The highest epoch this peer saw the swarm reach, kept after the trainers leave (an aux peer follows
        it: trainers that finish and withdraw at once must not leave it waiting one epoch short forever)."""
        with self._lock:
            return self._credit.reached

    def next_interval(self) -> float:
        """Seconds between reads (and publications) now: the cadence at this peer's expected epoch end, by its
        own count if it reported one, else by the swarm's progress toward the target batch. An epoch its own
        count reported over (eta 0: its round is on) reads at the longest interval: nothing in the view decides
        anything until the next epoch, and what the round needs it asks for (`refresh_now`, `wait_for_refresh`)."""
        with self._lock:
            peers, epoch_eta = len(self._records), self._epoch_eta
        if epoch_eta is not None and epoch_eta[0] <= 0:
            return self.cadence.interval(math.inf, peers)
        if epoch_eta is not None:
            eta = max(0.0, epoch_eta[0] - (time.monotonic() - epoch_eta[1]))
        else:
            eta = self.snapshot().eta_s
        return self.cadence.interval(eta, peers)

    def publish_interval(self) -> float:
        """Seconds between two publications within an epoch (see the module docstring): the read cadence when the
        swarm's target batch ends the epoch, the cadence's longest interval when this peer's own count does."""
        if self._epoch_eta is None:
            return self.next_interval()
        with self._lock:
            peers = len(self._records)
        return self.cadence.interval(math.inf, peers)

    def wait_for_refresh(self, timeout: float) -> bool:
        """Ask for a fetch now (it comes at once unless the byte budget's interval since the last one has not
        passed) and block until it completes (True) or `timeout` passes (False)."""
        with self._fetched:
            seen = self._fetch_count
            self._wanted.set()
            return self._fetched.wait_for(lambda: self._fetch_count > seen, timeout=timeout)

    def refresh_now(self, timeout: float = 2.0, *, retry_for: float = 0.0,
                    should_stop: Callable[[], bool] = lambda: False) -> ProgressSnapshot:
        """Fetch the records synchronously (e.g. before deciding to download state). A fetch that fails (a DHT
        timeout under load) or is incomplete (it lacks this peer's own record: for a newcomer, the DHT answered
        before it reached the swarm) keeps the previous view; with `retry_for`, such fetches are retried for up
        to that many seconds more, and a warning says when none succeeded (the view returned is then the
        previous one). `should_stop` ends the retries early (a stop requested meanwhile)."""
        deadline = time.monotonic() + retry_for
        while not self._fetch(timeout):
            if should_stop():
                break
            if time.monotonic() + timeout > deadline:
                if retry_for > 0:
                    logger.warning(f"could not read the swarm's progress from the DHT within {retry_for:g} s; "
                                   f"going on with the last view (swarm epoch {self.snapshot().global_epoch})")
                break
            time.sleep(min(timeout, 0.25))  # an incomplete read answers at once: do not spin on the DHT
        return self.snapshot()

    def shutdown(self) -> None:
        self._stop.set()
        self._wanted.set()
        self._thread.join(timeout=1.0)
        self._ticker.join(timeout=1.0)

    def _fetch(self, timeout: float) -> bool:
        """One DHT read of the records into the view; False (the previous view kept) if it failed or was
        incomplete (`holds_own_record`). Waiters (`wait_for_refresh`) are woken by every read that answered."""
        started = self._pauses.now()
        try:
            listed = list_peers(self.dht, self.run_id, timeout=timeout, include_leaving=True)
        except Exception as e:  # timeouts, DHT shutting down: keep the previous view
            logger.debug(f"progress refresh failed: {e}")
            return False
        own = self._own_record()
        complete = holds_own_record(listed, own.peer_id)
        if not complete:
            logger.debug(f"progress refresh did not find this peer's own record among {len(listed)}: "
                         f"an incomplete read, the previous view kept")
        now = time.monotonic()
        with self._fetched:
            self._last_fetch = now
            if complete:
                records = tuple(r for r in listed if not r.leaving)
                self._unwitnessed = self._witnesses.uncounted(records, own_peer_id=own.peer_id, epoch=own.epoch)
                # The pause watch's clock runs on through a suspend (time.monotonic does not): the swarm did too.
                credited = self._credit.apply(records, own.peer_id, now=self._pauses.now(),
                                              uncorroborated=self._unwitnessed)
                self._records = self._samples.apply(credited, own=own, swarm_epoch=self._credit.swarm_epoch,
                                                    now=now)
                self._credit.note_departures([r for r in listed if r.leaving])
                self._view_started = started
            self._fetch_count += 1
            self._fetched.notify_all()
        return complete

    def _refresh_loop(self) -> None:
        while not self._stop.is_set():
            if self._wanted.wait(self.next_interval()):
                self._wanted.clear()
                with self._lock:
                    allowed_at = self._last_fetch + self.cadence.floor(len(self._records))
                if self._stop.wait(max(0.0, allowed_at - time.monotonic())):
                    break
            if self._stop.is_set():
                break
            self._fetch(timeout=max(self.cadence.min_interval_s * 4, 2.0))
            if self._on_refresh is not None:
                try:
                    self._on_refresh()
                except Exception:
                    logger.debug("progress on_refresh hook failed", exc_info=True)
