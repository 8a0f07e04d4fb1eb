"""Accountability for work done inside the rules (issue 26): the data each peer must train on
(`assignment`), and owners that recompute a member's contribution from it (`spot_checks`)."""

from moshpeer.peer.accountability.assignment import AssignedBatches, assigned_batches, assignment_seed
from moshpeer.peer.accountability.spot_checks import SpotCheck, SpotChecker, compare

__all__ = ["AssignedBatches", "SpotCheck", "SpotChecker", "assigned_batches", "assignment_seed", "compare"]
