"""Server-side strategies: one module per method, found by its settings declaration.

A method is a :class:`~strategies.base.RoundLoopStrategy` subclass with a ``Settings``
declaration (:class:`~strategies.base.StrategySettings`) in a module of this package, or of any
package named by a ``fedmm.strategy`` entry point: ``strategy.name`` selects it, nothing lists it.

The strategy classes work in any Flower app (they need only Flower's message conventions)::

    from strategies import FedMR, FedCross, FedMut, FedAvg

Every method class and every client selector of this package is imported here by name and
listed in ``__all__`` (tests/test_architecture.py checks the list against discovery); a plugin's
classes are imported from its own package.
"""

from __future__ import annotations

from typing import Any

from flwr.serverapp.strategy import Strategy

from fedmm.config import as_run
from strategies.async_multimodel import AsyncMultiModel, FedCrossAsync, FedMRAsync
from strategies.asynchronous import AsyncRoundLoop
from strategies.base import RoundLoopStrategy, StrategySettings
from strategies.clustered_sampling import ClusteredSelector
from strategies.fedavg import FedAvg
from strategies.fedbuff import FedBuff
from strategies.fedcross import FedCross
from strategies.feddyn import FedDyn
from strategies.fedexp import FedExP
from strategies.fedgen import FedGen
from strategies.fedmr import FedMR
from strategies.fedmut import FedMut
from strategies.heterogeneity import LocalWork
from strategies.multimodel import MultiModelStrategy
from strategies.scaffold import Scaffold
from strategies.selection import ClientSelector, SeededRosterSelector
from strategies.solo import Solo

__all__ = [
    "build_strategy",
    # the bases a method subclasses
    "RoundLoopStrategy",
    "MultiModelStrategy",
    "AsyncRoundLoop",
    "AsyncMultiModel",
    "StrategySettings",
    # the methods (strategy.name)
    "FedAvg",
    "FedBuff",
    "FedCross",
    "FedCrossAsync",
    "FedDyn",
    "FedExP",
    "FedGen",
    "FedMR",
    "FedMRAsync",
    "FedMut",
    "Scaffold",
    "Solo",
    # the client selectors (selection)
    "ClientSelector",
    "SeededRosterSelector",
    "ClusteredSelector",
]


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

