"""A disk cache of computed partitions, shared by every process on a machine.

Computing a partition with the flwr-datasets partitioners takes a fraction of a second, but
importing them (flwr-datasets, ``datasets``, pandas, matplotlib) takes 2-5 s of CPU in every
process that partitions: each ``fedmm`` job of a sweep, each Ray worker, each ClientApp process
of a deployment with subprocess isolation. The rows a partitioner gives are a function of the
labels (and natural ids), the partition settings, the number of partitions, the seed, the
partitioner's version and this package's partition code; the cache is keyed by all of them, so
a hit is the rows the partitioner would give. Warnings raised while computing (e.g. Dirichlet
re-draws) are stored and raised again on every hit.

Where: ``$FEDMM_CACHE_DIR/partitions`` (default ``$XDG_CACHE_HOME/fedmm``, else
``~/.cache/fedmm``); ``FEDMM_CACHE_DIR=off`` turns the cache off. A file that cannot be read
is recomputed and rewritten; a directory that cannot be written leaves the cache unused.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

#: The environment variable naming the cache's root (``off``: no cache).
ENV = "FEDMM_CACHE_DIR"
#: The distributions whose versions are part of every key.
PARTITIONER_PACKAGES = ("flwr-datasets", "datasets")
#: This package's files whose contents are part of every key.
CODE = (Path(__file__).with_name("partition.py"), Path(__file__).with_name("spec.py"), Path(__file__))


def cache_dir() -> Path | None:
    """The partition cache's directory, or None when ``FEDMM_CACHE_DIR=off``."""
    root = os.environ.get(ENV, "")
    if root.lower() == "off":
        return None
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedmm")
    return Path(root) / "partitions"


def _versions() -> str:
    found = []
    for name in PARTITIONER_PACKAGES:
        try:
            found.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name}=none")
    return ";".join(found)


def key(*parts: object, arrays: tuple[np.ndarray | None, ...] = ()) -> str:
    """The hex key of ``parts`` (their reprs), ``arrays`` (dtype, shape, bytes), the partitioner
    packages' versions and this package's partition code."""
    h = hashlib.sha256()
    for part in (*parts, _versions()):
        h.update(repr(part).encode() + b"\0")
    for path in CODE:
        h.update(path.read_bytes())
    for array in arrays:
        if array is None:
            h.update(b"none\0")
            continue
        array = np.ascontiguousarray(array)
        h.update(f"{array.dtype.str}{array.shape}".encode())
        h.update(array.tobytes() if array.dtype != object else repr(array.tolist()).encode())
    return h.hexdigest()


def cached_rows(cache_key: str, compute: Callable[[], list[np.ndarray]]) -> list[np.ndarray]:
    """The rows stored under ``cache_key``, else ``compute()``'s, stored (with the warnings it
    raised, which are raised again on every later hit)."""
    where = cache_dir()
    path = None if where is None else where / f"{cache_key}.npz"
    if path is not None and path.is_file():
        try:
            return _read(path)
        except Exception as err:  # noqa: BLE001 - a damaged file is recomputed
            log.warning("partition cache: %s is unreadable (%s); recomputing it", path, err)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = compute()
    messages = [str(w.message) for w in caught]
    _warn(messages)
    if path is not None:
        _write(path, rows, messages)
    return rows


def _warn(messages: list[str]) -> None:
    for message in messages:
        warnings.warn(message, UserWarning, stacklevel=4)


def _read(path: Path) -> list[np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        rows, offsets, messages = data["rows"], data["offsets"], data["warnings"]
    if offsets[0] != 0 or offsets[-1] != len(rows) or np.any(np.diff(offsets) < 0):
        raise ValueError("offsets do not cut the rows")
    _warn([str(m) for m in messages])
    parts = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        part = rows[start:end].astype(np.int64, copy=True)
        part.setflags(write=False)
        parts.append(part)
    return parts


def _write(path: Path, rows: list[np.ndarray], messages: list[str]) -> None:
    offsets = np.zeros(len(rows) + 1, np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows])
    flat = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, rows=flat, offsets=offsets, warnings=np.array(messages, dtype=str))
            os.replace(tmp, path)  # atomic: a reader sees the old file, none, or the whole new one
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as err:
        log.info("partition cache: not written to %s (%s)", path.parent, err)
