"""The machine's disk cache (fedmm.data.disk_cache). Partitions (fedmm.data.partition_cache): a
hit is the partitioner's rows, without importing the partitioners; anything that changes the
rows changes the key; a damaged file is recomputed; the partitioner's warnings come back on
every hit. A ``save_to_disk`` folder's splits: a hit is what ``datasets`` reads, without
importing it; a changed file is read again."""

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


SAVED = ("import sys, json\n"
         "from fedmm.data.sources import load_dataset\n"
         "cfg = json.loads(sys.argv[1])\n"
         "train, test = load_dataset(cfg)\n"
         "print('datasets' in sys.modules, len(train), len(test), int(train.x.long().sum()), int(test.y.sum()), train.transform)\n")


def test_a_saved_folder_is_read_once_and_read_again_when_a_file_changes(tmp_path: Path) -> None:
    """Each process is a ClientApp's in a deployment: the first reads the folder with
    ``datasets`` and stores the arrays; the next gets them without importing it; a folder
    written again (other rows) is read again; the same folder under other settings is another
    entry."""
    import json

    from tests.test_deployment import write_site

    from fedmm.config import compose, to_container

    rng = np.random.default_rng(0)
    site = tmp_path / "site"
    write_site(site, rng.integers(0, 256, (50, 28, 28), dtype=np.uint8), np.arange(50) % 10)
    cfg = dict(to_container(compose(["dataset=mnist"]))["dataset"], path=str(site), source="hf")
    env = dict(os.environ, **{C.ENV: str(tmp_path / "cache")})

    def load(dataset_cfg: dict) -> list[str]:
        return subprocess.run([sys.executable, "-c", SAVED, json.dumps(dataset_cfg)], cwd=REPO, env=env,
                              capture_output=True, text=True, check=True).stdout.split(maxsplit=5)

    first, hit = load(cfg), load(cfg)
    assert first[0] == "True" and hit[0] == "False"  # read, then from the cache
    assert first[1:] == hit[1:] and first[1:3] == ["40", "10"] and "ImageNormalize" in hit[5]
    write_site(site, rng.integers(0, 256, (50, 28, 28), dtype=np.uint8), np.arange(50) % 10)  # other images
    again = load(cfg)
    assert again[0] == "True" and again[3] != first[3]
    other = load(dict(cfg, test_fraction=0.5))
    assert other[0] == "True" and other[1:3] == ["25", "25"]
    assert len(list((tmp_path / "cache" / "datasets").glob("*.npz"))) == 3
