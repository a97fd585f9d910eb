"""Where a run writes, and what: config, metrics.jsonl, models, plots.

One directory per run, never reused: the resolved ``config.yaml``, ``metrics.jsonl`` (one
line per evaluated round), ``label_histograms.json``/``.png``, ``learning_curve.png``,
``federated_evaluation.json`` (when clients evaluate), ``final_model.pt`` (the global
model's state_dict) and, for multi-model strategies,
``final_models.npz`` (the K models the server kept).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from fedmm.errors import ConfigError

METRICS_FILE = "metrics.jsonl"


def run_dir_name(cfg: Mapping[str, Any]) -> str:
    """``<timestamp>_<strategy>_<dataset>_<partition>_s<seed>``."""
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    objective = cfg.get("objective", {}).get("name", "ce")
    method = cfg["strategy"]["name"] + ("" if objective == "ce" else f"+{objective}")
    return f"{stamp}_{method}_{cfg['dataset']['name']}_{cfg['partition']['name']}_s{cfg['seed']}"


def create_run_dir(cfg: Mapping[str, Any]) -> Path:
    """Create the run's directory (absolute). Never reuses a directory that holds a run."""
    if cfg.get("output_dir"):
        path = Path(os.path.expanduser(str(cfg["output_dir"]))).resolve()
        if (path / METRICS_FILE).exists():
            raise ConfigError("output_dir", str(path), "a directory that does not already hold a run's metrics.jsonl")
        path.mkdir(parents=True, exist_ok=True)
        return path
    root = Path(os.path.expanduser(str(cfg["results_root"]))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    base = run_dir_name(cfg)
    for attempt in range(1000):
        path = root / (base if attempt == 0 else f"{base}-{attempt}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a fresh run directory under {root}")


class RunRecorder:
    """Writes the files of one run as it goes."""

    def __init__(self, path: Path, cfg: Mapping[str, Any]) -> None:
        self.path = path
        self.history: list[dict[str, Any]] = []
        with open(path / "config.yaml", "w", encoding="utf-8") as f:
            yaml.safe_dump(dict(cfg), f, sort_keys=False)

    def log_metrics(self, row: Mapping[str, Any]) -> None:
        """Append one evaluated round to ``metrics.jsonl`` (flushed at once)."""
        self.history.append(dict(row))
        with open(self.path / METRICS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def write_json(self, name: str, data: Any) -> None:
        """Write ``data`` as ``name`` (JSON)."""
        with open(self.path / name, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)

    def plot_learning_curve(self, title: str) -> Path:
        """``learning_curve.png``: test accuracy and loss of the global model per round."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out = self.path / "learning_curve.png"
        rounds = [row["round"] for row in self.history]
        fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
        ax_acc.plot(rounds, [100 * row["accuracy"] for row in self.history], marker=".")
        ax_acc.set_xlabel("round")
        ax_acc.set_ylabel("test accuracy (%)")
        ax_acc.grid(alpha=0.3)
        ax_loss.plot(rounds, [row["loss"] for row in self.history], marker=".", color="tab:red")
        ax_loss.set_xlabel("round")
        ax_loss.set_ylabel("test loss")
        ax_loss.grid(alpha=0.3)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """Rows of a run's ``metrics.jsonl`` (``path`` is the run directory or the file)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
