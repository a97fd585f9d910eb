"""Clustered sampling (Fraboni, Vidal, Kameni, Lorenzi, ICML 2021): pure functions.

MD sampling draws K clients with replacement, client i with probability p_i (its share of the
examples), and aggregates with weight 1/K each. Clustered sampling replaces the K identical
draws by K distributions r_1..r_K over the clients with

    Σ_i r_{k,i} = 1 for every k,     Σ_k r_{k,i} = K·p_i for every client i,

and draws one client from each: the expected aggregation weight of client i is still p_i
(unbiased) and clients that are alike are rarely drawn together (lower variance).

Masses are integers: client i carries m_i ≈ K·p_i·E units (E = 10^10, as the original code),
rounded by largest remainder so that Σ m_i = K·E exactly, and every distribution is filled with
exactly E units. Then Σ_k r_{k,i} = m_i / E, within 1/E of K·p_i, and no distribution is left
short or overfull by rounding (the original truncates, which can leave the last one short).

- :func:`algorithm1`: sample sizes only. Clients in decreasing order of mass are poured into
  distribution 1, 2, ..., a client whose mass does not fit being split across consecutive ones.
- :func:`algorithm2`: Ward clustering of the clients' representative gradients
  (:func:`distance_rows`), the tree cut into clusters of weight ≤ 1/K, the K heaviest clusters
  seeding one distribution each, the others poured in (ascending weight, clients shuffled).
  A client heavier than 1/K is a cluster on its own: it fills one distribution and the rest of
  its mass is poured first, so the identity above holds for it too (the original code would
  overfill that distribution).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Units of mass per distribution (the original code's ε).
UNITS = 10**10
#: Distances between representative gradients.
DISTANCES = ("arccos", "L1", "L2")


def masses(weights: Sequence[float], k: int, units: int = UNITS) -> np.ndarray:
    """Integer masses m_i ≈ K·p_i·units with Σ m_i = K·units exactly (largest remainder)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be finite, >= 0, with a positive sum; got {list(w)[:5]}")
    if k < 1:
        raise ValueError(f"K must be >= 1, got {k}")
    total = k * units
    exact = w / w.sum() * total
    out = np.floor(exact).astype(np.int64)
    short = int(total - out.sum())
    if short > 0:
        # the largest remainders (ties: lower index first) get one unit more
        order = np.lexsort((np.arange(len(w)), -(exact - out)))
        out[order[:short]] += 1
    return out


def _pour(dist: np.ndarray, k: int, client: int, mass: int, units: int) -> int:
    """Pour ``mass`` units of ``client`` into distributions k, k+1, ... (each holds ``units``);
    return the index of the first distribution that is not full afterwards."""
    while mass > 0:
        while dist[k].sum() >= units:
            k += 1
        put = min(units - int(dist[k].sum()), mass)
        dist[k, client] += put
        mass -= put
    while k < len(dist) and dist[k].sum() >= units:
        k += 1
    return k


def _normalised(dist: np.ndarray) -> np.ndarray:
    out = dist.astype(np.float64)
    return out / out.sum(axis=1, keepdims=True)


def algorithm1(weights: Sequence[float], k: int, units: int = UNITS) -> np.ndarray:
    """K×N distributions from the clients' weights only (Fraboni et al., Algorithm 1)."""
    m = masses(weights, k, units)
    dist = np.zeros((k, len(m)), dtype=np.int64)
    position = 0
    for client in np.lexsort((np.arange(len(m)), -m)):  # decreasing mass, ties by index
        position = _pour(dist, position, int(client), int(m[client]), units)
    return _normalised(dist)


def distance_rows(grads: np.ndarray, rows: Sequence[int], metric: str, chunk: int = 64) -> np.ndarray:
    """Distances from the representative gradients ``grads[rows]`` to every row of ``grads``
    (len(rows) × N), in float64.

    ``arccos``: the angle between the two vectors (the original's ``cosine`` option: arccos of
    the cosine, 0 when either is zero; the cosine is clipped to [−1, 1], where the original can
    produce NaN from rounding); ``L1``: Σ|a − b|; ``L2``: Σ(a − b)² (squared, as the original).
    """
    if metric not in DISTANCES:
        raise ValueError(f"distance must be one of {', '.join(DISTANCES)}; got {metric!r}")
    rows = list(rows)
    n = len(grads)
    out = np.zeros((len(rows), n), dtype=np.float64)
    if metric == "arccos":
        norms = np.sqrt(np.einsum("ij,ij->i", grads, grads, dtype=np.float64))
    for r, i in enumerate(rows):
        g = grads[i]
        g64 = g.astype(np.float64)
        for start in range(0, n, chunk):
            block = grads[start : start + chunk]
            if metric == "arccos":
                dots = block.astype(np.float64) @ g64
                denom = norms[start : start + chunk] * norms[i]
                with np.errstate(invalid="ignore", divide="ignore"):
                    cos = np.where(denom > 0, dots / np.where(denom > 0, denom, 1.0), 1.0)
                angle = np.arccos(np.clip(cos, -1.0, 1.0))
                out[r, start : start + chunk] = np.where(denom > 0, angle, 0.0)
            else:
                diff = block.astype(np.float64) - g64
                out[r, start : start + chunk] = np.abs(diff).sum(axis=1) if metric == "L1" else np.einsum("ij,ij->i", diff, diff)
    return out


