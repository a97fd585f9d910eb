"""End-to-end overhead of the Flower simulation: the same client work run (a) through the app
on Flower's simulation engine (``fedmm.cli.run_job``, Ray backend) and (b) as a plain
sequential PyTorch loop in one process that reuses the app's own pieces.

    python bench/e2e_overhead.py                                  # the app's default config, 5 rounds
    python bench/e2e_overhead.py --client-cpus 1 2 --threads 2 1  # also the like-for-like shapes
    python bench/e2e_overhead.py --strategies fedavg --rounds 2 --num-clients 4 \\
        --clients-per-round 2 --local-epochs 1                    # a quick smoke run

Both sides do the same work for the same seed: the same initial model, partitions, sampled
clients (``rng([seed, round]).choice`` over the nodes ordered by partition id, as
``strategies.selection.SeededRosterSelector``), local training (``client_app.training.train`` with the
ClientApp's per-(seed, round, partition) shuffling generator), server arithmetic (FedAvg's
sample-weighted mean, ``recombine`` for FedMR, ``cross_aggregation`` for FedCross) and central
evaluation on the test split every round (round 0 included, as ``Strategy.start`` does).

Seconds per round exclude start-up: (seconds at the last round - seconds at round 1) / (rounds - 1),
from ``metrics.jsonl`` for (a) and from the same clock for (b). Start-up is reported apart:
(a) the wall time of ``run_job`` minus rounds x seconds-per-round (Ray start, actor pool, the
roster query, data loading in every worker, first-round warm-up, shutdown); (b) loading the
data, partitioning and building the model.

Parallelism. The simulation runs up to floor(cores / client_cpus) ClientApps at once, each
with ``client_cpus`` torch threads; the plain loop trains one client after the other with
``--threads`` torch threads. With the app default (client_cpus=1) against ``--threads <cores>``
both use every core, which is what a user of either gets; ``--client-cpus <cores>`` against
``--threads <cores>`` has the same execution shape on both sides (one client at a time, all
cores), so the ratio is the pure overhead of the simulation. The ratio column is always
relative to the first ``--threads`` value.

Every measurement runs in a fresh subprocess (nothing cached between them). Prints a table and
writes bench/results/e2e_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def num_cores() -> int:
    """Cores this process may use (what Ray detects on a plain Linux machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def compose_cfg(args: argparse.Namespace, strategy: str, client_cpus: float, output_dir: Path) -> dict[str, Any]:
    """The resolved run config of one measurement (the app's defaults plus the options)."""
    from fedmm import config as config_mod
    from fedmm.cli import register_schemas

    register_schemas()

    overrides = [f"strategy={strategy}", f"num_rounds={args.rounds}", f"seed={args.seed}",
                 f"output_dir={output_dir}", f"simulation.client_cpus={client_cpus}"]
    for key, value in (("num_clients", args.num_clients), ("clients_per_round", args.clients_per_round),
                       ("training.local_epochs", args.local_epochs), ("model", args.model)):
        if value is not None:
            overrides.append(f"{key}={value}")
    overrides += args.override
    cfg = config_mod.to_container(config_mod.compose(overrides))
    if cfg["eval_every"] != 1:
        raise SystemExit("e2e_overhead: eval_every must be 1 (seconds per round are read from every round)")
    return cfg


def per_round(seconds: dict[int, float], rounds: int) -> float | None:
    """(seconds at the last round - seconds at round 1) / (rounds - 1); None for one round."""
    if rounds < 2:
        return None
    return (seconds[rounds] - seconds[1]) / (rounds - 1)


# --------------------------------------------------------------------------- (a) Flower


class ServerTimers:
    """Wall time of the server-side steps of ``run_experiment``, by round.

    Filled by :func:`instrument_server`, which wraps (in the measuring process only, never in
    the files) the strategy's ``configure_train`` / ``aggregate_train``, the roster query, the
    grid's ``send_and_receive`` and the central evaluation. A round's steps are attributed to
    the round of the last ``configure_train`` (round 0: the initial evaluation).
    """

    STEPS = ("configure_train", "roster_query", "train_send_and_receive", "aggregate_train", "central_evaluate",
             "other_send_and_receive")

    def __init__(self) -> None:
        self.round = 0
        self.seconds: dict[str, dict[int, float]] = {step: {} for step in self.STEPS}
        self.client_train_s: dict[int, float] = {}  # sum of the clients' own ``train_time`` metric

    def add(self, step: str, seconds: float) -> None:
        table = self.seconds[step]
        table[self.round] = table.get(self.round, 0.0) + seconds

    def per_round(self, rounds: int, parallel: int) -> dict[str, float] | None:
        """Mean seconds per round over rounds 2..rounds of every step (configure without the roster query)."""
        if rounds < 2:
            return None
        span = range(2, rounds + 1)

        def mean(table: dict[int, float]) -> float:
            return sum(table.get(r, 0.0) for r in span) / len(span)

        out = {step: mean(self.seconds[step]) for step in self.STEPS}
        out["configure_train"] -= out.pop("roster_query")
        out["client_train_sum"] = mean(self.client_train_s)
        # what the transport and scheduling add on top of the clients' own training time
        out["send_and_receive_minus_client_train"] = out["train_send_and_receive"] - out["client_train_sum"] / max(parallel, 1)
        return out

    def as_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "client_train_s": self.client_train_s}


