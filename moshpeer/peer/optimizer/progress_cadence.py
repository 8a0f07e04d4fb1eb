"""How often a peer reads the swarm's progress from the DHT and publishes its own: often only when an epoch is
about to end, and never more often than a byte budget allows.

Why: every read fetches the whole membership dictionary (every peer's signed record, ~1.4 KB with its owner
key and signature) from each of the nodes that store it, and every publication stores a record on up to five
nodes after asking them for the key, which they answer with the whole dictionary as they answer a read. At a
read every 0.3 s and a publication every 0.2 s, each peer's link carried 175 KB/s of DHT traffic in a 4-peer swarm
and 452 KB/s in an 8-peer one (`benchmarks/bench_dht.py`, docs/benchmarks.md): more than a DiLoCo round's payload
over its inner phase, and growing with the swarm.

The cadence is a plain function of two numbers the peer knows:
- `eta_s`, the seconds until this peer's epoch is expected to end (the swarm's target batch, or the
  strategy's own count of inner steps): progress is re-read after `eta_fraction` of it, so reads and
  publications come fast near the end of an epoch, where they decide when it ends, and seldom in between;
- `peers`, the records a read returns: the interval is at least `peers * bytes_per_record / budget_bps`,
  so the progress traffic costs a peer's link about `budget_bps` at most, however large the swarm grows (at
  the default 128 KB/s, ~2% of a 50 Mbit/s link: a read every 0.3 s up to 2 peers, every 0.5 s at 4, 1 s at
  8, 12.5 s at 100, where an epoch that the swarm's target batch ends is noticed that much later).
What the budget does not bound: the nodes that store the dictionary serve every peer's reads, so their load
grows with the swarm as (swarm size / replicas) times one reader's budget; see docs/benchmarks.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Upload bytes one record adds to a peer's link per read-and-publish cycle (bench_dht.py, fixed 0.3 s cadence:
# 175 KB/s / 3.3 cycles/s / 4 records = 13 KB at 4 peers, 452 / 3.3 / 8 = 17 KB at 8; of which reads ~9 KB at
# 8 peers). hivemind asks every node that stores the dictionary, and each answers with all of it. Since nodes
# stopped caching what they read (session 28), that is the key's 5 replicas: ~14 KB per record per cycle beyond 5.
BYTES_PER_RECORD = 16_000.0
DEFAULT_MAX_INTERVAL_S = 5.0


@dataclass(frozen=True)
class ProgressCadence:
    """When to read and publish swarm progress next (see the module docstring).

    :param min_interval_s: the shortest interval (near an epoch's end, in a small swarm)
    :param max_interval_s: the longest interval the epoch's distance alone can stretch it to
    :param eta_fraction: re-read after this fraction of the time left in the epoch
    :param budget_bps: the upload bytes per second progress may cost this peer (inf: no budget)
    :param bytes_per_record: what one record costs per read-and-publish cycle (BYTES_PER_RECORD)
    """

    min_interval_s: float = 0.3
    max_interval_s: float = DEFAULT_MAX_INTERVAL_S
    eta_fraction: float = 0.5
    budget_bps: float = 128_000.0
    bytes_per_record: float = BYTES_PER_RECORD

    def __post_init__(self):
        if not 0 < self.min_interval_s <= self.max_interval_s:
            raise ValueError(f"need 0 < min_interval_s <= max_interval_s, got {self.min_interval_s}, "
                             f"{self.max_interval_s}")
        if not 0 < self.eta_fraction <= 1 or not self.budget_bps > 0:
            raise ValueError("eta_fraction must be in (0, 1] and budget_bps positive")

    @classmethod
    def fastest(cls, interval_s: float) -> "ProgressCadence":
        """The default cadence with `interval_s` as its shortest interval (a user's `progress_refresh`)."""
        return cls(min_interval_s=interval_s, max_interval_s=max(interval_s, DEFAULT_MAX_INTERVAL_S))

    @classmethod
    def fixed(cls, interval_s: float) -> "ProgressCadence":
        """Every `interval_s` seconds, whatever the epoch or the swarm (the cadence before the byte budget)."""
        return cls(min_interval_s=interval_s, max_interval_s=interval_s, budget_bps=math.inf)

    def floor(self, peers: int) -> float:
        """The shortest interval the byte budget allows for a read of `peers` records."""
        return max(self.min_interval_s, max(peers, 1) * self.bytes_per_record / self.budget_bps)

    def interval(self, eta_s: float, peers: int) -> float:
        """Seconds until the next read (and the least between two publications) when the epoch is expected to
        end in `eta_s` seconds (inf or nan: unknown, e.g. nobody computes) and a read returns `peers` records."""
        floor = self.floor(peers)
        if not math.isfinite(eta_s):
            return max(self.max_interval_s, floor)
        return min(max(eta_s * self.eta_fraction, floor), max(self.max_interval_s, floor))
