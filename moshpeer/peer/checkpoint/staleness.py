"""Whether a peer that starts trains on, resumes from its checkpoint, or downloads the swarm's state
(`start_decision`): a plain rule that the trainer (`peer/runtime/trainer.py`) and the simulator's rejoining
peers (`simulation/rejoin.py`) both call.

A peer at start compares its epoch with the swarm's (production's progress rule: `progress.robust_epoch` over
the trainers' records). Not behind: it trains on. Behind without a checkpoint (a new peer, or one whose state
was lost): it downloads. Behind with a checkpoint: it resumes from it while the swarm is at most
`max_staleness` epochs ahead (a round or two of stale parameters, which its next group's average corrects,
against a whole state's bytes), and downloads beyond that.
"""

from __future__ import annotations

import enum

# Epochs a checkpoint may lag the swarm and still be resumed from (`moshpeer join --max-staleness`).
DEFAULT_MAX_STALENESS = 1


class Start(enum.Enum):
    """What a starting peer does with its state."""

    TRAIN_ON = "train on"  # not behind the swarm
    RESUME = "resume"  # behind by at most max_staleness, from its checkpoint
    DOWNLOAD = "download"  # behind with no checkpoint, or with one more than max_staleness behind


def start_decision(swarm_epoch: int, local_epoch: int, from_checkpoint: bool,
                   max_staleness: int = DEFAULT_MAX_STALENESS) -> Start:
    """The rule above. `local_epoch` is the checkpoint's epoch when `from_checkpoint`, else the fresh state's
    (0). Never raises."""
    lag = swarm_epoch - local_epoch
    if lag <= 0:
        return Start.TRAIN_ON
    if from_checkpoint and lag <= max_staleness:
        return Start.RESUME
    return Start.DOWNLOAD
