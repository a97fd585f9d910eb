"""Validation of the ``dataset`` and ``partition`` config groups, and what a model needs to
know about its input (:class:`InputSpec`), from the config alone (no data is loaded)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedmm.errors import ConfigError
from fedmm.settings import Choice, Number, Settings, Str, setting

NUM_CLIENTS_KEY = "num_clients"

#: Seed of the held-out test split for datasets without one. Fixed on purpose: the
#: test set must not change with the run seed, or runs would not be comparable.
HOLDOUT_SEED = 20240521

#: Text tasks (fedmm.data.text): token inputs, natural users.
TEXT_NAMES = ("shakespeare", "sent140")
DATASET_NAMES = ("mnist5k", "cifar10", "cifar100", "femnist", "mnist", "fashion_mnist") + TEXT_NAMES
EMBEDDED_NAMES = ("mnist5k",)
SOURCES = ("embedded", "hf")
PARTITION_NAMES = ("iid", "dirichlet", "natural", "file")
#: How a Dirichlet partition is drawn (``partition.algorithm``).
DIRICHLET_ALGORITHMS = ("flwr", "authors")
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
    "allow_partial",
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
    allow_partial: bool = False


_TEXT_KEYS = {
    "shakespeare": ("name", "source", "hf_id", "path", "user_column", "text_column", "label_column", "seq_len",
                    "num_classes", "test_fraction"),
    "sent140": ("name", "source", "hf_id", "path", "user_column", "text_column", "label_column", "seq_len",
                "num_classes", "test_fraction", "vocab_size", "min_count", "embeddings_path"),
}


@dataclass(frozen=True)
class _TextSpec:
    """Validated, hashable form of a text task's ``dataset`` config group."""

    name: str
    source: str
    hf_id: str | None
    path: str | None
    user_column: str
    text_column: str
    label_column: str
    seq_len: int
    num_classes: int
    test_fraction: float
    vocab_size: int = 0
    min_count: int = 1
    embeddings_path: str | None = None

    @property
    def token_ids(self) -> int:
        """Size of the model's embedding table: the 80-symbol alphabet, or the vocabulary + padding + unknown."""
        return 80 if self.name == "shakespeare" else self.vocab_size + 2


def _text_spec(cfg: Mapping) -> _TextSpec:
    name = cfg["name"]
    keys = _TEXT_KEYS[name]
    for key in cfg:
        if key not in keys:
            raise ConfigError(f"dataset.{key}", cfg[key], f"the keys of dataset {name}: {', '.join(keys)}")
    source = _require(cfg, "source", "dataset")
    if source != "hf":
        raise ConfigError("dataset.source", source, "hf (the hub id, or dataset.path: a LEAF folder, which wins when set)")
    path = _require(cfg, "path", "dataset")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError("dataset.path", path, "a LEAF folder path or null")
    path = os.path.expanduser(os.fspath(path)) if path else None
    hf_id = _opt_str(cfg, "hf_id")
    if path is None and hf_id is None:
        raise ConfigError("dataset.hf_id", hf_id, "a Hugging Face dataset id, or set dataset.path to a LEAF folder")
    columns = {}
    for key in ("user_column", "text_column", "label_column"):
        value = _require(cfg, key, "dataset")
        if not isinstance(value, str) or not value:
            raise ConfigError(f"dataset.{key}", value, "a column name of the hub dataset")
        columns[key] = value
    seq_len = _require(cfg, "seq_len", "dataset")
    if not _is_int(seq_len) or seq_len < 1:
        raise ConfigError("dataset.seq_len", seq_len, "a positive integer (characters / tokens per sample)")
    num_classes = _require(cfg, "num_classes", "dataset")
    want = 80 if name == "shakespeare" else 2
    if num_classes != want:
        raise ConfigError("dataset.num_classes", num_classes, f"{want} for {name}")
    test_fraction = _require(cfg, "test_fraction", "dataset")
    if not _is_number(test_fraction) or not 0.0 < float(test_fraction) < 1.0:
        raise ConfigError("dataset.test_fraction", test_fraction, "a number strictly between 0 and 1")
    extra: dict[str, Any] = {}
    if name == "sent140":
        vocab_size = _require(cfg, "vocab_size", "dataset")
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ConfigError("dataset.vocab_size", vocab_size, "a positive integer (words kept from the training split)")
        min_count = _require(cfg, "min_count", "dataset")
        if not _is_int(min_count) or min_count < 1:
            raise ConfigError("dataset.min_count", min_count, "an integer >= 1 (occurrences for a word to enter the vocabulary)")
        emb = _require(cfg, "embeddings_path", "dataset")
        if emb is not None and not isinstance(emb, str):
            raise ConfigError("dataset.embeddings_path", emb, "null or a GloVe-format text file")
        extra = {"vocab_size": int(vocab_size), "min_count": int(min_count), "embeddings_path": os.path.expanduser(emb) if emb else None}
    return _TextSpec(name=name, source=source, hf_id=hf_id, path=path, seq_len=int(seq_len), num_classes=int(num_classes),
                     test_fraction=float(test_fraction), **columns, **extra)


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
    if name in TEXT_NAMES:
        return _text_spec(cfg)  # type: ignore[return-value]
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
        allow_partial=_allow_partial(cfg),
    )


