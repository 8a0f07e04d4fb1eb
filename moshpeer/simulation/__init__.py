"""`moshpeer simulate`: many virtual peers on the decisions the real peers take (see docs/simulation.md).

The averaging level (`averaging`) is here: N peers holding vectors, Moshpit groups by group key, failures,
chunk loss on the production estimator, and the all-reduce baseline.
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

__all__ = [
    "INITIAL_KEYS", "RNG_STREAMS", "TOPOLOGIES", "AveragingConfig", "AveragingSimulation", "CellResult", "RoundStats",
    "Trajectory", "run_cell",
]
