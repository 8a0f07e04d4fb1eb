"""`moshpeer simulate`: many virtual peers on the decisions the real peers take (see docs/simulation.md).

The averaging level (`averaging`): N peers holding vectors, Moshpit groups by group key, failures, chunk loss on
the production estimator, and the all-reduce baseline. The training level (`training`): N peers training a
problem (a convex one or a small network) on a simulated clock (links, compute speeds, failures, hostile peers;
gradients, parameters and DiLoCo modes) and the synchronous data-parallel baseline.
"""

from moshpeer.simulation.averaging import (
    INITIAL_KEYS,
    RNG_STREAMS,
    TOPOLOGIES,
    AveragingConfig,
    AveragingSimulation,
    CellResult,
    RoundStats,
    Trajectory,
    run_cell,
)
from moshpeer.simulation.moshpit_training import MoshpitTraining
from moshpeer.simulation.sync_training import SyncTraining
from moshpeer.simulation.training import run_sync, run_training
from moshpeer.simulation.training_config import MODES, TrainingConfig, Workload
from moshpeer.simulation.training_result import TrainingResult

__all__ = [
    "INITIAL_KEYS", "RNG_STREAMS", "TOPOLOGIES", "AveragingConfig", "AveragingSimulation", "CellResult", "RoundStats",
    "Trajectory", "run_cell", "MODES", "MoshpitTraining", "SyncTraining", "TrainingConfig", "TrainingResult",
    "Workload", "run_sync", "run_training",
]
