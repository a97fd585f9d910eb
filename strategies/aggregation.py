"""Aggregation kernels shared by the methods: pure functions on lists of models (dicts of arrays)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedmm.protocol import ModelDict


def mean_models(models: Sequence[Mapping[str, np.ndarray]]) -> ModelDict:
    """Unweighted element-wise mean of K models (integer buffers are averaged, then rounded back)."""
    out: ModelDict = {}
    k = len(models)
    for key, first in models[0].items():
        acc = np.array(first, dtype=np.float64 if not np.issubdtype(first.dtype, np.floating) else first.dtype, copy=True)
        for model in models[1:]:
            acc += model[key]
        acc /= k
        out[key] = acc if acc.dtype == first.dtype else np.asarray(np.rint(acc)).astype(first.dtype)  # 0-d stays an array
    return out


def weighted_mean_models(models: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> ModelDict:
    """Σ_i p_i·w_i with p_i = weights_i / Σ weights (FedAvg), in each array's own dtype
    (integer buffers are averaged in float64, then rounded back)."""
    p = np.asarray(weights, dtype=np.float64)
    p = p / p.sum()
    out: ModelDict = {}
    for key, first in models[0].items():
        floating = np.issubdtype(first.dtype, np.floating)
        acc = np.multiply(first, p[0], dtype=first.dtype if floating else np.float64)
        tmp = np.empty_like(acc)
        for model, weight in zip(models[1:], p[1:]):
            np.multiply(model[key], weight, out=tmp, casting="unsafe")
            acc += tmp
        out[key] = acc if floating else np.asarray(np.rint(acc)).astype(first.dtype)
    return out


def non_finite_key(model: ModelDict | None) -> str | None:
    """The first key of ``model`` holding NaN or Inf, or None."""
    for key, value in (model or {}).items():
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            return key
    return None
