"""A disk cache of arrays that are expensive to make and cheap to read, shared by every process
on a machine: partitions (:mod:`fedmm.data.partition_cache`) and datasets read from a
``datasets.save_to_disk`` folder (:mod:`fedmm.data.sources`).

What makes them is cheap; what costs is the import it needs (flwr-datasets, ``datasets``,
pandas, pyarrow: 2-5 s of CPU) in every process that asks: each ``fedmm`` job of a sweep, each
Ray worker, each ClientApp process of a deployment with subprocess isolation (one per message).
Each kind keys its entries by everything its result depends on, so a hit is what would have
been computed. Warnings raised while computing are stored and raised again on every hit.

Where: ``$FEDMM_CACHE_DIR/<kind>`` (default ``$XDG_CACHE_HOME/fedmm``, else ``~/.cache/fedmm``);
``FEDMM_CACHE_DIR=off`` turns the cache off. A file that cannot be read is recomputed and
rewritten; a directory that cannot be written leaves the cache unused.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import TypeVar

import numpy as np

log = logging.getLogger(__name__)

#: The environment variable naming the cache's root (``off``: no cache).
ENV = "FEDMM_CACHE_DIR"
#: The stored array that holds the warnings raised while computing.
WARNINGS = "__warnings__"

T = TypeVar("T")


def cache_dir(kind: str) -> Path | None:
    """The folder of one kind of entry, or None when ``FEDMM_CACHE_DIR=off``."""
    root = os.environ.get(ENV, "")
    if root.lower() == "off":
        return None
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedmm")
    return Path(root) / kind


def versions(packages: Iterable[str]) -> str:
    """``name=version`` of each distribution (``none`` when it is not installed)."""
    found = []
    for name in packages:
        try:
            found.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name}=none")
    return ";".join(found)


def digest(*parts: object, arrays: tuple[np.ndarray | None, ...] = (), code: tuple[Path, ...] = ()) -> str:
    """The hex key of ``parts`` (their reprs), ``arrays`` (dtype, shape, bytes) and the contents
    of the source files ``code`` (this module's always)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode() + b"\0")
    for path in (*code, Path(__file__)):
        h.update(path.read_bytes())
    for array in arrays:
        if array is None:
            h.update(b"none\0")
            continue
        array = np.ascontiguousarray(array)
        h.update(f"{array.dtype.str}{array.shape}".encode())
        h.update(array.tobytes() if array.dtype != object else repr(array.tolist()).encode())
    return h.hexdigest()


def cached(kind: str, key: str, compute: Callable[[], T], encode: Callable[[T], dict[str, np.ndarray] | None],
           decode: Callable[[dict[str, np.ndarray]], T]) -> T:
    """The entry ``key`` of ``kind`` decoded, else ``compute()``'s result, stored.

    ``encode`` gives the arrays to store (None: this result is not stored, e.g. it holds Python
    objects); ``decode`` rebuilds the result from them and raises on anything inconsistent (the
    file is then recomputed)."""
    where = cache_dir(kind)
    path = None if where is None else where / f"{key}.npz"
    if path is not None and path.is_file():
        try:
            stored = read(path)
            result = decode(stored)
        except Exception as err:  # noqa: BLE001 - a damaged file is recomputed
            log.warning("%s cache: %s is unreadable (%s); recomputing it", kind, path, err)
        else:
            _warn([str(m) for m in stored[WARNINGS]])
            return result
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = compute()
    messages = [str(w.message) for w in caught]
    _warn(messages)
    arrays = encode(result) if path is not None else None
    if arrays is not None:
        _write(path, {**arrays, WARNINGS: np.array(messages, dtype=str)})
    return result


def read(path: Path) -> dict[str, np.ndarray]:
    """Every array of one entry (no pickles: ``allow_pickle=False``)."""
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def _warn(messages: list[str]) -> None:
    for message in messages:
        warnings.warn(message, UserWarning, stacklevel=5)


def _write(path: Path, arrays: dict[str, np.ndarray]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)  # atomic: a reader sees the old file, none, or the whole new one
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as err:
        log.info("cache: not written to %s (%s)", path.parent, err)