def full_distances(grads: np.ndarray, metric: str) -> np.ndarray:
    """The N×N matrix of :func:`distance_rows` over all clients."""
    return distance_rows(grads, range(len(grads)), metric)


def ward_linkage(matrix: np.ndarray, linkage_input: str) -> np.ndarray:
    """Ward's linkage of the clients.

    ``rows``: scipy gets the square matrix itself, and so clusters its rows as observation
    vectors (Euclidean distances between the clients' distance profiles): what both the original
    code and the FedMR authors' port do. ``condensed``: scipy gets the distances themselves
    (the matrix symmetrised, its diagonal zeroed).
    """
    from scipy.cluster.hierarchy import linkage
    from scipy.spatial.distance import squareform

    if len(matrix) < 2:
        return np.zeros((0, 4))
    if linkage_input == "rows":
        return linkage(matrix, "ward")
    if linkage_input == "condensed":
        sym = (matrix + matrix.T) / 2.0
        np.fill_diagonal(sym, 0.0)
        return linkage(squareform(sym, checks=False), "ward")
    raise ValueError(f"linkage_input must be rows or condensed; got {linkage_input!r}")


def weight_clusters(linkage_matrix: np.ndarray, m: np.ndarray, k: int, units: int = UNITS) -> np.ndarray:
    """Flat cluster labels (1..C) of the tree cut at weight 1/K: every merge's height is replaced
    by the mass of the merged cluster and the tree cut at ``units`` (= 1/K of the total)."""
    from scipy.cluster.hierarchy import fcluster

    n = len(m)
    if n == 1:
        return np.ones(1, dtype=np.int64)
    tree = np.array(linkage_matrix, dtype=np.float64, copy=True)
    mass = list(m.astype(np.float64))
    for row in tree:
        merged = mass[int(row[0])] + mass[int(row[1])]
        mass.append(merged)
        row[2] = merged
    return fcluster(tree, float(units), criterion="distance").astype(np.int64)


def algorithm2(
    linkage_matrix: np.ndarray, weights: Sequence[float], k: int, rng: np.random.Generator, units: int = UNITS
) -> tuple[np.ndarray, np.ndarray]:
    """(K×N distributions, flat cluster labels) from Ward's tree of the clients (Fraboni et al.,
    Algorithm 2; ``rng`` shuffles the clients of every poured cluster)."""
    m = masses(weights, k, units)
    labels = weight_clusters(linkage_matrix, m, k, units)
    ids = np.unique(labels)
    cluster_mass = np.array([m[labels == c].sum() for c in ids])
    order = ids[np.lexsort((ids, cluster_mass))]  # ascending mass, ties by label
    kept, poured = order[max(0, len(order) - k) :], order[: max(0, len(order) - k)]
    dist = np.zeros((k, len(m)), dtype=np.int64)
    overflow: list[tuple[int, int]] = []
    for slot, cluster in enumerate(kept):
        members = np.flatnonzero(labels == cluster)
        if m[members].sum() > units:  # one client heavier than 1/K: fill, pour the rest
            (client,) = members
            dist[slot, client] = units
            overflow.append((int(client), int(m[client]) - units))
        else:
            dist[slot, members] = m[members]
    position = 0
    for client, rest in overflow:
        position = _pour(dist, position, client, rest, units)
    for cluster in poured:
        members = np.flatnonzero(labels == cluster)
        for client in rng.permutation(members):
            position = _pour(dist, position, int(client), int(m[client]), units)
    return _normalised(dist), labels


def draw(distributions: np.ndarray, rng: np.random.Generator) -> list[int]:
    """One client index from each distribution, in distribution order."""
    return [int(rng.choice(distributions.shape[1], p=row)) for row in distributions]


def port_partial_update(matrix: np.ndarray, grads: np.ndarray, drawn: Sequence[int], metric: str) -> None:
    """The FedMR authors' in-place update of the distance matrix after a round (code-faithful):
    for each drawn i only the entry (i, j) with j the last drawn client is recomputed, one
    direction; i's distances to every other client keep their old values (from round 0, zeros)."""
    if not len(drawn):
        return
    last = int(drawn[-1])
    for i in drawn:
        i = int(i)
        matrix[i, last] = distance_rows(grads, [i], metric)[0, last] if i != last else 0.0
