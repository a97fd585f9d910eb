"""Analysis figures from run directories: model similarity over rounds, loss-landscape slices.

    python -m analysis.figures cosine <run dir>... --out cosine.png [--spread]
    python -m analysis.figures landscape <run dir> [--models 0 1 2] --out landscape.png [--max-examples 2000]
    python -m analysis.figures histograms <run dir>... [--out <folder>]

Each command writes the PNG and the plotted numbers as JSON next to it (``cosine.json``, ...).

``cosine``: the mean pairwise cosine similarity of the K trained models per round (FedMR KDD'24,
Fig. 6), one line per run, labelled by method (and by the settings that tell the runs apart).
Multi-model methods log it into ``metrics.jsonl`` as ``model_cosine`` (with ``model_cosine_min``
/ ``_max``, drawn as a band with ``--spread``): over the models whose training came back that
round, before the method's update; flattened floating-point state_dict entries (BatchNorm
running statistics included, integer buffers left out). See
:func:`strategies.multimodel.cosine_summary`. One-model methods (FedAvg) have no such key.

``landscape``: test loss and accuracy of the run's saved models and of the points between them,
on the run's own test split (data and model rebuilt from its ``config.yaml``). A model is
named by a token: ``i`` (the i-th model of ``final_models.npz``: the K server models after the
last round's update), ``global`` (``final_model.pt``: the global model, for multi-model methods
the mean of the last round's trained models), or ``<run dir>:i`` / ``<run dir>:global`` (a
model of another run with the same architecture, evaluated on this run's split).

- Line: ``w(t) = (1 − t)·w_a + t·w_b`` for t in ``--range`` (default −0.5 .. 1.5; 0 and 1 are
  always among the points, so the two ends are the models themselves).
- Plane through three models (``--grid`` × ``--grid`` points): ``w(x, y) = w_a + x·u + y·v``
  with ``u = (w_b − w_a)/‖w_b − w_a‖`` and ``v`` the part of ``w_c − w_a`` orthogonal to ``u``,
  normalised (Gram–Schmidt, as Garipov et al. 2018, Fig. 1). x and y are therefore distances
  in parameter space: the picture is an undistorted slice, the models sit at (0, 0),
  (‖w_b − w_a‖, 0) and (⟨w_c − w_a, u⟩, ‖(w_c − w_a)⊥‖), and the grid spans them plus
  ``--margin`` of their extent on every side.
- One model (e.g. a FedAvg run, ``--models global``): random directions instead, normalised
  filter by filter to the model's own filters (Li et al. 2018, "Visualizing the loss landscape
  of neural nets", Sec. 4; the FedMR papers' loss-landscape figure): a direction entry of a
  tensor with two or more dimensions is Gaussian, each slice along dim 0 rescaled to the norm
  of the same slice of the weights; biases, BatchNorm parameters and statistics get 0. The
  line is ``w + t·d₁``, the plane ``w + x·d₁ + y·d₂``, x, y in ``±--span``; seeded by ``--seed``.

Every floating-point state_dict entry moves like a weight, BatchNorm running means and variances
included (they are interpolated, not re-estimated for the new weights: for BatchNorm models
the points between the models can look worse than a recalibrated model would be). Integer
buffers (``num_batches_tracked``) are model a's. The arithmetic runs in float64 and each entry is
cast back to its dtype. ``--max-examples`` evaluates a seeded random subset of the test split
(the split may be sorted by label), the same subset at every point.

``histograms``: every run already draws ``label_histograms.png`` (the clients' label counts);
this lists them, redraws a missing one from ``label_histograms.json``, and with ``--out``
collects them into one folder.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from fedmm.data import TensorData
from fedmm.results import CONFIG_FILE, json_safe, read_metrics

COSINE_KEYS = ("model_cosine", "model_cosine_min", "model_cosine_max")
MODELS_FILE = "final_models.npz"
GLOBAL_FILE = "final_model.pt"

StateDict = dict[str, torch.Tensor]


# ====================================================================== run directories
def read_run(run_dir: Path | str) -> dict[str, Any]:
    """``{"dir", "cfg", "rows"}`` of a run directory (``cfg`` None without ``config.yaml``)."""
    run_dir = Path(run_dir)
    config = run_dir / CONFIG_FILE
    cfg = yaml.safe_load(config.read_text(encoding="utf-8")) if config.is_file() else None
    if isinstance(cfg, dict):
        cfg.setdefault("selection", {"name": "uniform"})  # runs made before selection was a group
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    return {"dir": run_dir, "cfg": cfg, "rows": rows}


def run_labels(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """A legend label per run: the method, then the settings that differ between the runs,
    then the seed and at last the directory name where labels would still collide."""
    from analysis.report import method_label, setting_keys, setting_label

    with_cfg = [r for r in runs if r["cfg"]]
    keys = setting_keys(with_cfg) if len(with_cfg) > 1 else []
    labels = []
    for run in runs:
        if not run["cfg"]:
            labels.append(run["dir"].name)
            continue
        setting = setting_label(run["cfg"], keys)
        labels.append(method_label(run["cfg"]) + ("" if setting == "—" else f" ({setting})"))
    for extra in (lambda r: f"seed {r['cfg']['seed']}" if r["cfg"] else "", lambda r: r["dir"].name):
        taken = {label: labels.count(label) for label in labels}
        labels = [f"{label}, {extra(run)}" if taken[label] > 1 and extra(run) else label for label, run in zip(labels, runs)]
    return labels


def run_title(cfg: Mapping[str, Any]) -> str:
    """Method · model · dataset · partition · seed, for plot titles."""
    from analysis.report import method_label, partition_label

    return f"{method_label(dict(cfg))} · {cfg['model']['name']} · {cfg['dataset']['name']} · {partition_label(dict(cfg))} · seed {cfg['seed']}"


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(json_safe(data), indent=1) + "\n", encoding="utf-8")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ====================================================================== cosine over rounds
def cosine_series(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Rounds and logged cosine values of the rows that carry ``model_cosine``."""
    kept = [r for r in rows if r.get("model_cosine") is not None]
    series: dict[str, list[float]] = {"round": [int(r["round"]) for r in kept]}
    for key in COSINE_KEYS:
        series[key] = [r.get(key) for r in kept]
    return series


