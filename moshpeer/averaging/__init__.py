"""Moshpit averaging: grid groups via hivemind's matchmaking, and a fast loss-tolerant group all-reduce.

See docs/averaging.md.
"""

from moshpeer.averaging.allreduce import AllReduceResult, GroupAllReduce, GroupMember
from moshpeer.averaging.averager import MoshpitAverager
from moshpeer.averaging.dataplane import DataPlane
from moshpeer.averaging.faults import FaultConfig, FaultyLinks
from moshpeer.averaging.links import Links
from moshpeer.averaging.loss_budget import LossBudget
from moshpeer.averaging.partition import Partition
from moshpeer.averaging.relay import StreamRelay
from moshpeer.averaging.report import DataPlaneStats, PhaseStats, RoundReport

__all__ = [
    "AllReduceResult",
    "DataPlane",
    "DataPlaneStats",
    "FaultConfig",
    "FaultyLinks",
    "GroupAllReduce",
    "GroupMember",
    "Links",
    "LossBudget",
    "MoshpitAverager",
    "Partition",
    "PhaseStats",
    "RoundReport",
    "StreamRelay",
]
