"""Who of a group's members makes it into the group, by when each is ready: the matchmaking window's decision, a
plain function of ready times (the simulator's training level calls it every round).

A group (the members matchmaking put under one key) forms from the largest set of its members whose ready times
lie within its window of each other (the latest such set on a tie). A member ready earlier waited the window in
vain and goes alone; one ready later found the group gone and is late. A group left smaller than
`min_group_size` does not form: all its members go alone.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

from moshpeer.averaging import grid


def form_groups(grouping: grid.Grouping, ready_of: np.ndarray, windows: np.ndarray, min_group_size: int
                ) -> Tuple[grid.Grouping, np.ndarray, np.ndarray]:
    """`grouping` cut by each group's window (`windows[j]`, seconds; `ready_of[peer]`: when the peer is ready) ->
    (the groups that form, the late peers, the index in the new grouping of the group each late peer missed)."""
    none = np.zeros(0, dtype=np.int64)
    if grouping.num_groups == 0:
        return grouping, none, none
    ready = ready_of[grouping.members]
    first = np.minimum.reduceat(ready, grouping.starts)
    last = np.maximum.reduceat(ready, grouping.starts)
    if (last - first <= windows).all():
        return grouping, none, none
    keep = np.ones(grouping.members.size, dtype=bool)
    late = np.zeros(grouping.members.size, dtype=bool)
    for j in np.flatnonzero(last - first > windows).tolist():
        lo, window = int(grouping.starts[j]), float(windows[j])
        times = ready[lo:lo + int(grouping.sizes[j])]
        order = np.sort(times)
        # For each member as the latest of the set: how many are ready within the window before it.
        counts = np.arange(order.size) - np.searchsorted(order, order - window) + 1
        best = int(np.flatnonzero(counts == counts.max())[-1])
        keep[lo:lo + times.size] = (times <= order[best]) & (times >= order[best] - window)
        late[lo:lo + times.size] = times > order[best]
    group_of = grouping.group_of_member()
    sizes = np.bincount(group_of[keep], minlength=grouping.num_groups)
    ok = sizes >= min_group_size
    in_ok = keep & ok[group_of]
    members = grouping.members[in_ok]
    kept = sizes[ok]
    starts = np.r_[0, np.cumsum(kept)[:-1]] if kept.size else np.zeros(0, dtype=np.int64)
    new_index = np.cumsum(ok) - 1
    is_late = late & ok[group_of]
    alone = np.r_[grouping.alone, grouping.members[~in_ok & ~is_late]]
    regrouped = grid.Grouping(members, starts.astype(np.int64), kept.astype(np.int64), alone.astype(np.int64))
    return regrouped, grouping.members[is_late], new_index[group_of[is_late]]
