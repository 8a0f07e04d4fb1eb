"""`TrainedApart`: epochs a trainer trained cut off from its swarm (an outage), and when it gives them up.

A peer whose network goes away trains alone: its DHT lists only itself, every round is "alone", and its epochs
end at its own pace (reconnect.py brings it back once the network returns). Back in the swarm it is ahead of the
others by what it trained alone, and the others used to follow it: in a swarm of three, two peers take the upper
median of their two others, which is the returning peer's epoch, so they downloaded its state and dropped what
the two of them trained meanwhile (measured, session 36: caught up 3 s after its return; behind a NAT its lead was
~450 epochs, and the pair spent 40 s in "could not catch up", the swarm view rising at most 10 epochs a second).
The majority's work is worth more than one peer's, so the returning peer gives way instead:

- while its DHT has no neighbour (`cut_off`), the peer notes since which epoch it is apart (`since_epoch`): the
  epoch after its last round with a group, or after the state it last took (`synced`), since the outage is seen
  a heartbeat late and its lone epochs may have raced ahead meanwhile. Its record says so
  (`PeerRecord.apart_since`), so readers do not let its later epochs move the swarm epoch (progress.py);
- back, once it sees other trainers (`others_epoch`: their robust epoch, this peer left out) and it trained apart
  for more than `max_epoch_lag` epochs, it downloads the state of a peer at their epoch (`rejoin_epoch`), dropping
  its work since `since_epoch` (counted in `dropped_samples` and logged). Ahead of them or not: a peer whose lone
  epochs happened to keep pace with theirs (its DHT process stalled for 20 s, test_pause) holds the same count but
  its own parameters, which it would otherwise have averaged into theirs;
- it keeps its state instead when the others are behind the epoch it left them at (the swarm restarted, or only
  newcomers are left: its state is then the more advanced; a peer that never averaged with a group counts from
  the epoch the outage was seen at), when it trained apart for no more than the lag (nothing to give up), or after
  MAX_REJOIN_ATTEMPTS downloads found no donor (the others then follow it, as before).

Only an outage this peer saw marks its epochs: no DHT neighbour at a check, or no fresh view of the swarm (its DHT
process stalled while it kept its neighbours: its epochs end alone the same way, progress.py's stale view). A peer
that is ahead for any other reason (the others' rounds failed, a swarm of newcomers that did not download) never
drops its state here.

Work that no donor replaced is not averaged (`holds_stale_work`): a stretch apart whose download failed, or an epoch
behind the swarm by more than the lag whose catch-up found no donor (for `max_attempts` epoch ends in a row: then
its group's round takes the peer along, epoch_agreement.py).

This module decides; the epoch loop feeds it and acts (no I/O here).
"""

from __future__ import annotations

from typing import Optional, Tuple

# Downloads tried (one per epoch end) before the peer keeps its own state. Early in training the two donors of a small
# swarm, one epoch apart, can fail the download's cross-check (measured in netlab: 3 tries within 7 s refused at
# epochs 10-14); each try costs one or two downloads of the state.
MAX_REJOIN_ATTEMPTS = 5


class TrainedApart:
    """Whether this trainer's lead over its swarm was trained cut off from it (see the module docstring)."""

    def __init__(self, max_attempts: int = MAX_REJOIN_ATTEMPTS):
        self.max_attempts = max_attempts
        self.since_epoch: Optional[int] = None  # apart since this epoch (its last sync); None: not apart
        self._synced: Optional[Tuple[int, int]] = None  # (epoch, samples computed before it) of the last sync
        self._samples_at_cut = 0
        self._attempts = 0
        self._behind_without_donor = 0  # epoch ends in a row behind the swarm where no donor delivered

    def synced(self, epoch: int, samples_before: int) -> None:
        """This peer starts `epoch` in step with its swarm (a round with a group, or a state taken), having computed
        `samples_before` samples in all; ignored while apart (one such round does not undo the epochs ahead)."""
        if self.since_epoch is None:
            self._synced = (epoch, samples_before)

    def observe(self, cut_off: bool, epoch: int, samples_before: int) -> bool:
        """Note whether the DHT has no neighbour now, at `epoch`, with `samples_before` computed before it; True when
        this starts a stretch apart, counted from the last sync (from now if there was none)."""
        if not cut_off or self.since_epoch is not None:
            return False
        self.since_epoch, self._samples_at_cut = self._synced or (epoch, samples_before)
        self._attempts = 0
        return True

    def rejoin_epoch(self, epoch: int, others_epoch: Optional[int], max_epoch_lag: int, cut_off: bool) -> Optional[int]:
        """The swarm epoch whose state this peer should adopt now, at its own `epoch`, or None. `others_epoch` is
        the robust epoch of the other trainers it sees (None: it sees none yet). Clears the stretch (`since_epoch`)
        when there is nothing to give up or the others are behind where this peer left them."""
        if self.since_epoch is None or cut_off or others_epoch is None:
            return None
        if epoch - self.since_epoch <= max_epoch_lag or others_epoch < self.since_epoch - max_epoch_lag:
            self.since_epoch = None
            return None
        return others_epoch

    def note_behind(self, without_donor: bool) -> None:
        """An epoch end found this peer behind the swarm by more than the lag, and no donor delivered the state it
        asked for (`without_donor`), or not."""
        self._behind_without_donor = self._behind_without_donor + 1 if without_donor else 0

    @property
    def holds_stale_work(self) -> bool:
        """Whether this epoch's work is on parameters the swarm has left and a download to replace them failed: a
        stretch apart whose download failed (for `max_attempts`, then the peer keeps its state), or behind the swarm
        with no donor (`max_attempts` epoch ends in a row, then its group's round takes it along: epoch_agreement.py).
        Such work is not averaged (test_pause: under load a peer back from a stopped p2pd found no donor on offer in
        time and averaged its stale gradients into the pair's round)."""
        return (self.since_epoch is not None and self._attempts > 0) or \
            0 < self._behind_without_donor < self.max_attempts

    def samples_apart(self, total_samples: int) -> int:
        """Samples this peer computed since `since_epoch` began."""
        return max(0, total_samples - self._samples_at_cut) if self.since_epoch is not None else 0

    def attempted(self, adopted: bool) -> bool:
        """A download of the swarm's state was tried; True when the stretch is over (adopted, or the last attempt
        failed: the peer keeps its state)."""
        self._attempts += 1
        if adopted or self._attempts >= self.max_attempts:
            self.since_epoch = None
            return True
        return False
