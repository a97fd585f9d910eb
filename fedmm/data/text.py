"""Text tasks: Shakespeare (next character) and Sent140 (tweet sentiment), naturally partitioned
by speaker / user, from a local folder in LEAF's JSON layout or from the Hugging Face hub.

A LEAF folder holds ``train/*.json`` and ``test/*.json``; each file has ``users`` (ids),
``num_samples`` and ``user_data`` (``{user: {"x": [...], "y": [...]}}``). Every row keeps its user
as its natural id (``partition=natural`` gives one client per user, ``partition.min_samples``
drops small users); the test split is the union of the users' test data.

- **Shakespeare**: ``x`` is a string of ``seq_len`` (80) characters, ``y`` the next character;
  both are mapped to LEAF's 80-symbol alphabet (:data:`ALPHABET`; a character outside it is
  mapped to the space and counted in a warning). Hub id ``flwrlabs/shakespeare`` (columns
  ``character_id``, ``x``, ``y``; one split, so ``test_fraction`` of every user's rows is held
  out with a fixed seed).
- **Sent140**: ``x`` is LEAF's row ``[id, date, query, user, text]`` (or the text itself), ``y``
  0 / 1. Tweets are split into words and punctuation as LEAF does, lower-cased, mapped through a
  vocabulary built from the training split (the ``vocab_size`` most frequent words seen at least
  ``min_count`` times; id 0 = padding, 1 = unknown) and padded / truncated to ``seq_len`` (25)
  tokens. Optional pre-trained vectors come from a local GloVe-format text file
  (``embeddings_path``). Hub: ``stanfordnlp/sentiment140`` (columns ``user``, ``text``,
  ``sentiment`` with 0 = negative, 4 = positive, mapped to 0 / 1; its training split only, with
  ``test_fraction`` of every user's rows held out, as its own small test split has a neutral
  class that LEAF leaves out).
"""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmm.data.tensors import Identity, TensorData
from fedmm.errors import ConfigError

#: LEAF's Shakespeare alphabet (80 symbols); a character's index is its class.
ALPHABET = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
_CHAR_INDEX = {c: i for i, c in enumerate(ALPHABET)}
#: Token ids of Sent140 that are not words.
PAD, UNK = 0, 1
_WORDS = re.compile(r"[\w']+|[.,!?;]")


class TextDataError(ConfigError):
    """A LEAF folder or file that cannot be read (names the file and the problem)."""


# ----------------------------------------------------------------------------- LEAF folders
def read_leaf_split(root: str | Path, split: str) -> list[tuple[str, list[Any], list[Any]]]:
    """(user, x, y) of every user in ``<root>/<split>/*.json``, files in name order."""
    folder = Path(root).expanduser() / split
    if not Path(root).expanduser().is_dir():
        raise TextDataError("dataset.path", str(root), "an existing folder in LEAF's layout (train/*.json, test/*.json)")
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise TextDataError("dataset.path", str(root), f"a LEAF folder with {split}/*.json files (none in {folder})")
    users: list[tuple[str, list[Any], list[Any]]] = []
    for path in files:
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
            names, data = content["users"], content["user_data"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise TextDataError("dataset.path", str(path), f"a LEAF JSON file with users and user_data ({type(err).__name__}: {err})") from err
        for user in names:
            entry = data.get(user) if isinstance(data, dict) else None
            if not entry or not entry.get("x") or len(entry.get("x", [])) != len(entry.get("y", [])):
                raise TextDataError("dataset.path", str(path), f"user {user!r} with samples: its x is empty or x and y differ in length")
            users.append((str(user), list(entry["x"]), list(entry["y"])))
    return users


# ----------------------------------------------------------------------------- Shakespeare
def encode_chars(strings: Iterable[str], seq_len: int) -> tuple[torch.Tensor, int]:
    """(int64 [N, seq_len] indices into :data:`ALPHABET`, characters outside it mapped to the space)."""
    rows, unknown = [], 0
    space = _CHAR_INDEX[" "]
    for s in strings:
        if len(s) != seq_len:
            raise ValueError(f"a Shakespeare sample has {len(s)} characters, dataset.seq_len={seq_len}: {s[:20]!r}...")
        row = [_CHAR_INDEX.get(c, -1) for c in s]
        unknown += row.count(-1)
        rows.append([space if i < 0 else i for i in row])
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, seq_len), unknown


