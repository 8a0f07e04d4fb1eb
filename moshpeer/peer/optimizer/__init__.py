"""The collaborative optimizer and the parts it is composed of.

    from moshpeer.peer.optimizer import CollaborativeOptimizer

- collaborative.py: `CollaborativeOptimizer`, the torch-facing wrapper and host of the parts below
- wiring.py: builds those parts (`prepare`, `assemble`) from the constructor's `Settings`; `Parts` (what spans
  several of them: catch-up, loading a checkpoint, shutdown); `delegate` (a part's method as the optimizer's)
- epoch_loop.py: `EpochLoop`, a trainer's epochs (progress, rounds, catch-up, the end of an epoch)
- aux_peer.py: `AuxPeer`, what an aux peer does instead of training
- state_exchange.py: `StateExchange`, state dicts, checkpoints, donating and downloading state
- round_timing.py: `RoundTiming`, the peer side's one owner of round timing (compute budget, windows)
- rounds.py: `CollaborativeRound`, the record of one epoch
- progress.py / swarm_link.py: the swarm's progress from peer records; how the optimizer is present in the swarm
- sample_credit.py: `SampleCredit`, how many of each trainer's claimed samples progress.py believes
- dropcompute.py, loss_phase.py, error_feedback.py, speed_meter.py: the compute budget, the loss budget's
  phase signal, EF21M state, this peer's throughput

The names below load on first use, so importing one part does not load the others.
"""

from typing import Any

_PUBLIC = {
    "CollaborativeOptimizer": "moshpeer.peer.optimizer.collaborative",
    "CollaborativeRound": "moshpeer.peer.optimizer.rounds",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
