"""moshpeer: decentralized training on volunteer and preemptible machines.

    from moshpeer import CollaborativeOptimizer, MoshpitAverager

The public names load on first use (they import torch and hivemind), so `import moshpeer` and the CLI
stay fast.
"""

from typing import Any

from moshpeer.version import __version__

_PUBLIC = {
    "CollaborativeOptimizer": "moshpeer.peer.optimizer",
    "CollaborativeRound": "moshpeer.peer.optimizer.rounds",
    "AveragingStrategy": "moshpeer.peer.strategies.base",
    "GradientsStrategy": "moshpeer.peer.strategies.gradients",
    "ParametersStrategy": "moshpeer.peer.strategies.parameters",
    "DiLoCoStrategy": "moshpeer.peer.strategies.diloco",
    "MoshpitAverager": "moshpeer.averaging.averager",
    "RoundResult": "moshpeer.averaging.report",
    "RoundFuture": "moshpeer.averaging.deadline",
    "FaultConfig": "moshpeer.averaging.faults",
    "FaultyLinks": "moshpeer.averaging.faults",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'moshpeer' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(__all__)
