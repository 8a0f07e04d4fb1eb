"""DiLoCo's outer loop: the outer parameters, the outer optimizer and the pseudo-gradient.

DiLoCo (Douillard et al., 2023) trains in rounds of H inner steps. Every peer starts a round from the
shared outer parameters θ_outer, takes H steps with its inner optimizer (AdamW), and the peers then
average the pseudo-gradient Δ = θ_outer − θ_local. An outer optimizer (SGD with Nesterov momentum, lr
0.7, momentum 0.9 in the paper) treats the averaged Δ as a gradient of θ_outer:

    Δ_i    = θ_outer − θ_local_i                     (`OuterState.pseudo_gradient`)
    Δ̄      = mean_i Δ_i                              (a Moshpit group's all-reduce, any codec)
    θ_outer ← OuterOpt(θ_outer, Δ̄)                   (`OuterState.apply`)
    θ_local ← θ_outer                                 every peer restarts from the same point

The outer step is linear in Δ̄ for a given optimizer state (SGD, momentum, Nesterov), so an unbiased
estimate of Δ̄ (the averager's loss-tolerant reconstruction) gives an unbiased outer step, and a chunk
of Δ̄ that never arrived is this peer's own Δ there (the averager keeps a peer's own value).

One-outer-step delay (overlap): the peer does not wait for Δ̄_t. It sends Δ_t, remembers where it was
(θ_sent) and goes on with the next H inner steps; when Δ̄_t is in, it takes the outer step and moves its
parameters onto the new θ_outer while keeping the local progress made since sending:

    θ_local ← θ_outer_new + (θ_local − θ_sent)        (`OuterState.apply_delayed`)

The next pseudo-gradient θ_outer_new − θ_local is then exactly that local progress, so every inner step
enters exactly one Δ (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", the
one-step-delayed variant with τ = H; Kale et al. 2025, "Eager updates"). The state of a pending Δ
(θ_sent) is part of `state_dict()`: a peer restarted from a checkpoint takes the outer step for it on its
own Δ (the round's result died with the old process).

Everything is fp32 and on the parameters' device. `load_state_dict` raises ValueError for a state that
does not fit (shapes, dtypes, non-finite values); nothing changes then.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from moshpeer.errors import UserError
from moshpeer.peer.tensor_checks import check_tensor_values, validate_optimizer_state

OuterOptimizerFactory = Callable[[List[torch.Tensor]], torch.optim.Optimizer]

OUTER_KINDS = ("nesterov", "sgd", "adam")
STATE_FORMAT = 1


@dataclass(frozen=True)
class OuterOptimizer:
    """A factory of the outer optimizer over θ_outer. Default: the paper's SGD with Nesterov momentum,
    lr 0.7, momentum 0.9. kind: "nesterov" (SGD, Nesterov momentum), "sgd" (SGD, heavy-ball momentum;
    momentum 0 and lr 1 is plain averaging of the local models, i.e. local SGD), "adam" (Adam with
    betas (momentum, 0.999))."""

    kind: str = "nesterov"
    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if self.kind not in OUTER_KINDS:
            raise UserError(f"outer optimizer must be one of {', '.join(OUTER_KINDS)}, got {self.kind!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise UserError(f"outer learning rate must be positive, got {self.lr}")
        if not (0.0 <= self.momentum < 1.0) or (self.kind == "nesterov" and self.momentum == 0.0):
            raise UserError(f"outer momentum must be in [0, 1) (> 0 for nesterov), got {self.momentum}")

    def __call__(self, params: List[torch.Tensor]) -> torch.optim.Optimizer:
        if self.kind == "adam":
            return torch.optim.Adam(params, lr=self.lr, betas=(self.momentum, 0.999))
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=self.kind == "nesterov")

    def describe(self) -> str:
        """The spec `parse_outer_optimizer` reads back, e.g. "nesterov:lr=0.7,momentum=0.9"."""
        return f"{self.kind}:lr={self.lr:g},momentum={self.momentum:g}"


def parse_outer_optimizer(spec: str) -> OuterOptimizer:
    """`KIND[:lr=X,momentum=Y]` (the CLI's --outer-optimizer), e.g. "nesterov", "sgd:lr=1,momentum=0";
    UserError for anything else."""
    kind, _, options = spec.strip().partition(":")
    values: Dict[str, float] = {}
    for item in filter(None, (part.strip() for part in options.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in ("lr", "momentum"):
            raise UserError(f"outer optimizer options are lr=X and momentum=Y, got {item!r} in {spec!r}")
        try:
            values[key] = float(value)
        except ValueError:
            raise UserError(f"outer optimizer option {key} must be a number, got {value!r}") from None
    return OuterOptimizer(kind=kind, **values)


def describe_outer_optimizer(factory: OuterOptimizerFactory) -> str:
    """A short name of an outer-optimizer factory for event lines and round results."""
    describe = getattr(factory, "describe", None)
    return describe() if callable(describe) else getattr(factory, "__name__", type(factory).__name__)


class OuterState:
    """θ_outer and the outer optimizer of one peer (see the module docstring).

    :param params: the model's parameters; θ_outer starts as an fp32 copy of them
    :param outer_optimizer: a factory `(list of tensors) -> torch.optim.Optimizer`
    """

    def __init__(self, params: Sequence[torch.Tensor], outer_optimizer: OuterOptimizerFactory = OuterOptimizer()):
        self.anchor: List[torch.Tensor] = [p.detach().to(torch.float32).clone() for p in params]
        self.outer_optimizer = outer_optimizer
        self.optimizer = outer_optimizer(self.anchor)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise UserError(f"the outer optimizer factory must return a torch.optim.Optimizer, "
                            f"got {type(self.optimizer).__name__}")
        self.outer_steps = 0
        # Overlap: where the parameters were when the pending Δ was taken (None: nothing pending).
        self.sent: Optional[List[torch.Tensor]] = None

    # ---- the outer step -------------------------------------------------------------------------

    @torch.no_grad()
    def pseudo_gradient(self, params: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
        """out <- θ_outer − params (fp32), one tensor per parameter."""
        for target, anchor, p in zip(out, self.anchor, params):
            target.copy_(anchor).sub_(p.detach().to(torch.float32))

    @torch.no_grad()
    def outer_step(self, delta: Sequence[torch.Tensor]) -> None:
        """θ_outer <- OuterOpt(θ_outer, delta): delta is the (averaged) pseudo-gradient."""
        for anchor, d in zip(self.anchor, delta):
            anchor.grad = d.to(device=anchor.device, dtype=torch.float32)
        try:
            self.optimizer.step()
        finally:
            for anchor in self.anchor:
                anchor.grad = None  # the averaging buffer stays ours alone
        self.outer_steps += 1

    @torch.no_grad()
    def apply(self, delta: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        """The outer step on `delta`, then params <- θ_outer (the next round starts from it)."""
        self.outer_step(delta)
        for p, anchor in zip(params, self.anchor):
            p.copy_(anchor)

    # ---- one-outer-step delay -------------------------------------------------------------------

    @torch.no_grad()
    def send(self, params: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
        """Overlap: out <- θ_outer − params, and remember params as θ_sent for `apply_delayed`.
        ValueError if a pending Δ was not applied first."""
        if self.sent is not None:
            raise ValueError("a pseudo-gradient is still pending: apply_delayed() it first")
        self.pseudo_gradient(params, out)
        self.sent = [p.detach().to(torch.float32).clone() for p in params]

    @property
    def pending(self) -> bool:
        """Whether a Δ was sent and its outer step is still to be taken (overlap)."""
        return self.sent is not None

    @torch.no_grad()
    def pending_delta(self) -> List[torch.Tensor]:
        """This peer's own pending Δ (θ_outer − θ_sent): the outer step's input when its round failed."""
        if self.sent is None:
            raise ValueError("no pseudo-gradient is pending")
        return [anchor - sent for anchor, sent in zip(self.anchor, self.sent)]

    @torch.no_grad()
    def apply_delayed(self, delta: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        """The outer step on the pending round's `delta`, then params <- θ_outer + (params − θ_sent):
        the local progress since sending is kept. ValueError if nothing is pending."""
        if self.sent is None:
            raise ValueError("no pseudo-gradient is pending")
        self.outer_step(delta)
        for p, anchor, sent in zip(params, self.anchor, self.sent):
            p.add_((anchor - sent).to(dtype=p.dtype))
        self.sent = None

    @torch.no_grad()
    def apply_keeping_progress(self, delta: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        """The outer step on `delta`, a group's Δ̄ that this peer's own Δ is not in (it missed the round), keeping
        every local step: params <- θ_outer_new + (params − θ_outer_old). This peer's own Δ of the missed round,
        pending or not, then enters its next pseudo-gradient instead of being lost; nothing is pending after."""
        before = [anchor.clone() for anchor in self.anchor]
        self.outer_step(delta)
        for p, anchor, old in zip(params, self.anchor, before):
            p.add_((anchor - old).to(dtype=p.dtype))
        self.sent = None

    def before_step(self) -> Dict[str, Any]:
        """Copies of θ_outer, the outer optimizer's state and the outer step count: what `retake` starts from."""
        return {"anchor": [a.detach().clone() for a in self.anchor],
                "optimizer": copy.deepcopy(self.optimizer.state_dict()), "outer_steps": self.outer_steps}

    @torch.no_grad()
    def retake(self, before: Dict[str, Any], delta: Optional[Sequence[torch.Tensor]],
               params: Sequence[torch.Tensor]) -> None:
        """Take the last outer step again, from `before` (`before_step()` just ahead of it) on `delta` instead (None:
        undo it), and move the parameters, and θ_sent if a Δ is pending, by what that changes of θ_outer: the inner
        steps taken since, and the pending Δ (θ_outer − θ_sent), stay as they were."""
        taken = [anchor.clone() for anchor in self.anchor]
        for anchor, value in zip(self.anchor, before["anchor"]):
            anchor.copy_(value)
        self.optimizer.load_state_dict(copy.deepcopy(before["optimizer"]))
        self.outer_steps = before["outer_steps"]
        if delta is not None:
            self.outer_step(delta)
        for i, (p, anchor, old) in enumerate(zip(params, self.anchor, taken)):
            shift = anchor - old
            p.add_(shift.to(dtype=p.dtype))
            if self.sent is not None:
                self.sent[i].add_(shift)

    # ---- state ----------------------------------------------------------------------------------

    @torch.no_grad()
    def reset(self, params: Sequence[torch.Tensor]) -> None:
        """Start over from `params`: θ_outer <- params, fresh outer optimizer, nothing pending."""
        for anchor, p in zip(self.anchor, params):
            anchor.copy_(p.detach())
        self.optimizer = self.outer_optimizer(self.anchor)
        self.outer_steps = 0
        self.sent = None

    def state_dict(self) -> Dict[str, Any]:
        """Copies of θ_outer, the outer optimizer's state (momentum), the outer step count and θ_sent."""
        return {"format": STATE_FORMAT, "anchor": [a.detach().clone() for a in self.anchor],
                "optimizer": copy.deepcopy(self.optimizer.state_dict()), "outer_steps": self.outer_steps,
                "sent": None if self.sent is None else [s.clone() for s in self.sent]}

    def check_state(self, state: Any) -> None:
        """ValueError unless `state` is an `OuterState.state_dict()` for these parameters."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError("unknown DiLoCo outer state format")
        if not isinstance(state.get("outer_steps"), int) or state["outer_steps"] < 0:
            raise ValueError("DiLoCo outer state: bad outer step count")
        if not isinstance(state.get("optimizer"), dict):
            raise ValueError("DiLoCo outer state: no outer optimizer state")
        for name in ("anchor", "sent"):
            tensors = state.get(name)
            if tensors is None and name == "sent":
                continue
            _check_tensors(name, tensors, self.anchor)
        # The checks a model's optimizer state gets (shapes that fit θ_outer, finite values of plausible size): a
        # momentum of 1e30 made the parameters inf at the first outer step, a misshaped one raised there (issue 26).
        validate_optimizer_state(self.optimizer.state_dict(), self.anchor, state["optimizer"])

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Adopt a `state_dict()`; ValueError (and nothing changed) when it does not fit."""
        self.adopt(state, self.fitted_optimizer(state))

    def fitted_optimizer(self, state: Dict[str, Any]) -> torch.optim.Optimizer:
        """`check_state`, then a fresh outer optimizer over θ_outer holding `state`'s optimizer state, for
        `adopt`. ValueError when the state does not fit; changes nothing either way."""
        self.check_state(state)
        optimizer = self.outer_optimizer(self.anchor)
        try:
            optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        except (KeyError, ValueError, RuntimeError) as e:
            raise ValueError(f"DiLoCo outer optimizer state does not fit: {e}") from None
        return optimizer

    @torch.no_grad()
    def adopt(self, state: Dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """Take `state` with its `fitted_optimizer(state)` (split from loading so that several outer states
        are all checked before any changes); cannot fail."""
        for anchor, value in zip(self.anchor, state["anchor"]):
            anchor.copy_(value)
        self.optimizer = optimizer
        self.outer_steps = int(state["outer_steps"])
        self.sent = None if state["sent"] is None else [s.detach().to(torch.float32).clone() for s in state["sent"]]


def _check_tensors(name: str, tensors: Any, like: Sequence[torch.Tensor]) -> None:
    if not isinstance(tensors, (list, tuple)) or len(tensors) != len(like):
        raise ValueError(f"DiLoCo outer state: {name} has the wrong number of tensors")
    for value, ours in zip(tensors, like):
        if not isinstance(value, torch.Tensor) or value.shape != ours.shape or value.dtype != torch.float32:
            raise ValueError(f"DiLoCo outer state: a tensor of {name} does not fit the model")
        check_tensor_values(f"DiLoCo outer {name}", value, ours)  # finite, of plausible size (1e30 is not)
