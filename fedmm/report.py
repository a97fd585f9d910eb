"""Summarise a sweep: a markdown table (mean ± std over seeds) and learning curves.

    python -m fedmm.report multirun/2026-11-21/14-06-31 --out docs/results/compare

Groups the runs under the sweep directory by every config key that differs between them (the
seed and the run's own paths excepted): never averaging runs of different datasets, models or
learning rates. Reports the final and best test accuracy (best over rounds >= 1), mean ± sample
std (ddof = 1) with the number of seeds, the model bytes per round and, with ``--reference``,
the rounds each method needs to reach the reference method's final accuracy (its accuracy at the
last round, same seed) and the speed-up: the rounds the reference itself first needs for that
accuracy / the rounds the method needs (the FedRL paper's Table 2).

Only completed runs count (``summary.json`` says ``status: completed`` and ``metrics.jsonl``
reaches ``num_rounds``); every other run is listed as refused.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedmm.results import SUMMARY_FILE, read_metrics


def method_label(cfg: dict[str, Any]) -> str:
    """Readable method name of a run's config."""
    s, obj = cfg["strategy"], cfg.get("objective", {}).get("name", "ce")
    name = {"fedavg": "FedAvg", "fedmr": "FedMR", "fedcross": "FedCross", "fedmut": "FedMut", "fedexp": "FedExP", "solo": "SOLO"}.get(s["name"], s["name"])
    if s["name"] == "fedmr" and s.get("partition_ratio") == 1.0:
        name = "Indep"
    extras = []
    if s.get("first_stage_rounds"):
        extras.append(f"first stage {s['first_stage_rounds']}")
    secure = s.get("secure") or {}
    if secure.get("enabled"):
        extras.append(f"secure {secure.get('mode')}, r_s {secure.get('repetitions')}" + (", padded" if secure.get("pad") else ""))
    if s.get("propeller_rounds") or s.get("dynamic_alpha_rounds"):
        extras.append(f"PM {s.get('propeller_rounds', 0)} + DA {s.get('dynamic_alpha_rounds', 0)}")
    if obj != "ce":
        o = cfg["objective"]
        client = {"fedprox": "FedProx", "fedrl": "FedRL"}.get(obj, obj)
        if obj == "asam":
            client = "FedASAM" if o.get("adaptive") else "FedSAM"
            if o.get("adaptive") and (o.get("rho"), o.get("eta")) != (0.7, 0.2):
                client += f" (ρ {o.get('rho')}, η {o.get('eta')})"
        name = client + ("" if s["name"] == "fedavg" else f" ({name})")
    sel = cfg.get("selection") or {"name": "uniform"}
    if sel["name"] == "clustered":
        clusamp = "CluSamp" + (" (FedMR port)" if sel.get("mode") == "fedmr_port" else "")
        if sel.get("algorithm") == 1:
            clusamp += " (Alg. 1)"
        name = clusamp if name == "FedAvg" else f"{name} + {clusamp}"
    return name + (f" ({', '.join(extras)})" if extras else "")


def partition_label(cfg: dict[str, Any]) -> str:
    p = cfg["partition"]
    return f"Dir({p['alpha']})" if p["name"] == "dirichlet" else p["name"]


#: Config keys that never tell runs apart: the seed is what the table averages over.
IGNORED_KEYS = ("seed", "output_dir", "resume", "results_root", "checkpoint_every", "round_timeout",
                "max_failed_rounds", "simulation.num_supernodes", "simulation.client_cpus", "simulation.client_gpus",
                "simulation.ray_address")
#: ... and the keys under these prefixes (where the ClientApps ran: a local Ray or a cluster).
IGNORED_PREFIXES = ("simulation.ray_init_args.",)


def load_runs(sweep: Path, refused: list[tuple[Path, str]] | None = None) -> list[dict[str, Any]]:
    """The completed runs under ``sweep``; every other run goes to ``refused`` with the reason."""
    runs = []
    refused = refused if refused is not None else []
    for config_file in sorted(sweep.rglob("config.yaml")):
        run_dir = config_file.parent
        if run_dir.name == ".hydra":
            continue
        cfg = yaml.safe_load(config_file.read_text())
        if isinstance(cfg, dict):
            cfg.setdefault("selection", {"name": "uniform"})  # runs made before selection was a group
        summary_file = run_dir / SUMMARY_FILE
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        status = summary.get("status", "unknown (no summary.json status)")
        if status != "completed":
            refused.append((run_dir, f"status {status}" + (f": {summary['reason']}" if summary.get("reason") else "")))
            continue
        rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
        if not rows or rows[-1]["round"] != cfg["num_rounds"]:
            refused.append((run_dir, f"metrics.jsonl stops at round {rows[-1]['round'] if rows else '-'} of {cfg['num_rounds']}"))
            continue
        runs.append({"cfg": cfg, "rows": rows, "dir": run_dir})
    return runs


