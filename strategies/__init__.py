"""Server-side strategies: one module per method, found by its settings declaration.

A method is a :class:`~strategies.method.Method` subclass with a ``Settings`` declaration
(:class:`~strategies.strategy_settings.StrategySettings`) in a module of this package, or of any
package named by a ``fedmm.strategy`` entry point: ``strategy.name`` selects it, and nothing
lists it, here either. The strategy classes work in any Flower app (they need only Flower's
message conventions)::

    from strategies import FedMR, FedCross, FedMut, FedAvg

A method class is found by its name among the declared methods (:func:`fedmm.settings.discover`,
which imports the modules of this package that declare them); the bases and drivers a method is
built on, and the client selectors, are imported here by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.serverapp.strategy import Strategy

from fedmm.config import as_run
from fedmm.observers import RunObserver
from strategies.asynchronous import AsyncRound
from strategies.base import FedmmStrategy, Participants
from strategies.clustered_sampling import ClusteredSelector
from strategies.method import Method
from strategies.multimodel import MultiModel
from strategies.rounds import SyncRound
from strategies.selection import ClientSelector, SeededRosterSelector
from strategies.strategy_settings import StrategySettings

#: What this package defines besides the methods: the bases a method subclasses, the drivers, the selectors.
FOUNDATIONS = ["build_strategy", "methods", "Method", "MultiModel", "StrategySettings", "FedmmStrategy", "Participants",
               "SyncRound", "AsyncRound", "ClientSelector", "SeededRosterSelector", "ClusteredSelector"]


def methods() -> dict[str, type[Method]]:
    """Every method class of the declared strategy options (this package's and any installed
    plugin's), by class name."""
    from fedmm.settings import discover

    return {cls.strategy_class.__name__: cls.strategy_class for cls in discover("strategy").values()
            if getattr(cls, "strategy_class", None) is not None}


#: Method classes that became a method with a setting: {old name: (the method's class name, the settings)}.
DEPRECATED = {"FedMRAsync": ("FedMR", {"asynchronous": {"enabled": True}}),
              "FedCrossAsync": ("FedCross", {"asynchronous": {"enabled": True}})}


def __getattr__(name: str) -> Any:
    """``from strategies import FedMR``: a method class, by its name among the declared methods;
    ``__all__``: the foundations and every declared method class. A deprecated name gives a
    function that builds its method with the settings that replaced it (with a DeprecationWarning)."""
    if name == "__all__":
        return FOUNDATIONS + sorted(methods())
    if name in DEPRECATED:
        return _deprecated(name, *DEPRECATED[name])
    found = methods().get(name) if not name.startswith("_") else None
    if found is None:
        raise AttributeError(f"module 'strategies' has no attribute {name!r}")
    return found


def _deprecated(name: str, method: str, changes: dict[str, Any]) -> Any:
    import warnings

    def build(*args: Any, **kwargs: Any) -> Method:
        warnings.warn(f"strategies.{name} is deprecated: use {method}(..., " + ", ".join(f"{k}={v!r}" for k, v in changes.items())
                      + ")", DeprecationWarning, stacklevel=2)
        return methods()[method](*args, **{**changes, **kwargs})

    build.__name__ = build.__qualname__ = name
    return build


def __dir__() -> list[str]:
    return sorted({*globals(), *methods()})


def build_strategy(config: Any, observers: Iterable[RunObserver] = ()) -> Strategy:
    """The strategy that ``strategy.name`` selects, with its client selector, its clock's work
    model and the roster query (``config``: run settings, or a plain config to validate), seen by
    ``observers`` (:func:`strategies.context.build_strategy`)."""
    from strategies.context import build_strategy as build

    return build(as_run(config), observers)
