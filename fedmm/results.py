"""The files of a run directory, as every consumer reads them (report tool, tests, scripts).

One directory per run: the resolved ``config.yaml``, ``metrics.jsonl`` (one line per evaluated
round), ``label_histograms.json``/``.png``, ``learning_curve.png``, ``federated_evaluation.json``
(when clients evaluate), ``summary.json``, ``checkpoint.pt`` and ``checkpoint.previous.pt`` (the
newest and the one before, to resume), ``final_model.pt`` (the global model's state_dict) and,
for multi-model strategies, ``final_models.npz`` (the K models).
The ServerApp writes them (``server_app/recording.py``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no NaN / Inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """Rows of a run's ``metrics.jsonl`` (``path`` is the run directory or the file).

    A last line without its newline (a run killed while writing it) is not a row.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    complete = lines[:-1]  # the text after the last newline is unfinished (usually "")
    return [json.loads(line) for line in complete if line.strip()]


def run_status(run_dir: Path | str) -> tuple[str, str]:
    """(status, reason) of a run directory from its ``summary.json`` (``missing`` when absent).

    The ServerApp writes ``completed``, ``failed`` (with the reason), ``interrupted`` (a signal
    to ``fedmm``) or ``stopped`` (Flower ended the ServerApp: ``flwr stop``, or a signal to its
    process); the last two leave a checkpoint that ``resume=<run dir>`` continues.
    """
    summary = Path(run_dir) / SUMMARY_FILE
    if not summary.is_file():
        return "missing", f"no {SUMMARY_FILE} in {run_dir} (the run did not start, or is still running)"
    data = json.loads(summary.read_text(encoding="utf-8"))
    return str(data.get("status", "unknown")), str(data.get("reason", ""))


def main(argv: list[str] | None = None) -> int:
    """``python -m fedmm.results check <run dir>``: exit 0 when the run completed, 1 otherwise.

    ``flwr run --stream`` exits 0 even when the ServerApp failed: scripts check this instead.
    """
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("command", choices=("check",))
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    status, reason = run_status(args.run_dir)
    print(f"{args.run_dir}: {status}" + (f" ({reason})" if reason else ""))
    return 0 if status == "completed" else 1


if __name__ == "__main__":
    raise SystemExit(main())
