"""Which epoch a round belonged to, by what its members declared: `agreed_epoch`.

Rounds are not keyed by epoch: a peer that ends its epoch just after its mates' group closed waits in matchmaking
and meets their round of the next epoch (with sub-second epochs that is common). It averages with them and steps, but
its count stays one behind theirs for good: every later round mixes its epoch e with their e + 1, its last epoch finds
nobody, and an owner's spot checks skip it as "another epoch" until the third skip in a row fails it. Keying rounds by
epoch would prevent the mix but livelocks a peer whose count trails (it never meets a round of its own epoch again).
So members tell their epoch in matchmaking (`MemberInfo.epoch`) and, after a successful round, a member behind the
epoch its group agreed on takes that count (epoch_loop.py).

The group's epoch is the lower median of the declared ones: a minority of members cannot move it past the epochs the
others declared (a hostile member declaring a far epoch would otherwise end everyone's run early), and a tie (two
members, one epoch apart) moves nobody.
"""

from __future__ import annotations

from typing import Optional, Sequence


def group_epoch(declared: Sequence[int]) -> Optional[int]:
    """The epoch of a round whose members declared these epochs: their lower median (None: nobody declared one)."""
    return sorted(declared)[(len(declared) - 1) // 2] if declared else None


def agreed_epoch(own: int, declared: Sequence[int]) -> Optional[int]:
    """The epoch a peer at `own` takes after a round whose members (itself included) `declared` these epochs: the
    group's lower median when it is past `own`, else None (stay). Never backwards: a peer ahead of its group keeps
    its count, and its mates, behind it, take nothing from it alone."""
    median = group_epoch(declared)
    return median if median is not None and median > own else None