def plot_cosine(run_dirs: Sequence[Path | str], out: Path, spread: bool = False) -> dict[str, Any]:
    """Draw the mean pairwise model cosine over rounds, one line per run; write ``out`` (PNG)
    and the numbers beside it (``.json``). Runs that logged none are skipped with a warning."""
    runs = []
    for run in map(read_run, run_dirs):
        run["series"] = cosine_series(run["rows"])
        if run["series"]["round"]:
            runs.append(run)
        else:
            print(f"warning: {run['dir']}: no model_cosine in metrics.jsonl (a one-model method, or a run logged "
                  "before multi-model strategies recorded it): skipped", file=sys.stderr)
    if not runs:
        raise SystemExit("no run has model_cosine in its metrics.jsonl: nothing to plot")
    data: dict[str, Any] = {}
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, label in zip(runs, run_labels(runs)):
        series = run["series"]
        data[label] = {"dir": str(run["dir"]), **series}
        (line,) = ax.plot(series["round"], series["model_cosine"], marker="." if len(series["round"]) <= 60 else None, label=label)
        if spread and None not in series["model_cosine_min"] and None not in series["model_cosine_max"]:
            ax.fill_between(series["round"], series["model_cosine_min"], series["model_cosine_max"], color=line.get_color(), alpha=0.15, linewidth=0)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("mean pairwise cosine similarity" + (" (band: min–max)" if spread else ""))
    ax.set_title("Similarity of the K trained models")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    write_json(out.with_suffix(".json"), data)
    return data


# ====================================================================== models of a run
def load_model(run_dir: Path | str, which: str) -> StateDict:
    """Model ``which`` of a run: ``"global"`` (``final_model.pt``) or an index into
    ``final_models.npz``; CPU tensors in the saved dtypes."""
    run_dir = Path(run_dir)
    if which == "global":
        path = run_dir / GLOBAL_FILE
        if not path.is_file():
            raise SystemExit(f"{path}: not found (the run did not finish)")
        return {k: v.detach().cpu() for k, v in torch.load(path, map_location="cpu", weights_only=True).items()}
    path = run_dir / MODELS_FILE
    if not path.is_file():
        raise SystemExit(f"{path}: not found (one-model methods save only final_model.pt: use 'global')")
    with np.load(path) as npz:
        count = len({name.split("/", 1)[0] for name in npz.files})
        if not which.isdigit() or int(which) >= count:
            raise SystemExit(f"model {which!r} of {run_dir}: allowed: 0..{count - 1} or global")
        prefix = f"{int(which)}/"
        return {name[len(prefix):]: torch.from_numpy(np.array(npz[name])) for name in npz.files if name.startswith(prefix)}


