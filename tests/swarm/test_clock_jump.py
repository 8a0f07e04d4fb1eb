"""A peer whose wall clock jumps mid-run (a VM resumed without NTP): hivemind checked clocks only at its start, and
its matchmaking declarations now expire by a clock 10 s off, so it finds no group. It must say why, and average
again once its clock is set right."""

from __future__ import annotations

import faketime
import pytest

from averaging_swarm import AveragingSwarm
from test_averaging_swarm import FULL_GROUP_MATCHMAKING_S, MATCHMAKING_ATTEMPTS

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(bool(faketime.MISSING), reason=f"needs {faketime.MISSING}")]

SKEWED = 2  # worker index whose clock moves
SEARCH_S = 4.0  # how long the skewed peer looks for a group in a round (its mates wait out their 3 s window)


def step(swarm: AveragingSwarm) -> list:
    for worker in swarm.workers:
        worker.send(cmd="step", **({"search_s": SEARCH_S} if worker.index == SKEWED else {}))
    return [worker.read_event("report", 60) for worker in swarm.workers]


def test_a_peer_whose_clock_jumped_names_it_when_no_group_forms_and_averages_again_once_set_right(tmp_path):
    offset = tmp_path / "offset"
    offset.write_text("+0\n")

    def wrap(index: int, argv: list) -> list:  # only the skewed worker runs with its clock read from `offset`
        if index != SKEWED:
            return argv
        return ["env", *(f"{name}={value}" for name, value in faketime.offset_file_env(offset).items()), *argv]

    with AveragingSwarm(3, "--numel", "4096", "--target-group-size", "3", "--min-group-size", "2", "--chunk-bytes",
                        "2048", "--matchmaking-time", FULL_GROUP_MATCHMAKING_S, wrap=wrap) as swarm:
        swarm.all("set", 30, cmd="set", seed=11)
        assert any(all(r["ok"] and r["group_size"] == 3 for r in step(swarm)) for _ in range(MATCHMAKING_ATTEMPTS))

        offset.write_text("+10\n")
        # The first round without a group starts the check in the background; a later one's error names the clock.
        errors, mates_paired = [], []
        for _ in range(3):
            reports = step(swarm)
            assert not reports[SKEWED]["ok"], reports[SKEWED]  # its declarations are 10 s off: nobody takes them
            errors.append(reports[SKEWED]["error"])
            mates_paired.append(all(r["ok"] and r["group_size"] == 2 for r in reports[:SKEWED]))
            if "clock" in errors[-1]:
                break
        assert "this machine's clock is 10." in errors[-1] and "s ahead of its peers'" in errors[-1], errors
        assert any(mates_paired), [r for r in reports[:SKEWED]]  # its mates average on without it
        warned = swarm.workers[SKEWED].wait_stderr("s ahead of its peers'", 10)
        assert " WARN" in warned, warned  # hivemind's log format names the level WARN

        offset.write_text("+0\n")
        assert any(all(r["ok"] and r["group_size"] == 3 for r in step(swarm)) for _ in range(MATCHMAKING_ATTEMPTS))
