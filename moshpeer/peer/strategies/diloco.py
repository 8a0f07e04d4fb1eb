"""`DiLoCoStrategy`: rare, compressed outer steps (averaging="diloco"; the math is in diloco_outer.py).

Every `step()` is an inner optimizer step (AdamW in the paper). After `inner_steps` (H) of them the
epoch is over: the round averages the pseudo-gradient Δ = θ_outer − θ_local with a Moshpit group (any
codec: int8 and int4 suit Δ; `topk-int2` with error feedback is SparseLoCo: the round sends the top rows of Δ
plus this peer's unsent residual, compression/residual_feedback.py), and the outer optimizer (default SGD with
Nesterov momentum, lr 0.7, momentum 0.9; plain SGD, lr 1 under error feedback) applies the group's Δ̄ to θ_outer.
Successive rounds meet different groups (the averager rotates the group key, as in Moshpit SGD), so with more peers
than one group the outer steps mix the whole swarm over rounds.

Loss tolerance is the averager's: a chunk of Δ whose contributions partly arrived is the unbiased
reconstruction, a chunk of Δ̄ this peer never received is its own Δ there. The outer step is linear in
Δ̄, so it stays unbiased. No group while others averaged (this peer was late): it takes the outer step
on their Δ̄, fetched from one of them (every member keeps the latest Δ̄ of each fragment, encoded as
the round sent it: round_update.py), so that a missed round costs one round's bytes, and this peer's own
Δ of that round is carried into its next one (late work counts a round later, not never); only if no
member delivers a Δ̄ that fits does it download their whole state (a lone outer step would leave its
θ_outer apart from the swarm's for good). No group at all (alone, or nobody else finished the round):
the outer step on its own Δ.

overlap=True (one-outer-step delay): the round of Δ_t runs in the background while the peer computes
the next H inner steps; the outer step on Δ̄_t is taken at the next epoch end, keeping the local
progress made meanwhile (OuterState.apply_delayed). The optimizer runs such a strategy's rounds with
`MoshpitAverager.step(wait=False)` and resolves them one epoch later. A Δ that comes pending with an adopted state
(a donor always has one) is stepped on alone at the next plan, then again on the group's Δ̄ of its round once the
optimizer fetched it (`lone_step`, `retake_lone_step`; peer/optimizer/lone_step_fetch.py).

quorum=Q (0 < Q <= 1; Decoupled DiLoCo's minimum quorum, inside the swarm): a peer ends its epoch early, with
the inner steps it has taken (at least one), once trainers holding Q of the swarm's compute rate have ended theirs
(their records: round_timing.quorum_eta_s). The round weighs each member's Δ by its samples (tokens), so a slower
peer counts for what it did, and it starts the next epoch with the others instead of missing their round.

fragments=F (Streaming DiLoCo, Douillard et al. 2025): the parameters are cut into F contiguous runs
(diloco_fragments.py), each with its own θ_outer, outer momentum and θ_sent. A collaborative epoch is H/F
inner steps and the round of epoch e averages fragment e mod F only (the epoch is the swarm's, so every
member of a round averages the same fragment, and a newcomer's downloaded epoch says which comes next):
each fragment still syncs every H inner steps, and a round carries 1/F of the bytes. F=1 is plain DiLoCo.

outer_params_every=K (default 4): every K-th round of a fragment also averages its θ_outer, and the members adopt
the group's mean before the outer step. Averaging Δ alone never contracts a difference between two peers' θ_outer:
each applies its group's Δ̄ to its own copy, so with more trainers than one group holds the copies drift apart (on
a small network in `moshpeer simulate --workload mlp`, far enough that the loss rises again; docs/training.md).
The epoch alone decides which rounds carry θ_outer, so every member of a round averages the same tensors; it costs
1/K more bytes. average_outer="auto" adopts a lossy codec's θ_outer average only when the swarm has more trainers
than a group holds (else the codec's noise would go into the weights for nothing), as gradients mode does with
parameters, or when the members' θ_outer differed: each tells its group a digest of its copy (RoundPlan.digest), and
a member that drifted apart (a missed outer step, Δs of two epochs in one group) is thus brought back within K rounds
instead of staying apart for good; error feedback averages Δ only (its residual is of Δ, and every round averages
every value).

Buffer: [Δ...] (one value per parameter; a round averages its fragment's slice), and a θ_outer copy of the same
layout for the rounds that carry it. State (checkpoints, downloads): per fragment θ_outer, the outer optimizer's
state (momentum), the outer step count and the pending θ_sent; the inner steps taken in the current epoch and the
fragment count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

import torch

from moshpeer.errors import UserError
from moshpeer.peer.strategies.averaged_buffers import flat_buffer_views, param_spread, values_digest
from moshpeer.peer.strategies.diloco_fragments import Fragment, make_fragments
from moshpeer.peer.strategies.diloco_outer import OuterOptimizer, OuterOptimizerFactory, describe_outer_optimizer
from moshpeer.peer.strategies.round_update import RoundUpdate
from moshpeer.peer.strategies.base import AveragingStrategy, RoundPlan, StrategyHost

if TYPE_CHECKING:  # the swarm view a strategy is handed; strategies do not depend on the optimizer
    from moshpeer.peer.optimizer.progress import ProgressSnapshot

DEFAULT_INNER_STEPS = 50
# Every 4th round of a fragment carries θ_outer too: 25% more bytes. In the simulator (1,000 peers in groups of 16,
# the convex problem) it brings the loss from 2.2x the optimum to 1.13x; every round, 1.131x (docs/simulation.md).
DEFAULT_OUTER_PARAMS_EVERY = 4
# The outer optimizer under error feedback unless one is given: plain SGD, lr 1 (SparseLoCo's; the residual's decay
# plays the outer momentum's part).
SPARSE_OUTER_OPTIMIZER = OuterOptimizer("sgd", lr=1.0, momentum=0.0)


@dataclass(frozen=True)
class LoneStep:
    """An outer step taken on a Δ that came pending with an adopted state (no round of this process averaged it):
    the round it belongs to, the fragment's outer state before it (`OuterState.before_step`: a copy of θ_outer and of
    the outer optimizer's state, held for about an epoch) and the flat Δ."""

    plan: RoundPlan
    before: Dict[str, Any]
    delta: torch.Tensor

    def of(self, plan: RoundPlan) -> bool:
        """Is `plan` the round of this step (its epoch and fragment)?"""
        return (plan.epoch, plan.fragment) == (self.plan.epoch, self.plan.fragment)