def saved_model_count(run_dir: Path | str) -> int:
    """K of ``final_models.npz`` (0 when the run has none)."""
    path = Path(run_dir) / MODELS_FILE
    if not path.is_file():
        return 0
    with np.load(path) as npz:
        return len({name.split("/", 1)[0] for name in npz.files})


def short_name(token: str) -> str:
    """How plots name a model token: ``<run dir>:i`` becomes ``<run dir's name>:i``."""
    other, sep, which = token.rpartition(":")
    return f"{Path(other).name}:{which}" if sep and other else token


def resolve_token(run_dir: Path, token: str) -> tuple[Path, str]:
    """``i`` / ``global`` of this run, or ``<run dir>:i`` / ``<run dir>:global`` of another."""
    if token == "global" or token.isdigit():
        return run_dir, token
    other, sep, which = token.rpartition(":")
    if not sep or not other or not (which == "global" or which.isdigit()):
        raise SystemExit(f"model {token!r}: allowed: an index into {MODELS_FILE}, global, or <run dir>:<index|global>")
    return Path(other), which


# ====================================================================== geometry (pure)
def floating_keys(model: Mapping[str, torch.Tensor]) -> list[str]:
    """The entries that move: floating point (integer buffers such as ``num_batches_tracked`` stay)."""
    return [key for key, value in model.items() if value.is_floating_point()]


def affine(terms: Sequence[tuple[float, Mapping[str, torch.Tensor]]], base: Mapping[str, torch.Tensor]) -> StateDict:
    """``Σ coef·m`` over the floating entries, in float64, cast back to ``base``'s dtypes; every
    other entry is ``base``'s. Direction dicts may hold only floating entries."""
    out: StateDict = {}
    for key, value in base.items():
        if not value.is_floating_point():
            out[key] = value
            continue
        acc = None
        for coef, model in terms:
            term = model[key].to(torch.float64) * float(coef)
            acc = term if acc is None else acc.add_(term)
        out[key] = acc.to(value.dtype)
    return out


def interpolate(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], t: float) -> StateDict:
    """``(1 − t)·a + t·b`` (t = 0 gives a and t = 1 gives b exactly); integer buffers from a."""
    return affine([(1.0 - t, a), (t, b)], a)


def inner(x: Mapping[str, torch.Tensor], y: Mapping[str, torch.Tensor]) -> float:
    """⟨x, y⟩ over the floating entries of ``x``, in float64."""
    return float(sum(torch.sum(x[k].to(torch.float64) * y[k].to(torch.float64)) for k in floating_keys(x)))


def difference(b: Mapping[str, torch.Tensor], a: Mapping[str, torch.Tensor]) -> StateDict:
    """``b − a`` over the floating entries, float64."""
    return {k: b[k].to(torch.float64) - a[k].to(torch.float64) for k in floating_keys(a)}


def plane_basis(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], c: Mapping[str, torch.Tensor]
) -> tuple[StateDict, StateDict, dict[str, tuple[float, float]]]:
    """Orthonormal ``u, v`` of the plane through a, b, c (Gram–Schmidt from ``b − a``) and the
    coordinates of a, b, c in it: ``a + x·u + y·v`` is the point (x, y)."""
    d_b, d_c = difference(b, a), difference(c, a)
    n_b = math.sqrt(inner(d_b, d_b))
    if n_b == 0.0:
        raise ValueError("models a and b are identical: they span no plane (pick other models)")
    u = {k: d / n_b for k, d in d_b.items()}
    along = inner(d_c, u)
    v = {k: d_c[k] - along * u[k] for k in d_c}
    n_v = math.sqrt(inner(v, v))
    if n_v <= 1e-9 * max(n_b, math.sqrt(inner(d_c, d_c))):
        raise ValueError("model c lies on the line through a and b: no plane through them (pick other models)")
    v = {k: d / n_v for k, d in v.items()}
    return u, v, {"a": (0.0, 0.0), "b": (n_b, 0.0), "c": (along, n_v)}


