"""Local-training throughput of the app's clients, one at a time and several sharing one device:
what to set ``simulation.client_gpus`` (the GPU fraction per ClientApp) to.

    python bench/gpu_throughput.py --device cuda                  # cnn, resnet20, vgg16; 1, 2, 4, 8 clients
    python bench/gpu_throughput.py --device cpu --clients 1 2     # the same on the CPU

Every client is a separate process (``torch.multiprocessing``, spawn), as Ray runs every
ClientApp in its own worker process. The processes are a pool started once (as many as the
largest n) that runs every case, smallest n first: a case of n clients runs on the first n
processes while the others wait (they have not touched the device yet), so torch and the app are
imported once per process, not once per case. For a case a client builds its model with ``fedmm.models.build_model``, its
own seeded CIFAR-shaped synthetic data (uint8 3x32x32, 10 classes, normalised as CIFAR-10) as a
``fedmm.data.TensorData``, and trains it with the app's loop (``client_app.training.train_epochs``,
the loop of ``client_app.training.train``, through the ``ce`` plugin of
``objectives.base.build_local_update``) with the SGD settings of
the declared training defaults (``fedmm/training.py``; epochs and batch size from the command line). After an untimed
warm-up of two batches, the n clients of a case start each timed round together at a barrier.

Reported per model and number of concurrent clients n (median over ``--repeats`` rounds):
samples/s of all clients together (n x samples x epochs / the time from the first start to the
last finish) and per client, seconds per client round, and the peak memory of one client: on
CUDA ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of its process in this case
(reset when the case starts; the CUDA context, a few hundred MiB per process, comes on top;
``device_used_mib`` in the JSON is the whole GPU's use while the n processes of the case are
alive, each having emptied its cache after its earlier cases), on the CPU the peak RSS of its
process during the case (Linux: ``VmHWM`` reset when the case starts; PyTorch's own runtime
included; in brackets the growth over the process after its imports). The JSON is written case
by case (``bench/cases.py``); ``--resume`` runs only the cases missing from ``--out``.
The suggestion is the largest n whose total throughput is within 5 % of the best n tested:
``client_gpus = 1/n``.

Runs where PyTorch and numpy are installed but not Flower, Ray or hydra: nothing of the app it
imports needs them. Writes bench/results/gpu_throughput.json.
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib.machinery
import json
import os
import platform
import queue as queue_module
import resource
import statistics
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as ``python bench/gpu_throughput.py`` from a plain copy of the repo
    sys.path.insert(0, str(REPO))
if str(REPO / "bench") not in sys.path:
    sys.path.insert(0, str(REPO / "bench"))

from cases import CaseLog  # noqa: E402 - bench/cases.py (no Flower)

MODELS = ("cnn", "resnet20", "vgg16")
#: CIFAR-10 as the app reads it (conf/dataset/cifar10.yaml).
IMAGE_SHAPE, NUM_CLASSES, MEAN, STD = (3, 32, 32), 10, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
#: Frameworks the benchmark must not need; the JSON lists any a client process loaded.
FRAMEWORKS = ("flwr", "ray", "hydra")
#: Total throughput within this fraction of the best counts as "as good" for the suggestion.
TOLERANCE = 0.05
WARMUP_BATCHES = 2
MIB = 2**20


# ------------------------------------------------------------------------------ the app
def _stand_in_for_omegaconf() -> list[str]:
    """``fedmm.config`` (imported by ``fedmm.models`` and ``fedmm.data`` to register their config
    schemas) imports omegaconf at its top but the training path never calls it. Where omegaconf
    is missing (a PyTorch-only machine) an empty stand-in takes its place; any use of it raises."""
    try:
        import omegaconf  # noqa: F401
    except ImportError:
        stub = types.ModuleType("omegaconf", "stand-in from bench/gpu_throughput.py: omegaconf is not installed")

        class _Missing:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise ImportError("omegaconf is not installed (bench/gpu_throughput.py put a stand-in in its place)")

        stub.DictConfig = type("DictConfig", (_Missing,), {})
        stub.OmegaConf = type("OmegaConf", (_Missing,), {})
        stub.__fedmm_stand_in__ = True
        # a spec without origin: importlib.util.find_spec("omegaconf") (torch 2.5's dynamo probes
        # optional packages with it) raises for a module without one
        stub.__spec__ = importlib.machinery.ModuleSpec("omegaconf", None)
        sys.modules["omegaconf"] = stub
        return ["omegaconf"]
    return []


def _app() -> types.SimpleNamespace:
    """The app's pieces the benchmark runs (imported here, in every client process)."""
    stand_ins = _stand_in_for_omegaconf()
    from objectives.base import build_local_update
    from client_app.training import train_epochs
    from fedmm.config import CONF_DIR
    from fedmm.data.spec import InputSpec
    from fedmm.data.tensors import ImageNormalize, TensorData
    from fedmm.models import build_model
    from fedmm.training import TrainingSettings

    return types.SimpleNamespace(
        build_local_update=build_local_update, train_epochs=train_epochs, conf_dir=Path(CONF_DIR), InputSpec=InputSpec,
        ImageNormalize=ImageNormalize, TensorData=TensorData, build_model=build_model, stand_ins=stand_ins,
        TrainingSettings=TrainingSettings,
    )


