"""The control plane's cost in the simulation: what reading and publishing swarm progress in the DHT costs each
peer's link (`ControlPlane`).

**When** a peer reads is production's decision, called here: `ProgressCadence.interval` (after half the time left
in the epoch, never faster than its byte budget allows; peer/optimizer/progress_cadence.py).

**What** one read costs is a model of hivemind's DHT, traced and fitted with `benchmarks/bench_dht.py`
(docs/benchmarks.md, "The control plane"): a read (hivemind's `get(latest=True)`) asks every node of its beam,
and each of the `DHT_REPLICAS` nodes that store the run's key answers with the whole progress dictionary, one
record per live peer at ~`WIRE_BYTES_PER_RECORD` on the wire. A publication costs as much again: hivemind's store
first looks up the nodes near the key with the same find request, and those answer with the dictionary too. Per
read-and-publish cycle that is min(N, 5) x N x 2.8 KB: 45 KB at 4 peers (44 measured), 112 at 8 and 224 at 16.
Until session 28 every node also answered from its cache of what it had read (hivemind's `cache_locally`, now off
in `SwarmDHT`), so the fan-out was the beam's 20 nodes, not the 5 replicas: 179 and 717 KB at 8 and 16 peers. At
16 peers on the 2-core sandbox (CPU-bound, so below these figures) turning the cache off took the default
cadence's upload from 164 to 67 KB/s per peer.

What follows for large swarms: production's byte budget assumes a constant `BYTES_PER_RECORD` (16 KB) per record,
so its floor interval grows as N x 16 KB / budget, while a record costs 5 x 2.8 = 14 KB from 5 peers on: a peer's
progress traffic levels off at 14 / 16 = 0.875 x the budget (112 KB/s at the default 128 KB/s), on its uplink and
its downlink, whatever the swarm's size. The 5 replicas answer every read (with the cache on too: they were always
asked), so their uplinks carry N / 5 times the mean (bench_dht's `max_upload_bps`); the model does not show it.

Not modelled: matchmaking's DHT traffic (a few small messages per round), and the replicas' extra load.
"""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from moshpeer.peer.optimizer.progress_cadence import ProgressCadence

DHT_REPLICAS = 5  # hivemind's num_replicas: the nodes that store a key and answer its reads
WIRE_BYTES_PER_RECORD = 2_800.0
# A peer keeps at least this share of its link for the data plane in the model (a link that the control plane
# alone would fill is reported through `saturates`, not modelled as a round that never ends).
MIN_DATA_SHARE = 0.1


def read_cycle_bytes(peers: int) -> float:
    """Bytes one read-and-publish cycle moves in a swarm of `peers` live peers (see the module docstring)."""
    n = max(int(peers), 1)
    return min(n, DHT_REPLICAS) * n * WIRE_BYTES_PER_RECORD


class ControlPlane:
    """Progress traffic per peer: reads over an epoch (`epoch_reads`), the rate between epochs (`floor_rate`),
    and the links left to the data plane (`data_share`). Pure arithmetic on the production cadence."""

    def __init__(self, cadence: ProgressCadence = ProgressCadence()):
        self.cadence = cadence
        self._reads: Dict[Tuple[float, int], float] = {}

    def epoch_reads(self, epoch_s: float, peers: int) -> float:
        """Reads during an epoch of `epoch_s` seconds of compute: the production cadence from eta = epoch_s down
        to 0 (fractional: a read interval the epoch ends inside counts as its share). Cached per (epoch to 3
        significant digits, peers)."""
        key = (float(f"{epoch_s:.3g}"), int(peers))
        if key not in self._reads:
            t, reads, epoch = 0.0, 0.0, key[0]
            while t < epoch:
                dt = self.cadence.interval(epoch - t, key[1])
                reads += min(dt, epoch - t) / dt
                t += dt
            self._reads[key] = reads
        return self._reads[key]

    def floor_rate(self, peers: int) -> float:
        """Bytes per second a peer's progress traffic takes from each of its links outside its epoch's compute
        (waiting for a group, the data plane): eta is past, so the cadence reads at its floor."""
        return read_cycle_bytes(peers) / self.cadence.floor(peers)

    def round_bytes(self, epoch_s: np.ndarray, tail_s: np.ndarray, peers: int) -> np.ndarray:
        """Progress bytes each peer's uplink carries in one round: `epoch_s` of compute, then `tail_s` of waiting
        and averaging."""
        epochs, index = np.unique(np.asarray(epoch_s, dtype=float), return_inverse=True)  # peers share speeds
        reads = np.array([self.epoch_reads(float(e), peers) for e in epochs])[index.reshape(-1)]
        return read_cycle_bytes(peers) * reads + self.floor_rate(peers) * np.maximum(tail_s, 0.0)

    def data_share(self, links: np.ndarray, peers: int) -> np.ndarray:
        """The link speeds left to the data plane once progress traffic has taken its floor rate."""
        return np.maximum(links - self.floor_rate(peers), MIN_DATA_SHARE * links)

    def saturates(self, links: np.ndarray, peers: int) -> np.ndarray:
        """Which links progress traffic alone would fill past 1 - MIN_DATA_SHARE of their speed."""
        return self.floor_rate(peers) > (1 - MIN_DATA_SHARE) * links
