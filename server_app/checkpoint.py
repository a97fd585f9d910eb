"""Checkpoints of a run: everything needed to continue it exactly, written atomically.

Two generations in the run directory: ``checkpoint.pt`` (the newest) and
``checkpoint.previous.pt`` (the one before). A new checkpoint is written to a temporary file in
the same directory and flushed to disk; only then does the newest become the previous generation
and the new file the newest (renames), so a crash at any moment leaves whole files, never a
half-written one, and the older generation is never given up before the newer one is complete.
A resume reads the newest; when that file cannot be read (truncated by a disk fault, corrupt) it
warns, naming the file and why, and continues from the previous generation.

A checkpoint loads with ``torch.load(weights_only=True)``: only tensors, numbers, strings, bytes
and containers of them, so a crafted checkpoint cannot run code when resumed; numpy arrays are
stored as their bytes with dtype and shape (:func:`to_safe`).
"""

from __future__ import annotations

import os
import random
import re
import zipfile
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.supercore import log

from fedmm.errors import ConfigError
from fedmm.observers import RunObserver
from server_app.recording import atomic_file

CHECKPOINT_FILE = "checkpoint.pt"
#: The generation before :data:`CHECKPOINT_FILE` (a resume falls back to it).
PREVIOUS_CHECKPOINT_FILE = "checkpoint.previous.pt"
#: Bumped when the layout of a checkpoint changes.
CHECKPOINT_VERSION = 2  # 2: weights-only (numpy arrays as bytes)


def rng_states() -> dict[str, Any]:
    """The server process's global RNG states (Python, numpy, torch)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng_states(states: dict[str, Any]) -> None:
    """Restore :func:`rng_states`."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


_NDARRAY = "__ndarray__"
_TUPLE = "__tuple__"
_DICT = "__dict__"
_REF = "__ref__"


