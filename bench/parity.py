"""Parity with the FedMR authors' code: their training loop and ours, same data, same partition
file, same seeds and settings, for every method their repository ships that we have a preset for.

    git clone https://github.com/HMHelloWorld/FedMR /tmp/fedmr_authors   # fetched by the user; never shipped
    .venv/bin/python bench/parity.py --authors /tmp/fedmr_authors \\
        --out bench/results/parity.json --markdown docs/parity.md       # all methods, seeds 0 1 2, 20 rounds
    .venv/bin/python bench/parity.py --authors /tmp/fedmr_authors --methods fedavg fedmr --seeds 0 --rounds 10

What runs. One partition file is written first (``fedmm.data.partition_file``, the authors'
Dirichlet split: ``partition=dirichlet partition.algorithm=authors partition.alpha=0.1
partition.min_partition_size=10``, seeded with ``--partition-seed``); both sides read it. For each
method and seed:

- **ours**: the real app, in process (``launch.cli.run_job``, Flower's simulation engine), with
  ``partition=file partition.path=<file>``, the method's preset, ``eval_every=10``; accuracies from
  ``<run>/metrics.jsonl``.
- **theirs**: a fresh interpreter (this file with ``--authors-driver``) whose ``sys.path`` starts
  with their checkout and whose working directory is a temporary folder (their ``./output``). It
  parses their flags with their own ``args_parser``, seeds with their ``set_random_seed(seed)`` and
  calls their algorithm function (``main_fed.FedAvg(net, dataset_train, dataset_test, dict_users)``
  with the module-global ``args``; ``FedMR(args, net, ...)`` and the other ``Algorithm/`` functions),
  which trains and evaluates exactly as released. Their flags: ``--num_users N --frac K/N
  --local_ep E --local_bs B --lr --momentum --epochs R --seed S --gpu -1 --dataset mnist --model cnn
  --iid 0 --noniid_case 5 --data_beta alpha --generate_data 0`` plus the method's own (below).

The same on both sides: the data (our embedded MNIST-5k, 4,000 training / 1,000 test images,
normalised with (0.1307, 0.3081): their datasets are built from our tensors), the partition, the
architecture (our ``cnn``; ``--model`` to change it) and its initial weights (our run's initial model
for that seed, rebuilt here as ``run_experiment`` builds it and loaded into theirs: the round-0
accuracy, evaluated on both sides, must agree and is checked), the client settings (SGD lr 0.01,
momentum 0.5, no weight decay, 5 epochs, batch 50, a new optimizer every round) and the horizon.
Both evaluate the global model on the test split at rounds 10, 20, ... (theirs: ``iter % 10 == 9``).
What differs: the random streams (client sampling, data order, recombination draws), so runs
agree statistically, not bit for bit: the table gives each side's final (last round) and best
(over the evaluated rounds) accuracy in points, mean ± std over seeds, and Δ = ours − theirs paired
by seed, mean ± std; for the methods each side samples exactly as FedAvg (``Method.fedavg_sampling``)
also their final Δ minus FedAvg's final Δ of the same seed, which removes the part of a seed's Δ
that the two sides' different client sequences cause in every such method alike.

Methods (ours: preset; theirs: function, extra flags):

| name | ours | theirs |
|---|---|---|
| fedavg | ``strategy=fedavg`` | ``main_fed.FedAvg`` |
| fedprox | ``strategy=fedprox objective.mu=0.01`` | ``main_fed.FedProx --prox_alpha 0.01`` |
| fedmr | ``strategy=fedmr strategy.first_stage_rounds=0`` | ``FedMR --first_stage_bound 0`` |
| indep | ``strategy=indep`` | ``FedIndep`` (their ``test_acc``: the mean of the K models) |
| fedmut | ``strategy=fedmut_fedmr_repo`` | ``FedMut --radius 5.0 --mut_acc_rate 0.3 --mut_bound 100`` |
| fedexp | ``strategy=fedexp_fedmr_repo`` | ``FedExP`` |
| fedasam | ``strategy=fedasam_fedmr_repo`` | ``FedASAM`` |
| fedgen | ``strategy=fedgen`` | ``FedGen`` (needs patch ``fedgen_mnist_config``) |
| clusamp | ``strategy=clusamp_fedmr_repo`` | ``main_fed.ClusteredSampling --sim_type L1`` |

Not run (listed in the output): FedCross (their repository ships only
``Algorithm/__pycache__/Training_FedCross.cpython-{37,39,310,312}.pyc``, no source, and no .pyc for
this interpreter's version; a .pyc for the running version is used if present), SCAFFOLD (only
``Triaining_Scaffold`` .pyc files), MOON (a client class ``LocalUpdate_Moon`` but no server loop).

Run-time patches to their code (their files are never edited; each is applied in the driver
process only, and the output lists the ones applied):

- ``driver``: their ``if __name__ == '__main__'`` block is replaced by the driver: it does what that
  block does (``args_parser()``, ``args.device``, ``set_random_seed(args.seed)``, build the model,
  call the algorithm) but takes the datasets, ``dict_users`` and the model from us, because their
  ``get_dataset`` downloads full MNIST and never makes a Dirichlet split for MNIST.
- ``ujson``: ``utils/dataset_utils.py`` imports ``ujson`` at module level; when it is not installed,
  the stdlib ``json`` stands in (it is not used on this path).
- ``ensemble_alpha``: ``LocalUpdate_FedMR``, ``_FedIndep``, ``_FedMut`` and ``_FedASAM`` read
  ``args.ensemble_alpha``, which their ``utils/options.py`` does not define (AttributeError); set
  to 0.2, a value they never use.
- ``model_interface``: their loop calls ``net(x)['output']`` (and FedGen ``net(z,
  start_layer_idx=-1)``, the classifier alone on a latent): our network is wrapped in a module with
  the same parameters and state_dict keys whose forward returns ``{'output': logits,
  'representation': latent}``, and applies only the last linear layer when ``start_layer_idx < 0``.
- ``fedgen_mnist_config`` (FedGen only): ``utils/model_config.py`` has no ``'mnist'`` entry in
  ``CNN_GENERATORCONFIGS`` or ``FedGenRUNCONFIGS`` (KeyError). Added: generator (hidden 512, latent
  = our model's latent width, 1 channel, 10 classes, noise 100) and run config = a copy of their
  ``'cifar10'`` entry (ensemble lr 3e-4, generative α = β = 0.2, weight decay 1e-2, 50 ensemble
  epochs), which are also our ``fedgen`` preset's values for a dataset it has no entry for.
- ``record_results``: ``save_result`` / ``save_fedmut_result`` in their modules are wrapped to also
  keep the values they are given (their files are still written, in the temporary folder); the
  driver reads their accuracies from there (percent; ours are fractions, converted to points).

Writes ``--out`` (JSON: settings, every run's curve, timings, patches) and, with ``--markdown``, the
table (between ``<!-- parity:begin -->`` and ``<!-- parity:end -->`` if the file has them, so
hand-written notes around it stay).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Method:
    """One method on both sides."""

    ours: tuple[str, ...]       # hydra overrides selecting our preset
    theirs: str                 # their algorithm function (an attribute of main_fed)
    flags: tuple[str, ...] = ()  # their extra command-line flags
    # Each side draws this method's clients exactly as it draws FedAvg's for the same seed (theirs:
    # nothing else reads NumPy's global generator; ours: the seeded uniform selector): its Δ can be
    # read against FedAvg's Δ of the same seed (the "Δ − FedAvg's Δ" column).
    fedavg_sampling: bool = True


METHODS: dict[str, Method] = {
    "fedavg": Method(("strategy=fedavg",), "FedAvg"),
    "fedprox": Method(("strategy=fedprox", "objective.mu=0.01"), "FedProx", ("--prox_alpha", "0.01")),
    "fedmr": Method(("strategy=fedmr", "strategy.first_stage_rounds=0"), "FedMR", ("--first_stage_bound", "0")),
    "indep": Method(("strategy=indep",), "FedIndep"),
    "fedmut": Method(("strategy=fedmut_fedmr_repo",), "FedMut",
                     ("--radius", "5.0", "--mut_acc_rate", "0.3", "--mut_bound", "100")),
    # FedMut with the FedMut repository's own defaults (radius 4.0, bound 50), on their FedMR
    # repository's copy of the loop: the row above diverges to chance on this 20-client split.
    "fedmut_r4": Method(("strategy=fedmut",), "FedMut",
                        ("--radius", "4.0", "--mut_acc_rate", "0.3", "--mut_bound", "50")),
    "fedexp": Method(("strategy=fedexp_fedmr_repo",), "FedExP"),
    "fedasam": Method(("strategy=fedasam_fedmr_repo",), "FedASAM"),
    # their FedGen also draws generator labels from NumPy's global generator; clustered sampling
    # draws its clients from the clusters on both sides
    "fedgen": Method(("strategy=fedgen",), "FedGen", fedavg_sampling=False),
    "clusamp": Method(("strategy=clusamp_fedmr_repo",), "ClusteredSampling", ("--sim_type", "L1"),
                      fedavg_sampling=False),
}

#: Methods of their repository we have presets for but cannot run from it, and why (FedCross
#: runs if a .pyc for this interpreter is present: see ``fedcross_source``).
NOT_RUN: dict[str, str] = {
    "fedcross": "their repository ships no Training_FedCross.py, only Algorithm/__pycache__/"
                "Training_FedCross.cpython-{37,39,310,312}.pyc (none for this Python)",
    "scaffold": "only Algorithm/__pycache__/Triaining_Scaffold.cpython-*.pyc, no source and no server loop in main_fed.py",
    "moon": "a client class (models/Update.py LocalUpdate_Moon) but no server loop",
}

PATCHES: dict[str, str] = {
    "driver": "their __main__ block replaced by this driver (args_parser, args.device, set_random_seed, model, "
              "algorithm call as there), with our datasets, partition file and model: their get_dataset downloads "
              "full MNIST and has no Dirichlet split for MNIST",
    "ujson": "utils/dataset_utils.py imports ujson at module level and it is not installed: stdlib json stands in "
             "(unused on this path)",
    "ensemble_alpha": "LocalUpdate_FedMR/_FedIndep/_FedMut/_FedASAM read args.ensemble_alpha, which utils/options.py "
                      "does not define (AttributeError): set to 0.2 (never used)",
    "model_interface": "their loop calls net(x)['output'] (FedGen also net(z, start_layer_idx=-1)): our network "
                       "wrapped (same parameters and state_dict keys) to return {'output', 'representation'} and to "
                       "apply only the classifier to a latent",
    "fedgen_mnist_config": "utils/model_config.py has no 'mnist' entry (KeyError in FedGen): CNN_GENERATORCONFIGS "
                           "['mnist'] = (512, latent width, 1, 10, 100), FedGenRUNCONFIGS['mnist'] = their 'cifar10' "
                           "entry (ensemble lr 3e-4, generative alpha = beta = 0.2, weight decay 1e-2, 50 epochs)",
    "numpy_size1_int": "utils/clustering.py calls int() on size-1 arrays (get_clusters_with_alg2: "
                       "int(new_weight * epsilon); sample_clients: int(choice(n, 1, p=...))), a TypeError since NumPy "
                       "2.x: a module-global int in utils.clustering that converts a size-1 array with .item() as "
                       "NumPy 1.x did",
    "record_results": "save_result/save_fedmut_result wrapped to keep the values they save (files still written)",
}


# --------------------------------------------------------------------------- settings

def shared_overrides(args: argparse.Namespace) -> list[str]:
    """Hydra overrides that fix what both sides share (data, shape, client settings)."""
    return [
        "dataset=mnist5k", f"model={args.model}",
        f"num_clients={args.num_clients}", f"clients_per_round={args.clients_per_round}",
        f"training.local_epochs={args.local_epochs}", f"training.batch_size={args.batch_size}",
        f"training.lr={args.lr}", f"training.momentum={args.momentum}", "training.weight_decay=0.0",
        "training.device=cpu", *args.override,
    ]


def their_flags(args: argparse.Namespace, method: Method, seed: int) -> list[str]:
    """Their command line for one run."""
    frac = args.clients_per_round / args.num_clients
    if max(int(frac * args.num_clients), 1) != args.clients_per_round:  # their m = max(int(frac * num_users), 1)
        frac = math.nextafter(frac, 1.0)
        if max(int(frac * args.num_clients), 1) != args.clients_per_round:
            raise SystemExit(f"parity: no --frac gives {args.clients_per_round} of {args.num_clients} clients in their code")
    return [
        "--algorithm", method.theirs, "--dataset", "mnist", "--model", "cnn", "--num_channels", "1",
        "--num_classes", "10", "--num_users", str(args.num_clients), "--frac", repr(frac),
        "--local_ep", str(args.local_epochs), "--local_bs", str(args.batch_size), "--lr", str(args.lr),
        "--momentum", str(args.momentum), "--iid", "0", "--noniid_case", "5", "--data_beta", str(args.alpha),
        "--generate_data", "0", "--epochs", str(args.rounds), "--seed", str(seed), "--gpu", "-1",
        *method.flags,
    ]


def fedcross_source(authors: Path) -> Path | None:
    """Their FedCross for this interpreter: a source file, or a .pyc of this Python version."""
    src = authors / "Algorithm" / "Training_FedCross.py"
    if src.is_file():
        return src
    tag = sys.implementation.cache_tag  # e.g. cpython-311
    pyc = authors / "Algorithm" / "__pycache__" / f"Training_FedCross.{tag}.pyc"
    return pyc if pyc.is_file() else None


# --------------------------------------------------------------------------- table arithmetic

def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None for fewer than two values; both None for none)."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def final_and_best(points: list[float]) -> tuple[float, float]:
    """Final (last evaluated round) and best accuracy of one curve (points)."""
    if not points:
        raise ValueError("no evaluated round")
    return points[-1], max(points)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's row from its runs: ``[{seed, ours: [points...], theirs: [points...]}]`` (the
    accuracies at the evaluated rounds 10, 20, ..., in points). Δ = ours − theirs, paired by seed;
    runs missing a side count for that side only."""
    ours = [final_and_best(r["ours"]) for r in runs if r.get("ours")]
    theirs = [final_and_best(r["theirs"]) for r in runs if r.get("theirs")]
    paired = [(final_and_best(r["ours"]), final_and_best(r["theirs"])) for r in runs if r.get("ours") and r.get("theirs")]
    row: dict[str, Any] = {"seeds": len(paired), "ours_runs": len(ours), "theirs_runs": len(theirs)}
    for i, what in enumerate(("final", "best")):
        row[f"ours_{what}"] = mean_std([o[i] for o in ours])
        row[f"theirs_{what}"] = mean_std([t[i] for t in theirs])
        row[f"delta_{what}"] = mean_std([o[i] - t[i] for o, t in paired])
    return row


