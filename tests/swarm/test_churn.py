"""Churn: a 3-peer swarm where two peers are ended (SIGKILL, then the preemption notice file) and
restarted (from the checkpoint directory, then fresh). Both come back and average with the others,
no survivor stalls past twice the round deadline, nothing hangs and no checkpoint is lost.
The long version (6 peers, every way to end and restart) is in test_churn_slow.py and
benchmarks/bench_churn.py."""

from __future__ import annotations

import time

import pytest

from chaos import ChaosPlan, ChurnSwarm, describe_joins

pytestmark = [pytest.mark.timeout(420), pytest.mark.swarm]

MATCHMAKING_S, ROUND_TIMEOUT_S = 1.0, 10.0
# What a round may take with the fixed flags: matchmaking (twice, as the optimizer allows), the
# round's timeout, and the optimizer's 5 s margin.
FIXED_ROUND_DEADLINE_S = 2 * MATCHMAKING_S + ROUND_TIMEOUT_S + 5.0


def test_two_peers_ended_and_restarted_rejoin_without_stalls_hangs_or_lost_checkpoints(swarm, tmp_path):
    churn = ChurnSwarm(swarm, "churn3", tmp_path, peers=3, grace_period=8.0, checkpoint_every_s=2.0,
                       fixed_round_deadline_s=FIXED_ROUND_DEADLINE_S,
                       peer_args=("--matchmaking-time", str(MATCHMAKING_S), "--round-timeout", str(ROUND_TIMEOUT_S),
                                  "--group-size", "3"))
    churn.start()
    churn.run_chaos(ChaosPlan(duration_s=60.0, every_s=2.0, pause_s=1.0, kills=2, seed=3,
                              endings=("sigkill", "notice"), restarts=("checkpoint", "fresh")))
    churn.wait_rejoined(timeout=120.0)
    end = time.monotonic()
    churn.stop()
    report = churn.measure(window_end=end)
    print("\n".join(describe_joins(report.joins)))
    print(f"max stall {report.max_stall_s:.2f} s ({report.stall_where}), epochs {report.epochs}, "
          f"deadline {report.round_deadline_s}")

    assert report.endings == 2 and [j.start for j in report.joins] == ["checkpoint", "fresh"]
    assert [j.ending for j in report.joins] == ["sigkill", "notice"]
    assert all(j.join_s is not None for j in report.joins), report.joins
    assert report.hung == [] and report.bad_exits == [], (report.hung, report.bad_exits)
    assert report.lost_checkpoints == [], report.lost_checkpoints
    assert report.max_stall_s < 2 * report.round_deadline_s, (report.max_stall_s, report.stall_where)
    # The restart from the checkpoint resumed from it (checked inside the harness); the fresh one had
    # nothing to resume from and downloaded the swarm's state.
    fresh = next(slot.current for slot in churn.slots if slot.current.start == "fresh")
    assert fresh.first("state_loaded") is not None, fresh.proc.describe(40)
    for slot in churn.slots:
        assert "Traceback" not in slot.current.proc.stderr, slot.current.proc.describe(60)