def to_safe(value: Any, path: str = "checkpoint", _memo: dict[int, int] | None = None) -> Any:
    """``value`` made of what ``torch.load(weights_only=True)`` reads back: numpy arrays as
    {bytes tensor, dtype, shape}, numpy scalars as Python numbers, tuples tagged; a dict or array
    met a second time is a reference to the first (K models sharing one dict stay shared).
    Anything else (an arbitrary object) is a TypeError naming where it is."""
    memo = {} if _memo is None else _memo
    if isinstance(value, (np.ndarray, dict)):
        if id(value) in memo:
            return {_REF: memo[id(value)]}
        memo[id(value)] = len(memo)
        index = memo[id(value)]
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError(f"{path}: a numpy array of Python objects cannot be checkpointed safely")
        raw = np.ascontiguousarray(value).tobytes()
        return {_NDARRAY: torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8),
                "dtype": value.dtype.str, "shape": list(value.shape), "id": index}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {_DICT: index, "items": [[to_safe(k, path, memo), to_safe(v, f"{path}.{k}", memo)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {_TUPLE: [to_safe(v, f"{path}[{i}]", memo) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [to_safe(v, f"{path}[{i}]", memo) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor)):
        return value
    raise TypeError(f"{path}: a {type(value).__name__} cannot be checkpointed safely (tensors, numbers, strings, "
                    "bytes, numpy arrays and containers of them can)")


def from_safe(value: Any, _seen: dict[int, Any] | None = None) -> Any:
    """Undo :func:`to_safe`."""
    seen = {} if _seen is None else _seen
    if isinstance(value, dict):
        if _REF in value:
            return seen[value[_REF]]
        if _NDARRAY in value:
            raw = value[_NDARRAY].numpy().tobytes()
            out = np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
            seen[value["id"]] = out
            return out
        if _DICT in value:
            built: dict[Any, Any] = {}
            seen[value[_DICT]] = built
            for k, v in value["items"]:
                built[from_safe(k, seen)] = from_safe(v, seen)
            return built
        if _TUPLE in value:
            return tuple(from_safe(v, seen) for v in value[_TUPLE])
        raise ValueError(f"an untagged mapping in a checkpoint: {sorted(value)[:5]}")
    if isinstance(value, list):
        return [from_safe(v, seen) for v in value]
    return value


def save_checkpoint(run_dir: Path, payload: dict[str, Any], keep_previous: bool = True) -> Path:
    """Write ``payload`` as the run's newest checkpoint, atomically (temp file + fsync + rename).

    ``keep_previous``: the newest until now becomes :data:`PREVIOUS_CHECKPOINT_FILE` (False: it
    is replaced, the previous generation kept as it is: a run resumed from the previous
    generation because the newest was unreadable)."""
    target = Path(run_dir) / CHECKPOINT_FILE
    safe = to_safe({"version": CHECKPOINT_VERSION, **payload})
    with atomic_file(target, "wb", previous=target.with_name(PREVIOUS_CHECKPOINT_FILE) if keep_previous else None) as f:
        torch.save(safe, f)
    return target


class UnreadableCheckpoint(Exception):
    """A checkpoint file that cannot be resumed from; the message names the file and why."""


def _sentences(text: str) -> str:
    """The first sentence of torch's message (whole, never cut), or of its specific part when
    the first paragraph is torch's general advice (``Weights only load failed. ...``)."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", str(text)) if p.strip()]
    if not paragraphs:
        return ""
    chosen = paragraphs[1] if len(paragraphs) > 1 and paragraphs[0].startswith("Weights only load failed") else paragraphs[0]
    first = re.split(r"(?<=[.!?])\s", " ".join(chosen.split()), maxsplit=1)[0]
    return first if first.endswith((".", "!", "?")) else f"{first}."


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint in the file ``path``; :class:`UnreadableCheckpoint` naming the file (its
    name: the run directory is the caller's to name) and why it cannot be read: empty, truncated (its end is missing), not a checkpoint, corrupt (a
    member fails its CRC check), not plain values (a crafted pickle), another layout."""
    size = path.stat().st_size
    if size == 0:
        raise UnreadableCheckpoint(f"{path.name} is empty (0 bytes)")
    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive
    if not zipped:
        raise UnreadableCheckpoint(f"{path.name} is not a checkpoint (not the zip archive torch.save writes)")
    if not zipfile.is_zipfile(path):
        raise UnreadableCheckpoint(f"{path.name} is truncated: its end is missing ({size:,} bytes written; a disk fault, a "
                                   f"full disk or a copy cut short)")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError) as err:
        raise UnreadableCheckpoint(f"{path.name} is unreadable ({_sentences(str(err))})") from None
    if bad is not None:
        raise UnreadableCheckpoint(f"{path.name} is corrupt: its part {bad} fails its CRC check (a disk fault)")
    try:
        state = from_safe(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as err:  # noqa: BLE001 - a pickle with code in it, a checkpoint of an older layout
        raise UnreadableCheckpoint(f"{path.name} is unreadable: it does not load as tensors and plain values (torch: "
                                   f"{_sentences(str(err)) or type(err).__name__})") from None
    version = state.get("version") if isinstance(state, dict) else None
    if version != CHECKPOINT_VERSION:
        raise UnreadableCheckpoint(f"{path.name} has another layout (version {version}; this fedmm reads version "
                                   f"{CHECKPOINT_VERSION})")
    return state


def load_checkpoint(run_dir: Path | str) -> dict[str, Any]:
    """The newest readable checkpoint of the run in ``run_dir``: :data:`CHECKPOINT_FILE`, or,
    with a warning naming it and why, :data:`PREVIOUS_CHECKPOINT_FILE` when the newest cannot be
    read. ConfigError (key ``resume``) when there is none, or neither can be read (naming both).
    ``loaded_from`` in the returned state is the file's name."""
    folder = Path(os.path.expanduser(str(run_dir)))
    newest, previous = folder / CHECKPOINT_FILE, folder / PREVIOUS_CHECKPOINT_FILE
    if not newest.is_file() and not previous.is_file():
        raise ConfigError("resume", str(run_dir), f"a run directory holding a {CHECKPOINT_FILE} (none found there)")
    problems = []
    for path in (newest, previous):
        if not path.is_file():
            problems.append(f"{path.name} is missing" if path == newest else f"there is no {PREVIOUS_CHECKPOINT_FILE} to fall back to")
            continue
        try:
            state = read_checkpoint(path)
        except UnreadableCheckpoint as err:
            problems.append(str(err))
            continue
        if problems:
            log(WARNING, "fedmm: in %s, %s; resuming from the previous checkpoint, %s (round %s): the rounds after it "
                "run again", folder, problems[0], path.name, state.get("round"))
        return {**state, "loaded_from": path.name}
    raise ConfigError("resume", str(run_dir), "a run directory with a readable checkpoint, and in it " + "; ".join(problems))


class Checkpointer(RunObserver):
    """Checkpoints of a run, an observer (:mod:`fedmm.observers`): after every round it keeps the
    state to save (the strategy's, the global RNGs, the metrics and federated metrics so far, the
    byte counters, the elapsed seconds: references, the server's arrays are never written in
    place), writes ``checkpoint.pt`` every ``every`` rounds and after the last (the one before
    kept as ``checkpoint.previous.pt``), and :meth:`flush` writes the last round's when it was not
    (an interrupted or failed run can be resumed from it).

    Parameters
    ----------
    run_dir : Path
        Where ``checkpoint.pt`` goes.
    strategy, recorder, grid :
        The run's strategy (its ``state_dict`` and federated metrics), its
        :class:`~server_app.recording.RunRecorder` (``history``, ``federated``) and its counting grid
        (``bytes_sent``, ``bytes_received``).
    elapsed : callable
        The run's seconds so far (a resumed run's include those before).
    every, num_rounds : int
        ``checkpoint_every`` (0: only after the last round) and the run's last round.
    done : int
        The rounds done before (a resumed run's).
    resumed_from : str, optional
        The file a resumed run's state came from (:func:`load_checkpoint`'s ``loaded_from``): when
        it is the previous generation, the newest was unreadable, and the first checkpoint written
        replaces it instead of keeping it as the previous one.
    """

    def __init__(self, run_dir: Path, strategy: Any, recorder: Any, grid: Any, elapsed: Any, every: int, num_rounds: int,
                 done: int = 0, resumed_from: str | None = None) -> None:
        self.run_dir, self.strategy, self.recorder, self.grid, self.elapsed = run_dir, strategy, recorder, grid, elapsed
        self.every, self.num_rounds = every, num_rounds
        #: The last completed round, the last one saved, and the state after the last completed round.
        self.round = self.saved = done
        self.state: dict[str, Any] | None = None
        #: Whether the next write keeps the newest file as the previous generation.
        self.keep_previous = resumed_from != PREVIOUS_CHECKPOINT_FILE

    def on_round_end(self, server_round: int) -> None:
        federated = self.strategy.context.evaluation.last_evaluate_metrics
        if federated is not None:
            self.recorder.federated[server_round] = dict(federated)
        self.round = server_round
        self.state = {
            "round": server_round, "strategy": self.strategy.context.state_dict(), "rng": rng_states(),
            "metrics": [dict(row) for row in self.recorder.history], "federated": dict(self.recorder.federated),
            "bytes_sent": self.grid.bytes_sent, "bytes_received": self.grid.bytes_received, "seconds": self.elapsed(),
        }
        if server_round == self.num_rounds or (self.every and server_round % self.every == 0):
            self._save()

    def flush(self) -> None:
        """Write the last completed round's state if it was not written."""
        if self.state is not None and self.saved < self.round:
            self._save()

    def _save(self) -> None:
        save_checkpoint(self.run_dir, self.state, keep_previous=self.keep_previous)
        self.saved, self.keep_previous = self.round, True
