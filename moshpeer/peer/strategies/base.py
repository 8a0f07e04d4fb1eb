"""Averaging strategies: what a collaborative round averages and how its average is applied.

The optimizer's epoch loop (optimizer/epoch_loop.py) runs the epochs (progress toward the target batch,
catch-up, deadlines, the commit decision); an `AveragingStrategy` is everything that differs between averaging
modes, and carries its own options (e.g. `DiLoCoStrategy(inner_steps=50)`). Adding
a mode (e.g. DiLoCo) means adding one subclass and, if it should be selectable by name, one entry in
`moshpeer.peer.strategies.STRATEGIES`.

Life of a strategy inside a `CollaborativeOptimizer` (all calls from the training thread, and all but `bind`
and `epoch_is_over` under the optimizer's lock; `state_dict` also from the state server's thread, under it):

    bind(host)              once, before the averager exists: keep the host, allocate `buffer`
    buffer                  one flat fp32 tensor; the averager is built over [buffer] and every round
                            averages a list of views of it (the `RoundPlan`)
    on_micro_batch(n)       after each `step()` that accounted n samples (the gradients are already
                            added to host.grad_sums when `accumulates_gradients` is True)
    epoch_is_over()         True/False: the strategy counts the epoch itself; None: the optimizer does
    plan_round(epoch, swarm) the epoch is over: fill the buffer, say what this round averages
    apply_averaged(plan, diverged)
                            the round succeeded: the plan's tensors hold the group's (weighted) average;
                            make the model and the inner optimizer use it; returns the parameter spread
                            (||params - group mean|| / ||group mean|| before adopting) or None. `diverged`: the
                            members' digests of what they should hold alike differed (RoundPlan.digest); a
                            strategy that averages those values then adopts the group's mean of them, even where
                            it would not otherwise (a lossy codec's noise in a swarm that one group holds)
    apply_alone(plan)       no group (alone, timed out, failed): take this epoch's step from local data
    kept_update(epoch)      (strategies that `rejoins_by_update`) the update a successful round of `epoch`
                            applied, kept for peers that missed that round (the state server's thread, under
                            the optimizer's lock); None if not kept
    head_start()            samples of the epoch's share counted as done (a peer that took an update starts the
                            next epoch as far in as its donor was); 0 unless a strategy says otherwise
    fit_update(plan, u)     this peer's round of `plan` failed while others averaged it: check a kept update
                            fetched from one of them (ValueError if it does not fit); apply_update(plan, fitted)
                            then takes the group's step with it instead of apply_alone
    lone_step()             (overlapping strategies) the round of a contribution that came pending with an adopted
                            state and was stepped on alone at the last plan; the epoch loop fetches the group's
                            update of it in the background (lone_step_fetch.py), fitted by `fit_update`, and
    retake_lone_step(p, u)  takes that step again with it before the next round is resolved
    averaged_gradient(plan) the gradient of this epoch after a successful round, if the strategy averages
                            one (the DBLP phase signal uses it; else the local mean gradient is used)
    state_dict() / load_state_dict(state) / check_state_dict(state)
                            strategy state a newcomer or a checkpoint needs besides the model and the
                            inner optimizer (e.g. DiLoCo's anchor parameters and outer optimizer);
                            load_state_dict raises ValueError when the state does not fit, and then
                            changes nothing; check_state_dict only checks
    agreed_tensors(state)   what two honest donors' states hold alike, compared before a download is adopted
                            (None: the parameters; DiLoCo: θ_outer, since each donor's parameters also hold its
                            own inner steps since the last outer step)

The host (`StrategyHost`, in practice the `CollaborativeOptimizer`) offers: `params`, `inner` (the wrapped
torch optimizer), `grad_sums` (per parameter, gradients x samples summed over this epoch),
`samples_accumulated`, the averaging settings `compression`, `group_size` and `error_feedback` (an `ErrorFeedback`
state or None), and `inner_step()` (one inner optimizer step, counted in `local_steps`).

Failure: a strategy raises `UserError` from its constructor or `bind` for settings that cannot work; it
never sees the network (the averager checks everything that arrives) and its apply methods only do
tensor arithmetic on tensors it allocated.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

if TYPE_CHECKING:  # the swarm view a strategy is handed; strategies do not depend on the optimizer
    from moshpeer.peer.optimizer.progress import ProgressSnapshot



class StrategyHost(Protocol):
    """What a strategy may use of its optimizer (see the module docstring)."""

    params: List[torch.nn.Parameter]
    inner: torch.optim.Optimizer
    grad_sums: List[torch.Tensor]
    samples_accumulated: int
    compression: str
    group_size: int
    error_feedback: Any

    def inner_step(self) -> None: ...


@dataclass(frozen=True)
class RoundPlan:
    """What one round averages: `tensors` (views of the strategy's buffer, filled) and what they hold,
    e.g. ("gradients",) or ("gradients", "parameters"); the round result reports `averages`. `fragment`: which
    part of the model the round covers, for strategies that average one part per round (DiLoCo's fragments;
    the apply methods read it, since an overlapped round is applied after the next plan); 0 for the others.
    `digest`: `values_digest` of values in `tensors` that the members should already hold bit for bit alike (DiLoCo's
    θ_outer; not gradients mode's parameters, which each member's own inner optimizer moves), told to the group so
    that members whose copies drifted apart (a missed step, a lost chunk) are found and brought back together
    (`apply_averaged(plan, diverged)`); b"": none in this round."""

    tensors: Tuple[torch.Tensor, ...]
    averages: Tuple[str, ...]
    epoch: int  # the collaborative epoch of the round (a kept update is found by it: no default to forget)
    fragment: int = 0
    digest: bytes = b""


class AveragingStrategy(abc.ABC):
    """One averaging mode of `CollaborativeOptimizer`; see the module docstring for the call order."""

    name: ClassVar[str]
    # step() adds each micro-batch's gradients, times its samples, to host.grad_sums.
    accumulates_gradients: ClassVar[bool] = False
    # Every step() is an inner optimizer step (local SGD); else the inner optimizer steps at the epoch end.
    steps_locally: ClassVar[bool] = False
    # The optimizer runs this strategy's round in the background and resolves it (apply_averaged or
    # apply_alone) at the next epoch end, before the next plan_round, while the peer computes (DiLoCo's
    # one-outer-step delay).
    overlaps: bool = False
    # An overlapped round spreads its upload over most of the next epoch's compute instead of bursting at the
    # link's rate (pacing.py; `RoundTiming.upload_spread`).
    paces_uploads: bool = False
    # A strategy that counts its own epochs may end one early, with the inner steps it has, once trainers
    # holding this share of the swarm's compute rate have ended theirs (round_timing.quorum_eta_s); 0: never.
    quorum: float = 0.0
    # A peer whose round failed while the others averaged downloads their state instead of stepping alone:
    # for strategies whose state would otherwise differ from the swarm's for good (DiLoCo's θ_outer).
    catches_up_after_missed_round: ClassVar[bool] = False
    # Such a peer first asks one of them for the update the group applied (kept_update): one round's bytes
    # instead of a whole state (DiLoCo's Δ̄). A strategy may rejoin by update without catching up: when no update
    # fits, it steps alone (gradients mode, whose lone step only leaves it apart until a parameters round).
    rejoins_by_update: ClassVar[bool] = False

    host: StrategyHost
    buffer: torch.Tensor

    def bind(self, host: StrategyHost) -> None:
        """Attach to an optimizer and allocate `buffer` (once, before the averager is built)."""
        self.host = host

    def on_micro_batch(self, batch_size: int) -> None:
        """After each step() of `batch_size` samples (gradients accounted, local step taken)."""

    def epoch_is_over(self) -> Optional[bool]:
        """Whether the epoch is over by this strategy's own count (e.g. DiLoCo's H inner steps); None: the
        optimizer decides (this peer's share of the target batch, the swarm's progress)."""
        return None

    def head_start(self) -> int:
        """Samples of this epoch's share of the target batch that count as done without this peer computing them
        (when the optimizer decides the epoch's end): a peer that took its group's update after missing a round
        starts the next epoch as far in as its donor was, so that it meets that epoch's round. 0: none."""
        return 0

    def steps_to_epoch_end(self) -> Optional[int]:
        """Micro-batches left until `epoch_is_over` says True by this strategy's own count; None when the
        optimizer decides (sets how often the swarm's progress is read: progress_cadence.py)."""
        return None

    @abc.abstractmethod
    def plan_round(self, epoch: int, swarm: ProgressSnapshot) -> RoundPlan:
        """Fill the buffer for this epoch's round and say what it averages."""

    @abc.abstractmethod
    def apply_averaged(self, plan: RoundPlan, diverged: bool = False) -> Optional[float]:
        """Apply a successful round (the plan's tensors hold the average; `diverged`: see the module docstring);
        returns the parameter spread."""

    @abc.abstractmethod
    def apply_alone(self, plan: Optional[RoundPlan]) -> None:
        """This epoch ends without a group: step on local data (plan is None if none was made)."""

    def kept_update(self, epoch: int) -> Optional[Any]:
        """The update a successful round of `epoch` applied, if this strategy keeps it (`rejoins_by_update`)."""
        return None

    def update_restores(self, plan: RoundPlan) -> bool:
        """Whether another member's kept update of `plan`'s round can stand for that round in a peer that missed it:
        `rejoins_by_update` by default."""
        return self.rejoins_by_update

    def needs_state_after_missing(self, plan: RoundPlan) -> bool:
        """Whether a peer that missed `plan`'s round and took no update must take the group's state rather than a
        lone step (nothing else would bring it back to the group's): `catches_up_after_missed_round` by default."""
        return self.catches_up_after_missed_round

    def fit_update(self, plan: RoundPlan, update: Any) -> Any:
        """What `apply_update` takes, if another peer's kept update of `plan`'s round fits this peer; ValueError
        saying why not otherwise (then nothing changed)."""
        raise ValueError(f"the {self.name} strategy does not rejoin by update")

    def apply_update(self, plan: RoundPlan, fitted: Any, carry: bool = True) -> None:
        """Take the group's step of `plan`'s round with a `fit_update` result, as `apply_averaged` would have; this
        peer's own work of the round, which the group's average lacks, is kept for its next contribution (`carry`),
        or dropped (a run whose contributions must stay recomputable by spot checks; ValueError from a strategy
        that cannot drop it)."""
        raise NotImplementedError

    def lone_step(self) -> Optional[RoundPlan]:
        """The round whose step this peer took alone at its last plan because its adopted state (a donor's, a
        checkpoint's) came with its contribution to that round pending, while the group's update of that round may
        still replace it (`retake_lone_step`); None (default): none."""
        return None

    def retake_lone_step(self, plan: RoundPlan, fitted: Optional[Any], undo: bool = False) -> bool:
        """Take `lone_step()`'s step again with the group's update of `plan`'s round (a `fit_update` result; None:
        the lone step stands; `undo`: undo it, the round being resolved is the group's round of `plan`'s epoch),
        keeping what was computed since; forget it either way. -> whether it was retaken or undone."""
        return False

    def averaged_gradient(self, plan: RoundPlan) -> Optional[Sequence[torch.Tensor]]:
        """This epoch's averaged gradient after a successful round, if the round averaged one."""
        return None

    def state_dict(self) -> Dict[str, Any]:
        """Strategy state that travels with checkpoints and downloaded states (tensors are copies)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Adopt a `state_dict()`; ValueError (and nothing changed) when it does not fit."""
        self.check_state_dict(state)

    def check_state_dict(self, state: Dict[str, Any]) -> None:
        """ValueError unless `state` is a `state_dict()` this strategy can adopt (a donor's, a checkpoint's)."""
        if state:
            raise ValueError(f"{self.name} strategy keeps no state, got {sorted(state)}")

    def agreed_tensors(self, state: Dict[str, Any]) -> Optional[Dict[str, torch.Tensor]]:
        """The tensors of a donor's `state_dict()` (checked) that honest donors hold alike, for the cross-check of a
        download between two donors; None (default): their parameters are what they hold alike."""
        return None

    def settings(self) -> Dict[str, Any]:
        """This strategy's settings as the join event line and every round result show them."""
        return {}
