"""Tests of fedmm.data: loading, partitioning, histograms and minibatches (offline)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fedmm import data as D
from fedmm.data import partition as P
from fedmm.data import sources as S
from fedmm.data import spec as SP
from fedmm.errors import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
DATASET_KEYS = set(SP._DATASET_KEYS)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No test may reach the network (the HF hub is unreachable here anyway)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)

    def no_hub(*args, **kwargs):
        raise AssertionError("a test tried to load a dataset from the Hugging Face hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)


def composed(group: str, which: str) -> dict:
    """The ``group`` node of ``<group>=<which>``, as hydra composes it (unvalidated)."""
    from fedmm.config import compose, to_container

    return to_container(compose([f"{group}={which}"], validate_config=False))[group]


def dataset_cfg(which: str, **overrides) -> dict:
    cfg = composed("dataset", which)
    cfg.update(overrides)
    return cfg


def partition_cfg(which: str, **overrides) -> dict:
    cfg = composed("partition", which)
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="module")
def mnist5k():
    return D.load_dataset(dataset_cfg("mnist5k"))


def tv_skew(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> float:
    """Mean total-variation distance between client and global label distributions."""
    hist = D.label_histograms(labels, parts, num_classes).astype(float)
    client = hist / hist.sum(axis=1, keepdims=True)
    overall = np.bincount(labels, minlength=num_classes) / len(labels)
    return float(0.5 * np.abs(client - overall).sum(axis=1).mean())


# ------------------------------------------------------------------------- configs


def test_dataset_options_compose_to_the_full_schema_and_validate():
    from fedmm.data.spec import _TEXT_KEYS

    for name in D.DATASET_NAMES:
        cfg = dataset_cfg(name)
        assert set(cfg) == set(_TEXT_KEYS.get(name, DATASET_KEYS)), name
        assert cfg["name"] == name
        D.check_dataset_config(cfg)  # defaults must pass validation
        assert D.expected_num_classes(cfg) == cfg["num_classes"]
    assert {p.stem for p in (CONF / "dataset").glob("*.yaml")} == set(D.DATASET_NAMES)
    for name in D.PARTITION_NAMES:
        D.check_partition_config(partition_cfg(name))
    with pytest.raises(ConfigError, match="partition.alpha"):
        D.check_partition_config(partition_cfg("dirichlet", alpha=0.0))
    with pytest.raises(ConfigError, match="dataset.label_type"):
        D.check_dataset_config(dataset_cfg("cifar10", label_type="fine"))


def test_dictconfig_is_accepted(mnist5k):
    from omegaconf import OmegaConf

    train, test = D.load_dataset(OmegaConf.create(dataset_cfg("mnist5k")))
    assert train is mnist5k[0] and test is mnist5k[1]  # same cache entry as a dict


# ------------------------------------------------------------------------- mnist5k


def test_mnist5k_loads_with_a_fixed_stratified_test_split(mnist5k):
    train, test = mnist5k
    assert len(train) == 4000 and len(test) == 1000
    for split in (train, test):
        assert split.x.dtype == torch.uint8 and split.y.dtype == torch.int64
        assert split.x.shape[1:] == (1, 28, 28)
        assert split.ids is None
        assert set(split.y.tolist()) == set(range(10))
    assert np.bincount(test.y.numpy()).tolist() == [100] * 10  # stratified
    assert int(train.x.max()) > 200  # raw 0..255 pixels, not rescaled

    S._load_dataset_cached.cache_clear()  # a genuinely fresh load gives the same split
    train2, test2 = D.load_dataset(dataset_cfg("mnist5k"))
    assert torch.equal(test.x, test2.x) and torch.equal(test.y, test2.y)
    assert torch.equal(train.x, train2.x)


def test_load_dataset_is_cached():
    a = D.load_dataset(dataset_cfg("mnist5k"))
    b = D.load_dataset(dataset_cfg("mnist5k"))
    assert a[0] is b[0] and a[1] is b[1]


# ----------------------------------------------------------------------- partitions


@pytest.mark.parametrize("name", ["iid", "dirichlet"])
def test_every_sample_is_assigned_exactly_once(mnist5k, name):
    train = mnist5k[0]
    parts = D.partition_indices(train, partition_cfg(name), 10, seed=1)
    assert len(parts) == 10
    allidx = np.concatenate(parts)
    assert len(allidx) == len(train)
    assert np.array_equal(np.sort(allidx), np.arange(len(train)))
    assert all(p.dtype == np.int64 for p in parts)
    if name == "iid":
        assert {len(p) for p in parts} == {400}
    else:
        assert min(len(p) for p in parts) >= 10  # min_partition_size


def test_dirichlet_skew_grows_as_alpha_shrinks(mnist5k):
    train = mnist5k[0]
    labels = train.y.numpy()
    skew = {
        "iid": tv_skew(labels, D.partition_indices(train, partition_cfg("iid"), 20, seed=3), 10),
        1.0: tv_skew(labels, D.partition_indices(train, partition_cfg("dirichlet", alpha=1.0), 20, seed=3), 10),
        0.1: tv_skew(
            labels,
            D.partition_indices(train, partition_cfg("dirichlet", alpha=0.1, min_partition_size=1), 20, seed=3),
            10,
        ),
    }
    assert skew[0.1] > skew[1.0] > skew["iid"]
    assert skew["iid"] < 0.15 and skew[0.1] > 0.5


@pytest.mark.parametrize("name", ["iid", "dirichlet"])
def test_partitions_depend_only_on_the_seed(mnist5k, name, monkeypatch):
    train = mnist5k[0]
    first = D.partition_indices(train, partition_cfg(name), 8, seed=5)
    P._partition_cached.cache_clear(); P._partitions.cache_clear()  # recompute rather than hit the caches
    monkeypatch.setenv("FEDMM_CACHE_DIR", "off")
    again = D.partition_indices(train, partition_cfg(name), 8, seed=5)
    other = D.partition_indices(train, partition_cfg(name), 8, seed=6)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def make_writers(counts: list[int], seed: int = 0) -> D.TensorData:
    """Tiny data set whose rows belong to writers w00, w01, ... (shuffled rows)."""
    rng = np.random.default_rng(seed)
    ids = np.repeat([f"w{i:02d}" for i in range(len(counts))], counts)
    ids = ids[rng.permutation(len(ids))]
    n = len(ids)
    return D.TensorData(
        x=torch.zeros(n, 1, 4, 4, dtype=torch.uint8),
        y=torch.from_numpy(rng.integers(0, 3, n)),
        ids=ids,
    )


def assert_one_whole_id_per_partition(data: D.TensorData, parts: list[np.ndarray]) -> list[str]:
    seen = []
    for part in parts:
        owners = set(data.ids[part].tolist())
        assert len(owners) == 1
        (owner,) = owners
        assert np.array_equal(part, np.flatnonzero(data.ids == owner))  # all its rows
        seen.append(owner)
    assert len(set(seen)) == len(seen)
    return seen


def test_natural_partitions_group_ids():
    data = make_writers([5, 3, 7, 2, 6, 4])
    parts = D.partition_indices(data, partition_cfg("natural"), 6, seed=0)
    assert sorted(assert_one_whole_id_per_partition(data, parts)) == [f"w{i:02d}" for i in range(6)]


def test_natural_filters_small_ids_and_samples_a_seeded_subset(monkeypatch):
    counts = [5, 3, 7, 2, 6, 4, 9, 8, 1, 5]
    data = make_writers(counts)
    cfg = partition_cfg("natural", min_samples=3)  # keeps the 7 ids with > 3 samples
    big = {f"w{i:02d}" for i, c in enumerate(counts) if c > 3}
    chosen = assert_one_whole_id_per_partition(data, D.partition_indices(data, cfg, 4, seed=1))
    assert set(chosen) <= big and len(chosen) == 4
    P._partition_cached.cache_clear(); P._partitions.cache_clear()
    monkeypatch.setenv("FEDMM_CACHE_DIR", "off")  # recomputed, not read back
    again = assert_one_whole_id_per_partition(data, D.partition_indices(data, cfg, 4, seed=1))
    assert again == chosen
    subsets = {
        frozenset(assert_one_whole_id_per_partition(data, D.partition_indices(data, cfg, 4, seed=s)))
        for s in range(6)
    }
    assert len(subsets) > 1  # the subset follows the seed
    with pytest.raises(ConfigError, match="num_clients") as err:
        D.partition_indices(data, cfg, 8, seed=0)
    assert "7" in str(err.value)  # says how many ids exist


def test_load_partition_returns_the_cached_shard(mnist5k):
    dcfg, pcfg = dataset_cfg("mnist5k"), partition_cfg("dirichlet")
    shard = D.load_partition(dcfg, pcfg, 2, 10, seed=4)
    parts = D.partition_indices(mnist5k[0], pcfg, 10, seed=4)
    assert torch.equal(shard.y, mnist5k[0].y[torch.from_numpy(np.array(parts[2]))])
    assert torch.equal(shard.x, mnist5k[0].x[torch.from_numpy(np.array(parts[2]))])
    assert D.load_partition(dcfg, pcfg, 2, 10, seed=4) is shard
    with pytest.raises(ConfigError, match="partition_id"):
        D.load_partition(dcfg, pcfg, 10, 10, seed=4)


# --------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    ("pcfg", "num_partitions", "key"),
    [
        (partition_cfg("dirichlet", alpha=0), 10, "partition.alpha"),
        (partition_cfg("dirichlet", alpha=-0.5), 10, "partition.alpha"),
        (partition_cfg("dirichlet", alpha="big"), 10, "partition.alpha"),
        ({"name": "pathological"}, 10, "partition.name"),
        (partition_cfg("natural"), 10, "dataset.id_column"),
        (partition_cfg("iid"), 4001, "num_clients"),
        (partition_cfg("iid"), 0, "num_clients"),
        (partition_cfg("dirichlet", min_partition_size=500), 10, "partition.min_partition_size"),
        (partition_cfg("dirichlet", alpha=0.01, min_partition_size=300), 10, "partition.min_partition_size"),
    ],
)
def test_partition_config_errors_name_the_key(mnist5k, pcfg, num_partitions, key):
    with pytest.raises(ConfigError) as err:
        D.partition_indices(mnist5k[0], pcfg, num_partitions, seed=0)
    assert err.value.key == key
    assert key in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"source": "ftp"}, "dataset.source"),
        ({"name": "imagenet"}, "dataset.name"),
        ({"path": "/nonexistent/fedmm-data"}, "dataset.path"),
        ({"num_classes": 100}, "dataset.num_classes"),  # coarse needs 20
        ({"label_type": "medium"}, "dataset.label_type"),
        ({"label_type": "fine"}, "dataset.num_classes"),  # fine needs 100
        ({"hf_id": None}, "dataset.hf_id"),
        ({"mean": [0.5]}, "dataset.mean"),
        ({"test_fraction": 1.5}, "dataset.test_fraction"),
    ],
)
def test_dataset_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        D.load_dataset(dataset_cfg("cifar100", **overrides))
    assert err.value.key == key
    assert key in str(err.value)


def test_embedded_source_only_for_mnist5k():
    with pytest.raises(ConfigError, match="dataset.source"):
        D.load_dataset(dataset_cfg("cifar10", source="embedded", hf_id=None))


def test_empty_local_folder_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="dataset.path"):
        D.load_dataset(dataset_cfg("cifar10", path=str(tmp_path)))


# --------------------------------------------------------------------- local folders


def random_images(rng, n: int, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 256, (n, *shape), dtype=np.uint8)


def test_save_to_disk_datasetdict_loads(tmp_path):
    import datasets
    from PIL import Image

    rng = np.random.default_rng(0)
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    arrays = {}
    splits = {}
    for split, n in (("train", 12), ("test", 5)):
        arrays[split] = (random_images(rng, n, (32, 32, 3)), rng.integers(0, 10, n))
        splits[split] = datasets.Dataset.from_dict(
            {"img": [Image.fromarray(a) for a in arrays[split][0]], "label": arrays[split][1].tolist()},
            features=features,
        )
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "cifar"))

    train, test = D.load_dataset(dataset_cfg("cifar10", path=str(tmp_path / "cifar")))
    for split, data in (("train", train), ("test", test)):
        images, labels = arrays[split]
        assert data.x.shape == (len(labels), 3, 32, 32) and data.x.dtype == torch.uint8
        assert np.array_equal(data.x.numpy(), images.transpose(0, 3, 1, 2))  # HWC -> CHW
        assert np.array_equal(data.y.numpy(), labels)

    # The same folder does not fit a 28x28 grayscale config.
    with pytest.raises(ConfigError, match="dataset.in_channels"):
        D.load_dataset(dataset_cfg("mnist", path=str(tmp_path / "cifar"), image_column="img"))


def test_save_to_disk_single_split_with_ids_holds_out_a_test_set(tmp_path):
    import datasets

    rng = np.random.default_rng(1)
    n = 60
    writers = np.repeat(["a", "b", "c", "d"], [10, 20, 12, 18])
    ds = datasets.Dataset.from_dict(
        {
            "image": random_images(rng, n, (28, 28)).tolist(),
            "character": rng.integers(0, 62, n).tolist(),
            "writer_id": writers.tolist(),
        }
    )
    ds.save_to_disk(str(tmp_path / "femnist"))
    cfg = dataset_cfg("femnist", path=str(tmp_path / "femnist"))
    train, test = D.load_dataset(cfg)
    assert len(train) == 48 and len(test) == 12  # test_fraction = 0.2
    assert train.x.shape[1:] == (1, 28, 28)
    assert train.ids is not None and set(train.ids.tolist()) == {"a", "b", "c", "d"}
    # The hold-out uses a fixed seed: a fresh load gives the same test rows.
    S._load_dataset_cached.cache_clear()
    assert torch.equal(D.load_dataset(cfg)[1].x, test.x)

    parts = D.partition_indices(train, partition_cfg("natural"), 4, seed=0)
    assert_one_whole_id_per_partition(train, parts)
    shard = D.load_partition(cfg, partition_cfg("natural"), 0, 4, seed=0)
    assert len(set(shard.ids.tolist())) == 1


def write_pickle(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def trust_md5(monkeypatch, cls_name: str, root) -> None:
    """Make torchvision's md5 list of CIFAR{10,100} the sums of the files a test wrote."""
    import hashlib

    import torchvision.datasets as tvd

    cls = getattr(tvd, cls_name)
    md5 = lambda name: hashlib.md5((root / name).read_bytes()).hexdigest()  # noqa: E731
    monkeypatch.setattr(cls, "train_list", [[n, md5(n)] for n, _ in cls.train_list])
    monkeypatch.setattr(cls, "test_list", [[n, md5(n)] for n, _ in cls.test_list])


