"""LinkReuse: which of a round's connections join peers that shared a group a few rounds before (what kept
connections can carry), on hand-made groups and on the simulator's production grouping."""

from __future__ import annotations

import numpy as np
import pytest

from moshpeer.averaging import grid
from moshpeer.simulation import AveragingConfig, AveragingSimulation
from moshpeer.simulation.link_reuse import LinkReuse


def groups(*members) -> grid.Grouping:
    sizes = np.array([len(m) for m in members])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return grid.Grouping(np.array([p for m in members for p in m]), starts, sizes, np.zeros(0, dtype=np.int64))


def test_a_pair_counts_as_reused_only_within_the_window():
    reuse = LinkReuse(window_rounds=2)
    assert reuse.observe(1, groups([0, 1], [2, 3])) == 0.0  # first meetings
    assert reuse.observe(2, groups([0, 1], [2, 4])) == 0.5  # 0 <-> 1 met last round; 2 <-> 4 never
    assert reuse.observe(5, groups([0, 1])) == 0.0  # three rounds since: past the window
    assert reuse.observe(6, groups([0, 1, 2])) == pytest.approx(2 / 6)  # of 6 links only 0 -> 1 and 1 -> 0


def test_a_round_without_groups_reuses_nothing_and_the_window_must_be_positive():
    assert LinkReuse(1).observe(1, groups()) == 0.0
    with pytest.raises(ValueError):
        LinkReuse(0)


def test_on_the_production_rule_a_swarm_within_one_group_keeps_every_link_and_a_large_one_few():
    def mean_reuse(peers: int, group_size: int) -> float:
        sim = AveragingSimulation(AveragingConfig(peers=peers, group_size=group_size, dim=1), seed=0)
        reuse = LinkReuse(3)
        fractions = []
        for _ in range(30):
            sim.step()
            fractions.append(reuse.observe(sim.round, sim.grouping))
        return float(np.mean(fractions[5:]))

    assert mean_reuse(8, 16) == 1.0
    assert mean_reuse(1000, 16) < 0.1  # Moshpit's rotation sends peers to new groups
