"""`GradientsStrategy`: large-batch training across the swarm (averaging="gradients").

Every `step()` adds the micro-batch's gradients, weighted by its samples, to the host's `grad_sums`. At
the end of the epoch the round averages this peer's mean gradient with its group, weighted by samples,
and every member applies the same averaged gradient with the inner optimizer. When the swarm is larger
than one group, groups receive different averages; the Moshpit SGD recipe keeps peers together by also
averaging the parameters, and `param_spread` reports how far this peer's parameters were from its
group's mean before that.

Buffer: [mean gradients..., parameters...] (gradients only with error feedback: EF21M's estimate is
meaningful for gradients only, so parameters are never averaged then).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from moshpeer.errors import UserError
from moshpeer.peer.averaged_buffers import flat_buffer_views, param_spread
from moshpeer.peer.progress import ProgressSnapshot
from moshpeer.peer.strategies.base import AveragingStrategy, RoundPlan, StrategyHost


class GradientsStrategy(AveragingStrategy):
    """Average the epoch's mean gradient (and, per `average_parameters`, the parameters).

    :param average_parameters: also adopt the group's average parameters in a round. "auto": always
        without compression; with a lossy codec only when the swarm has more trainers than `group_size`,
        where groups would drift apart (the codec's noise would otherwise go into the weights)
    """

    name = "gradients"
    accumulates_gradients = True

    def __init__(self, average_parameters: Union[bool, str] = "auto"):
        if average_parameters not in ("auto", True, False):
            raise UserError(f"average_parameters must be 'auto', True or False, got {average_parameters!r}")
        self.average_parameters = average_parameters

    def bind(self, host: StrategyHost) -> None:
        super().bind(host)
        self.with_params = host.error_feedback is None
        self.buffer, views = flat_buffer_views(host.params, 2 if self.with_params else 1)
        n = len(host.params)
        self.grads, self.param_copies = views[:n], views[n:]

    def _average_params_now(self, swarm: ProgressSnapshot) -> bool:
        if not self.with_params:
            return False
        if self.average_parameters == "auto":
            return self.host.compression == "none" or swarm.num_trainers > self.host.group_size
        return bool(self.average_parameters)

    def plan_round(self, epoch: int, swarm: ProgressSnapshot) -> RoundPlan:
        scale = 1.0 / max(self.host.samples_accumulated, 1)
        for buf, acc in zip(self.grads, self.host.grad_sums):
            buf.copy_(acc).mul_(scale)
        for buf, p in zip(self.param_copies, self.host.params):
            buf.copy_(p.detach())  # sent even when not adopted: the averager's tensor list is fixed
        averages = ("gradients", "parameters") if self._average_params_now(swarm) else ("gradients",)
        return RoundPlan(tensors=(self.buffer,), averages=averages)

    @torch.no_grad()
    def apply_averaged(self, plan: RoundPlan) -> Optional[float]:
        spread = None
        if "parameters" in plan.averages:
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
