"""`GradientsStrategy`: large-batch training across the swarm (averaging="gradients").

Every `step()` adds the micro-batch's gradients, weighted by its samples, to the host's `grad_sums`. At
the end of the epoch the round averages this peer's mean gradient with its group, weighted by samples,
and every member applies the same averaged gradient with the inner optimizer.

Members of a full group apply the same average and stay identical. A peer whose round failed while the others
averaged it takes their step instead of one of its own (`rejoins_by_update`): it fetches the averaged gradient a
member kept (round_update.py; one round's bytes, served until that member plans its next round, or two more epochs
while a straggler at that epoch is in view) and steps on it; its own gradient of the missed epoch is carried into
its next contribution, weighed by its samples, and it starts the next epoch as far in as the member was
(`head_start`), so that it meets that epoch's round instead of arriving as late again. A round whose members adopted
the averaged parameters cannot be made up for that way: a peer that missed it takes their state. Peers still drift
apart: a peer that stepped alone (no group that epoch, or no member served the update), or groups that received
different averages (a swarm larger than one group). So every `params_every` epochs the round also averages the
parameters and every member adopts their average (Moshpit SGD's recipe to pull groups back together); `param_spread`
reports how far this peer was from its group's mean before that. The other rounds send gradients only: half the
bytes. The choice depends on the epoch only, so the members of one round agree on it (peers group only with peers
whose round averages the same tensors).

Buffer: [mean gradients..., parameters...] (gradients only with error feedback: EF21M's estimate is
meaningful for gradients only, so parameters are never averaged then).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from moshpeer.errors import UserError
from moshpeer.peer.strategies.averaged_buffers import flat_buffer_views, param_spread
from moshpeer.peer.strategies.base import AveragingStrategy, RoundPlan, StrategyHost
from moshpeer.peer.strategies.round_update import RoundUpdate

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
    # A lone step on this peer's own gradient would leave its parameters apart from its group's until the next
    # parameters round (and spot checks of its work, or its checks of others', would then compare gradients at
    # different parameters); the group's averaged gradient keeps them together.
    rejoins_by_update = True

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
        self.kept_epoch: Optional[int] = None  # the epoch whose group average `grads` still hold (kept_update)
        self.kept_encoded: Optional[RoundUpdate] = None  # encoded at the first request, for every later one
        # Updates of the rounds before, kept past our plan while a trainer's record still showed their epoch (epoch ->
        # update; at most two): that peer may meet a later round of ours and then asks for the step it missed
        # (`_keep_for_stragglers`).
        self.previous: Dict[int, RoundUpdate] = {}
        # Own gradient sums (x samples) of rounds missed and made up for with the group's update (apply_update):
        # they go into the next contribution, or the next lone step.
        self.carried_sums: Optional[List[torch.Tensor]] = None
        self.carried_samples = 0
        self.head = 0  # head_start() of this epoch: its donor's samples into it, when it began with an update

    def _params_round(self, epoch: int) -> bool:
        """Do the parameters travel in this epoch's round? The epoch alone decides, so that all members of
        a round average the same tensors."""
        return self.with_params and self.average_parameters is not False and epoch % self.params_every == 0

    def _adopt_params(self, swarm: ProgressSnapshot) -> bool:
        if self.average_parameters == "auto" and self.host.compression != "none":
            return swarm.num_trainers > self.host.group_size
        return True

    def plan_round(self, epoch: int, swarm: ProgressSnapshot) -> RoundPlan:
        self.previous = self._keep_for_stragglers(swarm)
        self.kept_epoch, self.kept_encoded, self.head = None, None, 0  # the buffer is about to hold our gradient
        self._own_mean_gradient(out=self.grads)
        self.adopt_params = False
        if not self._params_round(epoch):
            return RoundPlan(tensors=(self.grad_part,), averages=("gradients",), epoch=epoch)
        for buf, p in zip(self.param_copies, self.host.params):
            buf.copy_(p.detach())
        self.adopt_params = self._adopt_params(swarm)
        # No digest of the parameters (RoundPlan.digest): members' parameters differ by design here, each stepping
        # with its own inner optimizer state (param_spread ~1e-4 every 16 epochs in a healthy swarm).
        return RoundPlan(tensors=(self.buffer,), averages=("gradients", "parameters"), epoch=epoch)

    @torch.no_grad()
    def apply_averaged(self, plan: RoundPlan, diverged: bool = False) -> Optional[float]:
        spread = None
        if self.adopt_params:
            spread = param_spread(self.host.params, self.param_copies)
            for p, avg in zip(self.host.params, self.param_copies):
                p.copy_(avg)
        self._step_on(self.grads)
        self.kept_epoch = plan.epoch
        self._drop_carried()
        return spread

    @torch.no_grad()
    def apply_alone(self, plan: Optional[RoundPlan]) -> None:
        # Recomputed, not read from the buffer: an abandoned round may still be writing to it.
        if self.host.samples_accumulated + self.carried_samples > 0:
            self._step_on(self._own_mean_gradient(), fresh=True)
        else:
            self.host.inner.zero_grad(set_to_none=True)  # the next epoch accumulates from scratch
        self._drop_carried()

    def kept_update(self, epoch: int) -> Optional[Dict[str, Any]]:
        """The averaged gradient this peer stepped on in its successful round of `epoch`, while its buffer still
        holds it (until it plans its next round), encoded with the run's gather codec, with this peer's phase now:
        (the next epoch, its samples so far); or one of the two rounds' before, kept for a straggler (no phase: this
        peer is an epoch or two further). The caller holds the optimizer's lock (the training thread plans under it)."""
        if epoch in self.previous:
            return self.previous[epoch].to_state()
        if self.kept_epoch != epoch:
            return None
        return self._encode_kept().to_state(phase=(epoch + 1, self.host.samples_accumulated))

    def update_restores(self, plan: RoundPlan) -> bool:
        """Not after a round whose members adopted the averaged parameters: its kept update is their gradient only,
        and a step on it would leave a peer that missed the round on its own parameters until the next parameters
        round (after the first round of a run: on another initialization altogether; seen 200 ms apart in session
        50). Such a peer takes their state instead (`needs_state_after_missing`)."""
        return not self.adopt_params

    def needs_state_after_missing(self, plan: RoundPlan) -> bool:
        return self.adopt_params

    def _encode_kept(self) -> RoundUpdate:
        if self.kept_encoded is None:
            self.kept_encoded = RoundUpdate.encode(self.grad_part, epoch=self.kept_epoch, fragment=0, steps=0,
                                                   compression=self.host.compression)
        return self.kept_encoded

    def _keep_for_stragglers(self, swarm: ProgressSnapshot) -> Dict[int, RoundUpdate]:
        """Before the buffer takes the next gradient: the updates of the last two rounds averaged whose epoch another
        trainer's record still shows (it has not averaged that round), encoded; else nothing. Such a trainer, with
        epochs shorter than a matchmaking window, may meet our next round, and then fetches the step it missed
        (epoch_loop.py). It asks once that shared round is over, which on long round trips comes after this peer
        planned the epoch after it (200 ms apart, the ask took 0.5-1.3 s and the next plan came first: the
        straggler downloaded a whole state, 3.5 s, and was one epoch late again at every round, docs/training.md):
        so the round before the last one is kept one more epoch. An encode only when such a straggler is in view;
        nothing is kept longer than two more epochs."""
        if self.kept_epoch is None:
            return {}
        behind = {r.epoch for r in swarm.peers if r.role == "trainer" and not r.leaving}
        kept = {epoch: update for epoch, update in self.previous.items()
                if epoch == self.kept_epoch - 1 and epoch in behind}
        if self.kept_epoch in behind:
            kept[self.kept_epoch] = self._encode_kept()
        return kept

    @torch.no_grad()
    def fit_update(self, plan: RoundPlan, update: Any) -> Tuple[torch.Tensor, int]:
        """(the group's averaged gradient of `plan`'s round, the next epoch's head start) from another member's
        `kept_update`, checked against this peer's own mean gradient of the round (round_update.py says what fits;
        no step count: the epoch places a gradients round); ValueError otherwise. The head start is the donor's
        samples into the next epoch when it served: a peer late by more than the matchmaking window would be as
        late for the next round, and every one after, were it to compute its whole share."""
        update = RoundUpdate.from_state(update)
        own = torch.cat([g.reshape(-1) for g in self._own_mean_gradient()])
        grad = update.check_fits(epoch=plan.epoch, fragment=0, steps=0, own=own)
        return grad, update.phase[1] if update.phase is not None and update.phase[0] == plan.epoch + 1 else 0

    @torch.no_grad()
    def apply_update(self, plan: RoundPlan, fitted: Tuple[torch.Tensor, int], carry: bool = True) -> None:
        """The group's step on its averaged gradient (`fit_update`'s); this peer's own gradient sums of the round
        are carried into its next contribution (else dropped), and its next epoch starts as far in as its donor
        was."""
        fitted, self.head = fitted
        params = self.host.params
        grads = [g.view_as(p) for g, p in zip(fitted.split([p.numel() for p in params]), params)]
        if carry:
            sums = [acc.clone() for acc in self.host.grad_sums]
            for total, carried in zip(sums, self.carried_sums or ()):
                total.add_(carried)
            self.carried_sums, self.carried_samples = sums, self.carried_samples + self.host.samples_accumulated
        else:
            self._drop_carried()
        self._step_on(grads, fresh=True)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._drop_carried()  # an adopted state replaces the carried work (the epoch loop counts it dropped)
        self.head, self.previous = 0, {}

    def head_start(self) -> int:
        return self.head

    def _own_mean_gradient(self, out: Optional[Sequence[torch.Tensor]] = None) -> Sequence[torch.Tensor]:
        """This peer's sample-weighted mean gradient of the epoch, with the work carried from missed rounds: written
        into `out` (the round's buffer, every epoch: no new tensors), else into new tensors."""
        scale = 1.0 / max(self.host.samples_accumulated + self.carried_samples, 1)
        out = out if out is not None else [torch.empty_like(acc) for acc in self.host.grad_sums]
        for buf, acc, extra in zip(out, self.host.grad_sums, self.carried_sums or [None] * len(out)):
            buf.copy_(acc)
            if extra is not None:
                buf.add_(extra)
            buf.mul_(scale)
        return out

    def _step_on(self, grads: Sequence[torch.Tensor], fresh: bool = False) -> None:
        """One inner optimizer step on `grads` (one per parameter; `fresh`: tensors nobody else holds, used as they
        are where device and dtype fit, else copied); the next epoch accumulates from scratch."""
        for p, grad in zip(self.host.params, grads):
            p.grad = grad.to(device=p.device, dtype=p.dtype, copy=not fresh)
        self.host.inner_step()
        self.host.inner.zero_grad(set_to_none=True)

    def _drop_carried(self) -> None:
        self.carried_sums, self.carried_samples = None, 0

    def averaged_gradient(self, plan: RoundPlan) -> Optional[Sequence[torch.Tensor]]:
        return self.grads
