"""FedMut's mutation kernel (Hu et al., AAAI 2024): pure functions on models (dicts of arrays).

After a round, the K next models are spread around the new global model along the round's
update Δ = w_glob − w_old. For every state_dict entry on its own, a shuffled list of ⌊K/2⌋
signs +1 and ⌊K/2⌋ signs (−1 + c) decides where each model lands:

    model_j[key] = w_glob[key] + sign_j[key] · radius · Δ[key]

with c = acc_rate · (1 − min(r / bound, 1)) for the 0-based round r ("mutation acceleration":
for even K the mean of the K models is w_glob + (radius · c / 2) · Δ, pushed forward along Δ
while r < bound, and exactly w_glob afterwards). For odd K the last model is w_glob unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedmm.protocol import ModelDict


def acceleration(server_round: int, acc_rate: float, bound: int) -> float:
    """c of round ``server_round`` (1-based, as the round loop counts; the formula uses r = round − 1)."""
    r = server_round - 1
    return float(acc_rate) * (1.0 - min(r / float(bound), 1.0))


def mutation_signs(rng: np.random.Generator, num_models: int, c: float) -> np.ndarray:
    """One shuffled list of ⌊K/2⌋ × (+1) and ⌊K/2⌋ × (−1 + c), in float64."""
    half = num_models // 2
    signs = np.array([1.0] * half + [-1.0 + c] * half, dtype=np.float64)
    return rng.permutation(signs)


def mutate(
    global_model: Mapping[str, np.ndarray],
    old_global: Mapping[str, np.ndarray],
    num_models: int,
    radius: float,
    c: float,
    rng: np.random.Generator,
) -> list[ModelDict]:
    """The K mutated models around ``global_model`` (every state_dict entry, its own signs).

    Floating-point entries are mutated in their own dtype. Integer entries (BatchNorm's
    ``num_batches_tracked``) are mutated in float64 and truncated toward zero back to their
    dtype, which is what loading the authors' float state_dict into the model does. The inputs
    are never written; an odd K's last model is ``global_model`` itself (shared arrays).
    """
    if num_models < 1:
        raise ValueError(f"num_models must be >= 1, got {num_models}")
    paired = 2 * (num_models // 2)
    models: list[ModelDict] = [{} for _ in range(paired)]
    for key, value in global_model.items():
        signs = mutation_signs(rng, num_models, c)
        floating = np.issubdtype(value.dtype, np.floating)
        work = value if floating else value.astype(np.float64)
        delta = work - (old_global[key] if floating else old_global[key].astype(np.float64))
        step = delta * np.asarray(radius, dtype=work.dtype)
        for j in range(paired):
            mutated = work + step * np.asarray(signs[j], dtype=work.dtype)
            models[j][key] = mutated if floating else np.trunc(mutated).astype(value.dtype)
    if paired < num_models:
        models.append(dict(global_model))
    return models