def training_config(conf_dir: Path, epochs: int, batch_size: int | None) -> dict[str, Any]:
    """The declared training defaults with ``local_epochs`` (and ``batch_size``) replaced."""
    from fedmm.training import TrainingSettings

    training = TrainingSettings().to_dict()
    training["local_epochs"] = int(epochs)
    if batch_size is not None:
        training["batch_size"] = int(batch_size)
    return training


def synthetic_data(app: types.SimpleNamespace, n: int, seed: int):
    """``n`` CIFAR-shaped uint8 images with labels in 0..9, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, *IMAGE_SHAPE), dtype=torch.uint8, generator=g)
    y = torch.randint(0, NUM_CLASSES, (n,), dtype=torch.int64, generator=g)
    return app.TensorData(x=x, y=y, ids=None, transform=app.ImageNormalize(MEAN, STD))


# ------------------------------------------------------------------------------ one client
def _peak_rss_mib() -> float:
    """Peak resident memory of this process since :func:`_reset_peak_rss` (Linux: ``VmHWM``), else
    since it started (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / MIB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak * 1024 / MIB


def _reset_peak_rss() -> bool:
    """Start this process's peak resident memory afresh (Linux: ``/proc/self/clear_refs`` 5), so
    that a worker's later case does not report an earlier case's peak, after handing the heap an
    earlier case freed back to the system (glibc's ``malloc_trim``); False where it cannot."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _client(rank: int, spec: dict[str, Any], barrier: Any, app: types.SimpleNamespace, rss_after_imports: float) -> dict[str, Any]:
    """One client of one case: build, warm up, then ``repeats`` timed rounds started at the barrier."""
    torch.set_num_threads(spec["threads"])
    peak_rss_reset = _reset_peak_rss()
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    seed = spec["seed"] * 10_007 + rank
    data = synthetic_data(app, spec["samples"], seed)
    torch.manual_seed(seed)  # model initialisation and dropout (vgg16)
    model = app.build_model(spec["model"], app.InputSpec(kind="image", num_classes=NUM_CLASSES, shape=IMAGE_SHAPE))
    # The ce plugin reads neither the node state nor the message records: empty mappings keep
    # Flower out (a RecordDict is made only when they are left out).
    update = app.build_local_update({"objective": {"name": "ce"}}, state={}, content={})
    training = app.TrainingSettings.from_dict(spec["training"], "training.")
    generator = torch.Generator().manual_seed(seed)
    warmup = data.subset(np.arange(min(len(data), WARMUP_BATCHES * training.batch_size)))
    app.train_epochs(model, warmup, update, training.replace(local_epochs=1), 1, generator, device)
    if cuda:
        torch.cuda.synchronize(device)
    rounds = []
    for r in range(spec["repeats"]):
        barrier.wait()
        start, cpu = time.monotonic(), time.process_time()
        loss, _ = app.train_epochs(model, data, update, training, r + 1, generator, device)
        if cuda:
            torch.cuda.synchronize(device)
        end = time.monotonic()
        rounds.append({"start": start, "end": end, "train_loss": loss, "cpu_s": time.process_time() - cpu})
    out: dict[str, Any] = {
        "rank": rank,
        "rounds": rounds,
        "peak_rss_mib": _peak_rss_mib(),
        "peak_rss_of_this_case": peak_rss_reset,
        "rss_after_imports_mib": rss_after_imports,
        "frameworks_loaded": sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in FRAMEWORKS}),
        "stand_ins": app.stand_ins,
    }
    if cuda:
        out["peak_allocated_mib"] = torch.cuda.max_memory_allocated(device) / MIB
        out["peak_reserved_mib"] = torch.cuda.max_memory_reserved(device) / MIB
    barrier.wait()  # every client of the case is alive and holds its memory
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        out["device_used_mib"] = (total - free) / MIB
    barrier.wait()
    del model, data, warmup, update
    if cuda:  # the next case of this worker starts from an empty cache
        torch.cuda.empty_cache()
    return out


def _worker(rank: int, tasks: Any, barriers: dict[int, Any], results: Any) -> None:
    """A client process of the pool: imports the app once, then runs the cases it is given
    (``(case index, spec)``; None ends it), each report or traceback into ``results``."""
    app = _app()
    rss_after_imports = _peak_rss_mib()
    while True:
        task = tasks.get()
        if task is None:
            return
        index, spec = task
        barrier = barriers[index]
        try:
            results.put((index, rank, _client(rank, spec, barrier, app, rss_after_imports), None))
        except BaseException:  # report it; the parent stops the case
            barrier.abort()
            results.put((index, rank, None, traceback.format_exc()))


class Pool:
    """``size`` client processes (``torch.multiprocessing``, spawn), started once and given every
    case in turn: the first n of them run a case of n clients, together at the case's barrier.
    Each imports torch and the app once, not once per case. A case whose client fails or times
    out ends the pool (:meth:`close`); the next case starts a fresh one."""

    def __init__(self, size: int, cases: list[int], timeout: float) -> None:
        self.ctx = mp.get_context("spawn")
        self.cases, self.timeout = cases, timeout  # cases[i]: the number of clients of case i
        self.barriers = {i: self.ctx.Barrier(n, timeout=timeout) for i, n in enumerate(cases)}
        self.results = self.ctx.Queue()
        self.tasks = [self.ctx.Queue() for _ in range(size)]
        self.procs = [self.ctx.Process(target=_worker, args=(rank, self.tasks[rank], self.barriers, self.results), daemon=True)
                      for rank in range(size)]
        for p in self.procs:
            p.start()

    def run(self, index: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
        """Case ``index`` (``cases[index]`` clients); their reports, by rank."""
        n = self.cases[index]
        for rank in range(n):
            self.tasks[rank].put((index, spec))
        reports: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.timeout * (spec["repeats"] + 3)
        while len(reports) < n:
            try:
                case, rank, report, error = self.results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [p.exitcode for p in self.procs[:n] if p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"{spec['model']} x{n}: a client process died (exit codes {dead}) or timed out")
                continue
            if case != index:
                continue  # a late report of a case that failed
            if error:
                raise RuntimeError(f"{spec['model']} x{n}: client {rank} failed:\n{error}")
            reports[rank] = report
        return [reports[rank] for rank in range(n)]

    def close(self) -> None:
        for tasks, p in zip(self.tasks, self.procs):
            if p.is_alive():
                tasks.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)


# ------------------------------------------------------------------------------ summary
def summarise(reports: list[dict[str, Any]], samples: int, epochs: int) -> dict[str, Any]:
    """Median over the timed rounds of the throughput of all clients together and of one client."""
    n, per_round = len(reports), samples * epochs
    totals, per_client, seconds, slowest, skews, busy = [], [], [], [], [], []
    for r in range(len(reports[0]["rounds"])):
        rounds = [rep["rounds"][r] for rep in reports]
        starts, ends = [x["start"] for x in rounds], [x["end"] for x in rounds]
        durations = [x["end"] - x["start"] for x in rounds]
        totals.append(n * per_round / (max(ends) - min(starts)))
        per_client.append(statistics.mean(per_round / d for d in durations))
        seconds.append(statistics.mean(durations))
        slowest.append(max(durations))
        skews.append(max(starts) - min(starts))
        busy.append(statistics.mean(x["cpu_s"] / (x["end"] - x["start"]) for x in rounds))
    row: dict[str, Any] = {
        "clients": n,
        "total_samples_per_s": statistics.median(totals),
        "per_client_samples_per_s": statistics.median(per_client),
        "s_per_client_round": statistics.median(seconds),
        "s_per_client_round_slowest": statistics.median(slowest),
        "start_skew_s": max(skews),
        # CPU seconds of a client process per second of its round: about its thread count on an
        # idle CPU; far less means other work took the cores (or, on CUDA, time spent waiting)
        "cpu_s_per_s_per_client": statistics.median(busy),
        "total_samples_per_s_each_round": totals,
        "peak_rss_mib_per_client": max(rep["peak_rss_mib"] for rep in reports),
        "rss_after_imports_mib_per_client": max(rep["rss_after_imports_mib"] for rep in reports),
        "final_train_loss": [rep["rounds"][-1]["train_loss"] for rep in reports],
        "frameworks_loaded": sorted({m for rep in reports for m in rep["frameworks_loaded"]}),
        "stand_ins": sorted({m for rep in reports for m in rep["stand_ins"]}),
    }
    if "peak_allocated_mib" in reports[0]:
        row["peak_allocated_mib_per_client"] = max(rep["peak_allocated_mib"] for rep in reports)
        row["peak_reserved_mib_per_client"] = max(rep["peak_reserved_mib"] for rep in reports)
        row["device_used_mib"] = max(rep["device_used_mib"] for rep in reports)
    return row


def suggest(rows: list[dict[str, Any]]) -> int:
    """The largest n whose total throughput is within :data:`TOLERANCE` of the best."""
    best = max(row["total_samples_per_s"] for row in rows)
    return max(row["clients"] for row in rows if row["total_samples_per_s"] >= (1 - TOLERANCE) * best)


def suggestion_text(n: int, cuda: bool, threads: int) -> str:
    if cuda:
        return f"client_gpus = {1 / n:.3g} ({n} per GPU)"
    return f"{n} at once (client_cpus = {threads})"


def markdown_table(result: dict[str, Any]) -> str:
    cuda = result["device"] == "cuda"
    mem = "peak GPU MiB / client (allocated / reserved)" if cuda else "peak RSS MiB / client (+ over imports)"
    # On the CPU: the share of its threads' time a client got (well under 100 %: other work on the machine)
    busy = "" if cuda else " CPU use |"
    lines = [
        f"| model | clients | threads / client | samples/s total | samples/s / client | s / client round | {mem} |{busy} speed-up vs 1 | suggestion |",
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("" if cuda else "---:|") + "---|",
    ]
    for model, entry in result["models"].items():
        base = next((row["total_samples_per_s"] for row in entry["rows"] if row["clients"] == 1), None)
        for row in entry["rows"]:
            if cuda:
                memory = f"{row['peak_allocated_mib_per_client']:.0f} / {row['peak_reserved_mib_per_client']:.0f}"
            else:
                growth = row["peak_rss_mib_per_client"] - row["rss_after_imports_mib_per_client"]
                memory = f"{row['peak_rss_mib_per_client']:.0f} (+{growth:.0f})"
            speedup = f"{row['total_samples_per_s'] / base:.2f}x" if base else "-"
            note = entry["suggestion"] if row["clients"] == entry["suggested_clients"] else ""
            use = "" if cuda else f" {100 * row['cpu_s_per_s_per_client'] / row['threads']:.0f} % |"
            lines.append(
                f"| {model} | {row['clients']} | {row['threads']} | {row['total_samples_per_s']:.0f} | "
                f"{row['per_client_samples_per_s']:.0f} | {row['s_per_client_round']:.2f} | {memory} |{use} {speedup} | {note} |"
            )
    return "\n".join(lines)


def machine_info(device: torch.device) -> dict[str, Any]:
    cpu_name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_name,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, gpu_memory_mib=props.total_memory / MIB,
                    cudnn=torch.backends.cudnn.version(), gpu_count=torch.cuda.device_count())
    else:
        info["device_name"] = f"{cpu_name} ({info['cpus_usable']} cores, {platform.machine()}), no GPU used"
    return info


# ------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when present")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 2, 4, 8], help="numbers of concurrent clients")
    parser.add_argument("--samples-per-client", type=int, default=500)
    parser.add_argument("--model-samples", nargs="*", default=[], metavar="MODEL=N",
                        help="samples per client for some models only, e.g. vgg16=200")
    parser.add_argument("--epochs", type=int, default=1, help="local epochs per round")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the declared training default (50)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per case (the median is reported)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per client process (default: usable CPUs / clients, at least 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one round may take before giving up")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_throughput.json"))
    parser.add_argument("--resume", action="store_true", help="keep the cases already in --out and run the others")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.clients) or args.samples_per_client < 1 or args.epochs < 1 or args.repeats < 1:
        parser.error("--clients, --samples-per-client, --epochs and --repeats must be >= 1")
    try:
        args.model_samples = {k: int(v) for k, v in (item.split("=", 1) for item in args.model_samples)}
    except ValueError:
        parser.error("--model-samples takes MODEL=N pairs")
    return args


def _load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: PyTorch sees no CUDA device")
    return torch.device(name)


def by_model(rows: list[dict[str, Any]], models: list[str], cuda: bool) -> dict[str, Any]:
    """The finished rows per model (by number of clients) with each model's suggestion."""
    out: dict[str, Any] = {}
    for model in models:
        mine = sorted((row for row in rows if row["model"] == model), key=lambda row: row["clients"])
        if not mine:
            continue
        n_best = suggest(mine)
        threads_best = next(row["threads"] for row in mine if row["clients"] == n_best)
        out[model] = {"samples_per_client": mine[0]["samples_per_client"], "rows": mine, "suggested_clients": n_best,
                      "suggested_client_gpus": 1 / n_best, "suggestion": suggestion_text(n_best, cuda, threads_best)}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    app = _app()
    training = training_config(app.conf_dir, args.epochs, args.batch_size)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    clients = sorted(set(args.clients))
    header: dict[str, Any] = {
        "benchmark": "gpu_throughput",
        "device": device.type,
        "machine": machine_info(device),
        "settings": {
            "models": args.models, "clients": clients, "samples_per_client": args.samples_per_client,
            "model_samples": args.model_samples, "epochs": args.epochs, "repeats": args.repeats,
            "threads": args.threads, "seed": args.seed, "warmup_batches": WARMUP_BATCHES, "tolerance": TOLERANCE,
            "training": training, "objective": "ce", "data": "synthetic uint8 3x32x32, 10 classes, mean=std=0.5",
            "loop": "client_app.training.train_epochs (the loop of client_app.training.train)",
            "order": "by number of clients, then model: a case of n clients runs on the pool's first n processes, "
                     "and the others have not touched the device yet",
        },
        "stand_ins": app.stand_ins,
        "load_average_before": _load_average(),  # other work on the machine skews the numbers
    }
    cuda = device.type == "cuda"

    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        models = by_model(rows, args.models, cuda)
        return {"models": models, "table": markdown_table({"device": device.type, "models": models})}

    log = CaseLog(args.out, header, key=("model", "clients"), resume=args.resume, summary=summary)
    cases = [(n, model) for n in clients for model in args.models if not log.finished(model=model, clients=n)]
    started = time.monotonic()
    pool: Pool | None = None
    try:
        for index, (n, model) in enumerate(cases):
            samples = args.model_samples.get(model, args.samples_per_client)
            threads = args.threads or max(1, usable // n)
            spec = {"model": model, "samples": samples, "repeats": args.repeats, "device": str(device),
                    "threads": threads, "seed": args.seed, "training": training}
            with log.case(model=model, clients=n) as row:
                t = time.monotonic()
                if pool is None:
                    pool = Pool(max(c for c, _ in cases), [c for c, _ in cases], args.timeout)
                try:
                    reports = pool.run(index, spec)
                except BaseException:
                    pool.close()
                    pool = None
                    raise
                row.update(summarise(reports, samples, args.epochs))
                row.update(threads=threads, samples_per_client=samples, case_wall_s=time.monotonic() - t)
                print(f"{model:>9} x{n}: {row['total_samples_per_s']:8.1f} samples/s total, "
                      f"{row['s_per_client_round']:.2f} s per client round ({row['case_wall_s']:.0f} s)", flush=True)
    finally:
        if pool is not None:
            pool.close()
    log.finish(wall_s=time.monotonic() - started, load_average_after=_load_average())
    result = json.loads(Path(args.out).read_text(encoding="utf-8"))
    print()
    print(f"Local training throughput on {result['machine']['device_name']} "
          f"(batch {training['batch_size']}, {args.epochs} epoch(s), median of {args.repeats} rounds; "
          f"load average {result['load_average_before']} before, {result['load_average_after']} after)")
    print()
    print(result.get("table", "(no case finished)"))
    print(f"\nwrote {args.out}")
    if log.exit_status():
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