def shakespeare_data(users: list[tuple[str, list[Any], list[Any]]], seq_len: int) -> TensorData:
    """A split from LEAF users (each row keeps its user as natural id)."""
    xs, ys, ids = [], [], []
    for user, x, y in users:
        xs += [str(s) for s in x]
        ys += [str(c)[:1] for c in y]
        ids += [user] * len(x)
    try:
        x_t, unknown = encode_chars(xs, seq_len)
    except ValueError as err:
        raise TextDataError("dataset.seq_len", seq_len, str(err)) from err
    y_idx = [_CHAR_INDEX.get(c, -1) for c in ys]
    unknown += y_idx.count(-1)
    if unknown:
        warnings.warn(f"{unknown} character(s) outside LEAF's 80-symbol alphabet were mapped to the space", stacklevel=2)
    y_t = torch.tensor([_CHAR_INDEX[" "] if i < 0 else i for i in y_idx], dtype=torch.int64)
    return TensorData(x=x_t, y=y_t, ids=np.asarray(ids), transform=Identity())


# ----------------------------------------------------------------------------- Sent140
def tweet_text(x: Any) -> str:
    """The text of a Sent140 sample: LEAF's row [id, date, query, user, text] or the text."""
    if isinstance(x, (list, tuple)):
        return str(x[4]) if len(x) >= 5 else str(x[-1])
    return str(x)


def words(text: str) -> list[str]:
    """LEAF's split into words and punctuation, lower-cased."""
    return _WORDS.findall(text.lower())


def build_vocabulary(texts: Iterable[str], vocab_size: int, min_count: int) -> dict[str, int]:
    """word -> id (2 ..): the ``vocab_size`` most frequent words with at least ``min_count``
    occurrences, ties in alphabetical order."""
    counts = Counter(w for t in texts for w in words(t))
    kept = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))[:vocab_size]
    return {w: i + 2 for i, w in enumerate(kept)}


def encode_words(texts: Iterable[str], vocab: Mapping[str, int], seq_len: int) -> torch.Tensor:
    """int64 [N, seq_len] token ids, padded with 0 at the end or truncated."""
    rows = []
    for t in texts:
        ids = [vocab.get(w, UNK) for w in words(t)][:seq_len]
        rows.append(ids + [PAD] * (seq_len - len(ids)))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, seq_len)


def sent140_labels(y: Iterable[Any]) -> torch.Tensor:
    """0 / 1 labels (Sentiment140's 4 = positive becomes 1)."""
    out = []
    for v in y:
        v = int(float(v))
        if v not in (0, 1, 4):
            raise ValueError(f"a Sent140 label must be 0, 1 or 4 (positive); got {v}")
        out.append(1 if v in (1, 4) else 0)
    return torch.tensor(out, dtype=torch.int64)


def sent140_data(users: list[tuple[str, list[Any], list[Any]]], vocab: Mapping[str, int], seq_len: int) -> TensorData:
    texts, ys, ids = [], [], []
    for user, x, y in users:
        texts += [tweet_text(v) for v in x]
        ys += list(y)
        ids += [user] * len(x)
    try:
        labels = sent140_labels(ys)
    except ValueError as err:
        bad = next(v for v in ys if int(float(v)) not in (0, 1, 4))
        raise TextDataError("dataset.label_column", bad, f"Sent140 labels 0, 1 or 4 ({err})") from err
    return TensorData(x=encode_words(texts, vocab, seq_len), y=labels, ids=np.asarray(ids), transform=Identity())


def load_glove(path: str | Path, vocab: Mapping[str, int], dim: int) -> tuple[np.ndarray, int]:
    """(vectors for the vocabulary's ids, how many words were found) from a GloVe-format text
    file ("word v1 ... v_dim" per line); rows of missing words stay 0."""
    out = np.zeros((len(vocab) + 2, dim), dtype=np.float32)
    found = 0
    file = Path(path).expanduser()
    if not file.is_file():
        raise TextDataError("dataset.embeddings_path", str(path), "a GloVe-format text file (word and its vector per line)")
    with file.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            parts = line.rstrip().split(" ")
            if len(parts) != dim + 1:
                raise TextDataError("dataset.embeddings_path", str(path),
                                    f"{dim} numbers after each word (model.embedding_dim); line {n} has {len(parts) - 1}")
            if parts[0] in vocab:
                out[vocab[parts[0]]] = np.asarray(parts[1:], dtype=np.float32)
                found += 1
    return out, found


# ----------------------------------------------------------------------------- splits
def per_user_holdout(data: TensorData, fraction: float, seed: int) -> tuple[TensorData, TensorData]:
    """(train, test) with ``fraction`` of every user's rows (at least one when it has two) in test."""
    rng = np.random.default_rng(seed)
    test_rows = []
    for user in np.unique(data.ids):
        rows = np.flatnonzero(data.ids == user)
        k = int(round(fraction * len(rows)))
        if len(rows) >= 2:
            k = min(max(k, 1), len(rows) - 1)
        else:
            k = 0
        test_rows.append(rng.permutation(rows)[:k])
    test = np.sort(np.concatenate(test_rows)) if test_rows else np.zeros(0, np.int64)
    train = np.setdiff1d(np.arange(len(data)), test, assume_unique=True)
    return data.subset(train), data.subset(test)