def carries_outer_params(epoch: int, fragments: int, every: int) -> bool:
    """Does the round of `epoch` carry θ_outer? Every `every`-th round of each fragment (never for every <= 0).
    The epoch alone decides, so every member of a round averages the same tensors (the simulator calls it too)."""
    return every > 0 and (epoch // fragments) % every == 0


class DiLoCoStrategy(AveragingStrategy):
    """H inner steps, then an outer step on the group's average pseudo-gradient.

    :param inner_steps: H, inner optimizer steps per outer step of each fragment
    :param outer_optimizer: factory `(list of tensors) -> torch.optim.Optimizer` over θ_outer; default
        `OuterOptimizer()` (SGD, Nesterov, lr 0.7, momentum 0.9), with error feedback SPARSE_OUTER_OPTIMIZER
    :param overlap: average Δ_t while computing the next epoch's inner steps (one-outer-step delay)
    :param pace: with overlap, spread each round's upload over most of the next epoch's compute (Streaming
        DiLoCo's overlap of a fragment's communication with the inner steps: a lower peak on the link); UserError
        without overlap (a round the peer waits for would only take longer)
    :param fragments: F, Streaming DiLoCo's fragments: an epoch of H/F inner steps averages one of them
        (1: plain DiLoCo). UserError unless a positive divisor of H; `bind` raises UserError when the model
        has fewer than F parameter tensors or error feedback is on (it averages every value every round)
    :param quorum: end an epoch early once trainers holding this share of the swarm's compute rate have ended
        theirs (see the module docstring); 0 (default): after H/F inner steps only. UserError outside [0, 1]
    :param outer_params_every: K: every K-th round of a fragment also averages θ_outer (module docstring); 0:
        never. UserError unless a non-negative integer
    :param average_outer: True: adopt the group's θ_outer in those rounds; "auto" (default): the same, except
        that with a lossy codec only when the swarm has more trainers than `group_size` or the members' θ_outer
        differed (their digests); False: never average
        θ_outer (as outer_params_every=0). UserError otherwise
    """

    name = "diloco"
    steps_locally = True
    catches_up_after_missed_round = True  # nothing else would bring a lone outer step back to the swarm's θ_outer
    rejoins_by_update = True  # ... but the group's Δ̄ (one round's bytes) does it as well, when a member has it

    def __init__(self, inner_steps: int = DEFAULT_INNER_STEPS, outer_optimizer: Optional[OuterOptimizerFactory] = None,
                 overlap: bool = False, fragments: int = 1, pace: bool = False, quorum: float = 0.0,
                 outer_params_every: int = DEFAULT_OUTER_PARAMS_EVERY, average_outer: Union[bool, str] = "auto"):
        if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
            raise UserError(f"inner_steps must be a positive integer, got {inner_steps!r}")
        if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
            raise UserError(f"fragments must be a positive integer, got {fragments!r}")
        if inner_steps % fragments:
            raise UserError(f"inner_steps ({inner_steps}) must be a multiple of fragments ({fragments}): "
                            f"each epoch is inner_steps / fragments inner steps")
        self.inner_steps, self.fragments = inner_steps, fragments
        self.steps_per_epoch = inner_steps // fragments
        self.outer_optimizer_given = outer_optimizer is not None
        self.outer_optimizer = outer_optimizer if outer_optimizer is not None else OuterOptimizer()
        if not callable(self.outer_optimizer):
            raise UserError("outer_optimizer must be a factory: (list of tensors) -> torch.optim.Optimizer")
        self.overlap = self.overlaps = bool(overlap)
        if pace and not self.overlap:
            raise UserError("pacing spreads a round's upload over the next epoch's compute: it needs overlap")
        self.paces_uploads = bool(pace)
        if isinstance(quorum, bool) or not isinstance(quorum, (int, float)) or not 0 <= quorum <= 1:
            raise UserError(f"quorum must be a share of the swarm's compute in [0, 1], got {quorum!r}")
        self.quorum = float(quorum)
        if isinstance(outer_params_every, bool) or not isinstance(outer_params_every, int) or outer_params_every < 0:
            raise UserError(f"outer_params_every must be a number of rounds >= 0, got {outer_params_every!r}")
        if average_outer not in ("auto", True, False):
            raise UserError(f"average_outer must be 'auto', True or False, got {average_outer!r}")
        self.outer_params_every, self.average_outer = outer_params_every, average_outer
        self.adopt_outer = False  # whether the last planned round's θ_outer average is adopted
        self.steps_this_epoch = 0
        self.planned = 0  # the fragment of the last plan: apply_alone(None) steps it
        self.planned_epoch = -1  # the epoch of the last plan
        self.kept: Dict[int, RoundUpdate] = {}  # fragment -> the Δ̄ of its last averaged round (kept_update)
        self._lone: Optional[LoneStep] = None  # the step taken alone on a Δ pending in an adopted state

    def bind(self, host: StrategyHost) -> None:
        super().bind(host)
        if self.fragments > 1 and host.error_feedback is not None:
            raise UserError("error feedback averages every value in every round: it does not combine with "
                            f"DiLoCo fragments ({self.fragments})")
        if host.error_feedback is not None and not self.outer_optimizer_given:
            # SparseLoCo: the decayed residual stands in for the outer momentum (residual_feedback.py).
            self.outer_optimizer = SPARSE_OUTER_OPTIMIZER
        self.buffer, self.delta = flat_buffer_views(host.params, 1)
        self.parts: List[Fragment] = make_fragments(host.params, self.buffer, self.delta, self.fragments,
                                                    self.outer_optimizer)
        # θ_outer copies, laid out as the Δ buffer (a fragment's copy is the same slice of it).
        self.with_outer = (host.error_feedback is None and self.average_outer is not False
                           and self.outer_params_every > 0)
        self.outer_copy = torch.zeros_like(self.buffer) if self.with_outer else None

    def on_micro_batch(self, batch_size: int) -> None:
        self.steps_this_epoch += 1

    def epoch_is_over(self) -> bool:
        """H/F inner steps since the last outer step (of any fragment)."""
        return self.steps_this_epoch >= self.steps_per_epoch

    def steps_to_epoch_end(self) -> int:
        return max(0, self.steps_per_epoch - self.steps_this_epoch)

    def plan_round(self, epoch: int, swarm: ProgressSnapshot) -> RoundPlan:
        self.steps_this_epoch = 0
        self.planned_epoch = epoch
        self.planned = epoch % self.fragments  # the swarm's epoch: every member averages the same fragment
        part = self.parts[self.planned]
        if self.overlap:
            # The epoch loop resolves a round before it plans the next, so a Δ still pending here was sent by no
            # round of this process (a checkpoint's or a donor's state): no average will come in this round, and its
            # outer step is taken on that Δ alone, as after a failed round, until the group's Δ̄ of it, fetched in
            # the background, replaces it (`lone_step`, `retake_lone_step`).
            for index, orphan in enumerate(self.parts):
                if orphan.outer.pending:
                    self._remember_lone_step(index, epoch - 1)
                    self._step_alone(orphan)
            part.outer.send(part.params, part.delta)
        else:
            part.outer.pseudo_gradient(part.params, part.delta)
        self.adopt_outer = False
        if not self._outer_round(epoch):
            return RoundPlan(tensors=(part.buffer,), averages=("pseudo_gradient",), fragment=self.planned,
                             epoch=epoch)
        copy = self._outer_copy(part)
        for view, anchor in zip(self._outer_views(part), part.outer.anchor):
            view.copy_(anchor)  # per tensor: copy_ crosses devices (a model spread over several), cat(out=) would not
        self.adopt_outer = self.average_outer is True or self.host.compression == "none" or \
            swarm.num_trainers > self.host.group_size
        return RoundPlan(tensors=(part.buffer, copy), averages=("pseudo_gradient", "outer_parameters"),
                         fragment=self.planned, epoch=epoch, digest=values_digest(copy))

    def _outer_round(self, epoch: int) -> bool:
        return self.with_outer and carries_outer_params(epoch, self.fragments, self.outer_params_every)

    def _outer_copy(self, part: Fragment) -> torch.Tensor:
        """`part`'s slice of the θ_outer copy (the slice its Δ has in the Δ buffer)."""
        start = part.buffer.storage_offset() - self.buffer.storage_offset()
        return self.outer_copy[start:start + part.buffer.numel()]

    def _outer_views(self, part: Fragment) -> List[torch.Tensor]:
        """`part`'s θ_outer copy, one view per parameter."""
        views, offset, copy = [], 0, self._outer_copy(part)
        for anchor in part.outer.anchor:
            views.append(copy[offset:offset + anchor.numel()].view_as(anchor))
            offset += anchor.numel()
        return views

    @torch.no_grad()
    def _adopt_outer(self, part: Fragment) -> float:
        """θ_outer <- the group's mean (this round's copy); -> how far this peer's θ_outer was from it."""
        averaged = self._outer_views(part)
        spread = param_spread(part.outer.anchor, averaged)
        for anchor, mean in zip(part.outer.anchor, averaged):
            anchor.copy_(mean)
        return spread

    @torch.no_grad()
    def apply_averaged(self, plan: RoundPlan, diverged: bool = False) -> Optional[float]:
        part = self.parts[plan.fragment]  # with overlap, the plan of the previous epoch: not `planned`
        self.kept[plan.fragment] = RoundUpdate.encode(part.buffer, epoch=plan.epoch, fragment=plan.fragment,
                                                      steps=part.outer.outer_steps,
                                                      compression=self.host.compression)
        # With overlap the previous epoch's plan: the epoch loop resolves a round before it plans the next, so
        # adopt_outer is still that plan's. Members whose θ_outer drifted apart adopt the mean whatever the codec.
        adopt = "outer_parameters" in plan.averages and (self.adopt_outer or diverged)
        spread = self._adopt_outer(part) if adopt else None
        self._outer_step(part, part.delta)
        return spread  # how far θ_outer was from the group's (rounds that adopt it), else None

    def kept_update(self, epoch: int) -> Optional[Dict[str, Any]]:
        """The Δ̄ this peer applied in its successful round of `epoch` (`RoundUpdate.to_state()`), while it is
        the latest of its fragment, with this peer's phase now: (epoch, inner steps into it)."""
        update = self.kept.get(epoch % self.fragments)
        if update is None or update.epoch != epoch:
            return None
        # This peer computes the epoch after its last plan's (with overlap too: a round is resolved at the next plan).
        return update.to_state(phase=(self.planned_epoch + 1, self.steps_this_epoch))

    @torch.no_grad()
    def fit_update(self, plan: RoundPlan, update: Any) -> Tuple[torch.Tensor, int]:
        """(the decoded Δ̄, inner steps to start the next epoch with) of another member's `kept_update` for
        `plan`'s round, checked against this peer's own Δ of the round (round_update.py says what fits), or for
        `lone_step()`'s round against the Δ that step was taken on; ValueError otherwise."""
        part = self.parts[plan.fragment]
        update = RoundUpdate.from_state(update)
        lone = self._lone if self._lone is not None and self._lone.of(plan) else None
        steps = lone.before["outer_steps"] if lone is not None else part.outer.outer_steps
        own = lone.delta if lone is not None else torch.cat([d.reshape(-1) for d in self._own_delta(part)])
        delta = update.check_fits(epoch=plan.epoch, fragment=plan.fragment, steps=steps, own=own)
        return delta, self._steps_to_skip(plan, update.phase)

    def lone_step(self) -> Optional[RoundPlan]:
        """With overlap: the round of the Δ that came pending with this peer's state and whose outer step it took
        alone at its last plan (see plan_round), until `retake_lone_step`."""
        return None if self._lone is None else self._lone.plan

    def _remember_lone_step(self, fragment: int, epoch: int) -> None:
        """Before the lone step on `fragment`'s pending Δ, sent at the end of `epoch` (this peer's state was its
        donor's or checkpoint's then): what `retake_lone_step` needs to take it again on the group's Δ̄."""
        outer = self.parts[fragment].outer
        if epoch < 0 or epoch % self.fragments != fragment:
            self._lone = None  # not the schedule's round: no update of it could fit
            return
        plan = RoundPlan(tensors=(self.parts[fragment].buffer,), averages=("pseudo_gradient",), fragment=fragment,
                         epoch=epoch)
        self._lone = LoneStep(plan, outer.before_step(), torch.cat([d.reshape(-1) for d in outer.pending_delta()]))

    @torch.no_grad()
    def retake_lone_step(self, plan: RoundPlan, fitted: Optional[Tuple[torch.Tensor, int]], undo: bool = False
                         ) -> bool:
        """Take `lone_step()`'s outer step again on the group's Δ̄ (a `fit_update` result for `plan`), from where
        it was taken: θ_outer becomes the group's, and the parameters and the pending Δ keep what was computed since.
        None: the lone step stands; `undo`: it is undone (the round being resolved is the group's round of `plan`'s
        epoch, whose Δ̄ takes that step). Forgets the lone step either way; -> whether it was retaken or undone."""
        lone, self._lone = self._lone, None
        if lone is None or (fitted is None and not undo) or not lone.of(plan):
            return False
        part = self.parts[plan.fragment]
        part.outer.retake(lone.before, None if undo else self._unflatten(fitted[0], part), part.params)
        return True

    @staticmethod
    def _unflatten(flat: torch.Tensor, part: Fragment) -> List[torch.Tensor]:
        """A flat fp32 Δ of `part`, one view per parameter, on each parameter's device."""
        views, offset = [], 0
        for d in part.delta:
            views.append(flat[offset:offset + d.numel()].view_as(d).to(d.device))
            offset += d.numel()
        return views

    def _steps_to_skip(self, plan: RoundPlan, phase: Optional[Tuple[int, int]]) -> int:
        """Inner steps into the epoch after `plan`'s at which a peer that took a donor's update starts it (without
        overlap), so that it meets that epoch's round in time: the donor's own steps into it, at most all but one
        (the epoch still ends by a step). A donor already past that epoch (its round of it under way: this peer
        learned late that it missed one, e.g. after a slow first micro-batch) means all but one: computing the
        whole epoch would make this peer as late for the next round too, and for every round after."""
        if self.overlap or phase is None:
            return 0
        donor_epoch, donor_steps = phase
        if donor_epoch == plan.epoch + 1:
            return min(donor_steps, self.steps_per_epoch - 1)
        return self.steps_per_epoch - 1 if donor_epoch > plan.epoch + 1 else 0

    @torch.no_grad()
    def apply_update(self, plan: RoundPlan, fitted: Tuple[torch.Tensor, int], carry: bool = True) -> None:
        """The outer step of `plan`'s fragment on the group's Δ̄ (`fit_update`'s), keeping this peer's own Δ of the
        round for its next one (`OuterState.apply_keeping_progress`: late work is carried, not dropped), and the
        next epoch starts as far in as the donor was. ValueError unless `carry`: spot checks, the one reason to drop
        it, need gradients mode (wiring.py refuses them with DiLoCo)."""
        if not carry:
            raise ValueError("DiLoCo carries a missed round's Δ into its next round")
        flat, steps = fitted
        part = self.parts[plan.fragment]
        part.outer.apply_keeping_progress(self._unflatten(flat, part), part.params)
        self.steps_this_epoch = max(self.steps_this_epoch, steps)

    def _outer_step(self, part: Fragment, delta: List[torch.Tensor]) -> None:
        """`part`'s outer step on the group's `delta`: the parameters restart from the new θ_outer (with overlap,
        plus the progress made since the round's Δ was taken)."""
        if self.overlap:
            part.outer.apply_delayed(delta, part.params)
        else:
            part.outer.apply(delta, part.params)

    def apply_alone(self, plan: Optional[RoundPlan]) -> None:
        """The outer step of the plan's fragment (plan None: the last planned one) on this peer's own Δ."""
        self._step_alone(self.parts[plan.fragment if plan is not None else self.planned])

    @torch.no_grad()
    def _step_alone(self, part: Fragment) -> None:
        """`part`'s outer step on this peer's own Δ (with overlap: its pending Δ, if any)."""
        if not self.overlap or part.outer.pending:
            self._outer_step(part, self._own_delta(part))

    def _own_delta(self, part: Fragment) -> List[torch.Tensor]:
        """This peer's own Δ of `part`'s current round (with overlap: the pending one, sent by a round).
        Recomputed rather than read from the buffer: an abandoned round may still be writing to it."""
        if self.overlap:
            return part.outer.pending_delta()
        own = [torch.empty_like(d) for d in part.delta]
        part.outer.pseudo_gradient(part.params, own)
        return own

    def settings(self) -> Dict[str, Any]:
        """What the join event line and every round result show of this strategy."""
        return {"inner_steps": self.inner_steps, "outer_optimizer": describe_outer_optimizer(self.outer_optimizer),
                "overlap": self.overlap, "pace": self.paces_uploads, "fragments": self.fragments, "quorum": self.quorum,
                "outer_params_every": self.outer_params_every if self.with_outer else 0,
                "delta_codec": self.host.compression}

    def state_dict(self) -> Dict[str, Any]:
        outer = [part.outer.state_dict() for part in self.parts]
        # One fragment: "outer" is the dict every earlier version wrote and reads, so that peers of either
        # version exchange states; they refuse a list (several fragments) as an unknown format.
        return {"outer": outer[0] if self.fragments == 1 else outer, "fragments": self.fragments,
                "steps_this_epoch": self.steps_this_epoch}

    def check_state_dict(self, state: Dict[str, Any]) -> None:
        self._outer_states(state)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._lone = None  # a step taken on the state being replaced
        outer = self._outer_states(state)
        # Every fragment's state is checked, and its optimizer built, before any fragment changes.
        optimizers = [part.outer.fitted_optimizer(s) for part, s in zip(self.parts, outer)]
        for part, s, optimizer in zip(self.parts, outer, optimizers):
            part.outer.adopt(s, optimizer)
        self.steps_this_epoch = state["steps_this_epoch"]

    def agreed_tensors(self, state: Dict[str, Any]) -> Dict[str, torch.Tensor]:
        """θ_outer of every fragment: members of one group hold the same after each outer step (bit for bit with codec
        none), whereas each one's parameters also hold its own inner steps since then (with overlap, two epochs' worth:
        early in training, honest donors' parameters differed by more than the cross-check's tolerance, measured)."""
        outer = self._outer_states(state)
        return {f"outer{f}.{i}": anchor for f, fragment in enumerate(outer)
                for i, anchor in enumerate(fragment["anchor"])}

    def _outer_states(self, state: Any) -> List[Dict[str, Any]]:
        """The outer state of each fragment in `state`, checked; ValueError unless the whole state fits."""
        if not isinstance(state, dict):
            raise ValueError("DiLoCo state: not a dict")
        fragments = state.get("fragments", 1)  # states from before fragments existed have one
        if fragments != self.fragments:
            raise ValueError(f"DiLoCo state of {fragments!r} fragments, this peer has {self.fragments}")
        steps = state.get("steps_this_epoch")
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= self.steps_per_epoch:
            raise ValueError("DiLoCo state: bad inner step count (another inner_steps or fragments setting?)")
        outer = [state.get("outer")] if self.fragments == 1 else state.get("outer")
        if not isinstance(outer, list) or len(outer) != self.fragments:
            raise ValueError(f"DiLoCo state: not one outer state per fragment ({self.fragments})")
        for part, fragment_state in zip(self.parts, outer):
            part.outer.check_state(fragment_state)
        return outer
