"""Summarise a sweep: a markdown table (mean ± std over seeds), learning curves and, with
``--paper``, the sweep laid out as a table of a seed paper with the paper's numbers beside ours.

    fedmm-report multirun/2026-11-21/14-06-31 --out docs/results/compare [--reference FedAvg]
    fedmm-report multirun/cifar --out docs/results/cifar --paper kdd_table1 [--all-rows]
    python -m analysis.report ...   (the same)

Groups the runs under the sweep directory by every config key that differs between them (the
seed and the run's own paths excepted): never averaging runs of different datasets, models or
learning rates. Reports the final and best test accuracy (best over rounds >= 1), mean ± sample
std (ddof = 1) with the number of seeds, the model bytes per round and, with ``--reference``,
the rounds each method needs to reach the reference method's final accuracy (its accuracy at the
last round, same seed) and the speed-up: the rounds the reference itself first needs for that
accuracy / the rounds the method needs (the FedRL paper's Table 2).

Only completed runs count (``summary.json`` says ``status: completed`` and ``metrics.jsonl``
reaches ``num_rounds``); every other run is listed as refused.

Writes ``<out>.md``, ``<out>.json``, ``<out>.png`` (every partition side by side) and
``<out>_curves/<model>_<dataset>_<partition>.png``: one figure per setting, one curve per
method (the mean over seeds, shaded ± the sample std).

``--paper <table>`` (the tables of :mod:`analysis.paper_numbers`; repeatable) also writes
``<out>_<table>.md``, ``.csv``, ``.tex`` and ``.json``: one row per setting of the paper (model,
dataset, α) and one column per method of the paper (FedRL's tables the other way round, as
printed); each cell ours, mean ± sample std over the n seeds, and the paper's value in
parentheses. A run's setting comes from ``model.name``, ``dataset.name`` and ``partition``
(``iid``: IID, ``natural``: FEMNIST's writers), its column from :func:`method_label` through
:data:`PAPER_METHODS`; ``--map`` adds names (``--map dataset.mnist5k=MNIST``, ``--map
'method.FedMR (first stage 100)=FedMR'``, ``--map method.CluSamp=`` to leave a method out). Runs
outside the table are listed under it, never dropped silently; two groups of runs for one cell
are an error unless ``--prefer <method label>`` says which one takes it. Settings and methods
we did not run stay out unless ``--all-rows``. Our numbers are at our horizon (``num_rounds``),
the paper's at its own: the caption says both.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from analysis.paper_numbers import PAPER_TABLES, PaperTable, PaperValue, Setting
from fedmm.config import options
from fedmm.results import SUMMARY_FILE, read_metrics
from fedmm.settings import OtherSettings, Settings, paired_objectives


def declared_settings(cfg: dict[str, Any], group: str) -> Settings:
    """The settings of one group of a run's config, read leniently (a run written before a key
    existed gets its default; an option no longer declared keeps its values, labelled by name)."""
    values = dict(cfg.get(group) or {})
    cls = options(group).get(values.get("name", DEFAULT_OPTION.get(group, "")))
    return cls.lenient(values) if cls is not None else OtherSettings(values=values)


#: The groups a method's label is made of, and the option of each that a run written before the
#: group existed had.
GROUPS_LABELLED = ("strategy", "objective", "selection", "server_optimizer")
DEFAULT_OPTION = {"selection": "uniform", "objective": "ce", "server_optimizer": "none"}


def method_label(cfg: dict[str, Any]) -> str:
    """Readable method name of a run's config, derived from its settings declarations: the
    method's name (a declaration may name a variant: "Indep", "SCAFFOLD (lab)"), the client
    objective's, the selector's, and what differs from the defaults (each setting's ``label``)."""
    strategy, objective, selection, optimizer = (declared_settings(cfg, g) for g in GROUPS_LABELLED)
    name = strategy.display
    selected = {*getattr(strategy, "companions", {}).values(), *paired_objectives(strategy.name)}
    if objective.name != "ce" and objective.name not in selected:
        client = objective.display
        name = client if strategy.name == "fedavg" else f"{client} ({name})"
    extras = strategy.label_parts() + objective.label_parts() + optimizer.label_parts()
    if selection.name != "uniform":
        name = selection.display if name == "FedAvg" else f"{name} + {selection.display}"
    if optimizer.name != "none":
        name = f"{name} + {optimizer.display}"
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


def setting_keys(runs: list[dict[str, Any]]) -> list[str]:
    """The differing keys a row or curve must name: those that vary among one method's runs.

    A key that only tells methods apart (CluSamp's ``selection.*``, a projection head) is
    already said by the method column."""
    flats = [(method_label(r["cfg"]), flat(r["cfg"])) for r in runs]
    keys = []
    for key in differing_keys(runs):
        values: dict[str, set[str]] = defaultdict(set)
        for method, f in flats:
            values[method].add(repr(f.get(key)))
        if any(len(v) > 1 for v in values.values()):
            keys.append(key)
    return keys


def setting_label(cfg: dict[str, Any], keys: list[str]) -> str:
    """The differing keys the partition and method columns do not show, as ``key=value``."""
    f = flat(cfg)
    return ", ".join(f"{k}={f.get(k)}" for k in keys if not k.startswith(_SHOWN)) or "—"


def rounds_to_reach(rows: list[dict[str, Any]], target: float) -> int | None:
    for row in rows:
        if row["round"] > 0 and row["accuracy"] >= target:
            return row["round"]
    return None


def seed_groups(runs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The runs grouped by every differing config key: each group differs only in the seed."""
    keys = differing_keys(runs)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for run in runs:
        f = flat(run["cfg"])
        groups[tuple((k, repr(f.get(k))) for k in keys)].append(run)
    return list(groups.values())


def final_accuracy(run: dict[str, Any]) -> float:
    """Test accuracy (%) after the last round."""
    return 100 * run["rows"][-1]["accuracy"]


def best_accuracy(run: dict[str, Any]) -> float:
    """The highest test accuracy (%) over rounds >= 1 (round 0 is the untrained model)."""
    return 100 * max(r["accuracy"] for r in run["rows"] if r["round"] >= 1)


def seconds_per_round(run: dict[str, Any]) -> float:
    """Wall-clock seconds per round from round 1 to the last (round 1's start-up left out)."""
    rows = run["rows"]
    return (rows[-1]["seconds"] - rows[1]["seconds"]) / max(1, rows[-1]["round"] - 1)


def speedups(group: list[dict[str, Any]], ref_group: list[dict[str, Any]]) -> list[tuple[int | None, float | None]]:
    """Per run: (the rounds it needs to reach the reference's final accuracy, the speed-up).

    The target is the reference run's accuracy at its last round (same seed); the speed-up is
    the rounds the reference itself first needs to reach it / the rounds the run needs (the
    FedRL paper's Table 2). (None, None) where the run never reaches it.
    """
    out: list[tuple[int | None, float | None]] = []
    for g in group:
        ref = next((r for r in ref_group if r["cfg"]["seed"] == g["cfg"]["seed"]), ref_group[0])
        target = ref["rows"][-1]["accuracy"]
        reached = rounds_to_reach(g["rows"], target)
        ref_reached = rounds_to_reach(ref["rows"], target)
        out.append((reached, ref_reached / reached if reached else None))
    return out


def _mean_std(values: np.ndarray | list[float], digits: int = 2) -> str:
    """``mean ± sample std`` (ddof = 1); the mean alone for one value."""
    values = np.asarray(values, dtype=float)
    if len(values) == 1:
        return f"{values.mean():.{digits}f}"
    return f"{values.mean():.{digits}f} ± {values.std(ddof=1):.{digits}f}"


def summarise(runs: list[dict[str, Any]], reference: str | None) -> tuple[str, dict]:
    """The markdown table and its data: one row per group of runs that differ only in the seed."""
    keys = setting_keys(runs)
    by_setting: dict[tuple[str, str, str], list[dict]] = {}
    for group in seed_groups(runs):
        part, method = partition_label(group[0]["cfg"]), method_label(group[0]["cfg"])
        setting = setting_label(group[0]["cfg"], keys)
        if (part, method, setting) in by_setting:  # two groups with one label: show the group key
            setting = f"{setting} [{len(by_setting)}]"
        by_setting[(part, method, setting)] = group
    with_setting = any(setting != "—" for _, _, setting in by_setting)  # else no setting column
    lines = ["| partition | method |" + (" setting |" if with_setting else "")
             + " n | final acc. (%) | best acc. (%) | MB sent / round | seconds / round |"
             + (f" rounds to {reference}'s final acc. | speed-up |" if reference else ""),
             "|---|---|" + ("---|" if with_setting else "") + "---|---|---|---|---|" + ("---|---|" if reference else "")]
    data = {}
    for (part, method, setting), group in sorted(by_setting.items()):
        final = np.array([final_accuracy(g) for g in group])
        best = np.array([best_accuracy(g) for g in group])
        last = group[0]["rows"][-1]
        mb_round = last["bytes_sent"] / last["round"] / 2**20
        sec_round = np.mean([seconds_per_round(g) for g in group])
        row = (f"| {part} | {method} |" + (f" {setting} |" if with_setting else "") + f" {len(group)} | {_mean_std(final)} | {_mean_std(best)} "
               f"| {mb_round:.2f} | {sec_round:.1f} |")
        entry = {"final": final.tolist(), "best": best.tolist(), "n": len(group), "mb_per_round": mb_round,
                 "seconds_per_round": sec_round}
        if reference:
            ref_group = by_setting.get((part, reference, setting), [])
            if ref_group:
                speeds = speedups(group, ref_group)
                rounds = [s[0] for s in speeds]
                ups = [s[1] for s in speeds if s[1] is not None]
                row += f" {', '.join(str(r) if r else '—' for r in rounds)} | {np.mean(ups):.2f}× |" if ups else f" {', '.join('—' for _ in rounds)} | — |"
                entry["rounds_to_reference"] = rounds
        lines.append(row)
        label = f"{part} / {method}" + ("" if setting == "—" else f" / {setting}")
        data[label] = entry
    return "\n".join(lines), data


def _draw_curves(ax: Any, runs: list[dict[str, Any]]) -> None:
    """One curve per group of runs that differ only in the seed: the mean test accuracy over the
    seeds at the rounds all of them evaluated, shaded ± the sample std (two or more seeds)."""
    keys = setting_keys(runs)
    labels: dict[str, list[dict]] = {}
    for group in seed_groups(runs):
        setting = setting_label(group[0]["cfg"], keys)
        label = method_label(group[0]["cfg"]) + ("" if setting == "—" else f" ({setting})")
        if label in labels:  # same label, other config: never one curve
            label = f"{label} [{len(labels)}]"
        labels[label] = group
    for index, (label, group) in enumerate(sorted(labels.items())):
        common = set.intersection(*({r["round"] for r in g["rows"]} for g in group))
        rounds = sorted(common)
        accs = np.array([[100 * r["accuracy"] for r in g["rows"] if r["round"] in common] for g in group])
        mean = accs.mean(axis=0)
        # ten colours, then the same colours dashed, dotted, ...: no two curves look alike
        style = ("-", "--", ":", "-.")[(index // 10) % 4]
        (line,) = ax.plot(rounds, mean, style, color=f"C{index % 10}", label=f"{label} (n={len(group)})")
        if len(group) > 1:
            std = accs.std(axis=0, ddof=1)
            ax.fill_between(rounds, mean - std, mean + std, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%), mean ± std over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot(runs: list[dict[str, Any]], out: Path) -> None:
    """Every partition side by side, one curve per method (and per other differing setting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = sorted({partition_label(r["cfg"]) for r in runs})
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts):
        _draw_curves(ax, [r for r in runs if partition_label(r["cfg"]) == part])
        ax.set_title(part)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def curve_setting(cfg: dict[str, Any]) -> tuple[str, str, str]:
    """The setting a learning-curve figure is drawn for: (model, dataset, partition)."""
    return cfg["model"]["name"], cfg["dataset"]["name"], partition_label(cfg)


def plot_settings(runs: list[dict[str, Any]], folder: Path) -> list[Path]:
    """One PNG per (model, dataset, partition): ``<folder>/<model>_<dataset>_<partition>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_setting: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for run in runs:
        by_setting[curve_setting(run["cfg"])].append(run)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for (model, dataset, part), setting_runs in sorted(by_setting.items()):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _draw_curves(ax, setting_runs)
        ax.set_title(f"{model}, {dataset}, {part}")
        fig.tight_layout()
        path = folder / (re.sub(r"[^A-Za-z0-9.-]+", "_", f"{model}_{dataset}_{part}").strip("_") + ".png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


# --- the papers' layout ----------------------------------------------------------------------

#: Our model names as the papers name them. The FedMR papers' "CNN" is the FedAvg paper's (our
#: ``cnn``); the authors' code uses a LeNet-style one on CIFAR (``lenet``). Their "ResNet-20" is
#: the authors' pre-activation one (``resnet20-preact``) or He et al.'s (``resnet20``).
PAPER_MODELS = {"cnn": "CNN", "lenet": "CNN", "resnet20": "ResNet-20", "resnet20-preact": "ResNet-20", "vgg16": "VGG-16"}
PAPER_DATASETS = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "femnist": "FEMNIST", "mnist": "MNIST",
                  "fashion_mnist": "FashionMNIST"}
#: :func:`method_label` -> the papers' column: each method's presets (the original's and the
#: FedMR authors' port); other variants need ``--map``.
PAPER_METHODS = {
    "FedAvg": "FedAvg", "FedProx": "FedProx", "FedGen": "FedGen", "FedGen (original)": "FedGen",
    "CluSamp": "CluSamp", "CluSamp (FedMR port)": "CluSamp", "FedExP": "FedExP",
    "FedExP (ε 0.1 constant, buffers extrapolated)": "FedExP", "FedASAM": "FedASAM",
    "FedASAM (ρ 0.1, η 0.0)": "FedASAM", "FedMut": "FedMut", "FedMut (radius 5.0, bound 100)": "FedMut",
    "FedMR": "FedMR", "SCAFFOLD": "SCAFFOLD", "SCAFFOLD (lab)": "SCAFFOLD", "MOON": "MOON", "SOLO": "SOLO",
    "FedRL": "FedRL",
}
_MAP_KINDS = ("model", "dataset", "method")


def paper_table(name: str) -> PaperTable:
    """The table ``--paper`` names; an unknown name is an error that lists the known ones."""
    if name not in PAPER_TABLES:
        raise ValueError(f"unknown paper table {name!r}; allowed: {', '.join(PAPER_TABLES)}")
    return PAPER_TABLES[name]


def paper_maps(extra: Sequence[str] = ()) -> dict[str, dict[str, str]]:
    """Our names -> the papers', for models, datasets and methods, with ``--map KIND.OURS=PAPER``
    entries on top (an empty PAPER leaves a method out of the table)."""
    maps = {"model": dict(PAPER_MODELS), "dataset": dict(PAPER_DATASETS), "method": dict(PAPER_METHODS)}
    for entry in extra:
        kind, dot, rest = entry.partition(".")
        ours, eq, paper = rest.rpartition("=")
        if kind not in _MAP_KINDS or not dot or not eq or not ours or (not paper and kind != "method"):
            raise ValueError(f"--map {entry!r}: expected KIND.OURS=PAPER with KIND one of {', '.join(_MAP_KINDS)} "
                             "(e.g. dataset.mnist5k=MNIST, 'method.FedMR (first stage 100)=FedMR'; "
                             "method.OURS= leaves a method out)")
        maps[kind][ours] = paper
    return maps


def paper_setting(cfg: dict[str, Any], maps: dict[str, dict[str, str]]) -> Setting:
    """A run's setting in the papers' words: model, dataset, and α / ``IID`` / ``natural``."""
    p = cfg["partition"]
    partition = str(float(p["alpha"])) if p["name"] == "dirichlet" else {"iid": "IID"}.get(p["name"], p["name"])
    return Setting(maps["model"].get(cfg["model"]["name"], cfg["model"]["name"]),
                   maps["dataset"].get(cfg["dataset"]["name"], cfg["dataset"]["name"]), partition)


def setting_text(setting: Setting) -> str:
    """``CNN CIFAR-10 α=0.1``, ``ResNet-20 FEMNIST``, ``MNIST α=0.5`` (a FedRL setting)."""
    part = {"natural": "", "IID": " IID"}.get(setting.partition, f" α={setting.partition}")
    return " ".join(x for x in (setting.model, setting.dataset) if x) + part


def _in_table(table: PaperTable, setting: Setting) -> Setting | None:
    """The table's setting a run's setting is, if any (a FedRL setting takes any model)."""
    for candidate in (setting, setting._replace(model=None)):
        if candidate in table.values:
            return candidate
    return None


def paper_cells(runs: list[dict[str, Any]], table: PaperTable, maps: dict[str, dict[str, str]],
                prefer: Sequence[str] = ()) -> tuple[dict[tuple[Setting, str], list[dict]], list[str]]:
    """Each group of runs (same config but the seed) in its cell of ``table``, and a line for
    each group that is not in the table, with the reason. Two groups for one cell: the one whose
    method label is in ``prefer`` takes it (e.g. ``FedMR (first stage 100)``, the paper's FedMR
    on ResNet-20, beside plain FedMR on the CNN rows); otherwise an error."""

    def where(group: list[dict]) -> str:
        cfg = group[0]["cfg"]
        names = ", ".join(sorted(g["dir"].name for g in group))
        return f"{setting_text(paper_setting(cfg, maps))} / {method_label(cfg)} ({_count(len(group), 'run')}: {names})"

    cells: dict[tuple[Setting, str], list[dict]] = {}
    outside = []
    for group in seed_groups(runs):
        cfg = group[0]["cfg"]
        label, ours = method_label(cfg), paper_setting(cfg, maps)
        setting, method = _in_table(table, ours), maps["method"].get(label)
        if setting is None:
            outside.append(f"{where(group)}: setting {setting_text(ours)} ({cfg['model']['name']}, "
                           f"{cfg['dataset']['name']}, {partition_label(cfg)}) is not in {table.name}")
        elif method not in table.methods:
            why = ("left out by --map" if method == "" else f"its columns are {', '.join(table.methods)} (one of them "
                   f"under another name? --map 'method.{label}=<column>')")
            outside.append(f"{where(group)}: method {label!r} is not a column of {table.name}: {why}")
        elif (setting, method) in cells:
            other = cells[(setting, method)]
            other_label = method_label(other[0]["cfg"])
            if (label in prefer) == (other_label in prefer):
                raise ValueError(
                    f"{table.name}: the cell {setting_text(setting)} / {method} would hold runs that differ in "
                    f"{', '.join(differing_keys([other[0], group[0]]))}: {other_label!r} ({other[0]['dir']}) and "
                    f"{label!r} ({group[0]['dir']}); keep one with --prefer '<label>', leave a method out with "
                    f"--map 'method.<label>=', or report a sweep without one of them")
            kept, dropped = (group, other) if label in prefer else (other, group)
            cells[(setting, method)] = kept
            outside.append(f"{where(dropped)}: its cell holds {method_label(kept[0]['cfg'])!r} (--prefer)")
        else:
            cells[(setting, method)] = group
    return cells, outside


def _paper_number(table: PaperTable, value: PaperValue | None) -> tuple[str, str]:
    """The paper's value (and its speed-up, for rounds) as the cell prints them in parentheses."""
    if value is None:
        return "–", "–"
    number, second = value
    if table.metric == "rounds_to_reference":
        return ("/", "/") if number is None else (f"{number:.0f}", f"{second:.2f}×")
    return f"{number:.2f}", ""


@dataclass
class PaperLayout:
    """A paper's table filled with our runs: the caption, the header and the body as text, the
    groups of runs outside the table, and the numbers behind each cell."""

    table: PaperTable
    caption: str
    header: list[str]
    body: list[list[str]]
    outside: list[str] = field(default_factory=list)
    data: list[dict[str, Any]] = field(default_factory=list)


def _cell(table: PaperTable, setting: Setting, method: str, cells: dict, show_rounds: bool) -> tuple[list[str], dict]:
    """The text of one cell (two for rounds: #rounds and speed-up) and its numbers."""
    paper_value = table.value(setting, method)
    paper, paper_speedup = _paper_number(table, paper_value)
    group = cells.get((setting, method))
    if group is None:
        return ([f"– ({paper})", f"– ({paper_speedup})"] if table.metric == "rounds_to_reference" else [f"– ({paper})"]), {}
    n = f"n={len(group)}" + (f", {group[0]['cfg']['num_rounds']} rounds" if show_rounds else "")
    entry: dict[str, Any] = {"setting": list(setting), "method": method, "paper": list(paper_value or ()),
                             "n": len(group), "num_rounds": group[0]["cfg"]["num_rounds"],
                             "runs": sorted(str(g["dir"]) for g in group)}
    if table.metric == "rounds_to_reference":
        ref_group = cells.get((setting, "FedAvg"))
        if ref_group is None:
            return [f"no FedAvg runs ({paper}) {n}", f"– ({paper_speedup})"], entry
        speeds = speedups(group, ref_group)
        rounds = [r for r, _ in speeds if r is not None]
        ups = [u for _, u in speeds if u is not None]
        entry.update(rounds=[r for r, _ in speeds], speedups=[u for _, u in speeds])
        if len(rounds) < len(group):
            n += f", {len(group) - len(rounds)} not reached"
        return [f"{_mean_std(rounds, 1) if rounds else '/'} ({paper}) {n}",
                f"{_mean_std(ups) + '×' if ups else '/'} ({paper_speedup})"], entry
    measure = {"final_accuracy": final_accuracy, "best_accuracy": best_accuracy,
               "seconds_per_round": seconds_per_round}[table.metric]
    ours = [measure(g) for g in group]
    entry["ours"] = ours
    return [f"{_mean_std(ours)} ({paper}) {n}"], entry


#: What our number in a cell is, per metric.
_OURS = {
    "final_accuracy": "test accuracy (%) after our last round",
    "best_accuracy": "the highest test accuracy (%) over our rounds 1 to the last",
    "rounds_to_reference": "the rounds to first reach FedAvg's test accuracy at its last round (same seed) and "
                           "the speed-up (the rounds FedAvg itself first needs for it / the method's)",
    "seconds_per_round": "wall-clock seconds per round on our machine (the whole round, server and clients; "
                         "from round 1 on)",
}


def _values(groups: list[list[dict]], key: str) -> str:
    """The values a config key takes in the table's runs: ``20`` or ``10/20``."""
    f = [flat(g[0]["cfg"]).get(key) for g in groups]
    return "/".join(str(v) for v in sorted(set(f), key=str))


def render_paper(table: PaperTable, runs: list[dict[str, Any]], maps: dict[str, dict[str, str]] | None = None,
                 all_rows: bool = False, prefer: Sequence[str] = ()) -> PaperLayout:
    """``table`` filled with our runs: ``ours mean ± std (paper) n=k`` in each cell we ran."""
    maps = maps if maps is not None else paper_maps()
    cells, outside = paper_cells(runs, table, maps, prefer)
    settings = [s for s in table.values if all_rows or any(c[0] == s for c in cells)]
    methods = [m for m in table.methods if all_rows or any(c[1] == m for c in cells)]
    groups = list(cells.values())
    horizons = sorted({g[0]["cfg"]["num_rounds"] for g in groups})
    subs = ["#rounds", "speed-up"] if table.metric == "rounds_to_reference" else [""]
    data: list[dict[str, Any]] = []

    def texts(setting: Setting, method: str) -> list[str]:
        cell_texts, entry = _cell(table, setting, method, cells, len(horizons) > 1)
        if entry:
            data.append(entry)
        return cell_texts

    if table.methods_as_rows:
        header = ["method"] + [f"{setting_text(s)} {sub}".strip() for s in settings for sub in subs]
        body = [[m] + [t for s in settings for t in texts(s, m)] for m in methods]
    else:
        header = ["model", "dataset", "α"] + [f"{m} {sub}".strip() for m in methods for sub in subs]
        body = [[s.model or "", s.dataset, {"natural": "–"}.get(s.partition, s.partition)]
                + [t for m in methods for t in texts(s, m)] for s in settings]
    names = set()  # our names where the paper's differ
    for group in groups:
        cfg = group[0]["cfg"]
        for kind, ours in (("model", cfg["model"]["name"]), ("dataset", cfg["dataset"]["name"]), ("method", method_label(cfg))):
            if maps[kind].get(ours, ours).lower() != ours.lower():
                names.add(f"{maps[kind][ours]} = {ours}")
    if not horizons:
        ours = "(none of our runs is in this table)"
    elif len(horizons) == 1:
        ours = f"after {horizons[0]} rounds of ours"
    else:
        ours = f"after {' or '.join(map(str, horizons))} rounds of ours, as each cell says"
    if groups:
        ours += (f" ({_values(groups, 'num_clients')} clients, {_values(groups, 'clients_per_round')} per round, "
                 f"{_values(groups, 'training.local_epochs')} local epochs)")
    caption = (
        f"{table.source} in the paper's layout, filled with our runs. Cell: ours, {_OURS[table.metric]}, mean ± sample "
        f"std over the n seeds, {ours}; in parentheses the paper's {table.what}, at the paper's own horizon "
        f"({table.horizon}), not at ours. – = no runs of ours."
        + (" / = not reached." if table.metric == "rounds_to_reference" else "")
        + (f" Our names: {'; '.join(sorted(names))}." if names else ""))
    return PaperLayout(table, caption, header, body, outside, data)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def paper_markdown(layout: PaperLayout, refused: Sequence[tuple[Path, str]] = ()) -> str:
    lines = [f"**{layout.table.name}**: {layout.caption}", ""]
    if layout.body:
        lines += ["| " + " | ".join(layout.header) + " |", "|" + "---|" * len(layout.header)]
        lines += ["| " + " | ".join(row) + " |" for row in layout.body]
    else:
        lines += [f"None of our runs is in {layout.table.name}."]
    if layout.outside:
        lines += ["", f"Not in the table ({_count(len(layout.outside), 'group')} of runs):"] + [f"- {o}" for o in layout.outside]
    if refused:
        lines += ["", f"Refused ({_count(len(refused), 'run')}, not counted):"] + [f"- {d}: {why}" for d, why in refused]
    return "\n".join(lines) + "\n"


def paper_csv(layout: PaperLayout) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(layout.header)
    writer.writerows(layout.body)
    return buffer.getvalue()


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "±": r"$\pm$", "×": r"$\times$",
        "–": "--", "—": "---", "α": r"$\alpha$", "ρ": r"$\rho$", "η": r"$\eta$"}


def _tex(text: str) -> str:
    return "".join(_TEX.get(c, c) for c in text)


def paper_latex(layout: PaperLayout) -> str:
    """A ``table`` with a booktabs ``tabular`` (needs ``\\usepackage{booktabs}``)."""
    lead = 1 if layout.table.methods_as_rows else 3
    spec = "l" * lead + "c" * (len(layout.header) - lead)
    lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{_tex(layout.caption)}}}",
             rf"\label{{tab:{layout.table.name}}}", rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(_tex(h) for h in layout.header) + r" \\", r"\midrule"]
    lines += [" & ".join(_tex(c) for c in row) + r" \\" for row in layout.body]
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def write_paper(layout: PaperLayout, prefix: Path, refused: Sequence[tuple[Path, str]] = ()) -> list[Path]:
    """``<prefix>_<table>.md``, ``.csv``, ``.tex`` and ``.json`` (the numbers behind each cell)."""
    stem = prefix.parent / f"{prefix.name}_{layout.table.name}"
    files = {".md": paper_markdown(layout, refused), ".csv": paper_csv(layout), ".tex": paper_latex(layout),
             ".json": json.dumps({"caption": layout.caption, "cells": layout.data, "outside": layout.outside}, indent=2)}
    paths = []
    for suffix, text in files.items():
        path = stem.with_name(stem.name + suffix)
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, help="a fedmm -m sweep directory (or any folder of run directories)")
    parser.add_argument("--out", type=Path, required=True, help="output prefix: writes <out>.md, <out>.json, <out>.png, <out>_curves/ "
                        "(and <out>_<table>.md/.csv/.tex/.json with --paper)")
    parser.add_argument("--reference", default=None, help="method whose final accuracy is the target, e.g. FedAvg")
    parser.add_argument("--paper", action="append", default=[], metavar="TABLE",
                        help=f"also lay the runs out as this paper table (repeatable): {', '.join(PAPER_TABLES)}")
    parser.add_argument("--all-rows", action="store_true",
                        help="keep the paper's settings and methods we did not run (cells '–')")
    parser.add_argument("--map", action="append", default=[], metavar="KIND.OURS=PAPER",
                        help="name one of our models, datasets or methods as the paper does, e.g. dataset.mnist5k=MNIST; "
                             "method.OURS= leaves a method out")
    parser.add_argument("--prefer", action="append", default=[], metavar="METHOD_LABEL",
                        help="where two methods map to one cell, the one with this label takes it "
                             "(e.g. --map 'method.FedMR (first stage 100)=FedMR' --prefer 'FedMR (first stage 100)')")
    args = parser.parse_args(argv)
    try:
        tables = [paper_table(name) for name in args.paper]
        maps = paper_maps(args.map)
    except ValueError as e:
        parser.error(str(e))
    refused: list[tuple[Path, str]] = []
    runs = load_runs(args.sweep, refused)
    for run_dir, reason in refused:
        print(f"refused {run_dir}: {reason}")
    if not runs:
        raise SystemExit(f"no completed runs under {args.sweep}")
    table, data = summarise(runs, args.reference)
    try:  # before anything is written: two groups for one cell stop the report
        layouts = [render_paper(paper, runs, maps, args.all_rows, args.prefer) for paper in tables]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(table + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=2))
    plot(runs, args.out.with_suffix(".png"))
    plot_settings(runs, args.out.parent / f"{args.out.name}_curves")
    print(table)
    for layout in layouts:
        write_paper(layout, args.out, refused)
        print("\n" + paper_markdown(layout, refused), end="")


if __name__ == "__main__":
    main()
