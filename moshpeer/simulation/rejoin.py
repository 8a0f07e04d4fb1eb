"""How a failed peer comes back, for `MoshpitTraining`: production's start rule on production's view of the
swarm's epoch.

A peer that fails either kept a checkpoint of the epoch it failed in (`resume_fraction` of failures: a
preemption it checkpointed on) or lost its state (a crash, a machine that is gone). When its time away is over
it reads the swarm's epoch as a starting peer does (`progress.robust_epoch`, the upper median of the live
trainers' epochs) and decides as `moshpeer join` does (`checkpoint.staleness.start_decision`): resume from the
checkpoint while the swarm is at most `max_staleness` epochs ahead, else download a live peer's state.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from moshpeer.peer.checkpoint.staleness import Start, start_decision
from moshpeer.peer.optimizer.progress import robust_epoch
from moshpeer.peer.strategies.diloco_outer import OuterState


def state_nbytes(model_params: int, mode: str) -> int:
    """Bytes of the state a rejoining peer downloads: the model in fp32 and, for DiLoCo, the outer momentum too."""
    return model_params * (2 if mode == "diloco" else 1) * 4


def kept_checkpoints(count: int, resume_fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Which of `count` failing peers keep a checkpoint of their epoch. Draws nothing from `rng` when
    `resume_fraction` is 0, so a run without checkpoints fails and rejoins exactly as before they were modelled."""
    if resume_fraction <= 0:
        return np.zeros(count, dtype=bool)
    return rng.random(count) < resume_fraction


def downloads_on_rejoin(epochs: np.ndarray, from_checkpoint: np.ndarray, live_epochs: np.ndarray,
                        max_staleness: int) -> np.ndarray:
    """For rejoining peers at `epochs` (their checkpoints' epochs where `from_checkpoint`): whether each downloads
    the swarm's state, against the swarm epoch that the live trainers' `live_epochs` give (non-empty)."""
    swarm_epoch = robust_epoch(live_epochs.tolist())
    return np.array([start_decision(swarm_epoch, int(epoch) if kept else 0, bool(kept), max_staleness)
                     is Start.DOWNLOAD for epoch, kept in zip(epochs, from_checkpoint)], dtype=bool)


def adopt_state(x: torch.Tensor, outer: Optional[OuterState], epochs: np.ndarray, peers: np.ndarray,
                donors: np.ndarray) -> None:
    """Rows `peers` of `x` take over their donors' state: the model, the epoch and, for DiLoCo (`outer`), θ_outer
    and the outer momentum."""
    epochs[peers] = epochs[donors]
    b, d = torch.from_numpy(peers), torch.from_numpy(donors)
    x[b] = x[d]
    if outer is not None:
        anchor = outer.anchor[0]
        anchor[b] = anchor[d]
        momentum = outer.optimizer.state.get(anchor, {}).get("momentum_buffer")
        if momentum is not None:
            momentum[b] = momentum[d]
