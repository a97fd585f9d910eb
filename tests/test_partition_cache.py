"""The disk cache of partitions (fedmm.data.partition_cache): a hit is the partitioner's rows,
without importing the partitioners; anything that changes the rows changes the key; a damaged
file is recomputed; the partitioner's warnings come back on every hit."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmm.data import partition as P
from fedmm.data import partition_cache as C
from fedmm.data.tensors import TensorData

REPO = Path(__file__).resolve().parent.parent
DIRICHLET = {"name": "dirichlet", "alpha": 0.1, "min_partition_size": 1, "self_balancing": False}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(C.ENV, str(tmp_path))
    P._partition_cached.cache_clear()
    P._partitions.cache_clear()
    yield tmp_path / "partitions"
    P._partition_cached.cache_clear()
    P._partitions.cache_clear()


def labelled(n: int = 600, seed: int = 0) -> TensorData:
    y = torch.from_numpy(np.random.default_rng(seed).integers(0, 10, n))
    return TensorData(x=torch.zeros(n, 1), y=y)


def rows(train: TensorData, cfg: dict = DIRICHLET, n: int = 12, seed: int = 3) -> list[np.ndarray]:
    P._partition_cached.cache_clear()  # the per-process cache: each call asks the disk
    return P.partition_indices(train, cfg, n, seed)


def test_a_hit_gives_the_partitioners_rows(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train = labelled()
    first = rows(train)
    assert len(list(cache.glob("*.npz"))) == 1
    hit = rows(train)
    monkeypatch.setenv(C.ENV, "off")
    P._partitions.cache_clear()
    computed = rows(train)
    assert len(hit) == len(computed) == 12
    assert all(np.array_equal(a, b) and a.dtype == np.int64 and not a.flags.writeable
               for a, b in zip(hit, computed))
    assert all(np.array_equal(a, b) for a, b in zip(first, computed))


def test_what_changes_the_rows_changes_the_key(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train = labelled()
    rows(train)
    rows(train, seed=4)
    rows(train, n=11)
    rows(train, {**DIRICHLET, "alpha": 0.5})
    rows(labelled(seed=1))
    rows(train, {"name": "iid"})
    monkeypatch.setattr(C, "_versions", lambda: "flwr-datasets=0.0.0")
    rows(train)
    assert len(list(cache.glob("*.npz"))) == 7


def test_a_hit_does_not_import_the_partitioners(cache: Path) -> None:
    script = ("import sys, numpy as np, torch\n"
              "from fedmm.data import partition as P\n"
              "from fedmm.data.tensors import TensorData\n"
              "y = torch.from_numpy(np.random.default_rng(0).integers(0, 10, 600))\n"
              f"parts = P.partition_indices(TensorData(x=torch.zeros(600, 1), y=y), {DIRICHLET!r}, 12, 3)\n"
              "print('flwr_datasets' in sys.modules, sum(int(p.sum()) * (i + 1) for i, p in enumerate(parts)))\n")
    env = dict(os.environ, **{C.ENV: str(cache.parent)})
    runs = [subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                           check=True).stdout.split() for _ in range(2)]
    assert runs[0][0] == "True" and runs[1][0] == "False"  # computed, then read back
    assert runs[0][1] == runs[1][1]


def test_a_damaged_file_is_recomputed_and_rewritten(cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    train = labelled()
    first = rows(train)
    (path,) = cache.glob("*.npz")
    path.write_bytes(path.read_bytes()[:100])
    again = rows(train)
    assert "unreadable" in caplog.text
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert all(np.array_equal(a, b) for a, b in zip(first, C._read(path)))


def test_the_partitioners_warnings_come_back_on_a_hit(cache: Path) -> None:
    def compute() -> list[np.ndarray]:
        warnings.warn("Dirichlet partitioning needed 3 re-draws", UserWarning)
        return [np.arange(3), np.arange(3, 5)]

    for _ in range(2):  # computed, then read back
        with pytest.warns(UserWarning, match="needed 3 re-draws"):
            got = C.cached_rows("k", compute)
        assert [p.tolist() for p in got] == [[0, 1, 2], [3, 4]]


def test_off_and_an_unwritable_folder_leave_the_rows_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(C.ENV, "off")
    assert C.cache_dir() is None
    assert [p.tolist() for p in C.cached_rows("k", lambda: [np.arange(2)])] == [[0, 1]]
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(C.ENV, str(blocker))  # partitions/ cannot be made under a file
    assert [p.tolist() for p in C.cached_rows("k", lambda: [np.arange(2)])] == [[0, 1]]
