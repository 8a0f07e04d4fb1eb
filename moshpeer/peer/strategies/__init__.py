"""Averaging strategies of `CollaborativeOptimizer` (see base.py for the interface).

`CollaborativeOptimizer(averaging=...)` takes a name from `STRATEGIES` or an `AveragingStrategy`
instance (e.g. `GradientsStrategy(average_parameters=True)`). A new mode is one class in its own
module plus one line in `STRATEGIES`. The names map to "module:Class" so that the CLI can list
them without importing torch; the classes load on first use.
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any, Dict, Union

from moshpeer.errors import UserError

if TYPE_CHECKING:
    from moshpeer.peer.strategies.base import AveragingStrategy

# Averaging modes selectable by name (CLI --averaging, CollaborativeOptimizer(averaging="...")).
STRATEGIES: Dict[str, str] = {
    "gradients": "moshpeer.peer.strategies.gradients:GradientsStrategy",
    "parameters": "moshpeer.peer.strategies.parameters:ParametersStrategy",
    "diloco": "moshpeer.peer.strategies.diloco:DiLoCoStrategy",
}
_EXPORTS = {
    "AveragingStrategy": "moshpeer.peer.strategies.base",
    "RoundPlan": "moshpeer.peer.strategies.base",
    "StrategyHost": "moshpeer.peer.strategies.base",
    "GradientsStrategy": "moshpeer.peer.strategies.gradients",
    "ParametersStrategy": "moshpeer.peer.strategies.parameters",
    "DiLoCoStrategy": "moshpeer.peer.strategies.diloco",
}


def strategy_class(name: str) -> type:
    """The class registered as `name` in STRATEGIES; UserError for an unknown name."""
    if name not in STRATEGIES:
        raise UserError(f"averaging must be one of {tuple(STRATEGIES)} or an AveragingStrategy, got {name!r}")
    module, _, cls = STRATEGIES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_strategy(averaging: Union[str, "AveragingStrategy"], **options: Any) -> "AveragingStrategy":
    """The strategy for `averaging`: an `AveragingStrategy` instance as is, or the class named so in
    `STRATEGIES` built with those of `options` its constructor takes (the optimizer passes all its
    strategy options, e.g. average_parameters, and each class picks its own; None: the class's default). UserError for an
    unknown name or a bad option value."""
    from moshpeer.peer.strategies.base import AveragingStrategy

    if isinstance(averaging, AveragingStrategy):
        return averaging
    if not isinstance(averaging, str):
        raise UserError(f"averaging must be a name or an AveragingStrategy, got {type(averaging).__name__}")
    cls = strategy_class(averaging)
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{name: value for name, value in options.items() if name in accepted and value is not None})


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["STRATEGIES", "make_strategy", "strategy_class", *_EXPORTS]
