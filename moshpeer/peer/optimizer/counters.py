"""`EpochCounters`: a trainer's own place in training (epoch, steps, samples, gradient accumulators)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch


@dataclass
class EpochCounters:
    """This peer's own place in training, shared by the epoch loop (which advances it), the state exchange
    (which saves and adopts it) and the strategies (which read the accumulators through their host)."""

    grad_sums: List[torch.Tensor]  # per parameter: gradients x samples summed over this epoch, fp32
    epoch: int = 0
    steps: int = 0  # inner optimizer steps taken
    samples: int = 0  # samples accumulated in this epoch
    total_samples: int = 0  # ever, by this peer
    dropped_samples: int = 0  # computed but left out of the swarm's average (missed rounds)
    # Per fragment (`RoundPlan.fragment`): samples of missed rounds whose work the parameters still hold (the
    # others' update was taken, this peer's own Δ kept), weighed into that fragment's next round. A checkpoint does
    # not keep it: a resumed peer weighs its first round by that epoch's samples alone.
    carried: Dict[int, int] = field(default_factory=dict)

    def reset_epoch(self) -> None:
        """Forget this epoch's accumulated gradients and samples."""
        for acc in self.grad_sums:
            acc.zero_()
        self.samples = 0