def flat(cfg: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a nested config."""
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value
    return out


def differing_keys(runs: list[dict[str, Any]]) -> list[str]:
    """Config keys whose values differ between runs (IGNORED_KEYS excepted)."""
    flats = [flat(r["cfg"]) for r in runs]
    keys = sorted(set().union(*flats))
    return [k for k in keys if k not in IGNORED_KEYS and not k.startswith(IGNORED_PREFIXES)
            and len({repr(f.get(k)) for f in flats}) > 1]


#: Keys already shown by the partition and method columns.
_SHOWN = ("partition.", "strategy.", "objective.")


def setting_label(cfg: dict[str, Any], keys: list[str]) -> str:
    """The differing keys the partition and method columns do not show, as ``key=value``."""
    f = flat(cfg)
    return ", ".join(f"{k}={f.get(k)}" for k in keys if not k.startswith(_SHOWN)) or "—"


def rounds_to_reach(rows: list[dict[str, Any]], target: float) -> int | None:
    for row in rows:
        if row["round"] > 0 and row["accuracy"] >= target:
            return row["round"]
    return None


def _mean_std(values: np.ndarray) -> str:
    std = values.std(ddof=1) if len(values) > 1 else 0.0
    return f"{values.mean():.2f} ± {std:.2f}" if len(values) > 1 else f"{values.mean():.2f}"


def summarise(runs: list[dict[str, Any]], reference: str | None) -> tuple[str, dict]:
    """The markdown table and its data: one row per group of runs that differ only in the seed."""
    keys = differing_keys(runs)
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for run in runs:
        f = flat(run["cfg"])
        group_key = tuple((k, repr(f.get(k))) for k in keys)
        groups[(partition_label(run["cfg"]), method_label(run["cfg"]), repr(group_key))].append(run)
    by_setting: dict[tuple[str, str, str], list[dict]] = {}
    for (part, method, _), group in groups.items():
        setting = setting_label(group[0]["cfg"], keys)
        if (part, method, setting) in by_setting:  # two groups with one label: show the group key
            setting = f"{setting} [{len(by_setting)}]"
        by_setting[(part, method, setting)] = group
    lines = ["| partition | method | setting | n | final acc. (%) | best acc. (%) | MB sent / round | seconds / round |"
             + (f" rounds to {reference}'s final acc. | speed-up |" if reference else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if reference else "")]
    data = {}
    for (part, method, setting), group in sorted(by_setting.items()):
        final = np.array([100 * g["rows"][-1]["accuracy"] for g in group])
        best = np.array([100 * max(r["accuracy"] for r in g["rows"] if r["round"] >= 1) for g in group])
        last = group[0]["rows"][-1]
        mb_round = last["bytes_sent"] / last["round"] / 2**20
        sec_round = np.mean([(g["rows"][-1]["seconds"] - g["rows"][1]["seconds"]) / max(1, g["rows"][-1]["round"] - 1) for g in group])
        row = (f"| {part} | {method} | {setting} | {len(group)} | {_mean_std(final)} | {_mean_std(best)} "
               f"| {mb_round:.2f} | {sec_round:.1f} |")
        entry = {"final": final.tolist(), "best": best.tolist(), "n": len(group), "mb_per_round": mb_round,
                 "seconds_per_round": sec_round}
        if reference:
            ref_group = by_setting.get((part, reference, setting), [])
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
        label = f"{part} / {method}" + ("" if setting == "—" else f" / {setting}")
        data[label] = entry
    return "\n".join(lines), data


def plot(runs: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = differing_keys(runs)
    parts = sorted({partition_label(r["cfg"]) for r in runs})
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts):
        curves: dict[str, list] = defaultdict(list)
        for run in runs:
            if partition_label(run["cfg"]) == part:
                setting = setting_label(run["cfg"], keys)
                label = method_label(run["cfg"]) + ("" if setting == "—" else f" ({setting})")
                curves[label].append([100 * r["accuracy"] for r in run["rows"]])
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
    refused: list[tuple[Path, str]] = []
    runs = load_runs(args.sweep, refused)
    for run_dir, reason in refused:
        print(f"refused {run_dir}: {reason}")
    if not runs:
        raise SystemExit(f"no completed runs under {args.sweep}")
    table, data = summarise(runs, args.reference)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(table + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=2))
    plot(runs, args.out.with_suffix(".png"))
    print(table)


if __name__ == "__main__":
    main()
