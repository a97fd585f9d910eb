"""Layer-wise model recombination (FedMR, Hu et al.; KDD'24 version Section 4).

Pure functions on lists of models (dicts of arrays or tensors). Recombination only moves
references: no array is copied, so K recombined models of any size cost K small dicts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TypeVar

import numpy as np

from fedmm.layers import GRANULARITIES, layer_units

T = TypeVar("T")

__all__ = ["GRANULARITIES", "layer_units", "recombine", "segments_for_ratio"]


def segments_for_ratio(partition_ratio: float | None) -> int | None:
    """Number of segments of "FedMR-p x": ⌈1/x⌉ (x = 1.0 is whole-model shuffling, "Indep")."""
    if partition_ratio is None:
        return None
    if not 0 < partition_ratio <= 1:
        raise ValueError(f"partition_ratio={partition_ratio!r}; allowed: a number in (0, 1] or null")
    return math.ceil(round(1.0 / partition_ratio, 9))


def recombine(
    models: Sequence[Mapping[str, T]],
    rng: np.random.Generator,
    granularity: str = "tensor",
    segments: int | None = None,
) -> list[dict[str, T]]:
    """Recombine K models layer by layer.

    For every unit (see :func:`layer_units`) draw an independent permutation ``perm`` of the
    K models and give recombined model i the unit of model ``perm[i]``. With ``segments``,
    the ordered units are cut into that many contiguous segments and all units of a segment
    share one permutation (``segments=1`` shuffles whole models).

    Every uploaded unit ends up in exactly one recombined model, so the element-wise sum of
    the models and Σ‖w_k − x‖² are unchanged (Lemma 4.4).
    """
    k = len(models)
    if k == 0:
        return []
    keys = list(models[0])
    units = layer_units(keys, granularity)
    if segments is not None:
        if segments < 1:
            raise ValueError(f"segments={segments!r}; allowed: an integer >= 1")
        bounds = np.linspace(0, len(units), min(segments, len(units)) + 1).round().astype(int)
        units = [sum(units[a:b], []) for a, b in zip(bounds[:-1], bounds[1:])]
    out: list[dict[str, T]] = [{} for _ in range(k)]
    for unit in units:
        perm = rng.permutation(k)
        for i in range(k):
            donor = models[perm[i]]
            for key in unit:
                out[i][key] = donor[key]
    # keep the state_dict order in every recombined model
    return [{key: model[key] for key in keys} for model in out]