def against_baseline(runs: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """Mean ± std over the seeds both have of (this method's final Δ − the baseline's final Δ), each
    Δ = ours − theirs of one seed. Where both sides draw the same clients for both methods, the
    part of a seed's Δ that comes from the two sides' different client sequences is common to
    both and cancels here; what is left is the method's own difference."""
    def deltas(rs: list[dict[str, Any]]) -> dict[int, float]:
        return {r["seed"]: r["ours"][-1] - r["theirs"][-1] for r in rs if r.get("ours") and r.get("theirs")}

    mine, base = deltas(runs), deltas(baseline)
    return mean_std([mine[seed] - base[seed] for seed in sorted(mine) if seed in base])


def _pm(value: tuple[float, float | None], signed: bool = False) -> str:
    mean, std = value
    if mean is None:
        return "—"
    text = f"{mean:+.2f}" if signed else f"{mean:.2f}"
    return text + (f" ± {std:.2f}" if std is not None else "")


def markdown_table(rows: dict[str, dict[str, Any]], not_run: dict[str, str], failures: dict[str, str]) -> str:
    """The table: accuracy in points, mean ± std over seeds; Δ = ours − theirs."""
    lines = [
        "| method | seeds | ours final | theirs final | Δ final | ours best | theirs best | Δ best | Δ final − FedAvg's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        flag = " ⚠" if any(row[f"delta_{w}"][0] is not None and abs(row[f"delta_{w}"][0]) > 1.0
                           for w in ("final", "best")) else ""
        lines.append(f"| {name}{flag} | {row['seeds']} | {_pm(row['ours_final'])} | {_pm(row['theirs_final'])} | "
                     f"{_pm(row['delta_final'], True)} | {_pm(row['ours_best'])} | {_pm(row['theirs_best'])} | "
                     f"{_pm(row['delta_best'], True)} | {_pm(row.get('delta_final_vs_fedavg', (None, None)), True)} |")
    for name, why in failures.items():
        lines.append(f"| {name} | 0 | failed: {why} | | | | | | |")
    for name, why in not_run.items():
        lines.append(f"| {name} | — | not run: {why} | | | | | | |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- ours

def compose_cfg(overrides: list[str]) -> dict[str, Any]:
    from fedmm import config as config_mod

    return config_mod.to_container(config_mod.compose(overrides))


def initial_model(cfg: dict[str, Any]) -> Any:
    """Our run's initial model for ``cfg``, built as ``server_app.runner`` builds it (seed, data,
    partition, then the model)."""
    from fedmm.data import input_spec, load_dataset, partition_indices
    from fedmm.models import model_for
    from server_app.runner import seed_everything

    seed_everything(int(cfg["seed"]))
    train, _ = load_dataset(cfg["dataset"])
    partition_indices(train, cfg["partition"], int(cfg["num_clients"]), int(cfg["seed"]))
    return model_for(cfg, input_spec(cfg["dataset"]))


def run_ours(cfg: dict[str, Any]) -> dict[str, Any]:
    """One run of the app; the accuracy (points) at every evaluated round."""
    from fedmm.results import read_metrics
    from launch.cli import run_job

    start = time.perf_counter()
    run_dir = run_job(cfg)
    seconds = time.perf_counter() - start
    rows = read_metrics(run_dir)
    return {"rounds": [int(r["round"]) for r in rows], "accuracy": [100.0 * float(r["accuracy"]) for r in rows],
            "seconds": round(seconds, 1), "run_dir": str(run_dir)}


# --------------------------------------------------------------------------- theirs

def run_theirs(spec: dict[str, Any], workdir: Path, timeout: float | None) -> dict[str, Any]:
    """One run of their algorithm in a fresh interpreter (this file as ``--authors-driver``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_file = workdir / "spec.json"
    spec = {**spec, "result": str(workdir / "result.json")}
    spec_file.write_text(json.dumps(spec, indent=1))
    start = time.perf_counter()
    with open(workdir / "log.txt", "w") as log:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--authors-driver", str(spec_file)],
                              cwd=workdir, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                              env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(spec["threads"]),
                                       MKL_NUM_THREADS=str(spec["threads"])))
    seconds = time.perf_counter() - start
    if proc.returncode != 0 or not Path(spec["result"]).is_file():
        tail = (workdir / "log.txt").read_text(errors="replace")[-2500:]
        raise RuntimeError(f"their run failed (exit {proc.returncode}); log {workdir / 'log.txt'}:\n{tail}")
    out = json.loads(Path(spec["result"]).read_text())
    out["seconds"] = round(seconds, 1)
    return out


def _interface_class() -> type:
    from fedmm.models.layered import LayeredModel

    class TheirInterface(LayeredModel):
        """Our network with their calling convention (patch ``model_interface``): the same
        blocks, parameters and state_dict keys (``layers.*``); forward returns ``{'output': logits,
        'representation': latent}``; ``start_layer_idx < 0`` feeds a latent to the classifier."""

        def __init__(self, net: LayeredModel) -> None:
            super().__init__(net.layers)

        def forward(self, x, start_layer_idx=0, logit=False):  # noqa: ANN001, ANN201 - their signature
            z = x if start_layer_idx < 0 else self.latent(x)
            out = self.classify(z)
            result = {"output": out, "representation": z}
            if logit:
                result["logit"] = out
            return result

    return TheirInterface


def _size1_int_fails() -> bool:
    import numpy as np

    try:
        int(np.array([1.0]))
    except TypeError:
        return True
    return False


def authors_driver(spec_file: str) -> None:
    """Run one of their algorithms as their ``__main__`` block would, on our data (see the
    module docstring for each patch)."""
    spec = json.loads(Path(spec_file).read_text())
    applied = ["driver"]
    sys.path.insert(0, str(Path(spec["authors"]).resolve()))
    try:
        import ujson  # noqa: F401
    except ImportError:
        sys.modules["ujson"] = json
        applied.append("ujson")
    import torch

    torch.set_num_threads(int(spec["threads"]))
    sys.argv = ["main_fed.py", *spec["flags"]]
    import main_fed  # safe: their driver sits under `if __name__ == '__main__'`

    args = main_fed.args_parser()
    args.device = torch.device("cpu")
    if not hasattr(args, "ensemble_alpha"):
        args.ensemble_alpha = 0.2
        applied.append("ensemble_alpha")
    main_fed.args = args  # FedAvg, FedProx and ClusteredSampling read the module-global args
    # Our architecture, built from the run config (its weights come from initial_state below);
    # before their seeding, so that building it draws nothing from their random streams.
    from fedmm.data import input_spec
    from fedmm.models import model_for

    ours = model_for(spec["run_config"], input_spec(spec["run_config"]["dataset"]))
    main_fed.set_random_seed(args.seed)

    data = torch.load(spec["data"], weights_only=True)

    class Images(torch.utils.data.Dataset):
        """(normalised float image [C, H, W], int label), as their torchvision datasets give."""

        def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
            self.x, self.y = x, y
            self.targets = y.tolist()

        def __len__(self) -> int:
            return len(self.y)

        def __getitem__(self, i: int):  # noqa: ANN204
            return self.x[i], int(self.y[i])

    dataset_train = Images(data["train_x"], data["train_y"])
    dataset_test = Images(data["test_x"], data["test_y"])
    part = json.loads(Path(spec["partition"]).read_text())
    dict_users = {int(k): v for k, v in part["train_data"].items()}

    net = _interface_class()(ours)
    applied.append("model_interface")
    net.load_state_dict(torch.load(spec["initial_state"], weights_only=True))
    net.to(args.device)

    if args.algorithm == "FedGen":
        import utils.model_config as model_config

        latent = int(ours.latent_dim)
        model_config.CNN_GENERATORCONFIGS.setdefault("mnist", (512, latent, 1, 10, 100))
        model_config.FedGenRUNCONFIGS.setdefault("mnist", dict(model_config.FedGenRUNCONFIGS["cifar10"]))
        applied.append("fedgen_mnist_config")

    clustering = sys.modules.get("utils.clustering")
    if clustering is not None and _size1_int_fails():
        import builtins

        import numpy as np

        class Size1Int:
            """int() as NumPy 1.x let it be called on a size-1 array; still int as a dtype (``.astype(int)``)."""

            dtype = np.dtype(builtins.int)

            def __call__(self, x=0, *rest):  # noqa: ANN001, ANN204 - int's signature
                if not rest and isinstance(x, np.ndarray) and x.size == 1:
                    return builtins.int(x.item())
                return builtins.int(x, *rest)

        clustering.int = Size1Int()  # a module global shadows the builtin in that module only
        applied.append("numpy_size1_int")

    saved: dict[str, list[float]] = {}

    def recording(original):  # noqa: ANN001, ANN202
        def save(data, ylabel, args):  # noqa: ANN001, ANN202 - their signature
            saved[ylabel] = [float(v) for v in data]
            return original(data, ylabel, args)
        return save

    for name, module in list(sys.modules.items()):
        if module is main_fed or name.startswith("Algorithm"):
            for fn in ("save_result", "save_fedmut_result"):
                if callable(getattr(module, fn, None)):
                    setattr(module, fn, recording(getattr(module, fn)))
    applied.append("record_results")

    initial_acc, _ = main_fed.test_img(net, dataset_test, args)
    algorithm = getattr(main_fed, args.algorithm)
    params = list(inspect.signature(algorithm).parameters)
    start = time.perf_counter()
    if params and params[0] == "args":
        algorithm(args, net, dataset_train, dataset_test, dict_users)
    else:
        algorithm(net, dataset_train, dataset_test, dict_users)
    seconds = time.perf_counter() - start
    if "test_acc" not in saved:
        raise SystemExit(f"{args.algorithm} saved no test_acc (saved: {sorted(saved)})")
    Path(spec["result"]).write_text(json.dumps({
        "initial_accuracy": float(initial_acc), "accuracy": saved["test_acc"],
        "rounds": [10 * (i + 1) for i in range(len(saved["test_acc"]))],
        "saved": saved, "patches": applied, "train_seconds": round(seconds, 1),
    }))


# --------------------------------------------------------------------------- the bench

def prepare(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path]:
    """The partition file both sides read and their datasets (our tensors, normalised)."""
    import torch

    from fedmm.data import load_dataset, partition_indices
    from fedmm.data.partition_file import write_partition_file

    cfg = compose_cfg([*shared_overrides(args), "partition=dirichlet", "partition.algorithm=authors",
                       f"partition.alpha={args.alpha}", f"partition.min_partition_size={args.min_partition_size}",
                       f"seed={args.partition_seed}"])
    train, test = load_dataset(cfg["dataset"])
    parts = partition_indices(train, cfg["partition"], args.num_clients, args.partition_seed)
    partition = write_partition_file(workdir / "partition.json", parts, dataset=cfg["dataset"]["name"],
                                     partition=cfg["partition"], seed=args.partition_seed)
    data = {}
    for split, d in (("train", train), ("test", test)):
        data[f"{split}_x"] = d.transform.prepare("cpu")(d.x).contiguous()
        data[f"{split}_y"] = d.y.clone()
    torch.save(data, workdir / "data.pt")
    return partition, workdir / "data.pt"


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    authors = Path(args.authors).resolve()
    if not (authors / "main_fed.py").is_file():
        raise SystemExit(f"parity: {authors} has no main_fed.py (a checkout of HMHelloWorld/FedMR?)")
    if args.rounds % 10:
        raise SystemExit("parity: --rounds must be a multiple of 10 (their code evaluates every 10 rounds)")
    unknown = [m for m in args.methods if m not in METHODS and m not in NOT_RUN]
    if unknown:
        raise SystemExit(f"parity: unknown methods {unknown}; known: {sorted(METHODS) + sorted(NOT_RUN)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="parity_")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"parity: working in {workdir}", flush=True)
    partition, data = prepare(args, workdir)
    not_run = {m: why for m, why in NOT_RUN.items() if m in args.methods}
    if "fedcross" in not_run and fedcross_source(authors) is not None:
        not_run["fedcross"] = f"{fedcross_source(authors)} exists, but no FedCross driver mapping is defined here"
    results: dict[str, Any] = {}
    for name in [m for m in args.methods if m in METHODS]:
        method = METHODS[name]
        runs = []
        for seed in args.seeds:
            run: dict[str, Any] = {"seed": seed}
            cfg = compose_cfg([*shared_overrides(args), *method.ours, "partition=file", f"partition.path={partition}",
                               f"num_rounds={args.rounds}", f"seed={seed}", "eval_every=10",
                               f"output_dir={workdir / name / f'ours_s{seed}'}"])
            model = initial_model(cfg)
            state_file = workdir / name / f"initial_s{seed}.pt"
            state_file.parent.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), state_file)  # tensors only: read back with weights_only=True
            print(f"parity: {name} seed {seed}: theirs ...", flush=True)
            try:
                if "theirs" not in args.sides:
                    raise _Skipped
                run["theirs"] = run_theirs({"authors": str(authors), "flags": their_flags(args, method, seed),
                                            "data": str(data), "partition": str(partition), "run_config": cfg,
                                            "initial_state": str(state_file), "threads": args.their_threads},
                                           workdir / name / f"theirs_s{seed}", args.timeout)
            except _Skipped:
                pass
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                run["theirs_error"] = str(err)
                print(f"parity: {name} seed {seed}: theirs FAILED: {err}", flush=True)
            print(f"parity: {name} seed {seed}: ours ...", flush=True)
            try:
                if "ours" in args.sides:
                    run["ours"] = run_ours(cfg)
            except Exception as err:  # noqa: BLE001 - a failed run is a result of the bench
                run["ours_error"] = f"{type(err).__name__}: {err}"
                print(f"parity: {name} seed {seed}: ours FAILED: {err}", flush=True)
            check_run(run, args.rounds)
            print(f"parity: {name} seed {seed}: {brief(run)}", flush=True)
            runs.append(run)
        results[name] = {"ours": list(method.ours), "theirs": method.theirs, "their_flags": list(method.flags),
                         "runs": runs}
    return {"settings": settings_of(args, authors), "workdir": str(workdir), "partition": str(partition),
            "partition_sha256": hashlib.sha256(Path(partition).read_bytes()).hexdigest(),
            "methods": results, "not_run": not_run, "patch_descriptions": PATCHES}


def collect(workdir: Path, settings: dict[str, Any], rounds: int) -> dict[str, Any]:
    """A result from a bench's working folder, e.g. of a run stopped before its end: every
    (method, seed) whose two sides both finished (their ``result.json``, our completed run
    directory) counts; the others are left out and listed in ``incomplete``."""
    import re

    from fedmm.results import read_metrics

    methods: dict[str, Any] = {}
    incomplete: list[str] = []
    for method_dir in sorted(p for p in workdir.iterdir() if p.is_dir() and p.name in METHODS):
        name, method = method_dir.name, METHODS[method_dir.name]
        runs = []
        for theirs_dir in sorted(method_dir.glob("theirs_s*")):
            seed = int(re.fullmatch(r"theirs_s(\d+)", theirs_dir.name).group(1))
            ours_dir = method_dir / f"ours_s{seed}"
            summary = ours_dir / "summary.json"
            done = summary.is_file() and json.loads(summary.read_text()).get("status") == "completed"
            if not (theirs_dir / "result.json").is_file() or not done:
                incomplete.append(f"{name} seed {seed}")
                continue
            rows = read_metrics(ours_dir)
            run = {"seed": seed, "theirs": json.loads((theirs_dir / "result.json").read_text()),
                   "ours": {"rounds": [int(r["round"]) for r in rows], "accuracy": [100.0 * float(r["accuracy"]) for r in rows],
                            "seconds": json.loads(summary.read_text()).get("seconds"), "run_dir": str(ours_dir)}}
            check_run(run, rounds)
            runs.append(run)
        if runs:
            methods[name] = {"ours": list(method.ours), "theirs": method.theirs, "their_flags": list(method.flags), "runs": runs}
    partition = workdir / "partition.json"
    return {"settings": {**settings, "seeds": sorted({r["seed"] for m in methods.values() for r in m["runs"]})},
            "workdir": str(workdir), "partition": str(partition),
            "partition_sha256": hashlib.sha256(partition.read_bytes()).hexdigest() if partition.is_file() else None,
            "methods": methods, "not_run": {}, "patch_descriptions": PATCHES, "incomplete": incomplete}


#: Settings that may differ between result files merged into one table.
MERGE_FREE = ("seeds", "authors")


def merge_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs of the bench with the same settings (methods or seeds run
    apart, e.g. on different days): runs are keyed by (method, seed), a later file's run wins.
    Refuses files whose settings or partition differ."""
    first = results[0]
    fixed = {k: v for k, v in first["settings"].items() if k not in MERGE_FREE}
    for other in results[1:]:
        theirs = {k: v for k, v in other["settings"].items() if k not in MERGE_FREE}
        diff = sorted(k for k in set(fixed) | set(theirs) if fixed.get(k) != theirs.get(k))
        if diff:
            raise SystemExit(f"parity: cannot merge results with different settings: {diff}")
        hashes = {r.get("partition_sha256") for r in (first, other)} - {None}
        if len(hashes) > 1:
            raise SystemExit("parity: cannot merge results made on different partition files")
    methods: dict[str, Any] = {}
    for result in results:
        for name, method in result["methods"].items():
            entry = methods.setdefault(name, {**{k: v for k, v in method.items() if k != "runs"}, "runs": {}})
            for run in method["runs"]:
                entry["runs"][run["seed"]] = run
    for entry in methods.values():
        entry["runs"] = [entry["runs"][seed] for seed in sorted(entry["runs"])]
    seeds = sorted({run["seed"] for m in methods.values() for run in m["runs"]})
    not_run: dict[str, str] = {}
    for result in results:
        not_run.update(result.get("not_run", {}))
    return {
        "settings": {**first["settings"], "seeds": seeds}, "workdir": [r.get("workdir") for r in results],
        "partition": first.get("partition"), "partition_sha256": next((r["partition_sha256"] for r in results
                                                                       if r.get("partition_sha256")), None),
        "methods": methods, "not_run": {k: v for k, v in not_run.items() if k not in methods},
        "patch_descriptions": PATCHES,
        "merged_from": [c for r in results for c in (r.get("merged_from") or [r.get("command")])],
        "seconds": round(sum(r.get("seconds", 0.0) for r in results), 1),
    }


class _Skipped(Exception):
    """A side left out with --sides."""


def check_run(run: dict[str, Any], rounds: int) -> None:
    """The evaluated rounds 10, 20, ... of both sides (points), and the initial-model check."""
    wanted = list(range(10, rounds + 1, 10))
    if "ours" in run:
        ours = dict(zip(run["ours"]["rounds"], run["ours"]["accuracy"]))
        missing = [r for r in wanted if r not in ours]
        if missing:
            run["ours_error"] = f"no accuracy at rounds {missing}"
        run["ours_points"] = [ours[r] for r in wanted if r in ours]
        run["ours_initial"] = ours.get(0)
    if "theirs" in run:
        theirs = dict(zip(run["theirs"]["rounds"], run["theirs"]["accuracy"]))
        run["theirs_points"] = [theirs[r] for r in wanted if r in theirs]
        if len(run["theirs_points"]) != len(wanted):
            run["theirs_error"] = f"{len(run['theirs_points'])} evaluations, expected {len(wanted)}"
        run["patches"] = run["theirs"].get("patches", [])
    if run.get("ours_initial") is not None and "theirs" in run:
        # same weights, same test images, same normalisation: the same count of correct digits
        run["initial_match"] = abs(run["ours_initial"] - run["theirs"]["initial_accuracy"]) < 1e-3


def brief(run: dict[str, Any]) -> str:
    ours = ", ".join(f"{v:.1f}" for v in run.get("ours_points", [])) or run.get("ours_error", "—")
    theirs = ", ".join(f"{v:.1f}" for v in run.get("theirs_points", [])) or run.get("theirs_error", "—")
    return (f"ours [{ours}] ({run.get('ours', {}).get('seconds', '?')} s)  theirs [{theirs}] "
            f"({run.get('theirs', {}).get('seconds', '?')} s)  initial match: {run.get('initial_match')}")


def settings_of(args: argparse.Namespace, authors: Path) -> dict[str, Any]:
    commit = None
    try:
        commit = subprocess.run(["git", "-C", str(authors), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "authors": str(authors), "authors_commit": commit, "rounds": args.rounds, "seeds": args.seeds,
        "num_clients": args.num_clients, "clients_per_round": args.clients_per_round,
        "local_epochs": args.local_epochs, "batch_size": args.batch_size, "lr": args.lr, "momentum": args.momentum,
        "alpha": args.alpha, "min_partition_size": args.min_partition_size, "partition_seed": args.partition_seed,
        "model": args.model, "override": args.override, "python": platform.python_version(),
        "machine": platform.machine(), "cores": os.cpu_count(),
    }


def table_rows(result: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    def points(method: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"seed": r["seed"],
                 "ours": r.get("ours_points") if "ours_error" not in r else None,
                 "theirs": r.get("theirs_points") if "theirs_error" not in r else None} for r in method["runs"]]

    rows, failures = {}, {}
    baseline = points(result["methods"]["fedavg"]) if "fedavg" in result["methods"] else []
    for name, method in result["methods"].items():
        runs = points(method)
        if any(r["ours"] or r["theirs"] for r in runs):
            rows[name] = summarize(runs)
            if name != "fedavg" and name in METHODS and METHODS[name].fedavg_sampling:
                rows[name]["delta_final_vs_fedavg"] = against_baseline(runs, baseline)
        errors = [f"seed {r['seed']}: " + "; ".join(r[k].splitlines()[0] for k in ("ours_error", "theirs_error") if k in r)
                  for r in method["runs"] if "ours_error" in r or "theirs_error" in r]
        if errors and name not in rows:
            failures[name] = " | ".join(errors)
        elif errors:
            rows[name]["errors"] = errors
    return rows, failures


def render_markdown(result: dict[str, Any], command: str) -> str:
    rows, failures = table_rows(result)
    s = result["settings"]
    patches = sorted({p for m in result["methods"].values() for r in m["runs"] for p in r.get("patches", [])},
                     key=list(PATCHES).index)
    init = [r.get("initial_match") for m in result["methods"].values() for r in m["runs"] if "initial_match" in r]
    commands = result.get("merged_from") or [command]
    lines = [
        ("Command: " if len(commands) == 1 else "Commands (one table, the runs merged with `--merge`): ")
        + ", ".join(f"`{c}`" for c in commands)
        + ("; merged: `python bench/parity.py --merge <the previous table's json> <a new run's json> --out "
           "bench/results/parity.json --markdown docs/parity.md`" if len(commands) > 1 else ""),
        "",
        f"Settings: their checkout {s['authors_commit'] or s['authors']}; mnist5k (4,000 train / 1,000 test), "
        f"{s['num_clients']} clients, {s['clients_per_round']} per round, Dir({s['alpha']}) authors' split "
        f"(min size {s['min_partition_size']}, partition seed {s['partition_seed']}, one file for both sides), "
        f"{s['local_epochs']} local epochs, batch {s['batch_size']}, SGD lr {s['lr']} momentum {s['momentum']}, "
        f"model `{s['model']}` with the same initial weights on both sides, {s['rounds']} rounds, "
        f"seeds {' '.join(map(str, s['seeds']))}" + (f", overrides {' '.join(s['override'])}" if s["override"] else "")
        + ".",
        "",
        f"Initial model check (round-0 test accuracy equal on both sides): {sum(bool(i) for i in init)} of "
        f"{len(init)} runs.",
        "",
        "Accuracy on the test split in points, mean ± std over seeds; final = round "
        f"{s['rounds']}, best = the best of rounds {', '.join(str(r) for r in range(10, s['rounds'] + 1, 10))}; "
        "Δ = ours − theirs, paired by seed; ⚠: |Δ| > 1 point. Δ final − FedAvg's: this method's final Δ "
        "minus FedAvg's final Δ of the same seed, mean ± std over the seeds both have, for the methods whose "
        "clients each side draws exactly as it draws FedAvg's (the client sequences' share of a seed's Δ cancels).",
        "",
        markdown_table(rows, result["not_run"], failures),
        "Run-time patches applied to their code:",
        "",
        *[f"- `{p}`: {PATCHES[p]}" for p in patches],
        "",
    ]
    errors = [f"- {name}: {e}" for name, row in rows.items() for e in row.get("errors", [])]
    if errors:
        lines += ["Failed runs (left out of the means):", "", *errors, ""]
    return "\n".join(lines)


def write_markdown(path: Path, block: str) -> None:
    begin, end = "<!-- parity:begin -->", "<!-- parity:end -->"
    body = f"{begin}\n{block}{end}\n"
    if path.is_file():
        text = path.read_text()
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            path.write_text(head + body + rest.split(end, 1)[1].lstrip("\n"))
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Parity with the FedMR authors' code\n\n" + body)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--authors", default=None, help="a checkout of HMHelloWorld/FedMR (needed unless --merge)")
    p.add_argument("--collect", default=None, metavar="WORKDIR",
                   help="run nothing: the result of the runs finished in a bench's --workdir (e.g. one stopped "
                        "early), with the settings given here")
    p.add_argument("--merge", nargs="+", default=None, metavar="RESULT_JSON",
                   help="run nothing: merge these result files (same settings; methods or seeds run apart) into --out")
    p.add_argument("--methods", nargs="+", default=[*METHODS, *NOT_RUN], help=f"of {[*METHODS, *NOT_RUN]}")
    p.add_argument("--rounds", type=int, default=20, help="a multiple of 10")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "parity.json"))
    p.add_argument("--markdown", default=None, help="write the table there (e.g. docs/parity.md)")
    p.add_argument("--workdir", default=None, help="keep partition, runs and logs there (default: a new temp folder)")
    p.add_argument("--num-clients", type=int, default=20)
    p.add_argument("--clients-per-round", type=int, default=10)
    p.add_argument("--local-epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration of the partition")
    p.add_argument("--min-partition-size", type=int, default=10)
    p.add_argument("--partition-seed", type=int, default=0)
    p.add_argument("--model", default="cnn", help="our model name, used on both sides")
    p.add_argument("--override", nargs="*", default=[],
                   help="extra hydra overrides for the data and our runs (e.g. dataset.test_fraction=0.5); "
                        "their side gets the data that results, nothing else")
    p.add_argument("--sides", nargs="+", choices=("ours", "theirs"), default=["ours", "theirs"],
                   help="run one side only (debugging; the table then has no delta)")
    p.add_argument("--timeout", type=float, default=None, help="seconds for one of their runs")
    p.add_argument("--their-threads", type=int, default=1,
                   help="torch threads of their process (1: as each of our ClientApps; more threads on a busy "
                        "machine made it 8x slower here, same results)")
    args = p.parse_args(argv)
    if args.authors is None and not (args.merge or args.collect):
        p.error("--authors is required (or --merge result files)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--authors-driver"]:
        authors_driver(argv[1])
        return 0
    args = parse_args(argv)
    command = "python bench/parity.py " + " ".join(argv)
    if args.collect:
        authors = Path(args.authors).resolve() if args.authors else Path(".")
        result = collect(Path(args.collect).resolve(), settings_of(args, authors), args.rounds)
        result["command"] = command
        print(f"parity: collected {sum(len(m['runs']) for m in result['methods'].values())} runs; "
              f"incomplete: {result['incomplete'] or 'none'}", flush=True)
    elif args.merge:
        result = merge_results([json.loads(Path(f).read_text()) for f in args.merge])
        result["command"] = command
    else:
        start = time.perf_counter()
        result = bench(args)
        result["seconds"] = round(time.perf_counter() - start, 1)
        result["command"] = command
    rows, failures = table_rows(result)
    result["table"] = {name: {k: v for k, v in row.items()} for name, row in rows.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(markdown_table(rows, result["not_run"], failures))
    print(f"parity: wrote {out} ({result.get('seconds', '?')} s)")
    if args.markdown:
        write_markdown(Path(args.markdown), render_markdown(result, command))
        print(f"parity: wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
