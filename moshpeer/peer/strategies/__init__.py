"""Averaging strategies of `CollaborativeOptimizer` (see base.py for the interface).

`CollaborativeOptimizer(averaging=...)` takes an `AveragingStrategy` instance, which carries its own
options (e.g. `GradientsStrategy(params_every=4)`, `DiLoCoStrategy(inner_steps=50, overlap=True)`), or a
name from `STRATEGIES` for that mode with its default options. A new mode is one class in its own
module plus one line in `STRATEGIES`. The names map to "module:Class" so that the CLI can list
them without importing torch; the classes load on first use.
"""

from __future__ import annotations

import importlib
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
    `STRATEGIES` built with `options`, its constructor's keyword arguments (None values are left out, so the
    class's defaults hold; the CLI passes its flags this way). UserError for an unknown name, options given
    with an instance, an option that mode does not take, or a bad option value."""
    from moshpeer.peer.strategies.base import AveragingStrategy

    options = {name: value for name, value in options.items() if value is not None}
    if isinstance(averaging, AveragingStrategy):
        if options:
            raise UserError(f"options {sorted(options)} belong in the strategy instance {type(averaging).__name__}")
        return averaging
    if not isinstance(averaging, str):
        raise UserError(f"averaging must be a name or an AveragingStrategy, got {type(averaging).__name__}")
    cls = strategy_class(averaging)
    try:
        return cls(**options)
    except TypeError as e:  # an option this mode does not take
        raise UserError(f"averaging {averaging!r}: {e}") from None


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["STRATEGIES", "make_strategy", "strategy_class", *_EXPORTS]