def _allow_partial(cfg: Mapping) -> bool:
    value = _require(cfg, "allow_partial", "dataset")
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError("dataset.allow_partial", value, "true or false")
    return bool(value)


def check_dataset_config(dataset_cfg: Mapping) -> None:
    """Validate the ``dataset`` config group without loading any data.

    Raises
    ------
    ConfigError
        Naming the first bad key (``dataset.<key>``) and its allowed values.
    """
    _dataset_spec(dataset_cfg)


@dataclass(frozen=True)
class _PartitionSpec:
    name: str
    alpha: float = 0.0
    min_partition_size: int = 0
    self_balancing: bool = False
    min_samples: int = 0
    algorithm: str = "flwr"
    path: str = ""


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
        algorithm = cfg.get("algorithm", "flwr")
        if algorithm not in DIRICHLET_ALGORITHMS:
            raise ConfigError("partition.algorithm", algorithm, ", ".join(DIRICHLET_ALGORITHMS))
        return _PartitionSpec(name, alpha=float(alpha), min_partition_size=int(min_size), self_balancing=bool(balancing),
                              algorithm=str(algorithm))
    if name == "file":
        path = _require(cfg, "path", "partition")
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ConfigError("partition.path", path, "the path of a partition file (JSON: client id -> row indices)")
        return _PartitionSpec(name, path=os.path.expanduser(os.fspath(path)))
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



# ------------------------------------------------------------------------ input spec


@dataclass(frozen=True)
class InputSpec:
    """What a model needs to know about its input, from the ``dataset`` config alone.

    Attributes
    ----------
    kind : str
        ``image`` (uint8 ``[C, H, W]`` inputs) or ``tokens`` (int64 token ids ``[T]``).
    num_classes : int
        Number of output logits.
    shape : tuple of int
        Shape of one input: ``(C, H, W)`` for images, ``(T,)`` for token sequences.
    vocab_size : int or None
        Vocabulary size of token inputs.
    """

    kind: str
    num_classes: int
    shape: tuple[int, ...]
    vocab_size: int | None = None

    @property
    def in_channels(self) -> int:
        """Image channels (images only)."""
        return self.shape[0]

    @property
    def image_size(self) -> int:
        """Side of the square images (images only)."""
        return self.shape[-1]


def input_spec(dataset_cfg: Mapping) -> InputSpec:
    """The :class:`InputSpec` of the configured dataset (validates the group)."""
    spec = _dataset_spec(dataset_cfg)
    if isinstance(spec, _TextSpec):
        return InputSpec(kind="tokens", num_classes=spec.num_classes, shape=(spec.seq_len,), vocab_size=spec.token_ids)
    return InputSpec(kind="image", num_classes=spec.num_classes, shape=(spec.in_channels, spec.image_size, spec.image_size))