def filter_normalized_direction(model: Mapping[str, torch.Tensor], generator: torch.Generator) -> StateDict:
    """A Gaussian direction with each filter (slice along dim 0) scaled to the norm of the same
    filter of ``model`` (Li et al. 2018, Sec. 4); 0 for tensors of fewer than two dimensions
    (biases, BatchNorm parameters and statistics). Drawn on the CPU: the same on any device."""
    out: StateDict = {}
    for key in floating_keys(model):
        w = model[key].to(torch.float64)
        if w.dim() < 2:
            out[key] = torch.zeros_like(w)
            continue
        d = torch.randn(w.shape, generator=generator, dtype=torch.float64).to(w.device)
        dims = tuple(range(1, w.dim()))
        norm = torch.linalg.vector_norm
        scale = norm(w, dim=dims, keepdim=True) / norm(d, dim=dims, keepdim=True).clamp_min(1e-12)
        out[key] = d * scale
    return out


def line_points(low: float, high: float, steps: int, always: Sequence[float] = (0.0, 1.0)) -> np.ndarray:
    """``steps`` evenly spaced values in [low, high], plus ``always`` (those inside the range)."""
    t = np.round(np.linspace(low, high, max(steps, 2)), 12)
    extra = [x for x in always if low <= x <= high]
    return np.union1d(t, np.asarray(extra, dtype=np.float64))


# ====================================================================== evaluation
def evaluation_subset(test: TensorData, max_examples: int | None, seed: int) -> TensorData:
    """The test split, or ``max_examples`` rows of it drawn at random with ``seed`` (kept in
    split order)."""
    if max_examples is None or max_examples >= len(test):
        return test
    rng = np.random.default_rng([seed, 0x1A5D])
    return test.subset(np.sort(rng.choice(len(test), size=max_examples, replace=False)))


class Evaluator:
    """Test loss and accuracy of state dicts, with one model and the data kept on the device."""

    def __init__(self, cfg: Mapping[str, Any], data: TensorData, device: torch.device, batch_size: int) -> None:
        from fedmm.data import input_spec
        from fedmm.models import model_for

        self.model = model_for(cfg, input_spec(cfg["dataset"])).to(device)
        self.data = TensorData(x=data.x.to(device), y=data.y.to(device), transform=data.transform)
        self.device, self.batch_size = device, batch_size
        self.calls = 0

    def check(self, state: Mapping[str, torch.Tensor], name: str) -> None:
        """A clear error when ``state`` does not fit the run's model."""
        own = self.model.state_dict()
        if set(state) != set(own) or any(tuple(state[k].shape) != tuple(own[k].shape) for k in own):
            raise SystemExit(f"model {name}: its entries do not match the run's {type(self.model).__name__} (another architecture?)")

    def __call__(self, state: Mapping[str, torch.Tensor]) -> tuple[float, float]:
        from fedmm.evaluation import evaluate

        self.model.load_state_dict(state)
        self.calls += 1
        result = evaluate(self.model, self.data, self.device, self.batch_size)
        return float(result["loss"]), float(result["accuracy"])


