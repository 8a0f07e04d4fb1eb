"""`ParametersStrategy`: Moshpit SGD / local SGD (averaging="parameters").

Every `step()` is a local inner optimizer step. At the end of each collaborative epoch the round
averages the parameters and, with `average_optimizer_state`, one per-parameter optimizer statistic
(Adam's second moment, SGD's momentum, ...: see `averaged_buffers.AVERAGED_STATISTICS`), and the peer
adopts both. Without a group the peer simply goes on from its own parameters.

Buffer: [parameters..., one optimizer statistic per parameter (zeros where there is none)...].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional

import torch

from moshpeer.peer.strategies.averaged_buffers import flat_buffer_views, optimizer_statistics, param_spread
from moshpeer.peer.strategies.base import AveragingStrategy, RoundPlan, StrategyHost

if TYPE_CHECKING:  # the swarm view a strategy is handed; strategies do not depend on the optimizer
    from moshpeer.peer.optimizer.progress import ProgressSnapshot


class ParametersStrategy(AveragingStrategy):
    """Average parameters (and optimizer statistics) once per epoch; step locally in between.

    :param average_optimizer_state: also average each parameter's optimizer statistic
    """

    name = "parameters"
    steps_locally = True

    def __init__(self, average_optimizer_state: bool = True):
        self.average_optimizer_state = bool(average_optimizer_state)

    def bind(self, host: StrategyHost) -> None:
        super().bind(host)
        self.buffer, views = flat_buffer_views(host.params, 2)
        n = len(host.params)
        self.param_copies, self.stat_copies = views[:n], views[n:]

    def _statistics(self) -> Dict[torch.nn.Parameter, torch.Tensor]:
        return optimizer_statistics(self.host.inner, self.host.params) if self.average_optimizer_state else {}

    def plan_round(self, epoch: int, swarm: ProgressSnapshot) -> RoundPlan:
        for buf, p in zip(self.param_copies, self.host.params):
            buf.copy_(p.detach())
        stats = self._statistics()
        for buf, p in zip(self.stat_copies, self.host.params):
            stat = stats.get(p)
            buf.copy_(stat) if stat is not None else buf.zero_()
        return RoundPlan(tensors=(self.buffer,), averages=("parameters", "optimizer_state"), epoch=epoch)

    @torch.no_grad()
    def apply_averaged(self, plan: RoundPlan, diverged: bool = False) -> Optional[float]:
        spread = param_spread(self.host.params, self.param_copies)
        for p, avg in zip(self.host.params, self.param_copies):
            p.copy_(avg)
        stats = self._statistics()
        for p, buf in zip(self.host.params, self.stat_copies):
            stat = stats.get(p)
            if stat is not None:  # a second moment must stay non-negative after lossy averaging
                stat.copy_(buf.clamp_min(0) if self.host.inner.state[p].get("exp_avg_sq") is stat else buf)
        return spread

    def apply_alone(self, plan: Optional[RoundPlan]) -> None:
        """Nothing to do: the local steps already moved the parameters."""