def instrument_server() -> ServerTimers:
    """Wrap the server-side steps of this process (see :class:`ServerTimers`)."""
    import functools

    from flwr.app import MessageType

    from server_app import runner as experiment
    from strategies.base import RoundLoopStrategy
    from strategies.selection import SeededRosterSelector

    timers = ServerTimers()

    def timed(step: str, fn: Any, sets_round: bool = False) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if sets_round:
                timers.round = int(args[1])  # (self, server_round, ...)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.add(step, time.perf_counter() - start)

        return wrapper

    cls = RoundLoopStrategy
    cls.configure_train = timed("configure_train", cls.configure_train, sets_round=True)
    cls.aggregate_train = timed("aggregate_train", cls.aggregate_train)
    SeededRosterSelector._query_keys = timed("roster_query", SeededRosterSelector._query_keys)
    experiment.evaluate_model = timed("central_evaluate", experiment.evaluate_model)
    send_and_receive = experiment.CountingGrid.send_and_receive

    def timed_send_and_receive(self: Any, messages: Any, *, timeout: float | None = None) -> Any:
        messages = list(messages)
        start = time.perf_counter()
        replies = send_and_receive(self, messages, timeout=timeout)
        is_train = any(m.metadata.message_type == MessageType.TRAIN for m in messages)
        timers.add("train_send_and_receive" if is_train else "other_send_and_receive", time.perf_counter() - start)
        if is_train:
            total = 0.0
            for reply in replies:
                if reply.has_content():
                    for record in reply.content.metric_records.values():
                        total += float(record.get("train_time", 0.0))
            timers.client_train_s[timers.round] = timers.client_train_s.get(timers.round, 0.0) + total
        return replies

    experiment.CountingGrid.send_and_receive = timed_send_and_receive
    return timers


