"""Federated partitions of a training split: iid, Dirichlet label skew, natural ids.

Partitions are computed with the flwr-datasets partitioners (public API only) on a small
``datasets.Dataset`` that holds labels, row indices and natural ids. Partitions and client
shards are cached per process, and the partitioners' rows on disk for every process of the
machine (:mod:`fedmm.data.partition_cache`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedmm.data import partition_cache
from fedmm.data.sources import _load_dataset_cached
from fedmm.data.spec import NUM_CLIENTS_KEY, _dataset_spec, _DatasetSpec, _is_int, _partition_spec, _PartitionSpec
from fedmm.data.tensors import TensorData
from fedmm.errors import ConfigError


def partition_indices(train: TensorData, partition_cfg: Mapping, num_partitions: int, seed: int) -> list[np.ndarray]:
    """Split the training rows among ``num_partitions`` clients.

    Parameters
    ----------
    train : TensorData
        The training split (as returned by :func:`load_dataset`).
    partition_cfg : Mapping
        The ``partition`` config group: ``iid``, ``dirichlet`` (label skew with
        concentration ``alpha``) or ``natural`` (one natural id per client).
    num_partitions : int
        Number of clients.
    seed : int
        Run seed; the same seed gives the same partitions.

    Returns
    -------
    list of numpy.ndarray
        Sorted, read-only int64 row indices of each partition. iid and dirichlet
        assign every row exactly once; natural keeps only the rows of the chosen ids.
        Cached per process (keyed by the identity of ``train``).
    """
    spec = _partition_spec(partition_cfg)
    _check_counts(len(train), num_partitions, seed)
    return _partition_cached(train, spec, int(num_partitions), int(seed))


def _check_counts(num_samples: int, num_partitions: int, seed: int) -> None:
    if not _is_int(num_partitions) or not 1 <= num_partitions <= num_samples:
        raise ConfigError(NUM_CLIENTS_KEY, num_partitions, f"an integer between 1 and the number of training samples ({num_samples})")
    if not _is_int(seed):
        raise ConfigError("seed", seed, "an integer")


class _Partitions:
    """The partitions of one (split, partition config, count, seed): a flwr-datasets partitioner
    that has decided every partition, or precomputed row lists (large IID federations)."""

    def __init__(self, partitioner: Any = None, rows: list[np.ndarray] | None = None) -> None:
        self.partitioner, self.rows = partitioner, rows

    def rows_of(self, partition_id: int) -> np.ndarray:
        """Sorted, read-only int64 rows of one partition (one select on the partitioner)."""
        if self.rows is not None:
            part = self.rows[partition_id]
        else:
            shard = self.partitioner.load_partition(partition_id)
            part = shard.with_format("numpy", columns=["idx"])[:]["idx"]
        arr = np.sort(np.asarray(part, dtype=np.int64))
        arr.setflags(write=False)  # shared through the cache
        return arr


@functools.lru_cache(maxsize=16)
def _partitions(train: TensorData, spec: _PartitionSpec, num_partitions: int, seed: int) -> _Partitions:
    labels = train.y.numpy()
    if spec.name == "iid":
        return _iid(labels, num_partitions, seed)
    if spec.name == "dirichlet":
        if spec.algorithm == "authors":
            return _Partitions(rows=authors_dirichlet(labels, num_partitions, spec.alpha, spec.min_partition_size, seed))
        return _dirichlet(labels, spec, num_partitions, seed)
    if spec.name == "file":
        from fedmm.data.partition_file import read_partition_file

        return _Partitions(rows=read_partition_file(spec.path, len(labels), num_partitions))
    return _natural(labels, train.ids, spec, num_partitions, seed)


def authors_dirichlet(labels: np.ndarray, num_clients: int, alpha: float, min_size: int, seed: int,
                      draw: Any = None, max_attempts: int = 1000) -> list[np.ndarray]:
    """The Dirichlet split of the FedMR / FedCross authors' repositories, step by step.

    With a ``numpy.random.RandomState(seed)`` (their code seeds the global one the same way):
    for each class in label order, shuffle its rows and draw proportions p ~ Dir(alpha) over the
    clients; a client that already holds N / num_clients rows or more gets p = 0 (self-balancing;
    it may overshoot within one class); renormalise, cut the class's rows at
    ``int(cumsum(p) · n_class)`` and hand the pieces out. Repeat the whole split until every client
    has ``min_size`` rows (their 10). Finally each client's rows are shuffled (their lists'
    order; we return them sorted like every partition). ``draw(rng, class, sizes)``, for tests,
    replaces the Dirichlet draw.
    """
    rng = np.random.RandomState(seed)
    n = len(labels)
    classes = np.unique(labels)
    cap = n / num_clients
    for _ in range(max_attempts):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for k in classes:
            rows = np.where(labels == k)[0]
            rng.shuffle(rows)
            sizes = np.array([len(p) for p in parts])
            p = draw(rng, k, sizes) if draw is not None else rng.dirichlet(np.repeat(alpha, num_clients))
            p = np.array([pj * (size < cap) for pj, size in zip(p, sizes)])
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(rows)).astype(int)[:-1]
            for j, piece in enumerate(np.split(rows, cuts)):
                parts[j].extend(piece.tolist())
        if min(len(p) for p in parts) >= min_size:
            out = []
            for part in parts:
                rng.shuffle(part)
                arr = np.sort(np.asarray(part, dtype=np.int64))
                arr.setflags(write=False)
                out.append(arr)
            return out
    raise ConfigError("partition.min_partition_size", min_size,
                      f"a smaller value: no Dirichlet draw with alpha={alpha} in {max_attempts} gave every one of "
                      f"the {num_clients} clients that many samples")


@functools.lru_cache(maxsize=16)
def _partition_cached(train: TensorData, spec: _PartitionSpec, num_partitions: int, seed: int) -> list[np.ndarray]:
    def compute() -> list[np.ndarray]:
        parts = _partitions(train, spec, num_partitions, seed)
        return [parts.rows_of(pid) for pid in range(num_partitions)]

    if spec.name == "file" or spec.algorithm == "authors":  # no flwr-datasets import to save
        return compute()
    # the flwr-datasets partitioners: their rows from the disk cache, shared by the machine's processes
    labels = train.y.numpy()
    ids = np.asarray(train.ids) if spec.name == "natural" and train.ids is not None else None
    key = partition_cache.key(spec, num_partitions, seed, arrays=(labels, ids))
    return partition_cache.cached_rows(key, compute)


def _assigned(partitioner: Any, ds: Any) -> _Partitions:
    """Give ``ds`` to the partitioner and make it decide every partition (its first load)."""
    partitioner.dataset = ds
    partitioner.load_partition(0)
    return _Partitions(partitioner=partitioner)


def _iid(labels: np.ndarray, num_partitions: int, seed: int) -> _Partitions:
    import datasets as hfds
    from flwr_datasets.partitioner import IidPartitioner

    # IidPartitioner cuts contiguous shards, so shuffle the rows first (as
    # FederatedDataset does before partitioning).
    order = np.random.default_rng(seed).permutation(len(labels))
    if num_partitions > 64:
        # IidPartitioner's contiguous shards are np.array_split's; skip one select per client
        return _Partitions(rows=np.array_split(order, num_partitions))
    ds = hfds.Dataset.from_dict({"label": labels[order], "idx": order})
    return _assigned(IidPartitioner(num_partitions=num_partitions), ds)


def _dirichlet(labels: np.ndarray, spec: _PartitionSpec, num_partitions: int, seed: int) -> _Partitions:
    import datasets as hfds
    from flwr_datasets.partitioner import DirichletPartitioner

    hint = (
        "a smaller value; or raise partition.alpha, set partition.self_balancing=true, "
        f"or use fewer clients ({NUM_CLIENTS_KEY})"
    )
    if spec.min_partition_size * num_partitions > len(labels):
        raise ConfigError(
            "partition.min_partition_size",
            spec.min_partition_size,
            f"at most {len(labels) // num_partitions} ({len(labels)} samples for {num_partitions} clients); " + hint,
        )
    ds = hfds.Dataset.from_dict({"label": labels, "idx": np.arange(len(labels))})
    partitioner = DirichletPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        alpha=spec.alpha,
        min_partition_size=spec.min_partition_size,
        self_balancing=spec.self_balancing,
        seed=seed,
    )
    # The partitioner warns on every re-draw; keep them quiet and report once.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            parts = _assigned(partitioner, ds)
        except ValueError as err:
            if "attempts" not in str(err):
                raise
            raise ConfigError(
                "partition.min_partition_size",
                spec.min_partition_size,
                f"{hint}: no Dirichlet draw with alpha={spec.alpha} gave every one of the "
                f"{num_partitions} clients that many samples",
            ) from err
    redraws = sum("min_partition_size" in str(w.message) for w in caught)
    if redraws:
        warnings.warn(
            f"Dirichlet partitioning needed {redraws} re-draws to give every client at least "
            f"partition.min_partition_size={spec.min_partition_size} samples",
            stacklevel=3,
        )
    return parts


def _natural(labels: np.ndarray, ids: np.ndarray | None, spec: _PartitionSpec, num_partitions: int, seed: int) -> _Partitions:
    import datasets as hfds
    from flwr_datasets.partitioner import NaturalIdPartitioner

    if ids is None:
        raise ConfigError("dataset.id_column", None, "a column of natural ids (e.g. writer_id for femnist) for partition.name=natural")
    unique, counts = np.unique(ids, return_counts=True)
    kept = unique[counts > spec.min_samples]
    if len(kept) < num_partitions:
        raise ConfigError(
            NUM_CLIENTS_KEY,
            num_partitions,
            f"at most {len(kept)}: only {len(kept)} ids have more than "
            f"partition.min_samples={spec.min_samples} samples",
        )
    if len(kept) > num_partitions:
        kept = np.sort(np.random.default_rng(seed).choice(kept, size=num_partitions, replace=False))
    rows = np.flatnonzero(np.isin(ids, kept))
    ds = hfds.Dataset.from_dict({"label": labels[rows], "idx": rows, "id": ids[rows]})
    return _assigned(NaturalIdPartitioner(partition_by="id"), ds)


def load_partition(
    dataset_cfg: Mapping, partition_cfg: Mapping, partition_id: int, num_partitions: int, seed: int, part: str = "train"
) -> TensorData:
    """Return one client's data: its training rows, or its held-out local test rows.

    Parameters
    ----------
    dataset_cfg, partition_cfg : Mapping
        The ``dataset`` and ``partition`` config groups. ``partition.local_test_fraction`` of the
        client's rows (0 by default) are held out for federated evaluation and never trained on.
    partition_id : int
        The client, ``0 <= partition_id < num_partitions``.
    num_partitions : int
        Number of clients.
    seed : int
        Run seed.
    part : str
        ``train`` or ``test`` (the held-out rows; an error when ``local_test_fraction`` is 0).

    Returns
    -------
    TensorData
        The client's rows (cached per process).
    """
    dspec = _dataset_spec(dataset_cfg)
    pspec = _partition_spec(partition_cfg)
    fraction = local_test_fraction(partition_cfg)
    train, _ = _load_dataset_cached(dspec)
    _check_counts(len(train), num_partitions, seed)
    if not _is_int(partition_id) or not 0 <= partition_id < num_partitions:
        raise ConfigError("partition_id", partition_id, f"an integer in 0..{num_partitions - 1}")
    if part not in ("train", "test"):
        raise ValueError(f"part={part!r}; allowed: train, test")
    if part == "test" and fraction == 0:
        raise ConfigError("partition.local_test_fraction", 0, "a fraction > 0 for federated evaluation (clients evaluate on held-out rows)")
    return _load_partition_cached(dspec, pspec, int(partition_id), int(num_partitions), int(seed), fraction, part)


def local_test_fraction(partition_cfg: Mapping) -> float:
    """``partition.local_test_fraction`` (0 when absent)."""
    return float(partition_cfg.get("local_test_fraction", 0.0) or 0.0)


def local_split(rows: np.ndarray, fraction: float, seed: int, key: int) -> tuple[np.ndarray, np.ndarray]:
    """Split one client's rows into (train, held-out test), seeded by (seed, key).

    ``round(fraction * n)`` rows, at least 1 and at most n - 1 when ``fraction > 0`` and the
    client has 2 rows or more, go to the test part; with ``fraction = 0`` every row trains.
    """
    n = len(rows)
    if fraction <= 0 or n < 2:
        return rows, rows[:0]
    n_test = min(n - 1, max(1, int(round(fraction * n))))
    order = np.random.default_rng([seed, key, 0x7E57]).permutation(n)
    return np.sort(rows[order[n_test:]]), np.sort(rows[order[:n_test]])


@functools.lru_cache(maxsize=256)
def _load_partition_cached(
    dspec: _DatasetSpec, pspec: _PartitionSpec, partition_id: int, num_partitions: int, seed: int, fraction: float, part: str
) -> TensorData:
    # Only this client's partition is read: a client process never loops over all clients.
    train, _ = _load_dataset_cached(dspec)
    rows = _partitions(train, pspec, num_partitions, seed).rows_of(partition_id)
    train_rows, test_rows = local_split(rows, fraction, seed, partition_id)
    return train.subset(train_rows if part == "train" else test_rows)
