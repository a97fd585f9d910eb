"""The units of a model that move together when models are recombined or exchanged (FedMR).

Shared by the server's recombination (:mod:`strategies.recombination`) and the clients' secure
exchange (:mod:`fedmm.secure`), so both cut a state_dict the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

GRANULARITIES = ("tensor", "layer")


def layer_units(keys: Sequence[str], granularity: str = "tensor") -> list[list[str]]:
    """Split ordered state_dict keys into the units that move together.

    ``tensor``: every state_dict entry is its own unit (the authors' code: a conv weight and
    its bias, or BatchNorm's weight and running_mean, may come from different donors).
    ``layer``: all entries of one module (same prefix before the last ``.``) move together.
    """
    if granularity == "tensor":
        return [[key] for key in keys]
    if granularity == "layer":
        units: list[list[str]] = []
        prefixes: dict[str, int] = {}
        for key in keys:
            prefix = key.rsplit(".", 1)[0] if "." in key else key
            if prefix not in prefixes:
                prefixes[prefix] = len(units)
                units.append([])
            units[prefixes[prefix]].append(key)
        return units
    raise ValueError(f"granularity={granularity!r}; allowed: {', '.join(GRANULARITIES)}")
