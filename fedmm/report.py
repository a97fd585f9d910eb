"""Summarise a sweep: a markdown table (mean ± std over seeds) and learning curves.

    python -m fedmm.report multirun/2026-11-21/14-06-31 --out docs/results/compare

Groups the runs under the sweep directory by method (strategy + objective + first-stage /
acceleration settings) and partition, and reports the final and best test accuracy, the
model bytes per round and, with ``--reference``, the rounds each method needs to reach the
reference method's final accuracy (its accuracy at the last round, same seed) and the speed-up:
the rounds the reference itself first needs for that accuracy / the rounds the method needs
(the FedRL paper's Table 2).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedmm.results import read_metrics


def method_label(cfg: dict[str, Any]) -> str:
    """Readable method name of a run's config."""
    s, obj = cfg["strategy"], cfg.get("objective", {}).get("name", "ce")
    name = {"fedavg": "FedAvg", "fedmr": "FedMR", "fedcross": "FedCross"}.get(s["name"], s["name"])
    if s["name"] == "fedmr" and s.get("partition_ratio") == 1.0:
        name = "Indep"
    extras = []
    if s.get("first_stage_rounds"):
        extras.append(f"first stage {s['first_stage_rounds']}")
    if s.get("propeller_rounds") or s.get("dynamic_alpha_rounds"):
        extras.append(f"PM {s.get('propeller_rounds', 0)} + DA {s.get('dynamic_alpha_rounds', 0)}")
    if obj != "ce":
        name = {"fedprox": "FedProx", "fedrl": "FedRL"}.get(obj, obj) + ("" if s["name"] == "fedavg" else f" ({name})")
    return name + (f" ({', '.join(extras)})" if extras else "")


def partition_label(cfg: dict[str, Any]) -> str:
    p = cfg["partition"]
    return f"Dir({p['alpha']})" if p["name"] == "dirichlet" else p["name"]


def load_runs(sweep: Path) -> list[dict[str, Any]]:
    runs = []
    for metrics in sorted(sweep.rglob("metrics.jsonl")):
        cfg = yaml.safe_load((metrics.parent / "config.yaml").read_text())
        rows = read_metrics(metrics)
        if not rows or rows[-1]["round"] != cfg["num_rounds"]:
            continue  # unfinished run
        runs.append({"cfg": cfg, "rows": rows, "dir": metrics.parent})
    return runs


def rounds_to_reach(rows: list[dict[str, Any]], target: float) -> int | None:
    for row in rows:
        if row["round"] > 0 and row["accuracy"] >= target:
            return row["round"]
    return None


def summarise(runs: list[dict[str, Any]], reference: str | None) -> tuple[str, dict]:
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for run in runs:
        groups[(partition_label(run["cfg"]), method_label(run["cfg"]))].append(run)
    lines = ["| partition | method | seeds | final acc. (%) | best acc. (%) | MB sent / round | seconds / round |"
             + (f" rounds to {reference}'s final acc. | speed-up |" if reference else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if reference else "")]
    data = {}
    for (part, method), group in sorted(groups.items()):
        final = np.array([100 * g["rows"][-1]["accuracy"] for g in group])
        best = np.array([100 * max(r["accuracy"] for r in g["rows"]) for g in group])
        last = group[0]["rows"][-1]
        mb_round = last["bytes_sent"] / last["round"] / 2**20
        sec_round = np.mean([(g["rows"][-1]["seconds"] - g["rows"][1]["seconds"]) / max(1, g["rows"][-1]["round"] - 1) for g in group])
        row = (f"| {part} | {method} | {len(group)} | {final.mean():.2f} ± {final.std():.2f} | {best.mean():.2f} ± {best.std():.2f} "
               f"| {mb_round:.2f} | {sec_round:.1f} |")
        entry = {"final": final.tolist(), "best": best.tolist(), "mb_per_round": mb_round, "seconds_per_round": sec_round}
        if reference:
            ref_group = groups.get((part, reference), [])
            if ref_group:
                speeds = []
                for g in group:
                    # target: the reference's accuracy at its last round (same seed); speed-up: the
                    # rounds the reference first needs to reach it / the rounds this method needs
                    ref = next((r for r in ref_group if r["cfg"]["seed"] == g["cfg"]["seed"]), ref_group[0])
                    target = ref["rows"][-1]["accuracy"]
                    reached = rounds_to_reach(g["rows"], target)
                    ref_reached = rounds_to_reach(ref["rows"], target)
                    speeds.append((reached, ref_reached / reached if reached else None))
                rounds = [s[0] for s in speeds]
                ups = [s[1] for s in speeds if s[1] is not None]
                row += f" {', '.join(str(r) if r else '—' for r in rounds)} | {np.mean(ups):.2f}× |" if ups else f" {', '.join('—' for _ in rounds)} | — |"
                entry["rounds_to_reference"] = rounds
        lines.append(row)
        data[f"{part} / {method}"] = entry
    return "\n".join(lines), data


def plot(runs: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = sorted({partition_label(r["cfg"]) for r in runs})
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts):
        curves: dict[str, list] = defaultdict(list)
        for run in runs:
            if partition_label(run["cfg"]) == part:
                curves[method_label(run["cfg"])].append([100 * r["accuracy"] for r in run["rows"]])
        for method, accs in sorted(curves.items()):
            n = min(len(a) for a in accs)
            mean = np.mean([a[:n] for a in accs], axis=0)
            ax.plot(range(n), mean, label=f"{method} (n={len(accs)})")
        ax.set_title(part)
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy (%), mean over seeds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, help="a fedmm -m sweep directory (or any folder of run directories)")
    parser.add_argument("--out", type=Path, required=True, help="output prefix: writes <out>.md, <out>.json, <out>.png")
    parser.add_argument("--reference", default=None, help="method whose final accuracy is the target, e.g. FedAvg")
    args = parser.parse_args()
    runs = load_runs(args.sweep)
    if not runs:
        raise SystemExit(f"no finished runs under {args.sweep}")
    table, data = summarise(runs, args.reference)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(table + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=2))
    plot(runs, args.out.with_suffix(".png"))
    print(table)


if __name__ == "__main__":
    main()
