"""Partition files: which training rows each client holds, in a format other frameworks write.

A partition file is JSON: an object whose ``train_data`` maps each client id, the decimal
string ``"0"`` … ``"N-1"``, to the list of its row indices into the training split, in the
split's own order (for the torchvision datasets, their native order)::

    {"format": "fedmm-partition/1", "dataset": "mnist5k", "num_clients": 3,
     "train_data": {"0": [4, 17, 2], "1": [0, 5], "2": [1, 3, 6]}}

Only ``train_data`` is required (other keys are descriptive), so the files that the FedMut
authors' repository ships (``data/cifar10_100_noniidCase5_beta0.1.json``: the same
``train_data`` object) load as they are; a bare ``{"0": [...], ...}`` object or a list of lists
(client i = the i-th list) is read too. Rows may not repeat within a client; clients may share
rows (some frameworks give overlapping shards), which a warning reports.

    python -m fedmm.data.partition_file out.json dataset=mnist5k partition=dirichlet partition.alpha=0.1 num_clients=100

writes the partition a run with those settings uses, so that another framework trains on it.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedmm.errors import ConfigError

FORMAT = "fedmm-partition/1"


def read_partition_file(path: str | os.PathLike, num_rows: int, num_clients: int) -> list[np.ndarray]:
    """The clients' row indices in a partition file, checked against the split and the run."""
    file = Path(os.path.expanduser(os.fspath(path)))
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("partition.path", str(path), "an existing partition file") from None
    except (OSError, ValueError) as err:
        raise ConfigError("partition.path", str(path), f"a readable JSON partition file ({err})") from None
    clients = data.get("train_data", data) if isinstance(data, dict) else data
    if isinstance(clients, dict):
        try:
            ids = sorted(int(k) for k in clients)
        except ValueError:
            raise ConfigError("partition.path", str(path), "client ids that are decimal integers 0..N-1") from None
        if ids != list(range(len(ids))):
            raise ConfigError("partition.path", str(path), f"client ids 0..{len(ids) - 1} without gaps")
        lists = [clients[k] for k in sorted(clients, key=int)]
    elif isinstance(clients, list):
        lists = clients
    else:
        raise ConfigError("partition.path", str(path), 'a JSON object with "train_data": {client id: [row, ...]}')
    if len(lists) != num_clients:
        raise ConfigError("num_clients", num_clients, f"{len(lists)}, the number of clients in {path}")
    rows: list[np.ndarray] = []
    seen = np.zeros(num_rows, dtype=np.int64)
    for cid, items in enumerate(lists):
        if not isinstance(items, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            raise ConfigError("partition.path", str(path), f"a list of integer row indices for client {cid}")
        arr = np.asarray(items, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= num_rows):
            raise ConfigError("partition.path", str(path), f"row indices in 0..{num_rows - 1} (the training split's size); "
                              f"client {cid} has {int(arr.min()) if arr.min() < 0 else int(arr.max())}")
        if len(np.unique(arr)) != len(arr):
            raise ConfigError("partition.path", str(path), f"no repeated row within a client (client {cid} repeats one)")
        if arr.size == 0:
            raise ConfigError("partition.path", str(path), f"at least one row per client (client {cid} has none)")
        seen[arr] += 1
        arr = np.sort(arr)
        arr.setflags(write=False)
        rows.append(arr)
    if (seen > 1).any():
        warnings.warn(f"{path}: {int((seen > 1).sum())} rows belong to more than one client", stacklevel=2)
    return rows


def write_partition_file(path: str | os.PathLike, rows: Sequence[Sequence[int]], **about: Any) -> Path:
    """Write the clients' row indices as a partition file (``about``: descriptive keys)."""
    file = Path(os.path.expanduser(os.fspath(path)))
    body = {"format": FORMAT, **about, "num_clients": len(rows),
            "train_data": {str(cid): [int(i) for i in r] for cid, r in enumerate(rows)}}
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(json.dumps(body), encoding="utf-8")
    os.replace(tmp, file)
    return file


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedmm.data.partition_file OUT [hydra overrides]``: the partition of a run."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    from fedmm.config import compose
    from fedmm.data import load_dataset, partition_indices

    run = compose(args[1:])
    train, _ = load_dataset(run.dataset)
    parts = partition_indices(train, run.partition, run.num_clients, run.seed)
    out = write_partition_file(args[0], parts, dataset=run.dataset.name, partition=run.partition.to_dict(), seed=run.seed)
    print(f"wrote {out}: {len(parts)} clients, {sum(len(p) for p in parts)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