def test_cifar10_python_batches_load(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    flat, labels = [], []
    for i in range(1, 6):
        data, lab = random_images(rng, 4, (3072,)), rng.integers(0, 10, 4).tolist()
        write_pickle(root / f"data_batch_{i}", {b"data": data, b"labels": lab})
        flat.append(data)
        labels += lab
    test_data = random_images(rng, 3, (3072,))
    write_pickle(root / "test_batch", {b"data": test_data, b"labels": [1, 2, 3]})

    # The parent folder works too.
    trust_md5(monkeypatch, "CIFAR10", root)
    train, test = D.load_dataset(dataset_cfg("cifar10", path=str(tmp_path)))
    flat = np.concatenate(flat)
    assert train.x.shape == (20, 3, 32, 32) and test.x.shape == (3, 3, 32, 32)
    assert train.y.tolist() == labels and test.y.tolist() == [1, 2, 3]
    # Row layout: 1024 red, 1024 green, 1024 blue values, each row-major.
    assert int(train.x[7, 1, 5, 9]) == int(flat[7, 1024 + 5 * 32 + 9])
    assert int(test.x[2, 2, 31, 0]) == int(test_data[2, 2048 + 31 * 32])


def test_cifar100_python_label_type_picks_fine_or_coarse(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    root = tmp_path / "cifar-100-python"
    root.mkdir()
    parts = {}
    for split, n in (("train", 10), ("test", 4)):
        parts[split] = {
            b"data": random_images(rng, n, (3072,)),
            b"fine_labels": rng.integers(0, 100, n).tolist(),
            b"coarse_labels": rng.integers(0, 20, n).tolist(),
        }
        write_pickle(root / split, parts[split])
    trust_md5(monkeypatch, "CIFAR100", root)
    coarse = D.load_dataset(dataset_cfg("cifar100", path=str(root)))
    fine = D.load_dataset(dataset_cfg("cifar100", path=str(root), label_type="fine", num_classes=100))
    for i, split in enumerate(("train", "test")):
        assert coarse[i].y.tolist() == parts[split][b"coarse_labels"]
        assert fine[i].y.tolist() == parts[split][b"fine_labels"]
        assert torch.equal(coarse[i].x, fine[i].x)
    with pytest.raises(ConfigError, match="dataset.num_classes"):
        D.load_dataset(dataset_cfg("cifar100", path=str(root), label_type="fine"))


def test_a_partial_or_corrupted_cifar_folder_is_refused_naming_the_file(tmp_path, monkeypatch):
    rng = np.random.default_rng(4)
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    for i in range(1, 6):
        write_pickle(root / f"data_batch_{i}", {b"data": random_images(rng, 4, (3072,)), b"labels": [0, 1, 2, 3]})
    write_pickle(root / "test_batch", {b"data": random_images(rng, 3, (3072,)), b"labels": [1, 2, 3]})
    trust_md5(monkeypatch, "CIFAR10", root)
    (root / "data_batch_3").write_bytes((root / "data_batch_3").read_bytes()[:100])  # truncated copy
    (root / "data_batch_5").unlink()  # an interrupted extraction
    with pytest.raises(ConfigError) as info:
        D.load_dataset(dataset_cfg("cifar10", path=str(root)))
    assert info.value.key == "dataset.path" and "data_batch_3 fails its md5 check" in str(info.value)
    assert "(and 1 more)" in str(info.value) and "dataset.allow_partial=true" in str(info.value)
    # allow_partial reads the intact files only: the one that fails its md5 is never unpickled
    import pickle

    (root / "data_batch_3").write_bytes(pickle.dumps(__import__("os").system))  # altered: code when unpickled
    read = []
    monkeypatch.setattr(pickle, "load", lambda f, **kw: read.append(f.name) or pickle.loads(f.read(), **kw))
    with pytest.warns(UserWarning, match="loaded 12 of 50,000 training and 3 of 10,000 test images"):
        train, test = D.load_dataset(dataset_cfg("cifar10", path=str(root), allow_partial=True))
    assert len(train) == 12 and len(test) == 3
    assert not any(name.endswith("data_batch_3") for name in read)


def test_a_folder_of_no_known_format_is_a_config_error_before_any_run(tmp_path):
    from fedmm.config import compose

    (tmp_path / "images.zip").write_bytes(b"PK")
    with pytest.raises(ConfigError) as info:
        compose([f"dataset.path={tmp_path}"])
    assert info.value.key == "dataset.path" and "found images.zip there" in str(info.value)


# ----------------------------------------------------------------- label statistics


def test_label_histograms_exact():
    labels = np.array([0, 1, 1, 2, 2, 2, 0, 1])
    parts = [np.array([0, 1, 2]), np.array([3, 4, 5, 6]), np.array([7]), np.array([], dtype=np.int64)]
    hist = D.label_histograms(labels, parts, num_classes=4)
    assert hist.tolist() == [[1, 2, 0, 0], [1, 0, 3, 0], [0, 1, 0, 0], [0, 0, 0, 0]]
    assert hist.dtype == np.int64


def test_plot_label_histograms_writes_a_png(tmp_path):
    hist = np.array([[5, 0, 1], [0, 3, 9]])
    out = tmp_path / "plots" / "labels.png"
    D.plot_label_histograms(hist, out)
    assert out.stat().st_size > 1000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------- minibatches


def small_data(n: int = 23, channels: int = 3) -> D.TensorData:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, channels, 4, 4), generator=g, dtype=torch.uint8)
    return D.TensorData(x=x, y=torch.arange(n, dtype=torch.int64), transform=D.ImageNormalize([0.5] * channels, [0.5] * channels))  # label = row number


