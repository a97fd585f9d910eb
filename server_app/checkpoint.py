"""Checkpoints of a run: everything needed to continue it exactly, written atomically.

One file, ``checkpoint.pt`` in the run directory, replaced as a whole: the new checkpoint is
written to a temporary file in the same directory, flushed to disk, then renamed over the old
one, so a crash at any moment leaves either the previous checkpoint or the new one, never a
half-written file. It loads with ``torch.load(weights_only=True)``: only tensors, numbers,
strings, bytes and containers of them, so a crafted checkpoint cannot run code when resumed;
numpy arrays are stored as their bytes with dtype and shape (:func:`to_safe`).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmm.errors import ConfigError
from fedmm.observers import RunObserver
from server_app.recording import atomic_file

CHECKPOINT_FILE = "checkpoint.pt"
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


def save_checkpoint(run_dir: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as the run's checkpoint, atomically (temp file + fsync + rename)."""
    target = Path(run_dir) / CHECKPOINT_FILE
    safe = to_safe({"version": CHECKPOINT_VERSION, **payload})
    with atomic_file(target, "wb") as f:
        torch.save(safe, f)
    return target


def load_checkpoint(run_dir: Path | str) -> dict[str, Any]:
    """The checkpoint of the run in ``run_dir``; ConfigError (key ``resume``) when there is none."""
    path = Path(os.path.expanduser(str(run_dir))) / CHECKPOINT_FILE
    if not path.is_file():
        raise ConfigError("resume", str(run_dir), f"a run directory holding a {CHECKPOINT_FILE} (none found there)")
    try:
        state = from_safe(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as err:  # a pickle with code in it, or a checkpoint of an older layout
        raise ConfigError("resume", str(run_dir), f"a {CHECKPOINT_FILE} written by this version of fedmm "
                          f"(it does not load as tensors and plain values: {str(err).splitlines()[0][:200]})") from None
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        raise ConfigError("resume", str(run_dir), f"a checkpoint of version {CHECKPOINT_VERSION} (found {state.get('version')})")
    return state


class Checkpointer(RunObserver):
    """Checkpoints of a run, an observer (:mod:`fedmm.observers`): after every round it keeps the
    state to save (the strategy's, the global RNGs, the metrics and federated metrics so far, the
    byte counters, the elapsed seconds: references, the server's arrays are never written in
    place), writes ``checkpoint.pt`` every ``every`` rounds and after the last, and
    :meth:`flush` writes the last round's when it was not (an interrupted or failed run can be
    resumed from it).

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
    """

    def __init__(self, run_dir: Path, strategy: Any, recorder: Any, grid: Any, elapsed: Any, every: int, num_rounds: int,
                 done: int = 0) -> None:
        self.run_dir, self.strategy, self.recorder, self.grid, self.elapsed = run_dir, strategy, recorder, grid, elapsed
        self.every, self.num_rounds = every, num_rounds
        #: The last completed round, the last one saved, and the state after the last completed round.
        self.round = self.saved = done
        self.state: dict[str, Any] | None = None

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
            save_checkpoint(self.run_dir, self.state)
            self.saved = server_round

    def flush(self) -> None:
        """Write the last completed round's state if it was not written."""
        if self.state is not None and self.saved < self.round:
            save_checkpoint(self.run_dir, self.state)
            self.saved = self.round
