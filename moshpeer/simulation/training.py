"""The training level of `moshpeer simulate`: N virtual peers train one model on a simulated clock.

Nothing sleeps: every peer carries its own clock (seconds of simulated time) and every duration comes from a
model (compute: samples / speed; a group round: bytes / link speed + round trips; failures: exponential).
The training math runs for real, vectorized over peers (one row of a matrix per peer).

The level's modules, each re-exported here (the entry points `run_training` and `run_sync` live here):

- `training_config.py`: `TrainingConfig` (one run) and `Workload` (what it trains), `MODES`, `PARTITIONS`;
- `problems.py`: the problems a `Workload` names (`Quadratic`, `TeacherMLP`) behind one `Problem` interface;
- `time_model.py`: the network time model (`group_round_seconds`, `matchmaking_seconds`,
  `ring_allreduce_seconds`);
- `swarm.py`: `Swarm`, the per-peer properties and the problem (one seed gives one swarm);
- `moshpit_training.py`: `MoshpitTraining`, the swarm training with Moshpit groups (the modes, one round,
  hostile peers);
- `sync_training.py`: `SyncTraining`, the synchronous data-parallel baseline;
- `training_result.py`: `TrainingResult`, what a run measured, and how goodput is counted.
"""

from __future__ import annotations

import math
from typing import Optional

from moshpeer.simulation.moshpit_training import GROUP_ID_BYTES, MoshpitTraining
from moshpeer.simulation.swarm import HOUR
from moshpeer.simulation.sync_training import SyncTraining
from moshpeer.simulation.time_model import group_round_seconds, matchmaking_seconds, ring_allreduce_seconds
from moshpeer.simulation.training_config import MODES, PARTITIONS, TrainingConfig, Workload
from moshpeer.simulation.training_result import TrainingResult

__all__ = [
    "GROUP_ID_BYTES", "HOUR", "MODES", "PARTITIONS", "MoshpitTraining", "SyncTraining", "TrainingConfig",
    "TrainingResult", "Workload", "group_round_seconds", "matchmaking_seconds", "ring_allreduce_seconds",
    "run_sync", "run_training",
]


def run_training(config: TrainingConfig, seed: int = 0) -> TrainingResult:
    """One Moshpit training run (`MoshpitTraining(config, seed).run()`). ValueError for a bad config."""
    return MoshpitTraining(config, seed).run()


def run_sync(config: TrainingConfig, seed: int = 0, *, seconds: Optional[float] = None, steps: Optional[int] = None,
             **options: float) -> TrainingResult:
    """The synchronous baseline for `seconds` of simulated time (or `steps` steps). ValueError for a bad config,
    or when neither limit is given."""
    if seconds is None and steps is None:
        raise ValueError("give seconds or steps")
    return SyncTraining(config, seed, **options).run(steps if steps is not None else 1 << 62,
                                                     seconds if seconds is not None else math.inf)
