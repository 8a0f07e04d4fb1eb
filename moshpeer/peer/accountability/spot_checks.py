"""Spot checks: an owner recomputes what one member of its group sent and distrusts it on a mismatch.

Robust aggregation judges a contribution by how it sits among the others; a member that stays inside the rules
(a plausible gradient of other data, a stale one, zeros with a full weight) passes it. With a data assignment
(assignment.py) what a member should have sent is a fact anyone can recompute: the mean gradient of the first W
samples of its assigned stream at the epoch's parameters, W its declared weight. So after a round, with
probability `rate`, the trainer takes the contribution its averager kept of one other member, drawn in secret
(`RoundResult.sample`: that member's values of the part this peer owned), recomputes it at the parameters this
peer held during the epoch, and compares (`compare`). A failed check makes the averager's `SuspectTracker` weigh
the member at zero until a later check passes (suspects.py); the trainer says so in a `spot_check` event.

Cost: a check recomputes the member's whole contribution (its W samples), so at `rate` r in a swarm of equal peers
checks take about r of a peer's compute (`SpotCheck.samples` counts it). Tolerance: the checker's parameters equal
the member's when they averaged in the same groups (gradients mode); drift between groups and a lossy codec add a
relative error, which `TOLERANCE` leaves room for (docs/security.md has the measured errors).

A check is skipped, not failed, when the checker cannot do it fairly: the member declared another epoch than the
checker's (this peer holds only its own epoch's parameters), or the part holds no gradients (a parameters round's
second half). An honest member is rarely an epoch off its group, so the MAX_OTHER_EPOCH_SKIPS-th such skip of one
member in a row fails: declaring another epoch is no way around the checks either. A member that declares no work in
a run with spot checks, a weight that is not its samples, or values that differ fails; so does one that claims more
than MAX_WORK_FACTOR times the checker's own samples: a claim nobody can afford to recompute would otherwise be a
way never to be checked (robust aggregation credits no member with more than the group's median weight anyway). The
price: in a run with spot checks, a peer more than MAX_WORK_FACTOR times faster than a checker fails that checker's
checks.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from moshpeer.averaging.report import ContributionSample
from moshpeer.bounded_memory import remember
from moshpeer.errors import UserError
from moshpeer.peer.accountability.assignment import assigned_batches
from moshpeer.peer.optimizer.rounds import CollaborativeRound
from moshpeer.peer.tasks.protocol import Task

logger = logging.getLogger(__name__)

TOLERANCE = 0.25  # largest ||sent - recomputed|| / ||recomputed|| that passes
MAX_WORK_FACTOR = 8.0
MAX_OTHER_EPOCH_SKIPS = 3
MAX_TRACKED_PEERS = 1024  # members whose other-epoch skips are counted (the oldest forgotten first)

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass(frozen=True)
class SpotCheck:
    """One check: of whom, for which epoch, its outcome (PASSED, FAILED or SKIPPED) and why, the relative error
    found, and what it cost (samples recomputed, seconds)."""

    peer_id: str
    epoch: int
    outcome: str
    reason: str = ""
    relative_error: Optional[float] = None
    samples: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"peer": self.peer_id, "epoch": self.epoch, "outcome": self.outcome, "reason": self.reason,
                "relative_error": None if self.relative_error is None else round(self.relative_error, 5),
                "samples": self.samples, "seconds": round(self.seconds, 4)}


def compare(sent: torch.Tensor, recomputed: torch.Tensor, tolerance: float = TOLERANCE) -> Optional[float]:
    """The relative error ||sent - recomputed|| / ||recomputed|| over the values that arrived (`sent` is NaN where
    its chunk did not), or None when none arrived. A check passes at most `tolerance`."""
    arrived = ~torch.isnan(sent)
    if not bool(arrived.any()):
        return None
    sent, recomputed = sent[arrived].double(), recomputed[arrived].double()
    scale = float(recomputed.norm())
    error = float((sent - recomputed).norm())
    if not math.isfinite(error):
        return math.inf
    return error / scale if scale > 0 else (0.0 if error == 0 else math.inf)


class SpotChecker:
    """A trainer's spot checks (see the module docstring).

    :param task: the run's task (its batches and loss recompute a member's contribution)
    :param run_id: the run (part of every assignment's seed)
    :param params: the task model's parameters in the order the gradients round lays them out (the wrapped
        optimizer's); ValueError for one that is not the model's
    :param rate: probability of checking the sampled contribution after a round, in [0, 1]
    :param rng: where the decisions come from (default: seeded by the OS: members cannot predict them)
    """

    def __init__(self, task: Task, run_id: str, params: Sequence[torch.nn.Parameter], rate: float, *,
                 rng: Optional[random.Random] = None, tolerance: float = TOLERANCE):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"spot-check rate must be within [0, 1], got {rate}")
        self.task, self.run_id, self.params, self.rate, self.tolerance = task, run_id, list(params), rate, tolerance
        self.rng = rng or random.SystemRandom()
        self._epoch: Optional[int] = None
        # A copy of the model holding the parameters of `_epoch` as this peer trained on them: checks compute on it,
        # never on the live model (which the state server and checkpoints read meanwhile). Made at the first epoch.
        self._model: Optional[torch.nn.Module] = None
        self._params: List[torch.nn.Parameter] = []  # the copy's, in `params` order
        self.checks_run = self.samples_checked = 0  # checks made and the samples they recomputed (their cost)
        self._other_epoch: Dict[str, int] = {}  # member -> checks in a row skipped for declaring another epoch

    def start_epoch(self, epoch: int) -> None:
        """Keep the parameters of `epoch` (call before its first micro-batch; nothing happens within an epoch)."""
        if epoch == self._epoch or self.rate == 0:
            return
        if self._model is None:
            self._model = copy.deepcopy(self.task.model)
            own = dict(self._model.named_parameters())
            names = {id(p): name for name, p in self.task.model.named_parameters()}
            if any(id(p) not in names for p in self.params):
                raise ValueError("spot checks need the optimizer's parameters to be the task model's")
            self._params = [own[names[id(p)]] for p in self.params]
        with torch.no_grad():
            self._model.load_state_dict(self.task.model.state_dict())
        self._epoch = epoch

    def after_round(self, round_: CollaborativeRound, own_samples: Optional[int] = None) -> Optional[SpotCheck]:
        """Maybe check the contribution the round sampled -> the check, or None when none ran."""
        result = round_.result
        if result is None or not result.ok or result.sample is None or self.rng.random() >= self.rate:
            return None
        check = self.check(result.sample, round_.epoch, own_samples if own_samples is not None else round_.samples)
        self.checks_run += 1
        self.samples_checked += check.samples
        return check

    def check(self, sample: ContributionSample, epoch: int, own_samples: int) -> SpotCheck:
        """Recompute `sample`'s member's contribution of `epoch` and compare (module docstring)."""
        started = time.monotonic()

        def verdict(outcome: str, reason: str = "", error: Optional[float] = None, samples: int = 0) -> SpotCheck:
            return SpotCheck(sample.peer_id, epoch, outcome, reason, error, samples, time.monotonic() - started)

        if sample.weight == 0:
            return verdict(SKIPPED, "weight 0: it contributes nothing (an aux peer)")
        if sample.work is None:
            return verdict(FAILED, "declared no work")
        declared_epoch, batch_size = sample.work
        if declared_epoch != epoch or self._epoch != epoch:
            if declared_epoch != epoch and self._count_other_epoch(sample.peer_id) >= MAX_OTHER_EPOCH_SKIPS:
                return verdict(FAILED, f"declared another epoch than ours in {MAX_OTHER_EPOCH_SKIPS} checks in a row")
            return verdict(SKIPPED, f"declared epoch {declared_epoch}; this peer holds the parameters of {self._epoch}")
        self._other_epoch.pop(sample.peer_id, None)
        samples = sample.weight
        if samples != int(samples) or samples < 1:
            return verdict(FAILED, f"weight {samples} is not a sample count")
        samples = int(samples)
        if samples > MAX_WORK_FACTOR * max(own_samples, 1):
            return verdict(FAILED, f"claims {samples} samples: more than {MAX_WORK_FACTOR:g}x this peer's "
                                   f"{own_samples}")
        if batch_size > samples:  # (which also bounds what a recomputation may cost: under 2x the samples)
            return verdict(FAILED, f"declared micro-batches of {batch_size} for {samples} samples")
        numel = sum(p.numel() for p in self.params)
        end = min(sample.start + sample.values.numel(), numel)
        if sample.start >= end:
            return verdict(SKIPPED, "the part holds no gradients")
        try:
            recomputed, counted = self._recompute(sample.peer_id, epoch, batch_size, samples)
        except UserError as e:  # e.g. a declared batch size the task's data cannot give
            return verdict(FAILED, f"its declared work cannot be recomputed: {e}")
        if recomputed is None:
            return verdict(FAILED, f"its batches hold {counted} samples, not the {samples} it declared", samples=counted)
        error = compare(sample.values[:end - sample.start], recomputed[sample.start:end].cpu(), self.tolerance)
        if error is None:
            return verdict(SKIPPED, "none of its chunks arrived", samples=samples)
        if error > self.tolerance:
            return verdict(FAILED, f"relative error {error:.3g} over {self.tolerance:g}", error, samples)
        return verdict(PASSED, "", error, samples)

    def _count_other_epoch(self, peer_id: str) -> int:
        count = self._other_epoch.get(peer_id, 0) + 1
        remember(self._other_epoch, peer_id, count, limit=MAX_TRACKED_PEERS)
        return count

    def _recompute(self, peer_id: str, epoch: int, batch_size: int, samples: int):
        """The mean gradient of `peer_id`'s first `samples` assigned samples of `epoch` at this peer's parameters of
        that epoch (on the copy), flat in `params` order -> (it, samples) or (None, samples counted) when its
        batches do not add up to `samples`."""
        model, params = self._model, self._params
        total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
        counted = 0
        stream = assigned_batches(self.task, self.run_id, peer_id, epoch, batch_size)
        with torch.enable_grad():
            while counted < samples:
                loss, count = self.task.loss(model, next(stream))
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                total.add_(torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float()
                                      for g, p in zip(grads, params)]), alpha=float(count))
                counted += count
        if counted != samples:
            return None, counted
        return total.div_(samples), counted