# ====================================================================== landscape
def landscape(
    run_dir: Path | str,
    tokens: Sequence[str] | None = None,
    *,
    steps: int = 25,
    t_range: tuple[float, float] | None = None,
    grid: int = 21,
    margin: float = 0.25,
    span: float = 1.0,
    max_examples: int | None = None,
    seed: int = 0,
    batch_size: int = 500,
    device: str = "auto",
) -> dict[str, Any]:
    """Loss and accuracy along a line and over a plane through 1..3 models of a run (see the
    module docstring); returns the numbers that :func:`plot_landscape` draws."""
    from fedmm.data import load_dataset
    from fedmm.evaluation import resolve_device

    run_dir = Path(run_dir)
    cfg = read_run(run_dir)["cfg"]
    if not cfg:
        raise SystemExit(f"{run_dir}: no {CONFIG_FILE}")
    if tokens is None:
        tokens = [str(i) for i in range(min(saved_model_count(run_dir), 3))] or ["global"]
    if not 1 <= len(tokens) <= 3:
        raise SystemExit(f"--models takes 1, 2 or 3 models, got {len(tokens)}")
    dev = resolve_device(device)
    _, test = load_dataset(cfg["dataset"])
    data = evaluation_subset(test, max_examples, seed)
    evaluator = Evaluator(cfg, data, dev, batch_size)
    names = [short_name(token) for token in tokens]
    cpu_models = [load_model(*resolve_token(run_dir, token)) for token in tokens]
    for name, state in zip(names, cpu_models):
        evaluator.check(state, name)
    models = [{k: v.to(dev) for k, v in m.items()} for m in cpu_models]
    del cpu_models
    a = models[0]
    a64 = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in a.items()}

    # the directions first: models that span no plane fail before any evaluation
    gen = torch.Generator().manual_seed(seed)
    if len(models) == 1:
        d1 = filter_normalized_direction(a, gen)
        low, high = t_range or (-span, span)
        line_of = lambda t: affine([(1.0, a64), (t, d1)], a)  # noqa: E731
        line = {"kind": "random direction", "formula": "w + t·d1 (d1 filter-normalised, Li et al. 2018)"}
        t_values = line_points(low, high, steps, always=(0.0,))
    else:
        b64 = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in models[1].items()}
        low, high = t_range or (-0.5, 1.5)
        line_of = lambda t: affine([(1.0 - t, a64), (t, b64)], a)  # noqa: E731
        line = {"kind": "interpolation", "formula": f"(1 - t)·w[{names[0]}] + t·w[{names[1]}]"}
        t_values = line_points(low, high, steps, always=(0.0, 1.0))
    plane: dict[str, Any] | None = None
    if grid >= 2 and len(models) == 3:
        u, v, where = plane_basis(a64, models[1], models[2])
        points = dict(zip(names, (where["a"], where["b"], where["c"])))
        xs, ys = [p[0] for p in points.values()], [p[1] for p in points.values()]
        pad = margin * max(max(xs) - min(xs), max(ys) - min(ys))
        x_axis = np.linspace(min(xs) - pad, max(xs) + pad, grid)
        y_axis = np.linspace(min(ys) - pad, max(ys) + pad, grid)
        plane = {"kind": "plane through three models", "units": "L2 distance in parameter space",
                 "formula": f"w[{names[0]}] + x·u + y·v; u, v orthonormal (Gram-Schmidt of w[{names[1]}] - w[{names[0]}], "
                            f"w[{names[2]}] - w[{names[0]}])"}
    elif grid >= 2 and len(models) == 1:
        u, v = d1, filter_normalized_direction(a, gen)
        points = {names[0]: (0.0, 0.0)}
        x_axis = y_axis = np.linspace(-span, span, grid)
        plane = {"kind": "random directions", "units": "multiples of d1, d2", "formula": "w + x·d1 + y·d2 (filter-normalised, Li et al. 2018)"}

    result: dict[str, Any] = {
        "run_dir": str(run_dir), "title": run_title(cfg), "examples": len(data), "test_examples": len(test),
        "seed": seed, "device": str(dev), "models": [],
    }
    for token, name, state in zip(tokens, names, models):
        loss, acc = evaluator(state)
        result["models"].append({"model": name, "token": token, "loss": loss, "accuracy": acc})
    losses, accs = zip(*(evaluator(line_of(float(t))) for t in t_values))
    result["line"] = {**line, "t": t_values.tolist(), "loss": list(losses), "accuracy": list(accs)}
    if plane is not None:
        loss_grid, acc_grid = np.empty((grid, grid)), np.empty((grid, grid))
        for j, y in enumerate(y_axis):
            for i, x in enumerate(x_axis):
                loss_grid[j, i], acc_grid[j, i] = evaluator(affine([(1.0, a64), (float(x), u), (float(y), v)], a))
        result["plane"] = {**plane, "x": x_axis.tolist(), "y": y_axis.tolist(), "points": {k: list(p) for k, p in points.items()},
                           "loss": loss_grid.tolist(), "accuracy": acc_grid.tolist()}
    result["evaluations"] = evaluator.calls
    return result


