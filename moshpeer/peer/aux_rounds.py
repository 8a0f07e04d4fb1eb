"""Aux peers of a `CollaborativeOptimizer` (role="aux"): they average with weight 0 and never compute.

`AuxRounds` is a mixin of `CollaborativeOptimizer` (it uses its progress, averager, strategy and rounds).
"""

from __future__ import annotations

import time
from typing import Optional

from moshpeer.errors import UserError
from moshpeer.peer.rounds import CollaborativeRound

# An aux waits in matchmaking this many matchmaking times: it never leads (the trainers' leader decides
# when the group is complete), and a leader accepts only followers whose window outlasts its own.
AUX_WINDOW_FACTOR = 10


class AuxRounds:
    """`wait_and_average`, what an aux peer calls instead of `step()`."""

    def wait_and_average(self, timeout: Optional[float] = None) -> Optional[CollaborativeRound]:
        """Aux peers: take part in the swarm's next averaging round with weight 0 (bandwidth: the aux owns
        a part of every reduce-scatter and all-gather of its group; no samples, no weight). The aux follows
        the trainers' epoch and waits in matchmaking as a follower, so the trainers' leader finds it there.
        Returns the round if it averaged, None if no group formed or no trainer showed up by `timeout`."""
        if self.role != "aux":
            raise UserError("wait_and_average is for aux peers; trainers call step()")
        deadline = time.monotonic() + (timeout if timeout is not None else self.round_timeout * 3)
        while time.monotonic() < deadline and not self._should_stop():
            snapshot = self.progress.snapshot()
            # The swarm's epoch, also once its trainers are gone: trainers that end their last epoch without
            # the aux (its round failed) and withdraw at once would otherwise leave it one epoch short forever.
            followed = max(snapshot.global_epoch if snapshot.num_trainers > 0 else 0,
                           self.progress.swarm_epoch_reached)
            if followed > self.local_epoch:
                with self.lock:
                    self.local_epoch = followed
                self._report_progress(force=True)
            if snapshot.num_trainers > 0:
                target, plan = self.group_target(snapshot), self._plan_round(snapshot)
                future = self._start_round(plan, 0.0, target, AUX_WINDOW_FACTOR * self.matchmaking_time)
                result = self.timing.await_result(future, target, self._should_stop)
                if result is None or not result.ok:
                    self.failed_rounds += 1
                    return None
                return self._end_epoch(plan, result, None, epoch=self.local_epoch, samples=0, group_target=target,
                                       swarm_samples=snapshot.samples_accumulated, num_trainers=snapshot.num_trainers)
            self.progress.wait_for_refresh(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        return None