def test_batches_cover_every_sample_once_per_epoch():
    data = small_data()
    kwargs: dict = {}
    g = torch.Generator().manual_seed(7)
    seen = [yb for _, yb in D.batches(data, 5, shuffle=True, generator=g, **kwargs)]
    assert [len(b) for b in seen] == [5, 5, 5, 5, 3]
    order = torch.cat(seen)
    assert sorted(order.tolist()) == list(range(23))
    assert order.tolist() != list(range(23))  # actually shuffled
    again = torch.cat([yb for _, yb in D.batches(data, 5, shuffle=True, generator=torch.Generator().manual_seed(7), **kwargs)])
    assert torch.equal(order, again)  # same generator seed -> same order
    plain = torch.cat([yb for _, yb in D.batches(data, 5, shuffle=False, generator=None, **kwargs)])
    assert plain.tolist() == list(range(23))


def test_batches_normalise_per_channel():
    mean, std = [0.1, 0.5, 0.9], [0.2, 0.3, 0.4]
    raw = small_data(n=10)
    data = D.TensorData(x=raw.x, y=raw.y, transform=D.ImageNormalize(mean, std))
    got = torch.cat([xb for xb, _ in D.batches(data, 4, shuffle=False, generator=None)])
    want = (data.x.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Shuffled batches carry matching images and labels.
    g = torch.Generator().manual_seed(1)
    for xb, yb in D.batches(data, 3, shuffle=True, generator=g):
        torch.testing.assert_close(xb, want[yb], atol=1e-5, rtol=1e-5)


def test_partitions_equal_flower_datasets_per_partition_loading() -> None:
    """The app's partitions are flwr-datasets' (public load_partition), and the array_split
    shortcut of large IID federations gives IidPartitioner's shards."""
    import datasets as hfds
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    labels = np.random.default_rng(0).integers(0, 10, size=3000)
    train = D.TensorData(x=torch.zeros((3000, 1, 2, 2), dtype=torch.uint8), y=torch.from_numpy(labels),
                         transform=D.ImageNormalize([0.5], [0.5]))
    ours = D.partition_indices(train, {"name": "dirichlet", "alpha": 0.3, "min_partition_size": 5, "self_balancing": False}, 30, 4)
    slow_p = DirichletPartitioner(30, "label", 0.3, 5, seed=4)
    slow_p.dataset = hfds.Dataset.from_dict({"label": labels, "idx": np.arange(len(labels))})
    slow = [np.sort(np.asarray(slow_p.load_partition(i)["idx"])) for i in range(30)]
    assert all(np.array_equal(a, b) for a, b in zip(ours, slow))

    order = np.random.default_rng(1).permutation(len(labels))
    iid_p = IidPartitioner(num_partitions=70)
    iid_p.dataset = hfds.Dataset.from_dict({"label": labels[order], "idx": order})
    flower = [np.asarray(iid_p.load_partition(i)["idx"]) for i in range(70)]
    assert all(np.array_equal(a, b) for a, b in zip(np.array_split(order, 70), flower))


def test_token_data_batches_untouched_with_the_identity_transform():
    """The same container and batching serve token sequences (int64 [N, T]) for text tasks."""
    x = torch.arange(40, dtype=torch.int64).view(10, 4)
    data = D.TensorData(x=x, y=torch.arange(10, dtype=torch.int64))
    assert isinstance(data.transform, D.Identity)
    got = list(D.batches(data, 4, shuffle=True, generator=torch.Generator().manual_seed(0)))
    assert [len(yb) for _, yb in got] == [4, 4, 2]
    for xb, yb in got:
        assert xb.dtype == torch.int64 and torch.equal(xb, x[yb])  # values untouched, rows matched
    assert sorted(torch.cat([yb for _, yb in got]).tolist()) == list(range(10))
    assert len(data.subset(np.array([1, 3]))) == 2 and isinstance(data.subset(np.array([1])).transform, D.Identity)


def test_input_spec_from_the_config_alone():
    from fedmm.config import compose, to_container

    mnist = D.input_spec(to_container(compose([]))["dataset"])
    assert (mnist.kind, mnist.num_classes, mnist.shape) == ("image", 10, (1, 28, 28))
    cifar = D.input_spec(to_container(compose(["dataset=cifar10"]))["dataset"])
    assert (cifar.in_channels, cifar.image_size, cifar.num_classes) == (3, 32, 10)


def test_mnist5k_first_batch_is_the_old_formula_in_the_same_order(mnist5k):
    train, _ = mnist5k
    n = len(train)
    first_x, first_y = next(D.batches(train, 50, shuffle=True, generator=torch.Generator().manual_seed(0)))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:50]
    assert torch.equal(first_y, train.y[order])
    want = (train.x[order].float() / 255 - 0.1307) / 0.3081
    torch.testing.assert_close(first_x, want, atol=1e-5, rtol=1e-5)