def child_flower(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the app through ``run_job`` and read its metrics."""
    import flwr.simulation  # noqa: F401 - imported before the clock starts (as the app is)
    import torch  # noqa: F401

    import client_app.client_app  # noqa: F401
    from fedmm.cli import run_job
    from fedmm.results import read_metrics

    cfg = spec["cfg"]
    timers = instrument_server()
    start = time.perf_counter()
    run_dir = run_job(cfg)
    wall = time.perf_counter() - start
    rows = read_metrics(run_dir)
    seconds = {int(r["round"]): float(r["seconds"]) for r in rows}
    rounds = int(cfg["num_rounds"])
    pr = per_round(seconds, rounds)
    return {
        "run_dir": str(run_dir),
        "wall_s": wall,
        "seconds": seconds,
        "accuracy": {int(r["round"]): r["accuracy"] for r in rows},
        "per_round_s": pr,
        "startup_s": wall - rounds * pr,
        "first_round_s": seconds[1] - seconds.get(0, 0.0),
        "final_model": str(Path(run_dir) / "final_model.pt"),
        "breakdown_per_round_s": timers.per_round(rounds, int(spec["parallel"])),
        "roster_query_s": sum(timers.seconds["roster_query"].values()),
        "server_timers": timers.as_json(),
    }


# --------------------------------------------------------------------------- (b) plain loop


def _to_numpy(model: Any) -> dict[str, Any]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def _load(model: Any, state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    model.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in state.items()}, strict=True)


def fedavg_mean(models: list[dict[str, Any]], weights: list[float]) -> dict[str, Any]:
    """Flower's ``aggregate_arrayrecords`` arithmetic, then the app's cast back to each dtype."""
    import numpy as np

    total = sum(weights)
    out: dict[str, Any] = {}
    for model, w in zip(models, [w / total for w in weights]):
        for key, value in model.items():
            if key not in out:
                out[key] = value * w
            else:
                out[key] += value * w
    for key, first in models[0].items():
        if out[key].dtype != first.dtype:
            out[key] = np.rint(out[key]).astype(first.dtype) if np.issubdtype(first.dtype, np.integer) else out[key].astype(first.dtype)
    return out


class MultiModelUpdate:
    """``update_models`` of FedMR / FedCross written with the app's pure functions."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        import numpy as np

        self.s = cfg["strategy"]
        self.k = int(cfg["clients_per_round"])
        self.rng = np.random.default_rng([int(cfg["seed"]), 0x5EED])  # as MultiModelStrategy

    def __call__(self, server_round: int, models: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from strategies.aggregation import mean_models

        s, k = self.s, self.k
        first = int(s.get("first_stage_rounds", 0))
        if server_round <= first:
            return [mean_models(models)] * k
        if s["name"] == "fedmr":
            from strategies.recombination import recombine, segments_for_ratio

            return recombine(models, self.rng, s.get("granularity", "tensor"), segments_for_ratio(s.get("partition_ratio")))
        from strategies.cross_aggregation import (
            collaborative_models,
            cross_aggregate,
            dynamic_alpha,
            model_similarity,
            propellers,
        )

        prop = int(s.get("propeller_rounds", 0))
        if server_round <= first + prop:
            return cross_aggregate(models, propellers(k, int(s.get("num_propellers", 2))), float(s.get("propeller_alpha", 0.5)))
        selection = s.get("selection", "lowest-similarity")
        sim = None if selection == "in-order" else model_similarity(models, s.get("similarity", "model"))
        partners = collaborative_models(sim, selection, server_round, k)
        alpha = dynamic_alpha(server_round, float(s.get("alpha", 0.99)), int(s.get("dynamic_alpha_rounds", 0)), start_round=first + prop)
        return cross_aggregate(models, partners, alpha)


def child_plain(spec: dict[str, Any]) -> dict[str, Any]:
    """The same rounds as a plain sequential loop in this process."""
    import numpy as np
    import torch

    from client_app.local_update import build_local_update
    from client_app.training import train
    from fedmm.data import input_spec, load_dataset, load_partition, partition_indices
    from fedmm.evaluation import evaluate, resolve_device
    from fedmm.models import build_model
    from server_app.runner import seed_everything
    from strategies.aggregation import mean_models

    cfg = spec["cfg"]
    torch.set_num_threads(int(spec["threads"]))
    d, seed = cfg["dataset"], int(cfg["seed"])
    n, k, rounds = int(cfg["num_clients"]), int(cfg["clients_per_round"]), int(cfg["num_rounds"])
    name = cfg["strategy"]["name"]
    device = resolve_device(cfg["training"]["device"])

    setup_start = time.perf_counter()
    # Same order as run_experiment: seed, data, partitions, then the initial model.
    seed_everything(seed)
    train_data, test_data = load_dataset(d)
    partition_indices(train_data, cfg["partition"], n, seed)
    shape = input_spec(d)
    server_model = build_model(cfg["model"]["name"], shape)
    initial = _to_numpy(server_model)
    client_model = build_model(cfg["model"]["name"], shape)  # the ClientApp's cached model
    update = MultiModelUpdate(cfg) if name in ("fedmr", "fedcross") else None
    setup = time.perf_counter() - setup_start

    t0 = time.perf_counter()
    seconds: dict[int, float] = {}
    accuracy: dict[int, float] = {}
    parts = {"train_s": 0.0, "aggregate_s": 0.0, "evaluate_s": 0.0}

    def central_evaluate(server_round: int, state: dict[str, Any]) -> None:
        start = time.perf_counter()
        _load(server_model, state)
        accuracy[server_round] = evaluate(server_model, test_data, device)["accuracy"]
        seconds[server_round] = time.perf_counter() - t0
        if server_round >= 2:
            parts["evaluate_s"] += time.perf_counter() - start

    global_state = initial
    pool = [initial] * k
    central_evaluate(0, global_state)
    for server_round in range(1, rounds + 1):
        # SeededRosterSelector.select over the nodes ordered by "partition:%09d", i.e. by partition id.
        sampled = [int(i) for i in np.random.default_rng([seed, server_round]).choice(n, size=k, replace=False)]
        start = time.perf_counter()
        trained, weights = [], []
        for index, pid in enumerate(sampled):
            _load(client_model, global_state if update is None else pool[index])
            data = load_partition(d, cfg["partition"], pid, n, seed)
            generator = torch.Generator().manual_seed(hash((seed, server_round, pid)) % (2**63))
            metrics = train(client_model, data, build_local_update(cfg), cfg["training"], server_round, generator, device)
            trained.append(_to_numpy(client_model))
            weights.append(float(metrics["num-examples"]))
        mid = time.perf_counter()
        if update is None:
            global_state = fedavg_mean(trained, weights)
        else:
            global_state = mean_models(trained)
            pool = update(server_round, trained)
        end = time.perf_counter()
        if server_round >= 2:
            parts["train_s"] += mid - start
            parts["aggregate_s"] += end - mid
        central_evaluate(server_round, global_state)

    out_file = Path(spec["workdir"]) / "final_model.npz"
    np.savez(out_file, **global_state)
    pr = per_round(seconds, rounds)
    return {
        "setup_s": setup,
        "startup_s": setup,
        "wall_s": setup + seconds[rounds],
        "seconds": seconds,
        "accuracy": accuracy,
        "per_round_s": pr,
        "first_round_s": seconds[1] - seconds[0],
        "breakdown_per_round_s": {key: value / (rounds - 1) for key, value in parts.items()} if rounds >= 2 else None,
        "final_model": str(out_file),
    }


# --------------------------------------------------------------------------- driver


def run_child(kind: str, spec: dict[str, Any], workdir: Path, verbose: bool) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter; return its result dict."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, workdir=str(workdir), verbose=verbose)
    (workdir / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, str(workdir)]
    log_path = workdir / "log.txt"
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=None if verbose else log, stderr=subprocess.STDOUT if not verbose else None)
    if proc.returncode != 0:
        tail = "" if verbose else "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"e2e_overhead: {kind} measurement failed (exit {proc.returncode}); log: {log_path}\n{tail}")
    result = json.loads((workdir / "result.json").read_text())
    for key in ("seconds", "accuracy"):
        result[key] = {int(r): v for r, v in result[key].items()}
    return result


def max_weight_diff(path_a: str, path_b: str) -> float:
    """Largest absolute difference between two final global models (.pt state_dict or .npz)."""
    import numpy as np
    import torch

    def load(path: str) -> dict[str, np.ndarray]:
        if path.endswith(".pt"):
            return {k: v.numpy() for k, v in torch.load(path, map_location="cpu", weights_only=True).items()}
        with np.load(path) as z:
            return {k: z[k] for k in z.files}

    a, b = load(path_a), load(path_b)
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=["fedavg", "fedmr", "fedcross"],
                        help="strategy config options (conf/strategy/*.yaml)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (>= 2 to measure seconds per round)")
    parser.add_argument("--num-clients", type=int, default=None, help="N (default: the app's, 20)")
    parser.add_argument("--clients-per-round", type=int, default=None, help="K (default: the app's, 10)")
    parser.add_argument("--local-epochs", type=int, default=None, help="default: the app's, 2")
    parser.add_argument("--model", default=None, help="default: the app's, cnn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-cpus", nargs="+", type=float, default=[1.0],
                        help="simulation.client_cpus of the Flower runs, one run per value (app default 1)")
    parser.add_argument("--threads", nargs="+", type=int, default=[num_cores()],
                        help="torch threads of the plain loop, one run per value; the first is the ratio's reference "
                             f"(default: all {num_cores()} cores)")
    parser.add_argument("--override", nargs="*", default=[], help="further hydra overrides for both sides, e.g. partition.alpha=0.1")
    parser.add_argument("--workdir", default=None, help="where runs and logs go (default: a new temporary folder)")
    parser.add_argument("--verbose", action="store_true", help="show the children's output")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "e2e_overhead.json"))
    parser.add_argument("--child", nargs=2, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        kind, workdir = args.child
        spec = json.loads((Path(workdir) / "spec.json").read_text())
        result = (child_flower if kind == "flower" else child_plain)(spec)
        (Path(workdir) / "result.json").write_text(json.dumps(result))
        return

    if args.rounds < 2:
        parser.error("--rounds must be >= 2: seconds per round are measured from round 1 to the last round")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fedmm-e2e-")).resolve()
    cores = num_cores()
    print(f"e2e_overhead: {cores} cores, runs and logs in {workdir}", flush=True)
    rows: list[dict[str, Any]] = []
    header = (f"{'strategy':<10}{'runner':<22}{'parallel':>9}{'threads':>8}{'s/round':>9}{'ratio':>7}{'startup s':>11}"
              f"{'1st round s':>12}{'final acc':>10}{'Δacc':>9}{'max|Δw|':>10}")
    print(header, flush=True)
    for strategy in args.strategies:
        plain_rows: list[dict[str, Any]] = []
        for threads in args.threads:
            cfg = compose_cfg(args, strategy, args.client_cpus[0], workdir / strategy / f"plain-t{threads}")
            res = run_child("plain", {"cfg": cfg, "threads": threads}, workdir / strategy / f"plain-t{threads}", args.verbose)
            plain_rows.append(dict(res, strategy=strategy, runner="plain loop", parallel=1, threads=threads, client_cpus=None,
                                   num_clients=cfg["num_clients"], clients_per_round=cfg["clients_per_round"],
                                   local_epochs=cfg["training"]["local_epochs"], model=cfg["model"]["name"]))
        reference = plain_rows[0]
        flower_rows: list[dict[str, Any]] = []
        for client_cpus in args.client_cpus:
            tag = f"flower-c{client_cpus:g}"
            cfg = compose_cfg(args, strategy, client_cpus, workdir / strategy / tag / "run")
            parallel = max(1, int(cores // client_cpus))
            res = run_child("flower", {"cfg": cfg, "parallel": parallel}, workdir / strategy / tag, args.verbose)
            threads = max(1, int(client_cpus))
            # Compare with the plain loop of the same per-client thread count when there is one:
            # then only FedAvg's reply order (Flower aggregates in arrival order) can differ.
            match = next((p for p in plain_rows if p["threads"] == threads), reference)
            flower_rows.append(dict(res, strategy=strategy, runner=f"flower client_cpus={client_cpus:g}",
                                    parallel=parallel, threads=threads, client_cpus=client_cpus,
                                    compared_with_threads=match["threads"],
                                    delta_accuracy=res["accuracy"][args.rounds] - match["accuracy"][args.rounds],
                                    max_weight_diff=max_weight_diff(res["final_model"], match["final_model"])))
        for p in plain_rows[1:]:
            p["compared_with_threads"] = reference["threads"]
            p["delta_accuracy"] = p["accuracy"][args.rounds] - reference["accuracy"][args.rounds]
            p["max_weight_diff"] = max_weight_diff(p["final_model"], reference["final_model"])
        for row in flower_rows + plain_rows:
            row["final_accuracy"] = row["accuracy"][args.rounds]
            row["ratio"] = row["per_round_s"] / reference["per_round_s"]
            delta = f"{row['delta_accuracy']:+.4f}" if "delta_accuracy" in row else "ref"
            diff = f"{row['max_weight_diff']:.1e}" if "max_weight_diff" in row else "ref"
            print(f"{strategy:<10}{row['runner']:<22}{row['parallel']:>9}{row['threads']:>8}{row['per_round_s']:>9.3f}"
                  f"{row['ratio']:>7.2f}{row['startup_s']:>11.2f}{row['first_round_s']:>12.2f}{row['final_accuracy']:>10.4f}"
                  f"{delta:>9}{diff:>10}", flush=True)
            rows.append(row)
        for row in flower_rows:
            b = row.get("breakdown_per_round_s")
            if b:
                print(f"{'':<10}{row['runner']} per round: configure {b['configure_train']:.3f}s, send_and_receive "
                      f"{b['train_send_and_receive']:.3f}s (clients' own training {b['client_train_sum']:.3f}s summed, "
                      f"/{row['parallel']} parallel), aggregate {b['aggregate_train']:.3f}s, evaluate "
                      f"{b['central_evaluate']:.3f}s; roster query (round 1) {row['roster_query_s']:.3f}s", flush=True)
        b = reference.get("breakdown_per_round_s")
        if b:
            print(f"{'':<10}plain loop threads={reference['threads']} per round: train {b['train_s']:.3f}s, "
                  f"aggregate {b['aggregate_s']:.3f}s, evaluate {b['evaluate_s']:.3f}s", flush=True)
    print("ratio: seconds per round / those of the plain loop with the first --threads value; Δacc and max|Δw|: final "
          "accuracy and largest weight difference of the final global model against the plain loop with the same "
          "per-client threads (else the first).")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "processor": platform.processor(), "cpus": cores,
               "python": platform.python_version()}
    out.write_text(json.dumps({"machine": machine, "argv": sys.argv[1:], "workdir": str(workdir), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
