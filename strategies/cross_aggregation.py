"""Multi-model cross-aggregation (FedCross, Hu et al., Section III).

Pure functions on lists of models (dicts of numpy arrays): similarity between models,
collaborative-model selection, and the update ``w_j ← α·w_j + (1−α)·w_c(j)``.
Everything works one state_dict entry at a time, so no flattened copy of a whole model
(let alone K² of them) is ever built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

SELECTIONS = ("in-order", "lowest-similarity", "highest-similarity")
SIMILARITIES = ("model", "chunked")


def _float_keys(model: Mapping[str, np.ndarray]) -> list[str]:
    # integer buffers (BatchNorm's num_batches_tracked) carry no direction to compare
    return [key for key, value in model.items() if np.issubdtype(value.dtype, np.floating)]


def _gram(
    models: Sequence[Mapping[str, np.ndarray]], keys: Sequence[str], block_bytes: int = 64 << 20, dtype: np.dtype | None = None
) -> np.ndarray:
    """G[i, j] = Σ_keys <w_i[key], w_j[key]>.

    The K models' tensors are copied, in state_dict order, into one reusable K × B buffer of
    at most ``block_bytes`` (64 MiB); each full buffer costs one BLAS product. So the only copy
    ever held is that buffer, whatever the model size or K. Products run in the models' dtype
    (or ``dtype``); each block's result is accumulated in float64.
    """
    k = len(models)
    gram = np.zeros((k, k), dtype=np.float64)
    if not keys:
        return gram
    dtype = np.dtype(dtype) if dtype is not None else np.result_type(*(models[0][key].dtype for key in keys))
    cols = max(1, block_bytes // (dtype.itemsize * k))
    total = sum(models[0][key].size for key in keys)
    buf = np.empty((k, min(cols, total)), dtype=dtype)
    fill = 0
    for key in keys:
        flat = [np.asarray(m[key]).reshape(-1) for m in models]  # views, no copy
        start, n = 0, flat[0].size
        while start < n:
            take = min(buf.shape[1] - fill, n - start)
            for i, f in enumerate(flat):
                buf[i, fill : fill + take] = f[start : start + take]
            fill += take
            start += take
            if fill == buf.shape[1]:
                gram += (buf @ buf.T).astype(np.float64)
                fill = 0
    if fill:
        part = buf[:, :fill]
        gram += (part @ part.T).astype(np.float64)
    return gram


def _cosine_from_gram(gram: np.ndarray) -> np.ndarray:
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    denom = np.outer(norms, norms)
    return np.divide(gram, denom, out=np.zeros_like(gram), where=denom > 0)


def model_similarity(models: Sequence[Mapping[str, np.ndarray]], mode: str = "model", chunk_size: int = 2) -> np.ndarray:
    """K × K similarity between models.

    ``model``: one cosine over all floating-point weights (the paper's formula).
    ``chunked``: the sum of cosines over consecutive chunks of ``chunk_size`` state_dict
    tensors, as the authors' code chunks them: every state_dict entry in order, integer buffers
    (BatchNorm's ``num_batches_tracked``) included as numbers, so that the pairs are theirs
    (chunks of two: a layer's weight and bias). Each chunk counts once; the authors' loop adds
    its last chunk a second time after the loop, which we do not copy (it weighs the classifier
    double).
    """
    if mode == "model":
        return _cosine_from_gram(_gram(models, _float_keys(models[0])))
    if mode == "chunked":
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r}; allowed: an integer >= 1")
        keys = list(models[0])
        total = np.zeros((len(models), len(models)))
        for start in range(0, len(keys), chunk_size):
            total += _cosine_from_gram(_gram(models, keys[start : start + chunk_size], dtype=np.float64))
        return total
    raise ValueError(f"similarity={mode!r}; allowed: {', '.join(SIMILARITIES)}")


def in_order_offset(server_round: int, k: int) -> int:
    """Offset of the in-order selection: r mod (K−1) + 1 (visits every other model in K−1 rounds)."""
    return server_round % (k - 1) + 1


def collaborative_models(similarity: np.ndarray | None, selection: str, server_round: int, k: int) -> np.ndarray:
    """Index c(j) of the collaborative model of every model j (never j itself, for K > 1)."""
    if selection not in SELECTIONS:
        raise ValueError(f"selection={selection!r}; allowed: {', '.join(SELECTIONS)}")
    if k == 1:
        return np.zeros(1, dtype=np.int64)
    if selection == "in-order":
        return (np.arange(k) + in_order_offset(server_round, k)) % k
    if similarity is None or similarity.shape != (k, k):
        raise ValueError(f"{selection} selection needs a {k}x{k} similarity matrix")
    sim = np.array(similarity, dtype=np.float64)
    if selection == "lowest-similarity":
        np.fill_diagonal(sim, np.inf)
        return np.argmin(sim, axis=1)
    np.fill_diagonal(sim, -np.inf)
    return np.argmax(sim, axis=1)


def propellers(k: int, count: int) -> list[list[int]]:
    """The ``count`` in-order partners of every model: (j+1, ..., j+count) mod K."""
    count = max(1, min(count, k - 1)) if k > 1 else 0
    return [[(j + d) % k for d in range(1, count + 1)] or [j] for j in range(k)]


def cross_aggregate(
    models: Sequence[dict[str, np.ndarray]],
    collaborators: Sequence[Sequence[int]] | np.ndarray,
    alpha: float,
    consume: bool = False,
    block_bytes: int = 64 << 20,
) -> list[dict[str, np.ndarray]]:
    """``w_j ← α·w_j + (1−α)·mean(w_c for c in collaborators[j])`` for all j, from the old set.

    ``collaborators[j]`` is one index (cross-aggregation) or several (propeller models).
    Integer buffers are left as they are.

    ``consume=False`` (pure): new arrays; the inputs are untouched. ``consume=True`` (what the
    strategy uses, handing over the trained models): the result is written into the input
    arrays, block by block, through one K × B buffer of at most ``block_bytes`` holding the old
    values; the input dicts are emptied. Beyond the K models, memory is then that buffer plus one
    tensor (an input array shared between models, e.g. after a stage-1 reset, is copied first).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r}; allowed: a number in [0, 1]")
    partners = [np.atleast_1d(np.asarray(c, dtype=np.int64)) for c in collaborators]
    k = len(models)
    if len(partners) != k:
        raise ValueError(f"{len(partners)} collaborator lists for {k} models")
    out: list[dict[str, np.ndarray]] = [{} for _ in range(k)]
    for key, first in list(models[0].items()):
        if not np.issubdtype(first.dtype, np.floating) or alpha == 1.0:
            for j in range(k):
                out[j][key] = models[j][key]
        elif consume:
            _fuse_in_place(models, key, partners, alpha, out, block_bytes)
        else:
            for j in range(k):
                new = np.multiply(models[j][key], alpha, dtype=first.dtype)
                weight = (1.0 - alpha) / len(partners[j])
                for c in partners[j]:
                    new += weight * models[int(c)][key]
                out[j][key] = new
        if consume:
            for model in models:
                model.pop(key, None)
    return out


def _fuse_in_place(
    models: Sequence[dict[str, np.ndarray]],
    key: str,
    partners: list[np.ndarray],
    alpha: float,
    out: list[dict[str, np.ndarray]],
    block_bytes: int,
) -> None:
    """The fusion of one state_dict entry, written into the K input arrays block by block."""
    k = len(models)
    owned: list[np.ndarray] = []
    seen: set[int] = set()
    for model in models:
        array = model[key]
        if id(array) in seen or not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, order="C", copy=True)  # never write through an alias
        seen.add(id(array))
        owned.append(array)
    flat = [a.reshape(-1) for a in owned]  # views of the owned arrays
    n, dtype = flat[0].size, flat[0].dtype
    cols = max(1, min(n, block_bytes // (dtype.itemsize * k)))
    old = np.empty((k, cols), dtype=dtype)
    for start in range(0, n, cols):
        width = min(cols, n - start)
        for i, f in enumerate(flat):
            old[i, :width] = f[start : start + width]
        for j, f in enumerate(flat):
            target = f[start : start + width]
            np.multiply(old[j, :width], alpha, out=target)
            weight = (1.0 - alpha) / len(partners[j])
            for c in partners[j]:
                target += weight * old[int(c), :width]
    for j in range(k):
        out[j][key] = owned[j]


def dynamic_alpha(server_round: int, alpha: float, rounds: int, start_round: int = 0, initial: float = 0.5) -> float:
    """Dynamic α of the acceleration (linear schedule).

    α(r) = initial + (alpha − initial)·min(1, (r − start_round − 1) / rounds) for r > start_round:
    ``initial`` (0.5) in the first round after ``start_round``, rising linearly to ``alpha``
    after ``rounds`` rounds, then constant. ``rounds = 0`` disables it (α = alpha always).
    """
    if rounds <= 0:
        return alpha
    progress = min(1.0, max(0.0, (server_round - start_round - 1) / rounds))
    return initial + (alpha - initial) * progress
