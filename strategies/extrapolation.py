"""FedExP's server step (Jhunjhunwala, Wang, Joshi, ICLR 2023): pure functions on models.

With w the current global model and w_i the K trained models (weights p_i ∝ the clients'
example counts): Δ_i = w_i − w over the trainable parameters, Δ̄ = Σ p_i Δ_i,
A = Σ p_i ‖Δ_i‖², and the server step size

    η_g = max(1, A / (2 · (‖Δ̄‖² + K · ε)))

(ε multiplied by the number of participating clients, as the original code does). The next
global model is w + η_g · Δ̄: FedExP never steps less than FedAvg (η_g ≥ 1).

Parameters and buffers are told apart by name and dtype: integer entries and the entries named
``*.running_mean``, ``*.running_var``, ``*.num_batches_tracked`` (PyTorch's BatchNorm buffers)
are buffers. Norms cover parameters only. Buffers are either averaged (the original: its models
have none, GroupNorm) or extrapolated with the same η_g (the FedMR authors' port), which can
push a running variance below zero; averaging cannot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedmm.protocol import ModelDict
from strategies.aggregation import weighted_mean_models

#: Names of PyTorch's BatchNorm buffers (the last part of a state_dict key).
BUFFER_NAMES = ("running_mean", "running_var", "num_batches_tracked")


def is_buffer(key: str, value: np.ndarray) -> bool:
    """Whether a state_dict entry is a buffer rather than a trainable parameter."""
    return not np.issubdtype(value.dtype, np.floating) or key.rsplit(".", 1)[-1] in BUFFER_NAMES


def step_size(sq_norms: Sequence[float], weights: Sequence[float], mean_sq_norm: float, epsilon: float) -> float:
    """η_g = max(1, A / (2(‖Δ̄‖² + K·ε))), A the p-weighted mean of the ‖Δ_i‖²."""
    p = np.asarray(weights, dtype=np.float64)
    p = p / p.sum()
    a = float(np.dot(p, np.asarray(sq_norms, dtype=np.float64)))
    return max(1.0, a / (2.0 * (float(mean_sq_norm) + len(p) * float(epsilon))))


def fedexp_step(
    current: Mapping[str, np.ndarray],
    models: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float],
    epsilon: float,
    extrapolate_buffers: bool,
    mean: ModelDict | None = None,
    robust: bool = False,
) -> tuple[ModelDict, float]:
    """(next global model, η_g) from the current global model and the trained models.

    ``mean``: the mean of ``models`` the run takes (default: their weighted mean). ``robust``:
    it is a robust mean (``strategy.defence.aggregator``); A is then the median of the ‖Δ_i‖²,
    which one client cannot inflate."""
    mean = weighted_mean_models(models, weights) if mean is None else mean  # w + Δ̄ for every entry
    params = [key for key, value in current.items() if not is_buffer(key, value)]
    sq_norms = []
    for model in models:
        total = 0.0
        for key in params:
            diff = (model[key] - current[key]).ravel()
            total += float(np.dot(diff, diff))
        sq_norms.append(total)
    mean_sq = 0.0
    for key in params:
        diff = (mean[key] - current[key]).ravel()
        mean_sq += float(np.dot(diff, diff))
    if robust:
        sq_norms, weights = [float(np.median(sq_norms))] * len(sq_norms), [1.0] * len(sq_norms)
    eta = step_size(sq_norms, weights, mean_sq, epsilon)
    out: ModelDict = {}
    for key, value in current.items():
        if is_buffer(key, value) and not extrapolate_buffers:
            out[key] = mean[key]
        elif np.issubdtype(value.dtype, np.floating):
            out[key] = value + (mean[key] - value) * np.asarray(eta, dtype=value.dtype)
        else:  # an integer buffer extrapolated: in float64, rounded back
            step = value.astype(np.float64) + eta * (mean[key].astype(np.float64) - value.astype(np.float64))
            out[key] = np.rint(step).astype(value.dtype)
    return out, eta


def average_iterates(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> ModelDict:
    """(a + b) / 2 for every entry (integer entries rounded back): the model FedExP evaluates."""
    out: ModelDict = {}
    for key, value in a.items():
        if np.issubdtype(value.dtype, np.floating):
            out[key] = (value + b[key]) * np.asarray(0.5, dtype=value.dtype)
        else:
            out[key] = np.rint((value.astype(np.float64) + b[key]) / 2).astype(value.dtype)
    return out
