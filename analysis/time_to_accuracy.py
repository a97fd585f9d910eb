"""Accuracy against virtual time: the figure and the time-to-accuracy table of docs/async.md.

    python -m analysis.time_to_accuracy <sweep dir>... --targets 0.6 0.7 0.8 --out docs/results/async

Reads every completed run under the sweep directories (as :func:`analysis.report.load_runs`),
groups the runs that differ only in their seed, labels each group by its method
(:func:`analysis.report.method_label`), and uses the ``virtual_time`` each row of
``metrics.jsonl`` carries (:mod:`strategies.heterogeneity`; round 0 is at time 0). Writes

- ``<out>.md``: per method, the virtual seconds to first reach each target test accuracy (mean ±
  sample std over the seeds that reach it, "n/m" when not every seed does) and the accuracy at the
  common horizon (the earliest last virtual time of all groups, so every method is read at a time
  it reached);
- ``<out>.json``: the same numbers, and every run's (virtual time, accuracy) points;
- ``<out>.png``: accuracy against virtual time, the mean over seeds of each run's last evaluated
  accuracy at each time (a step curve), shaded ± the sample std.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from analysis.report import load_runs, method_label, seed_groups, setting_keys, setting_label


def curve(rows: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(virtual times, accuracies) of a run's evaluated rows, round 0 at time 0."""
    points = [(0.0 if row["round"] == 0 else float(row["virtual_time"]), float(row["accuracy"])) for row in rows]
    times, accuracies = zip(*points)
    return np.asarray(times), np.asarray(accuracies)


def time_to(rows: list[dict[str, Any]], target: float) -> float | None:
    """The first virtual time at which the run's test accuracy is at least ``target`` (None: never)."""
    times, accuracies = curve(rows)
    reached = np.flatnonzero(accuracies >= target)
    return float(times[reached[0]]) if len(reached) else None


def step_value(times: np.ndarray, accuracies: np.ndarray, moment: float) -> float:
    """The last accuracy evaluated at or before ``moment`` (times ascending, the first 0)."""
    return float(accuracies[np.searchsorted(times, moment, side="right") - 1])


def accuracy_at(rows: list[dict[str, Any]], moment: float) -> float:
    """The run's last evaluated accuracy at or before ``moment``."""
    return step_value(*curve(rows), moment)


def _mean_std(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    if not values:
        return "—"
    a = np.asarray(values) * scale
    return f"{a.mean():.{digits}f} ± {a.std(ddof=1):.{digits}f}" if len(a) > 1 else f"{a[0]:.{digits}f}"


def summarise(runs: list[dict[str, Any]], targets: list[float]) -> tuple[str, dict[str, Any]]:
    """The markdown table and its numbers."""
    missing = [str(r["dir"]) for r in runs if any("virtual_time" not in row for row in r["rows"][1:])]
    if missing:
        raise SystemExit(f"runs without virtual_time in metrics.jsonl (made before the virtual clock): {missing[:3]}")
    keys = setting_keys(runs)
    groups = []
    for group in seed_groups(runs):
        label = method_label(group[0]["cfg"])
        extra = setting_label(group[0]["cfg"], keys)
        groups.append((label + ("" if extra == "—" else f" [{extra}]"), sorted(group, key=lambda r: r["cfg"]["seed"])))
    groups.sort(key=lambda g: g[0])
    horizon = min(float(max(curve(r["rows"])[0])) for _, group in groups for r in group)
    head = "| method | seeds | " + " | ".join(f"time to {100 * t:g} %" for t in targets) + f" | accuracy at {horizon:.1f} s |"
    lines = [f"Virtual seconds to first reach each test accuracy (mean ± std over the seeds that reach it; "
             f"n/m: only n of m seeds do), and the accuracy (%) at the common horizon {horizon:.1f} s.", "",
             head, "|" + "---|" * (len(targets) + 3)]
    numbers: dict[str, Any] = {"horizon": horizon, "targets": targets, "methods": {}}
    for label, group in groups:
        cells = []
        reached_by_target = {}
        for target in targets:
            reached = [t for t in (time_to(r["rows"], target) for r in group) if t is not None]
            reached_by_target[str(target)] = reached
            cell = _mean_std(reached)
            cells.append(cell if len(reached) == len(group) else f"{cell} ({len(reached)}/{len(group)})")
        at_horizon = [accuracy_at(r["rows"], horizon) for r in group]
        lines.append(f"| {label} | {len(group)} | " + " | ".join(cells) + f" | {_mean_std(at_horizon, 100, 2)} |")
        numbers["methods"][label] = {
            "seeds": [r["cfg"]["seed"] for r in group], "time_to": reached_by_target, "accuracy_at_horizon": at_horizon,
            "curves": [[list(map(float, c)) for c in curve(r["rows"])] for r in group], "runs": [str(r["dir"]) for r in group],
        }
    return "\n".join(lines) + "\n", numbers


def plot(numbers: dict[str, Any], out: Path) -> None:
    """Accuracy against virtual time, one step curve per method (mean ± std over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    horizon = numbers["horizon"]
    grid = np.linspace(0.0, horizon, 400)
    for label, method in numbers["methods"].items():
        values = np.array([[step_value(np.asarray(t), np.asarray(a), g) for g in grid] for t, a in method["curves"]])
        mean = 100 * values.mean(axis=0)
        ax.step(grid, mean, where="post", label=label)
        if len(values) > 1:
            std = 100 * values.std(axis=0, ddof=1)
            ax.fill_between(grid, mean - std, mean + std, step="post", alpha=0.2)
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="sweep (or run) directories")
    parser.add_argument("--targets", nargs="+", type=float, default=[0.6, 0.7, 0.8], help="test accuracies in [0, 1]")
    parser.add_argument("--out", type=Path, required=True, help="output prefix: <out>.md, .json, .png")
    args = parser.parse_args(argv)
    refused: list[tuple[Path, str]] = []
    runs = [run for sweep in args.sweeps for run in load_runs(sweep, refused)]
    for run_dir, why in refused:
        print(f"left out {run_dir}: {why}")
    if not runs:
        raise SystemExit("no completed run under " + ", ".join(map(str, args.sweeps)))
    table, numbers = summarise(runs, args.targets)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(table, encoding="utf-8")
    args.out.with_suffix(".json").write_text(json.dumps(numbers, indent=1), encoding="utf-8")
    plot(numbers, args.out.with_suffix(".png"))
    print(table)
    print(f"wrote {args.out}.md, .json, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