def plot_landscape(result: Mapping[str, Any], out: Path) -> None:
    """The line (loss and accuracy) and, when computed, the plane (loss and accuracy contours)."""
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    plane = result.get("plane")
    fig, axes = plt.subplots(1, 3 if plane else 1, figsize=(16 if plane else 6.5, 4.8), squeeze=False)
    ax = axes[0][0]
    line = result["line"]
    t = np.asarray(line["t"], dtype=float)
    ax.plot(t, np.asarray(line["loss"], dtype=float), color="tab:red", marker=".")
    ax.set_xlabel("t" if line["kind"] == "interpolation" else "t (along d1)")
    ax.set_ylabel("test loss", color="tab:red")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot(t, 100 * np.asarray(line["accuracy"], dtype=float), color="tab:blue", marker=".")
    twin.set_ylabel("test accuracy (%)", color="tab:blue")
    ends = [m["model"] for m in result["models"]][: 2 if line["kind"] == "interpolation" else 1]
    for x, name in zip((0.0, 1.0), ends):
        ax.axvline(x, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"model {name}", (x, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -12), textcoords="offset points", fontsize=8)
    ax.set_title(line["formula"], fontsize=9)
    if plane:
        x, y = np.asarray(plane["x"], dtype=float), np.asarray(plane["y"], dtype=float)
        loss = np.ma.masked_invalid(np.asarray(plane["loss"], dtype=float))
        acc = np.ma.masked_invalid(100 * np.asarray(plane["accuracy"], dtype=float))
        low, high = (float(loss.min()), float(loss.max())) if loss.count() else (0.0, 0.0)
        if 0 < low < high:
            levels = np.geomspace(low, high, 16)
            filled = axes[0][1].contourf(x, y, loss, levels=levels, norm=LogNorm(low, high), cmap="viridis")
        else:
            filled = axes[0][1].contourf(x, y, loss, levels=16, cmap="viridis")
        fig.colorbar(filled, ax=axes[0][1], label="test loss", format="%.3g")
        filled = axes[0][2].contourf(x, y, acc, levels=16, cmap="magma")
        fig.colorbar(filled, ax=axes[0][2], label="test accuracy (%)", format="%.1f")
        for panel, what in ((axes[0][1], "test loss"), (axes[0][2], "test accuracy")):
            for name, (px, py) in plane["points"].items():
                panel.plot(px, py, marker="o", color="white", markeredgecolor="black")
                panel.annotate(f"model {name}", (px, py), xytext=(4, 4), textcoords="offset points", fontsize=8, color="white")
            panel.set_aspect("equal", adjustable="box")
            panel.set_title(f"{what}: {plane['kind']}", fontsize=9)
            panel.set_xlabel(f"x ({plane['units']})")
            panel.set_ylabel("y")
    fig.suptitle(f"{result['title']}  ·  {result['examples']} test examples", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


# ====================================================================== label histograms
def histograms(run_dirs: Sequence[Path | str], out: Path | None = None) -> list[Path]:
    """Each run's ``label_histograms.png`` (redrawn from ``label_histograms.json`` when missing),
    copied to ``out/<run name>_label_histograms.png`` when ``out`` is given."""
    from fedmm.data import plot_label_histograms

    found = []
    for run_dir in map(Path, run_dirs):
        png, counts = run_dir / "label_histograms.png", run_dir / "label_histograms.json"
        if not png.is_file():
            if not counts.is_file():
                print(f"warning: {run_dir}: no label histograms (a resumed or deployed run draws none)", file=sys.stderr)
                continue
            plot_label_histograms(np.asarray(json.loads(counts.read_text(encoding="utf-8"))), png)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            png = Path(shutil.copyfile(png, out / f"{run_dir.name}_label_histograms.png"))
        found.append(png)
    return found


# ====================================================================== per-model curves
def model_series(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Rounds, the global accuracy and each tracked model's own (``model_<i>_accuracy``) of the
    rows that carry them (a run with ``strategy.track_models``: Indep)."""
    kept = [r for r in rows if "model_0_accuracy" in r]
    series: dict[str, list[float]] = {"round": [int(r["round"]) for r in kept], "accuracy": [r["accuracy"] for r in kept]}
    count = max((int(k.split("_")[1]) + 1 for r in kept for k in r if k.startswith("model_") and k.endswith("_accuracy")), default=0)
    for i in range(count):
        series[f"model_{i}_accuracy"] = [r.get(f"model_{i}_accuracy") for r in kept]
    return series


def plot_models(run_dir: Path | str, out: Path, models: Sequence[int] | None = None) -> dict[str, Any]:
    """Each tracked model's test accuracy over rounds beside the global (mean) model's (KDD Fig. 5
    plots four of Indep's K models); write ``out`` (PNG) and the numbers (``.json``)."""
    from analysis.report import method_label

    run = read_run(run_dir)
    series = model_series(run["rows"])
    if not series["round"]:
        raise SystemExit(f"{run_dir}: no model_<i>_accuracy in metrics.jsonl (run with strategy.track_models=true, e.g. strategy=indep)")
    available = sorted(int(k.split("_")[1]) for k in series if k.startswith("model_"))
    chosen = list(models) if models else available
    missing = [i for i in chosen if i not in available]
    if missing:
        raise SystemExit(f"models {missing} not tracked; the run has models {available[0]}..{available[-1]}")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i in chosen:
        ax.plot(series["round"], [100 * v for v in series[f"model_{i}_accuracy"]], linewidth=1, label=f"model {i}")
    ax.plot(series["round"], [100 * v for v in series["accuracy"]], color="black", linewidth=2, label="global (mean of the K)")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"Each model on its own: {method_label(run['cfg']) if run['cfg'] else run['dir'].name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    data = {"dir": str(run["dir"]), **{k: v for k, v in series.items() if k in ("round", "accuracy") or int(k.split("_")[1]) in chosen}}
    write_json(out.with_suffix(".json"), data)
    return data


# ====================================================================== command line
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.figures", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    cos = sub.add_parser("cosine", help="mean pairwise cosine similarity of the K models over rounds")
    cos.add_argument("run_dirs", nargs="+", type=Path)
    cos.add_argument("--out", type=Path, required=True, help="PNG to write (the numbers go to the same name .json)")
    cos.add_argument("--spread", action="store_true", help="also draw the min..max band over model pairs")

    land = sub.add_parser("landscape", help="test loss/accuracy along a line and a plane through saved models")
    land.add_argument("run_dir", type=Path)
    land.add_argument("--models", nargs="+", default=None, metavar="MODEL",
                      help="1-3 of: i (final_models.npz), global (final_model.pt), <run dir>:i|global; default 0 1 2 (or global)")
    land.add_argument("--out", type=Path, required=True, help="PNG to write (the numbers go to the same name .json)")
    land.add_argument("--steps", type=int, default=25, help="points on the line (0 and 1 are added)")
    land.add_argument("--range", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                      help="t range of the line (default -0.5 1.5; one model: -span span)")
    land.add_argument("--grid", type=int, default=21, help="N: N x N points on the plane (0: no plane)")
    land.add_argument("--margin", type=float, default=0.25, help="plane through three models: border around them, share of their extent")
    land.add_argument("--span", type=float, default=1.0, help="one model: the random directions' range, +-span")
    land.add_argument("--max-examples", type=int, default=None, help="evaluate a seeded random subset of the test split this large")
    land.add_argument("--seed", type=int, default=0, help="seeds the test subset and the random directions")
    land.add_argument("--batch-size", type=int, default=500)
    land.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, ...")

    per_model = sub.add_parser("models", help="each of the K models' own accuracy over rounds (a run with strategy.track_models)")
    per_model.add_argument("run_dir", type=Path)
    per_model.add_argument("--out", type=Path, required=True, help="PNG to write (the numbers go to the same name .json)")
    per_model.add_argument("--models", type=int, nargs="+", default=None, help="which models (default: all tracked)")

    hist = sub.add_parser("histograms", help="the runs' label histograms (drawn by every run)")
    hist.add_argument("run_dirs", nargs="+", type=Path)
    hist.add_argument("--out", type=Path, default=None, help="folder to collect them into")

    args = parser.parse_args(argv)
    if args.command == "cosine":
        data = plot_cosine(args.run_dirs, args.out, args.spread)
        for label, series in data.items():
            print(f"{label}: {len(series['round'])} rounds, last model_cosine {series['model_cosine'][-1]:.4f}")
        print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    elif args.command == "landscape":
        if args.steps < 2 or args.grid < 0 or args.grid == 1:
            parser.error("--steps must be >= 2 and --grid 0 or >= 2")
        try:
            result = landscape(args.run_dir, args.models, steps=args.steps, t_range=tuple(args.range) if args.range else None,
                               grid=args.grid, margin=args.margin, span=args.span, max_examples=args.max_examples,
                               seed=args.seed, batch_size=args.batch_size, device=args.device)
        except ValueError as err:
            raise SystemExit(f"landscape: {err}") from None
        plot_landscape(result, args.out)
        write_json(args.out.with_suffix(".json"), result)
        for m in result["models"]:
            print(f"model {m['model']}: loss {m['loss']:.4f}  accuracy {100 * m['accuracy']:.2f}%")
        print(f"{result['evaluations']} evaluations on {result['examples']} examples; wrote {args.out} and {args.out.with_suffix('.json')}")
    elif args.command == "models":
        data = plot_models(args.run_dir, args.out, args.models)
        print(f"{len(data['round'])} rounds; wrote {args.out} and {args.out.with_suffix('.json')}")
    else:
        for path in histograms(args.run_dirs, args.out):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
