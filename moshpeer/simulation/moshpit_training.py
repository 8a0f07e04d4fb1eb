"""The swarm training with Moshpit groups (`MoshpitTraining`): the training level's system under test.

**Modes** (the production strategies, `moshpeer/peer/strategies/`):

- `gradients`: each round = one step: the peer's minibatch gradient is averaged in its group and applied with
  SGD; every `DEFAULT_PARAMS_EVERY` rounds the parameters are averaged too (as `GradientsStrategy` does).
- `parameters`: one local SGD step, then the parameters are averaged in the group.
- `diloco`: H inner SGD steps, then the pseudo-gradient Δ = θ_outer - θ_local is averaged in the group and the
  production `OuterState` (SGD, Nesterov, lr 0.7, momentum 0.9: `OuterOptimizer()`) takes the outer step, on
  all peers' rows at once; every `outer_params_every`-th round the group averages θ_outer too and its members adopt
  it first (production `carries_outer_params`). A peer with no group steps on its own Δ (`DiLoCoStrategy.apply_alone`).

**One round** (`MoshpitTraining.step`), for the peers up at its start:

1. compute: each peer's clock advances by steps x batch / speed: H steps (diloco; 1 in the other modes), or
   with a `quorum` fewer, as production's quorum ends an epoch (`round_timing.quorum_time` over the peers' due
   times and speeds), and its contribution weighs the samples it holds. A peer whose failure time falls inside
   fails there: the work since its last completed round is lost, it is down for Exp(rejoin_s) (or for good,
   with probability `never_return`), and it takes no part in the round.
2. grouping: the key rule as the averaging level models it (`grid.assemble_groups` on the peers' group keys), then
   the matchmaking window (`matchmaking_window.form_groups`): a group keeps its largest set of members ready within
   its window of each other: `matchmaking_window_s`, longer when production's straggler hold
   (`RoundTiming.straggler_hold`) keeps it open for the swarm's last trainer still computing, by the records. An
   earlier member waited the window in vain and steps alone; a later one found the group gone: in DiLoCo and
   gradients mode it takes the group's update as production does (`rejoins_by_update`: the group's Δ̄ or averaged
   gradient from a member after the round, its own work carried into its next round), in parameters mode it steps
   alone. A group smaller than `min_group_size` does not assemble. Rounds are numbered swarm-wide: every peer takes
   part in each round it is up for, so a fast peer waits for its group's slowest member (H steps unless a quorum ends
   the epoch; DropCompute's budget is not modelled).
3. the group round starts when its last member is ready, after matchmaking ((2 + log2 N) round trips of the
   slowest member's RTT: DHT lookup, join request, leader's reply). Its data-plane time is the bandwidth model
   of `group_round_seconds` over the production part sizes (`partition.bandwidth_part_sizes`) of a vector of
   `model_params` values; with `chunk_loss`, a receiver that lost chunks stops at production's loss budget or
   waits for the deadline (round_losses.py). A member whose failure time falls inside the round sends nothing:
   the owners treat it as departed, its own part is lost for everybody (each keeps its own value there), and the
   others wait for the round's deadline (the latest of the survivors' production `DeadlineLearner`; each peer
   records every round it finished, as a peer does).
4. aggregation per owner part and chunk (`group_aggregation.py`, production `Partition` on the workload's
   dimension): `mean` = the production estimator `estimate_over_sum` over what arrived (with chunk loss),
   `clipped`/`trimmed` = the production `robust_combine`, with `clipped` owners weighing the peers their production
   `SuspectTracker` distrusts at zero; declared weights capped by `cap_weights` (`weight_cap_factor(mode)`); lost
   averaged chunks keep the receiver's own value.
5. keys rotate with hivemind's rule (`grid.rotate_grouped_keys`); a rejoining peer decides by production's start
   rule on the live peers' epochs (rejoin.py): it resumes from its checkpoint (`resume_fraction` of failures keep
   one) while the swarm is at most `max_staleness` epochs ahead, else downloads the state of a random live honest
   peer (state bytes / its downlink); either way it resumes at the swarm's median clock. A peer that was
   ready only after its group had formed takes the group's update as production does (`rejoins_by_update`,
   `StrategySteps.take_update`): a member's Δ̄ or averaged gradient after the round (its bytes / its downlink),
   the group's step on it, and its own work of the round carried into its next one (its compute is not lost; that
   round weighs its samples too).

**The control plane** (`control_plane.py`, unless `progress_budget_bps` is 0): every peer up reads and publishes
swarm progress in the DHT at the production cadence, over its epoch's compute and at the cadence's floor while it
waits and averages; that traffic is counted (`dht_bytes_per_peer`) and takes its floor rate from both links of a
group round's members.

**Hostile peers** (a fixed random subset): they train honestly but send `hostile_scale` x their contribution
(-100 = the issue's scaled attack, -1 = sign flip) and declare `hostile_weight` x their true weight; with
`hostile_replay` R they send, in place of this round's contribution, the one they computed R rounds (of their
own) earlier: stale work from an old epoch, inside any clip radius, replayed round after round. As owners they
aggregate honestly (a hostile owner is out of robust aggregation's reach; see aggregation.py).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

import numpy as np
import torch

from moshpeer.averaging import grid
from moshpeer.averaging.adaptive_deadlines import DeadlineLearner
from moshpeer.averaging.partition import Partition, bandwidth_part_sizes
from moshpeer.averaging.suspects import SuspectTracker
from moshpeer.peer.strategies.diloco import carries_outer_params
from moshpeer.peer.strategies.diloco_outer import OuterState, parse_outer_optimizer
from moshpeer.peer.strategies.gradients import DEFAULT_PARAMS_EVERY
from moshpeer.peer.optimizer.progress_cadence import ProgressCadence
from moshpeer.peer.optimizer.round_timing import RoundTiming, quorum_time
from moshpeer.simulation.control_plane import ControlPlane
from moshpeer.simulation.group_aggregation import aggregate_group
from moshpeer.simulation.matchmaking_window import form_groups
from moshpeer.simulation.rejoin import adopt_state, downloads_on_rejoin, kept_checkpoints, state_nbytes
from moshpeer.simulation.round_losses import lossy_round_seconds
from moshpeer.simulation.strategy_steps import StrategySteps
from moshpeer.simulation.swarm import Swarm
from moshpeer.simulation.time_model import SEGMENT_BYTES, group_round_seconds, matchmaking_seconds
from moshpeer.simulation.training_config import TrainingConfig, config_dict
from moshpeer.simulation.training_result import TrainingResult

GROUP_ID_BYTES = 20


class MoshpitTraining:
    """The swarm training with Moshpit groups (mode gradients, parameters or diloco); `run()` or `step()`.

    Deterministic for a (config, seed). Bad config: ValueError (see `TrainingConfig.check`).
    """

    def __init__(self, config: TrainingConfig, seed: int = 0):
        self.swarm = s = Swarm(config, seed)
        self.config = config
        n = config.peers
        self.x = s.problem.start.repeat(n, 1)  # each peer's model (diloco: θ_local between rounds = θ_outer)
        self.outer = (OuterState([self.x], parse_outer_optimizer(config.outer_optimizer))
                      if config.mode == "diloco" else None)
        self.clock = np.zeros(n)
        self.fail_at = s.next_failure(self.clock)
        self.down_until = np.zeros(n)  # > clock: away; inf: gone for good
        self.down_s = np.zeros(n)
        self.useful = np.zeros(n)
        self.lost = np.zeros(n)
        self.wait = np.zeros(n)
        self.comm = np.zeros(n)
        self.sent = np.zeros(n)
        self.dht_sent = np.zeros(n)
        self.control = (ControlPlane(ProgressCadence(budget_bps=config.progress_budget_bps))
                        if config.progress_budget_bps > 0 else None)
        self.saturated = 0  # group participations whose link progress traffic alone would fill
        self.live_peers = n
        self.key_bits = config.resolved_key_bits()
        self.keys = grid.initial_group_keys(n, self.key_bits, s.group_rng)
        self.deadlines: Dict[int, DeadlineLearner] = {}
        # "clipped": each peer's production SuspectTracker as a part's owner (group_aggregation.py)
        self.suspects: Optional[Dict[int, SuspectTracker]] = {} if config.aggregation == "clipped" else None
        self.replays: Dict[int, Deque[torch.Tensor]] = {}  # hostile_replay: a hostile peer's recent contributions
        self.carried = np.zeros(n)  # samples of a late peer's Δ kept in its parameters, weighed into its next round
        self.steps = StrategySteps(config, s.problem.dim, self.x, self.outer)
        self.epoch = np.zeros(n, dtype=np.int64)  # rounds each peer applied: the epoch its record shows
        self.checkpointed = np.zeros(n, dtype=bool)  # away with a checkpoint of its epoch (rejoin.py)
        # Production's round timing (no compute budget): the straggler hold of `_window`.
        self.timing = RoundTiming(config.matchmaking_window_s, None, config.group_size)
        self.round = 0
        self.stalls = self.failures = self.catch_ups = self.state_downloads = self.checkpoint_resumes = 0
        self.loss_stalls = 0  # group rounds that waited for the deadline for chunks lost beyond the loss budget
        self.group_sizes: List[int] = []
        self.alone = 0
        self.participations = 0
        self.initial_loss = s.problem.loss(self.x[torch.from_numpy(s.honest)])
        self.curve: List[Tuple[float, float]] = [(0.0, self.initial_loss)]
        self.mm_s = matchmaking_seconds(n, 1.0)  # x the slowest member's RTT

    # -- helpers --

    def _deadline(self, peer: int) -> DeadlineLearner:
        if peer not in self.deadlines:
            c = self.config
            self.deadlines[peer] = DeadlineLearner(matchmaking_floor=c.matchmaking_window_s,
                                                  matchmaking_cap=c.matchmaking_window_s,
                                                  round_floor=c.min_round_timeout_s, round_cap=c.round_timeout_s)
        return self.deadlines[peer]

    def _fail(self, peers: np.ndarray, at: np.ndarray) -> None:
        """Peers fail at times `at`: away for Exp(rejoin_s), or for good with probability never_return; some keep a
        checkpoint of their epoch (rejoin.py)."""
        if peers.size == 0:
            return
        s, c = self.swarm, self.config
        self.failures += int(peers.size)
        away = s.fail_rng.exponential(c.rejoin_s, peers.size)
        gone = s.fail_rng.random(peers.size) < c.never_return
        back = np.where(gone, np.inf, at + away)
        self.down_until[peers] = back
        self.clock[peers] = at
        self.fail_at[peers] = np.where(gone, np.inf, s.next_failure(np.where(gone, 0.0, back)))
        self.checkpointed[peers] = kept_checkpoints(peers.size, c.resume_fraction, s.fail_rng)

    def _rejoin(self, now: float) -> None:
        """Peers whose time away is over by the swarm's median clock come back by production's start rule
        (rejoin.py): from their checkpoint, or with a live honest peer's state, downloaded."""
        s, c = self.swarm, self.config
        back = np.flatnonzero((self.down_until > self.clock) & (self.down_until <= now))
        up = self.down_until <= self.clock
        live = np.flatnonzero(up & s.honest)
        if back.size == 0 or live.size == 0:
            return
        donors = live[s.group_rng.integers(0, live.size, back.size)]
        self.down_s[back] += self.down_until[back] - self.clock[back]
        fetch = downloads_on_rejoin(self.epoch[back], self.checkpointed[back], self.epoch[up], c.max_staleness)
        self.state_downloads += int(fetch.sum())
        self.checkpoint_resumes += int((~fetch).sum())
        download = np.where(fetch, state_nbytes(c.model_params, c.mode) / s.downlink[back], 0.0)
        resume = np.maximum(self.down_until[back] + download, now)
        self.wait[back] += resume - self.down_until[back]  # the download, then waiting for the next round
        self.clock[back] = resume
        self.down_until[back] = 0.0
        adopt_state(self.x, self.outer, self.epoch, back[fetch], donors[fetch])

    # -- one round --

    def step(self) -> None:
        """One round for every peer that is up (see the module docstring)."""
        s, c = self.swarm, self.config
        self.round += 1
        up = self.down_until <= self.clock
        now = float(np.median(self.clock[up])) if up.any() else float(self.clock.max())
        self._rejoin(now)
        active = np.flatnonzero(self.down_until <= self.clock)
        if active.size == 0:
            return
        self.live_peers = active.size
        step_s = c.workload.batch / s.speed[active]
        full = self.clock[active] + c.steps_per_round() * step_s  # done with every step: what its record says
        taken = self._steps_taken(active, full, step_s)
        compute = taken * step_s
        ready = self.clock[active] + compute
        failing = self.fail_at[active] < ready
        worked = self.fail_at[active[failing]] - self.clock[active[failing]]
        self.lost[active[failing]] += worked
        if self.control is not None:  # (a failed peer's reads taken as those of an epoch that short)
            self.dht_sent[active[failing]] += self.control.round_bytes(worked, np.zeros(worked.size), active.size)
        self._fail(active[failing], self.fail_at[active[failing]])
        self.carried[active[failing]] = 0.0  # work since its last round is lost (a checkpoint holds its epoch)
        survivors, ready, compute, taken = active[~failing], ready[~failing], compute[~failing], taken[~failing]
        samples = taken * c.workload.batch + self.carried[survivors]  # what each contribution holds: its weight
        honest, contributions, weights = self._compute(survivors, taken, samples)
        ready_of = np.full(c.peers, np.nan)
        ready_of[survivors] = ready

        grouping = grid.assemble_groups(survivors, self.keys[survivors], c.group_size, c.min_group_size,
                                        s.group_rng)
        grouping, late, late_group, window_of = self._window(grouping, ready_of, float(full.max()))
        if not self.steps.rejoins_by_update and late.size:  # the strategy steps alone (apply_alone)
            grouping = grid.Grouping(grouping.members, grouping.starts, grouping.sizes,
                                     np.r_[grouping.alone, late].astype(np.int64))
            late = late_group = np.zeros(0, dtype=np.int64)
        row_of = np.full(c.peers, -1, dtype=np.int64)
        row_of[survivors] = np.arange(survivors.size)
        averaged = honest.clone()  # alone, or a lost averaged chunk: the peer's own (honest) value
        done = np.ones(survivors.size, dtype=bool)  # False: died during the round, or came late
        ends, donors = np.zeros(grouping.num_groups), np.full(grouping.num_groups, -1, dtype=np.int64)
        for j in range(grouping.num_groups):
            members = grouping.members[grouping.starts[j]:grouping.starts[j] + grouping.sizes[j]]
            done_members, ends[j] = self._group_round(members, row_of[members], ready_of[members], contributions,
                                                      weights, averaged)
            done[row_of[members]] = done_members
            if done_members.any():
                donors[j] = members[np.flatnonzero(done_members)[0]]
        # Late (ready after its group had formed): production DiLoCo's rule (`rejoins_by_update`, the epoch loop's
        # MISSED_ROUND_UPDATE): the group's Δ̄ from a member that finished the round, own Δ carried.
        catch_up = late[donors[late_group] >= 0] if late.size else late
        catch_donor = donors[late_group][donors[late_group] >= 0] if late.size else late
        catch_end = ends[late_group][donors[late_group] >= 0] if late.size else np.zeros(0)
        alone = np.r_[grouping.alone, late[donors[late_group] < 0]].astype(np.int64) if late.size else grouping.alone
        done[row_of[catch_up]] = False
        # Alone: waited its group's window in vain, then steps on its own contribution.
        self.alone += int(alone.size)
        self.participations += int(survivors.size)
        self.wait[alone] += window_of[alone]
        self.clock[alone] = ready_of[alone] + window_of[alone]
        self.useful[survivors[done]] += compute[done]
        self.steps.apply(survivors, done, averaged)
        self.epoch[survivors] += 1  # averaged, stepped alone, or (below) took the group's update
        # Merging by tokens: a late peer's Δ, kept in its parameters, is weighed into its next round (the epoch
        # loop's `EpochCounters.carried`); everybody else's work went into this round's step.
        self.carried[survivors] = 0.0
        self.carried[catch_up] = samples[row_of[catch_up]]
        if catch_up.size:
            self.useful[catch_up] += compute[row_of[catch_up]]  # carried into the next round, not lost
            self.catch_ups += int(catch_up.size)
            self.steps.take_update(catch_up, averaged[torch.from_numpy(row_of[catch_donor])], honest[row_of[catch_up]])
            resume = catch_end + c.model_params * c.bytes_per_value / s.downlink[catch_up]
            self.wait[catch_up] += resume - ready_of[catch_up]
            self.clock[catch_up] = resume
        if self.control is not None:
            tail = self.clock[survivors] - ready_of[survivors]
            self.dht_sent[survivors] += self.control.round_bytes(compute, tail, active.size)
        if grouping.num_groups:
            blob = s.group_rng.bytes(GROUP_ID_BYTES * grouping.num_groups)
            ids = [blob[k * GROUP_ID_BYTES:(k + 1) * GROUP_ID_BYTES] for k in range(grouping.num_groups)]
            self.keys = grid.rotate_grouped_keys(self.keys, self.key_bits, grouping, c.group_size, ids)
        live_honest = np.flatnonzero((self.down_until <= self.clock) & s.honest)
        if live_honest.size:
            t = float(np.median(self.clock[self.down_until <= self.clock]))
            self.curve.append((t, s.problem.loss(self.x[torch.from_numpy(live_honest)])))

    def _steps_taken(self, peers: np.ndarray, full: np.ndarray, step_s: np.ndarray) -> np.ndarray:
        """Inner steps each of `peers` takes this round: all of them, or with a quorum (diloco) those until the
        step that passes the moment trainers holding `quorum` of the swarm's rate are done (production
        `quorum_time` over their records: each done at `full`, computing at its speed), at least one."""
        c = self.config
        steps = np.full(peers.size, c.steps_per_round(), dtype=np.int64)
        if c.quorum == 0:
            return steps
        at = quorum_time(zip(full.tolist(), self.swarm.speed[peers].tolist()), c.quorum)
        early = np.ceil((at - self.clock[peers]) / step_s - 1e-9)
        return np.clip(early, 1, steps).astype(np.int64)

    def _compute(self, peers: np.ndarray, taken: np.ndarray, samples: np.ndarray
                 ) -> Tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """The round's local work of `peers` (`taken` inner steps each) -> (its honest contribution, what it
        sends, its declared weight: `samples`, unless it lies)."""
        s, c = self.swarm, self.config
        rows = torch.from_numpy(peers)
        x = self.x[rows]
        problem = s.problem
        lr = c.workload.lr
        if c.mode == "diloco":
            local = x.clone()
            for k in range(int(taken.max(initial=0))):
                if taken.min() > k:
                    local.sub_(problem.gradients(local, peers), alpha=lr)
                else:  # a quorum ended some peers' epochs before this step
                    going = np.flatnonzero(taken > k)
                    at = torch.from_numpy(going)
                    local[at] -= lr * problem.gradients(local[at], peers[going])
            self.x[rows] = local
            contribution = self.outer.anchor[0][rows] - local  # Δ = θ_outer - θ_local
            if carries_outer_params(self.round, 1, c.outer_params_every):
                contribution = torch.cat([contribution, self.outer.anchor[0][rows]], dim=1)
        elif c.mode == "gradients":  # a late peer's carried gradient goes in, weighed by its samples (production)
            carried = torch.from_numpy(self.carried[peers] / samples).to(x.dtype).unsqueeze(1)
            contribution = problem.gradients(x, peers) * (1 - carried) + self.steps.carried_grad[rows] * carried
            if self.round % DEFAULT_PARAMS_EVERY == 0:  # GradientsStrategy's parameter rounds
                contribution = torch.cat([contribution, x], dim=1)
        else:
            x = x - lr * problem.gradients(x, peers)
            self.x[rows] = x
            contribution = x.clone()
        weights = samples.astype(np.float64)
        hostile = s.hostile[peers]
        sent = contribution
        if hostile.any():
            sent = contribution.clone()
            if c.hostile_replay:
                self._replay(peers, hostile, contribution, sent)
            h = torch.from_numpy(hostile)
            sent[h] *= c.hostile_scale
            weights[hostile] *= c.hostile_weight
        return contribution, sent, weights

    def _replay(self, peers: np.ndarray, hostile: np.ndarray, contribution: torch.Tensor, sent: torch.Tensor) -> None:
        """Hostile rows of `sent` <- the contribution that peer computed `hostile_replay` of its rounds ago (its
        oldest until it has that many). Only the model-sized part is stale: an appended parameter copy stays."""
        dim = self.swarm.problem.dim
        for row in np.flatnonzero(hostile):
            history = self.replays.setdefault(int(peers[row]), deque(maxlen=self.config.hostile_replay + 1))
            history.append(contribution[row, :dim].clone())
            sent[row, :dim] = history[0]

    def _window(self, grouping: grid.Grouping, ready_of: np.ndarray, last_due: float
                ) -> Tuple[grid.Grouping, np.ndarray, np.ndarray, np.ndarray]:
        """`matchmaking_window.form_groups` with each group's window: `matchmaking_window_s`, or longer by the
        production straggler hold of the group's first member (`RoundTiming.straggler_hold`) for the swarm's
        trainers still computing, the last of them due at `last_due` by its record. Also returns each peer's window
        (how long it waits in vain if it goes alone)."""
        c = self.config
        windows = np.full(grouping.num_groups, c.matchmaking_window_s)
        window_of = np.full(c.peers, c.matchmaking_window_s)
        if c.straggler_hold and grouping.num_groups:
            first = np.minimum.reduceat(ready_of[grouping.members], grouping.starts)
            windows = np.maximum(windows, [self.timing.straggler_hold(last_due - t) for t in first.tolist()])
            window_of[grouping.members] = np.repeat(windows, grouping.sizes)
        return (*form_groups(grouping, ready_of, windows, c.min_group_size), window_of)

    def _group_round(self, members: np.ndarray, rows: np.ndarray, ready: np.ndarray, contributions: torch.Tensor,
                     weights: np.ndarray, averaged: torch.Tensor) -> Tuple[np.ndarray, float]:
        """Time, traffic and aggregation of one group; writes the members' results into `averaged`; returns
        which members finished the round (the others failed in it) and when it ended."""
        s, c = self.swarm, self.config
        n = members.size
        self.group_sizes.append(n)
        ups, downs = s.uplink[members], s.downlink[members]
        if self.control is not None:  # progress traffic shares both links with the round
            self.saturated += int(self.control.saturates(ups, self.live_peers).sum())
            ups, downs = (self.control.data_share(ups, self.live_peers),
                          self.control.data_share(downs, self.live_peers))
        numel = c.model_params * (2 if contributions.shape[1] > self.swarm.problem.dim else 1)
        if c.partition == "bandwidth":
            sizes = bandwidth_part_sizes(numel, ups.tolist())
        else:
            sizes = Partition(numel, n, c.chunk_numel).part_starts
            sizes = [b - a for a, b in zip(sizes, sizes[1:])]
        data_s, sent = group_round_seconds(numel, sizes, ups, downs, float(s.rtt[members].max()), c.bytes_per_value,
                                           c.initial_window * SEGMENT_BYTES)
        start = float(ready.max()) + self.mm_s * float(s.rtt[members].max())
        # Lost chunks: a receiver stops at the loss budget (round_losses.py), or waits for the deadline (inf).
        round_s = lossy_round_seconds(s.loss_rng, numel, sizes, data_s, c.chunk_loss, c.loss_budget)
        end = start + (round_s if math.isfinite(round_s) else data_s)
        dying = self.fail_at[members] < end
        payload = numel * c.bytes_per_value
        alive_members = members[~dying].tolist()
        if dying.any() or math.isinf(round_s):
            # Nobody hears from a member that died (or a lost chunk beyond the budget never comes): each owner waits
            # until its own deadline, so the round ends at the latest of the survivors' deadlines. (Such a round is
            # not recorded.)
            if dying.any():
                self.stalls += 1
            else:
                self.loss_stalls += 1
            waits = [self._deadline(m).round_deadline(n, payload) for m in alive_members] or [c.round_timeout_s]
            end = start + max(data_s, max(waits))
        else:
            # Every member records the round, as every peer's own DeadlineLearner does.
            for m in alive_members:
                self._deadline(m).observe_round(n, payload, round_s, hit_deadline=False, member_died=False)
        self.sent[members[~dying]] += np.asarray(sent)[~dying]
        self.wait[members] += start - ready
        self.comm[members[~dying]] += end - start
        self.clock[members[~dying]] = end
        if dying.any():
            died = members[dying]
            self.lost[died] += ready[dying] - self.clock[died]  # the epoch's compute, not only the round
            self._fail(died, self.fail_at[died])
        aggregate_group(self.config, self.swarm.loss_rng, rows, contributions, weights, dying, averaged, self.suspects)
        return ~dying, end

    # -- a run --

    def run(self) -> TrainingResult:
        """`config.rounds` rounds; the figures of the whole run."""
        for _ in range(self.config.rounds):
            self.step()
        return self.result()

    def result(self) -> TrainingResult:
        s, c = self.swarm, self.config
        # Per peer: up from 0 to its own clock (an away peer's clock stopped when it failed), less its time away.
        # Clocks of peers in different groups differ by up to a round at the end; each peer counts its own.
        end = float(np.median(self.clock))
        still_away = self.down_until > self.clock
        up_s = float((self.clock - self.down_s).sum())
        live_honest = np.flatnonzero(~still_away & s.honest)
        models = self.x[torch.from_numpy(live_honest)]
        final = s.problem.loss(models) if live_honest.size else float("nan")
        return TrainingResult(
            system=f"moshpit-{c.mode}", config=config_dict(c), rounds=self.round, sim_seconds=end,
            goodput=float(self.useful.sum() / up_s) if up_s > 0 else 0.0, useful_s=float(self.useful.sum()),
            up_s=up_s, lost_s=float(self.lost.sum()), wait_s=float(self.wait.sum()), comm_s=float(self.comm.sum()),
            stalls=self.stalls, loss_stalls=self.loss_stalls, failures=self.failures, final_loss=final,
            loss_floor=s.problem.loss_floor(),
            initial_loss=self.initial_loss, bytes_per_peer=float(self.sent.mean()),
            dht_bytes_per_peer=float(self.dht_sent.mean()),
            dht_saturated_fraction=self.saturated / max(sum(self.group_sizes), 1),
            final_spread=s.problem.spread(models) if live_honest.size else float("nan"),
            mean_group_size=float(np.mean(self.group_sizes)) if self.group_sizes else 0.0,
            alone_fraction=self.alone / max(self.participations, 1), catch_ups=self.catch_ups,
            state_downloads=self.state_downloads, checkpoint_resumes=self.checkpoint_resumes,
            state_bytes_per_peer=self.state_downloads * state_nbytes(c.model_params, c.mode) / c.peers,
            curve=self.curve)
