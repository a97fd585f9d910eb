"""Server-side strategies: one module per method, registered here by config name.

Each module provides ``from_config(cfg) -> Strategy`` and, when its config group has keys of
its own, ``validate(cfg)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flwr.serverapp.strategy import Strategy

from strategies import fedavg, fedcross, fedmr

#: strategy.name -> module with ``from_config`` (and optionally ``validate``).
STRATEGIES: dict[str, Any] = {
    "fedavg": fedavg,
    "fedmr": fedmr,
    "fedcross": fedcross,
}


def build_strategy(cfg: Mapping[str, Any]) -> Strategy:
    """The strategy selected by ``strategy.name``."""
    builder: Callable[[Mapping[str, Any]], Strategy] = STRATEGIES[cfg["strategy"]["name"]].from_config
    return builder(cfg)


def validate_strategy_config(cfg: Mapping[str, Any]) -> None:
    """Run the selected strategy's own config checks, if it has any."""
    module = STRATEGIES[cfg["strategy"]["name"]]
    if hasattr(module, "validate"):
        module.validate(cfg)
