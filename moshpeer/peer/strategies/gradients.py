"""`GradientsStrategy`: large-batch training across the swarm (averaging="gradients").

Every `step()` adds the micro-batch's gradients, weighted by its samples, to the host's `grad_sums`. At
the end of the epoch the round averages this peer's mean gradient with its group, weighted by samples,
and every member applies the same averaged gradient with the inner optimizer.

Members of a full group apply the same average and stay identical. Peers still drift apart: a peer
that stepped alone (no group that epoch), or groups that received different averages (a swarm larger
than one group). So every `params_every` epochs the round also averages the parameters and every
member adopts their average (Moshpit SGD's recipe to pull groups back together); `param_spread` reports
how far this peer was from its group's mean before that. The other rounds send gradients only: half
the bytes. The choice depends on the epoch only, so the members of one round agree on it (peers group
only with peers whose round averages the same tensors).

Buffer: [mean gradients..., parameters...] (gradients only with error feedback: EF21M's estimate is
meaningful for gradients only, so parameters are never averaged then).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

from moshpeer.errors import UserError
from moshpeer.peer.strategies.averaged_buffers import flat_buffer_views, param_spread
from moshpeer.peer.strategies.base import AveragingStrategy, RoundPlan, StrategyHost

if TYPE_CHECKING:  # the swarm view a strategy is handed; strategies do not depend on the optimizer
    from moshpeer.peer.optimizer.progress import ProgressSnapshot

# Epochs between parameter rounds: 16 sends (1 + 1/16) / 2 = 0.53x the bytes of averaging the parameters
# every round, and a peer that stepped alone rejoins the swarm's parameters within 16 epochs.
DEFAULT_PARAMS_EVERY = 16


class GradientsStrategy(AveragingStrategy):
    """Average the epoch's mean gradient (and, per `average_parameters`, the parameters).

    :param average_parameters: True: every `params_every` epochs the round also averages the parameters
        and the peer adopts their average. "auto": the same, except that with a lossy codec the peer adopts
        them only when the swarm has more trainers than `group_size`, where groups drift apart (else the
        codec's noise would go into the weights for nothing). False: gradients only, always
    :param params_every: epochs between parameter rounds (1: every round, as moshpeer did before 0.2)
    """

    name = "gradients"
    accumulates_gradients = True

    def __init__(self, average_parameters: Union[bool, str] = "auto", params_every: int = DEFAULT_PARAMS_EVERY):
        if average_parameters not in ("auto", True, False):
            raise UserError(f"average_parameters must be 'auto', True or False, got {average_parameters!r}")
        if not isinstance(params_every, int) or params_every < 1:
            raise UserError(f"params_every must be a positive number of epochs, got {params_every!r}")
        self.average_parameters = average_parameters
        self.params_every = params_every

    def bind(self, host: StrategyHost) -> None:
        super().bind(host)
        self.with_params = host.error_feedback is None
        self.buffer, views = flat_buffer_views(host.params, 2 if self.with_params else 1)
        n = len(host.params)
        self.grads, self.param_copies = views[:n], views[n:]
        self.grad_part = self.buffer[:sum(p.numel() for p in host.params)]  # a gradients-only round averages this

    def _params_round(self, epoch: int) -> bool:
        """Do the parameters travel in this epoch's round? The epoch alone decides, so that all members of
        a round average the same tensors."""
        return self.with_params and self.average_parameters is not False and epoch % self.params_every == 0

    def _adopt_params(self, swarm: ProgressSnapshot) -> bool:
        if self.average_parameters == "auto" and self.host.compression != "none":
            return swarm.num_trainers > self.host.group_size
        return True

    def plan_round(self, epoch: int, swarm: ProgressSnapshot) -> RoundPlan:
        scale = 1.0 / max(self.host.samples_accumulated, 1)
        for buf, acc in zip(self.grads, self.host.grad_sums):
            buf.copy_(acc).mul_(scale)
        self.adopt_params = False
        if not self._params_round(epoch):
            return RoundPlan(tensors=(self.grad_part,), averages=("gradients",))
        for buf, p in zip(self.param_copies, self.host.params):
            buf.copy_(p.detach())
        self.adopt_params = self._adopt_params(swarm)
        return RoundPlan(tensors=(self.buffer,), averages=("gradients", "parameters"))

    @torch.no_grad()
    def apply_averaged(self, plan: RoundPlan) -> Optional[float]:
        spread = None
        if self.adopt_params:
            spread = param_spread(self.host.params, self.param_copies)
            for p, avg in zip(self.host.params, self.param_copies):
                p.copy_(avg)
        for p, avg in zip(self.host.params, self.grads):
            p.grad = avg.to(device=p.device, dtype=p.dtype).clone()
        self._inner_step()
        return spread

    @torch.no_grad()
    def apply_alone(self, plan: Optional[RoundPlan]) -> None:
        samples = self.host.samples_accumulated
        if samples > 0:
            for p, acc in zip(self.host.params, self.host.grad_sums):
                p.grad = (acc * (1.0 / samples)).to(dtype=p.dtype)
            self.host.inner_step()
        self.host.inner.zero_grad(set_to_none=True)  # the next epoch accumulates from scratch

    def _inner_step(self) -> None:
        self.host.inner_step()
        self.host.inner.zero_grad(set_to_none=True)

    def averaged_gradient(self, plan: RoundPlan) -> Optional[Sequence[torch.Tensor]]:
        return self.grads
