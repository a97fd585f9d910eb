"""Checkpoints of a run: everything needed to continue it exactly, written atomically.

One file, ``checkpoint.pt`` in the run directory, replaced as a whole: the new checkpoint is
written to a temporary file in the same directory, flushed to disk, then renamed over the old
one, so a crash at any moment leaves either the previous checkpoint or the new one, never a
half-written file. The file is a pickle (``torch.save``): load only checkpoints you wrote.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmm.errors import ConfigError
from server_app.recording import atomic_file

CHECKPOINT_FILE = "checkpoint.pt"
#: Bumped when the layout of a checkpoint changes.
CHECKPOINT_VERSION = 1


def rng_states() -> dict[str, Any]:
    """The server process's global RNG states (Python, numpy, torch)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng_states(states: dict[str, Any]) -> None:
    """Restore :func:`rng_states`."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


def save_checkpoint(run_dir: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as the run's checkpoint, atomically (temp file + fsync + rename)."""
    target = Path(run_dir) / CHECKPOINT_FILE
    with atomic_file(target, "wb") as f:
        torch.save({"version": CHECKPOINT_VERSION, **payload}, f)
    return target


def load_checkpoint(run_dir: Path | str) -> dict[str, Any]:
    """The checkpoint of the run in ``run_dir``; ConfigError (key ``resume``) when there is none."""
    path = Path(os.path.expanduser(str(run_dir))) / CHECKPOINT_FILE
    if not path.is_file():
        raise ConfigError("resume", str(run_dir), f"a run directory holding a {CHECKPOINT_FILE} (none found there)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("version") != CHECKPOINT_VERSION:
        raise ConfigError("resume", str(run_dir), f"a checkpoint of version {CHECKPOINT_VERSION} (found {state.get('version')})")
    return state
