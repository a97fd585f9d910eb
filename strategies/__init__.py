"""Server-side strategies: one module per method, found by its settings declaration.

A method is a :class:`~strategies.base.RoundLoopStrategy` subclass with a ``Settings``
declaration (:class:`~strategies.base.StrategySettings`) in a module of this package, or of any
package named by a ``fedmm.strategy`` entry point: ``strategy.name`` selects it, nothing lists it.

The strategy classes work in any Flower app (they need only Flower's message conventions)::

    from strategies import FedMR, FedCross, FedMut, FedAvg

(any method class is importable from here by its class name).
"""

from __future__ import annotations

from typing import Any

from flwr.serverapp.strategy import Strategy

from fedmm.config import as_run, discover
from strategies.base import RoundLoopStrategy, StrategySettings
from strategies.heterogeneity import LocalWork
from strategies.selection import ClientSelector, SeededRosterSelector

__all__ = ["build_strategy", "ClientSelector", "RoundLoopStrategy", "SeededRosterSelector", "StrategySettings"]


def build_strategy(cfg: Any) -> Strategy:
    """The strategy that ``strategy.name`` selects, with the client selector of ``selection``,
    waiting at most ``min_nodes_timeout`` for nodes (``cfg``: run settings or a plain config)."""
    run = as_run(cfg)
    strategy = run.strategy.strategy_class.from_settings(run)
    selector = run.selection.build(run)
    if selector is not None:
        strategy.selector = selector
    if isinstance(strategy.selector, SeededRosterSelector):
        strategy.selector.min_nodes_timeout = float(run.min_nodes_timeout) or None
        strategy.selector.query = True  # the fedmm ClientApp answers the roster query
    if isinstance(strategy, RoundLoopStrategy):  # the virtual clock models the clients' local work
        strategy.clock.work = LocalWork.from_run(run)
    return strategy


def __getattr__(name: str) -> Any:
    """``from strategies import FedMR``: any declared method class, or selector, by its name."""
    import inspect

    for group in ("strategy", "selection"):
        discover(group)
    import sys

    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("strategies.") and hasattr(module, name) and inspect.isclass(getattr(module, name)):
            return getattr(module, name)
    raise AttributeError(f"module 'strategies' has no attribute {name!r}")