def test_local_test_rows_are_held_out_of_training(mnist5k):
    from fedmm.config import compose, to_container

    cfg = to_container(compose(["partition.local_test_fraction=0.25"]))
    d, p = cfg["dataset"], cfg["partition"]
    whole = D.load_partition(d, {**p, "local_test_fraction": 0.0}, 3, 20, 0)
    train = D.load_partition(d, p, 3, 20, 0)
    test = D.load_partition(d, p, 3, 20, 0, part="test")
    assert len(train) + len(test) == len(whole) and len(test) == round(0.25 * len(whole))
    key = lambda data: {bytes(row) for row in data.x.numpy().reshape(len(data), -1)}  # noqa: E731
    assert not key(train) & key(test)  # no held-out image is trained on
    assert key(train) | key(test) == key(whole)
    same = D.load_partition(d, p, 3, 20, 0, part="test")
    assert torch.equal(same.y, test.y)  # seeded: the same rows every time
    with pytest.raises(ConfigError) as info:
        D.load_partition(d, {**p, "local_test_fraction": 0.0}, 3, 20, 0, part="test")
    assert info.value.key == "partition.local_test_fraction"


def test_offline_the_hub_is_asked_once_and_the_error_says_what_to_do(monkeypatch):
    """HF_HUB_OFFLINE (set by conftest, as on an offline machine): no retries, one clear error."""
    import datasets as hfds

    calls = []
    real = hfds.load_dataset
    monkeypatch.setattr(hfds, "load_dataset", lambda *a, **k: calls.append(a) or real(*a, **k))
    with pytest.raises(RuntimeError) as info:
        D.load_dataset(dataset_cfg("cifar10"))
    assert len(calls) == 1
    assert "dataset.hf_id='uoft-cs/cifar10'" in str(info.value) and "set dataset.path" in str(info.value)
