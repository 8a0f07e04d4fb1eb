"""What one training-level run measured (`TrainingResult`), for both systems (Moshpit and the synchronous
baseline).

**Goodput** = useful compute (peer-seconds of compute that ended in a completed round) / up time (peer-seconds
the peers were up). Lost compute (failed mid-epoch), waiting for slower members, matchmaking, the data plane,
deadlines and state downloads are not useful. Both systems' down time (a machine away) is out of the
denominator: the synchronous baseline is elastic (it restarts without the failed peer) rather than waiting.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List, Tuple


@dataclass
class TrainingResult:
    """What a run measured. `curve` = (simulated seconds, loss) after each round (sync: each checkpoint
    interval); `stalls` = group rounds (sync: steps) that waited for a dead member until a deadline/timeout;
    `loss_stalls` = group rounds that waited for the deadline for chunks lost beyond the loss budget;
    `catch_ups` = peers that came after their group had formed and took its update from a member instead;
    `state_downloads` / `checkpoint_resumes` = failed peers that came back with a live peer's state / from their own
    checkpoint (rejoin.py), `state_bytes_per_peer` = the states they downloaded;
    `bytes_per_peer` = the data plane's upload (rounds), `dht_bytes_per_peer` = progress traffic in the DHT
    (control_plane.py; 0 for the synchronous baseline, which has none), `dht_saturated_fraction` = the share of
    group participations in which progress traffic alone would have filled the member's link."""

    system: str
    config: dict
    rounds: int
    sim_seconds: float
    goodput: float
    useful_s: float
    up_s: float
    lost_s: float
    wait_s: float
    comm_s: float
    stalls: int
    failures: int
    final_loss: float
    loss_floor: float
    initial_loss: float
    bytes_per_peer: float
    dht_bytes_per_peer: float = 0.0
    loss_stalls: int = 0
    dht_saturated_fraction: float = 0.0
    final_spread: float = 0.0
    catch_ups: int = 0
    state_downloads: int = 0
    checkpoint_resumes: int = 0
    state_bytes_per_peer: float = 0.0
    mean_group_size: float = 0.0
    alone_fraction: float = 0.0
    curve: List[Tuple[float, float]] = field(default_factory=list)

    @property
    def excess_loss(self) -> float:
        """Final loss minus the optimum (what training can still remove)."""
        return self.final_loss - self.loss_floor

    def summary(self) -> dict:
        """JSON-ready figures (the curve thinned to at most 50 points)."""
        step = max(1, len(self.curve) // 50)
        out = {k: v for k, v in asdict(self).items() if k not in ("curve", "config")}
        out["excess_loss"] = self.excess_loss
        out["curve"] = [(round(t, 1), float(f"{loss:.6g}")) for t, loss in self.curve[::step]]
        return {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in out.items()}
