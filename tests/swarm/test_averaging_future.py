"""`MoshpitAverager.step(wait=False)`: a future of one typed `RoundResult`, resolved by the round's own
deadline; per-round tensors (a part of the averaged buffer); and the public names of the package."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest
import torch

from moshpeer import MoshpitAverager, RoundFuture, RoundResult

pytestmark = pytest.mark.timeout(120)
RUN = "future"


def test_round_futures_carry_one_typed_result_and_average_only_the_round_tensors(dht_node):
    boot = dht_node(run_ids=[RUN])
    other = dht_node(initial_peers=[str(m) for m in boot.get_visible_maddrs()], run_ids=[RUN])
    buffers = [torch.full((64,), 1.0), torch.full((64,), 3.0)]
    averagers = [MoshpitAverager([buf], dht=dht, run_id=RUN, target_group_size=2, matchmaking_time=1.0,
                                 round_timeout=10.0) for buf, dht in zip(buffers, (boot, other))]
    try:
        for attempt in range(3):  # a loaded machine may keep the two apart in one round: try again
            futures = [a.step(timeout=5.0, tensors=[buf[:16]], averaged=("gradients",), wait=False)
                       for a, buf in zip(averagers, buffers)]
            assert all(isinstance(f, RoundFuture) and f.deadline.end > time.monotonic() for f in futures)
            results = [f.result(timeout=f.deadline.remaining() + 5.0) for f in futures]
            if all(r.ok for r in results):
                break
        assert all(isinstance(r, RoundResult) and r.ok and r.group_size == 2 for r in results), results
        assert all(r.averaged == ("gradients",) and r.bytes_sent > 0 for r in results)
        for buf, own in zip(buffers, (1.0, 3.0)):
            assert torch.equal(buf[:16], torch.full((16,), 2.0))  # the round's part: averaged
            assert torch.equal(buf[16:], torch.full((48,), own))  # the rest: untouched, never sent
        # A 16-value round sends about a quarter of the bytes of a 64-value one.
        full = [a.step(timeout=5.0, wait=False) for a in averagers]
        full_results = [f.result(timeout=f.deadline.remaining() + 5.0) for f in full]
        if all(r.ok for r in full_results):
            assert results[0].bytes_sent < 0.5 * full_results[0].bytes_sent
        with pytest.raises(dataclasses.FrozenInstanceError):
            results[0].ok = False  # frozen: nobody downstream rewrites a result
    finally:
        for averager in averagers:
            averager.shutdown()


def test_a_lone_round_resolves_by_its_deadline(dht_node):
    averager = MoshpitAverager([torch.zeros(8)], dht=dht_node(run_ids=["alone"]), run_id="alone",
                               matchmaking_time=0.3, round_timeout=2.0)
    try:
        future = averager.step(timeout=0.6, wait=False)
        result = future.result(timeout=future.deadline.remaining() + 2.0)
        assert not result.ok and result.error and time.monotonic() <= future.deadline.end + 1.0
        assert averager.step(timeout=0.6).ok is False  # wait=True: the result itself
    finally:
        averager.shutdown()


def test_public_names_load_on_first_use():
    code = ("import sys, moshpeer; assert 'torch' not in sys.modules; "
            "from moshpeer import CollaborativeOptimizer, MoshpitAverager; "
            "from moshpeer.peer.optimizer import CollaborativeOptimizer as C; assert C is CollaborativeOptimizer")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