#: The local dataset folders ``dataset.path`` may name.
LOCAL_FORMATS = "a datasets.save_to_disk output, cifar-10-batches-py or cifar-100-python"


def detect_local_format(path: str | Path) -> tuple[str, Path]:
    """(format, folder) of a local dataset folder, from its file names only (no data is read):
    ``cifar10``, ``cifar100`` or ``hf``. ConfigError (``dataset.path``) when it is none of them."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError("dataset.path", str(path), "an existing folder: " + LOCAL_FORMATS)
    # Accept the parent folder of the extracted CIFAR archives too.
    for sub in ("cifar-10-batches-py", "cifar-100-python"):
        if (root / sub).is_dir():
            root = root / sub
    if any((root / f).is_file() for f in ("test_batch", "batches.meta")) or list(root.glob("data_batch_*")):
        return "cifar10", root
    if (root / "train").is_file() or (root / "test").is_file():
        return "cifar100", root
    if any((root / f).is_file() for f in ("dataset_dict.json", "state.json")):
        return "hf", root
    found = ", ".join(sorted(p.name for p in root.iterdir())[:8]) or "nothing"
    raise ConfigError("dataset.path", str(path), f"{LOCAL_FORMATS} (found {found} there)")


# ------------------------------------------------------------------------ settings
_HELD_OUT = setting(0.0, Number(ge=0, lt=1, allowed="a fraction in [0, 1) of each client's rows held out for federated evaluation"),
                    "share of each client's rows held out for federated evaluation (needed when strategy.fraction_evaluate > 0)")


@dataclass
class ImageDatasetSettings(Settings):
    """An image dataset (``conf/dataset/<name>.yaml`` sets what differs from these)."""

    group = "dataset"
    keyed = False
    options_for = tuple(n for n in DATASET_NAMES if n not in TEXT_NAMES)
    name: str = setting("???", Choice(*options_for), "which dataset (its option file)")
    source: str = setting("hf", Choice(*SOURCES), "embedded (shipped in a package) | hf (the hub id, or path)")
    hf_id: str | None = setting(None, help="Hugging Face dataset id")
    path: str | None = setting(None, help="a local folder (save_to_disk output or CIFAR python batches); wins over hf_id")
    image_column: str | None = setting("image", help="the image column")
    label_column: str | None = setting("label", help="the label column")
    id_column: str | None = setting(None, help="the natural-partition id column (FEMNIST: writer_id)")
    label_type: str | None = setting(None, help="cifar100: coarse (20 superclasses) | fine (100)")
    num_classes: int = setting(10, help="classes")
    in_channels: int = setting(1, help="1 (grayscale) | 3 (RGB)")
    image_size: int = setting(28, help="side of the square images")
    mean: list = setting([0.5], help="normalisation mean per channel")
    std: list = setting([0.5], help="normalisation std per channel")
    test_split: str | None = setting(None, help="the split held out for testing; null: hold out test_fraction with a fixed seed")
    test_fraction: float = setting(0.2, help="share held out as test when there is no test split")
    allow_partial: bool = setting(False, help="a local CIFAR folder with missing or corrupted files: refused (false) or "
                                  "loaded with a warning (true)")

    def check_values(self, prefix: str) -> None:
        """The keys depend on each other: checked together (:func:`_dataset_spec`), and a local
        folder must exist."""
        _check_dataset_group(self.to_dict())


@dataclass
class TextDatasetSettings(Settings):
    """A text task (LEAF's Shakespeare and Sent140: natural users, token inputs)."""

    group = "dataset"
    keyed = False
    options_for = ("shakespeare",)
    name: str = setting("???", Choice(*TEXT_NAMES), "which task (its option file)")
    source: str = setting("hf", Choice("hf"), "hf (the hub id, or dataset.path: a LEAF folder, which wins when set)")
    hf_id: str | None = setting(None, help="Hugging Face dataset id")
    path: str | None = setting(None, help="a folder in LEAF's layout (train/*.json, test/*.json)")
    user_column: str = setting("user", help="hub column of the user (a LEAF folder has its own layout)")
    text_column: str = setting("text", help="hub column of the text")
    label_column: str = setting("label", help="hub column of the label")
    seq_len: int = setting(80, help="characters / tokens per sample")
    num_classes: int = setting(2, help="classes")
    test_fraction: float = setting(0.2, help="share of every user's rows held out as test (hub copy)")

    def check_values(self, prefix: str) -> None:
        _check_dataset_group(self.to_dict())


@dataclass
class Sent140Settings(TextDatasetSettings):
    """Sent140: a word vocabulary and optional GloVe vectors on top of the text task."""

    options_for = ("sent140",)
    vocab_size: int = setting(10000, help="most frequent words of the training split")
    min_count: int = setting(1, help="occurrences for a word to enter the vocabulary")
    embeddings_path: str | None = setting(None, help="a GloVe-format text file to initialise the embedding "
                                          "(model.embedding_dim = its width)")


@dataclass
class IidSettings(Settings):
    """Uniformly random, equally sized partitions."""

    group = "partition"
    option = "iid"
    local_test_fraction: float = _HELD_OUT

    def check_values(self, prefix: str) -> None:
        _partition_spec(self.to_dict())


@dataclass
class DirichletSettings(IidSettings):
    """Label skew: per-class proportions drawn from Dir(alpha); smaller alpha = more skew."""

    option = "dirichlet"
    alpha: float = setting(0.5, help="concentration (0.1: strong skew, 0.5, 1.0)", paper="0.1, 0.5, 1.0")
    min_partition_size: int = setting(10, help="redraw until every client has at least this many rows")
    self_balancing: bool = setting(False, help="stop giving a client rows of a class once it holds its share "
                                   "(algorithm authors: always on)")
    algorithm: str = setting("flwr", Choice(*DIRICHLET_ALGORITHMS),
                             "flwr: flwr-datasets' DirichletPartitioner | authors: the FedMR / FedCross repositories' "
                             "split (a fresh draw per class, a client holding N/num_clients rows gets no more; "
                             "redrawn until every client has min_partition_size rows)",
                             paper="authors (min_partition_size 10, seed 1: their partition files)")

    #: Declared after runs were made: the value that reproduces those runs.
    added = {"algorithm": "flwr"}


@dataclass
class FileSettings(IidSettings):
    """The partition a file states: client id -> row indices of the training split
    (docs/reproduce.md, "Partition files"); written by ``python -m fedmm.data.partition_file``
    or any other framework."""

    option = "file"
    path: str = setting("???", Str(), "the partition file (JSON)")


@dataclass
class NaturalSettings(IidSettings):
    """One partition per natural id (``dataset.id_column``, e.g. FEMNIST writer_id)."""

    option = "natural"
    min_samples: int = setting(0, help="keep only ids with more than this many samples",
                               paper="100 (FEMNIST: 180 writers with > 100 samples)")


def _check_dataset_group(values: Mapping) -> None:
    spec = _dataset_spec(values)
    path = values.get("path")
    if isinstance(spec, _TextSpec):
        if path and not (os.path.isdir(os.path.join(os.path.expanduser(str(path)), "train"))):
            raise ConfigError("dataset.path", path, "an existing folder in LEAF's layout (train/*.json, test/*.json), or null")
        return
    if path:
        if not os.path.exists(os.path.expanduser(str(path))):
            raise ConfigError("dataset.path", path, "an existing local dataset folder (save_to_disk output or CIFAR python batches), or null")
        detect_local_format(os.path.expanduser(str(path)))  # its format, from file names only
