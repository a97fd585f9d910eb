"""Server-side strategies: one module per method, registered here by config name.

Each module provides ``from_config(cfg) -> Strategy`` and ``CONFIG_SCHEMA`` (the keys of its
``strategy`` config group); importing this package registers the schemas with
:func:`fedmm.config.register_schema`.

The strategy classes work in any Flower app (they need only Flower's message conventions):

    from strategies import FedMR, FedCross, FedMut, FedAvg
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

from flwr.serverapp.strategy import Strategy

from fedmm import protocol
from fedmm.config import register_schema
from fedmm.errors import ConfigError
from strategies import clustered_sampling, fedavg, fedcross, fedexp, fedgen, fedmr, fedmut, scaffold, solo
from strategies.base import RoundLoopStrategy
from strategies.clustered_sampling import ClusteredSelector
from strategies.fedavg import FedAvg
from strategies.fedcross import FedCross
from strategies.fedexp import FedExP
from strategies.fedmr import FedMR
from strategies.fedmut import FedMut
from strategies.multimodel import MultiModelStrategy
from strategies.scaffold import Scaffold
from strategies.selection import ClientSelector, SeededRosterSelector

__all__ = [
    "STRATEGIES", "build_strategy", "ClientSelector", "ClusteredSelector", "FedAvg", "FedCross", "FedExP", "FedMR", "FedMut", "MultiModelStrategy",
    "RoundLoopStrategy", "Scaffold", "SeededRosterSelector",
]

#: strategy.name -> module with ``from_config`` and ``CONFIG_SCHEMA``.
STRATEGIES: dict[str, ModuleType] = {
    "fedavg": fedavg,
    "fedmr": fedmr,
    "fedcross": fedcross,
    "fedmut": fedmut,
    "fedexp": fedexp,
    "solo": solo,
    "scaffold": scaffold,
    "fedgen": fedgen,
}

def check_federated_evaluation(values: Mapping[str, Any], cfg: Mapping[str, Any]) -> None:
    """Clients evaluate on rows they never train on: fraction_evaluate > 0 needs a held-out part."""
    if values.get("fraction_evaluate", 0) > 0 and not cfg["partition"].get("local_test_fraction"):
        raise ConfigError(
            "partition.local_test_fraction",
            cfg["partition"].get("local_test_fraction"),
            f"a fraction > 0 when strategy.fraction_evaluate={values['fraction_evaluate']} "
            "(clients evaluate on held-out rows of their own data, never on what they train on)",
        )


def _checker(module: ModuleType):  # noqa: ANN202
    own = getattr(module, "check_config", None)

    def check(values: Mapping[str, Any], cfg: Mapping[str, Any]) -> None:
        check_federated_evaluation(values, cfg)
        if own is not None:
            own(values, cfg)

    return check


for _name, _module in STRATEGIES.items():
    register_schema("strategy", _name, _module.CONFIG_SCHEMA, _checker(_module))

#: Strategies with one server model, whose aggregation a selector may weigh (clustered sampling).
ONE_MODEL = ("fedavg", "fedexp", "fedgen")


def _check_selection(values: Mapping[str, Any], cfg: Mapping[str, Any]) -> None:
    if cfg["strategy"]["name"] not in ONE_MODEL:
        raise ConfigError(
            "selection", values["name"],
            f"selection=uniform with strategy.name={cfg['strategy']['name']} (clustered sampling weighs the "
            f"replies of one model: strategies {', '.join(ONE_MODEL)}, or presets built on them such as fedprox)",
        )
    clustered_sampling.check_config(values, cfg)


register_schema("selection", "uniform", {})
register_schema("selection", "clustered", clustered_sampling.CONFIG_SCHEMA, _check_selection)


def build_strategy(cfg: Mapping[str, Any]) -> Strategy:
    """The strategy selected by ``strategy.name`` with the client selector of ``selection``, waiting
    at most ``min_nodes_timeout`` for nodes."""
    strategy = STRATEGIES[cfg["strategy"]["name"]].from_config(cfg)
    if cfg.get("selection", {}).get("name", "uniform") == "clustered":
        query = {protocol.ROSTER_EXAMPLES: 1, protocol.RUN_CONFIG: protocol.run_config_record(cfg)}
        strategy.selector = clustered_sampling.build_selector(cfg, query)
    if isinstance(strategy.selector, SeededRosterSelector):
        strategy.selector.min_nodes_timeout = float(cfg["min_nodes_timeout"]) or None
    return strategy
