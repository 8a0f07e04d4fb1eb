"""The synchronous data-parallel baseline of the training level (`SyncTraining`): one all-reduce per step,
checkpoints, and a restart without the failed peer after each failure.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from moshpeer.simulation.swarm import HOUR, Swarm
from moshpeer.simulation.time_model import ring_allreduce_seconds
from moshpeer.simulation.training_config import TrainingConfig, config_dict
from moshpeer.simulation.training_result import TrainingResult


class SyncTraining:
    """Synchronous data parallelism on the same swarm: every step everybody computes its minibatch, one
    all-reduce averages the gradients (`ring_allreduce_seconds`), one SGD step. A checkpoint every
    `checkpoint_every` steps (`checkpoint_s` each; None: Young's optimal interval sqrt(2 checkpoint_s MTBF) for the
    swarm's mean time between failures, so the baseline is not handicapped by a bad setting). A failure anywhere
    stalls the step until `timeout_s`, then the job restarts from the last checkpoint (`restart_s` plus the state
    download) without the failed peer,
    losing the steps since the checkpoint; a returning peer is added at the next checkpoint (no stall: generous
    to the baseline). Runs until it has taken `steps` steps or its clock passes `max_seconds`.

    The model is one vector (every peer holds the same); hostile peers are not modelled here.
    """

    def __init__(self, config: TrainingConfig, seed: int = 0, *, checkpoint_every: Optional[int] = None,
                 checkpoint_s: float = 5.0, timeout_s: float = 60.0, restart_s: float = 60.0):
        if (checkpoint_every is not None and checkpoint_every < 1) or not (
                checkpoint_s >= 0 and timeout_s >= 0 and restart_s >= 0):
            raise ValueError("need checkpoint_every >= 1 and non-negative checkpoint_s, timeout_s, restart_s")
        self.swarm = s = Swarm(config, seed)
        if checkpoint_every is None:
            step_s = float((config.workload.batch / s.speed).max()) + ring_allreduce_seconds(
                config.model_params, config.peers, float(s.uplink.min()), float(s.downlink.min()), float(s.rtt.max()),
                config.bytes_per_value)
            rate = config.failure_rate_per_hour / HOUR * config.peers
            interval = math.sqrt(2 * max(checkpoint_s, 1e-3) / rate) if rate > 0 else 1e9
            checkpoint_every = int(min(max(1, round(interval / step_s)), 1 << 30))
        self.config = config
        self.checkpoint_every, self.checkpoint_s = checkpoint_every, checkpoint_s
        self.timeout_s, self.restart_s = timeout_s, restart_s

    def run(self, steps: int, max_seconds: float = math.inf) -> TrainingResult:
        """Run; the figures of the whole run. ValueError for steps < 1."""
        if steps < 1:
            raise ValueError("steps must be >= 1")
        s, c = self.swarm, self.config
        w = c.workload
        n = c.peers
        x = s.problem.start.clone()
        ckpt_x, ckpt_step, ckpt_useful = x.clone(), 0, 0.0
        t = 0.0
        fail_at = s.next_failure(np.zeros(n))
        member = np.ones(n, dtype=bool)
        back_at = np.zeros(n)  # when an away peer is back (inf: gone)
        away_since = np.zeros(n)
        away = np.zeros(n)
        useful = lost = wait = comm = 0.0
        stalls = failures = 0
        step = 0
        sent = 0.0
        curve = [(0.0, s.problem.loss(x[None]))]
        while step < steps and t < max_seconds:
            peers = np.flatnonzero(member)
            if peers.size == 0:
                break
            compute = w.batch / s.speed[peers]
            ar = ring_allreduce_seconds(c.model_params, peers.size, float(s.uplink[peers].min()),
                                        float(s.downlink[peers].min()), float(s.rtt[peers].max()), c.bytes_per_value)
            step_s = float(compute.max()) + ar
            first = int(peers[np.argmin(fail_at[peers])])
            if fail_at[first] < t + step_s:
                # The step hangs until the timeout, then a restart from the checkpoint without the failed peer.
                failures += 1
                stalls += 1
                f = float(fail_at[first])
                useful_lost = useful - ckpt_useful
                useful = ckpt_useful
                lost += useful_lost + float(np.minimum(compute, f - t).clip(0).sum())
                reload = c.model_params * 4 / float(s.downlink[peers].min())
                pause = (f - t) + self.timeout_s + self.restart_s + reload
                wait += pause * (peers.size - 1) - float(np.minimum(compute, f - t).clip(0).sum())
                t = f + self.timeout_s + self.restart_s + reload
                member[first] = False
                away_since[first] = f
                gone = s.fail_rng.random() < c.never_return
                back_at[first] = math.inf if gone else f + s.fail_rng.exponential(c.rejoin_s)
                fail_at[first] = math.inf
                x, step = ckpt_x.clone(), ckpt_step
                curve.append((t, s.problem.loss(x[None])))
                continue
            x = x - w.lr * s.problem.mean_gradient(x, peers)
            step += 1
            t += step_s
            useful += float(compute.sum())
            wait += float((compute.max() - compute).sum())
            comm += ar * peers.size
            sent += 2 * (peers.size - 1) / peers.size * c.model_params * c.bytes_per_value * peers.size
            if step % self.checkpoint_every == 0:
                t += self.checkpoint_s
                wait += self.checkpoint_s * peers.size
                ckpt_x, ckpt_step, ckpt_useful = x.clone(), step, useful
                returning = np.flatnonzero(~member & (back_at <= t))
                if returning.size:
                    away[returning] += back_at[returning] - away_since[returning]
                    member[returning] = True
                    fail_at[returning] = s.next_failure(back_at[returning])
            if step % self.checkpoint_every == 0 or step % 25 == 0:
                curve.append((t, s.problem.loss(x[None])))
        still = ~member
        away_total = away + np.where(still, t - np.minimum(away_since, t), 0.0)
        up_s = float(n * t - away_total.sum())
        final = s.problem.loss(x[None])
        return TrainingResult(
            system="sync", config=dict(config_dict(c), checkpoint_every=self.checkpoint_every,
                                       checkpoint_s=self.checkpoint_s, timeout_s=self.timeout_s,
                                       restart_s=self.restart_s),
            rounds=step, sim_seconds=t, goodput=useful / up_s if up_s > 0 else 0.0, useful_s=useful, up_s=up_s,
            lost_s=lost, wait_s=wait, comm_s=comm, stalls=stalls, failures=failures, final_loss=final,
            loss_floor=s.problem.loss_floor(), initial_loss=curve[0][1], bytes_per_peer=sent / n, curve=curve)
