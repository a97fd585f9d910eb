"""Partitions from the machine's disk cache (:mod:`fedmm.data.disk_cache`).

Computing a partition with the flwr-datasets partitioners takes a fraction of a second, but
importing them (flwr-datasets, ``datasets``, pandas, matplotlib) takes 2-5 s of CPU in every
process that partitions. The rows a partitioner gives are a function of the labels (and natural
ids), the partition settings, the number of partitions, the seed, the partitioner's version and
this package's partition code; the cache is keyed by all of them, so a hit is the rows the
partitioner would give. Warnings raised while computing (e.g. Dirichlet re-draws) are stored
and raised again on every hit. Where, and how to turn it off: :mod:`fedmm.data.disk_cache`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedmm.data import disk_cache
from fedmm.data.disk_cache import ENV  # noqa: F401 - the setting's name, for callers

#: This cache's folder under the cache root.
KIND = "partitions"
#: The distributions whose versions are part of every key.
PARTITIONER_PACKAGES = ("flwr-datasets", "datasets")
#: This package's files whose contents are part of every key.
CODE = (Path(__file__).with_name("partition.py"), Path(__file__).with_name("spec.py"), Path(__file__))


def cache_dir() -> Path | None:
    """The partition cache's directory, or None when ``FEDMM_CACHE_DIR=off``."""
    return disk_cache.cache_dir(KIND)


def _versions() -> str:
    return disk_cache.versions(PARTITIONER_PACKAGES)


def key(*parts: object, arrays: tuple[np.ndarray | None, ...] = ()) -> str:
    """The hex key of ``parts``, ``arrays``, the partitioner packages' versions and this
    package's partition code."""
    return disk_cache.digest(*parts, _versions(), arrays=arrays, code=CODE)


def cached_rows(cache_key: str, compute: Callable[[], list[np.ndarray]]) -> list[np.ndarray]:
    """The rows stored under ``cache_key``, else ``compute()``'s, stored (with the warnings it
    raised, which are raised again on every later hit)."""
    return disk_cache.cached(KIND, cache_key, compute, _encode, _decode)


def _encode(rows: list[np.ndarray]) -> dict[str, np.ndarray]:
    offsets = np.zeros(len(rows) + 1, np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows])
    flat = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
    return {"rows": flat, "offsets": offsets}


def _decode(stored: dict[str, np.ndarray]) -> list[np.ndarray]:
    rows, offsets = stored["rows"], stored["offsets"]
    if offsets[0] != 0 or offsets[-1] != len(rows) or np.any(np.diff(offsets) < 0):
        raise ValueError("offsets do not cut the rows")
    parts = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        part = rows[start:end].astype(np.int64, copy=True)
        part.setflags(write=False)
        parts.append(part)
    return parts


def _read(path: Path) -> list[np.ndarray]:
    """The rows of one stored file (raises on a damaged one)."""
    return _decode(disk_cache.read(path))
