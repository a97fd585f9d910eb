"""End-to-end overhead of the Flower simulation: the same client work run (a) through the app
on Flower's simulation engine (``launch.cli.run_job``, Ray backend) and (b) as a plain
sequential PyTorch loop in one process that reuses the app's own pieces.

    python bench/e2e_overhead.py                                  # the app's default config, 5 rounds
    python bench/e2e_overhead.py --client-cpus 1 2 --threads 2 1  # also the like-for-like shapes
    python bench/e2e_overhead.py --strategies fedavg --rounds 2 --num-clients 4 \\
        --clients-per-round 2 --local-epochs 1                    # a quick smoke run

Both sides do the same work for the same seed: the same initial model, partitions, sampled
clients (``rng([seed, round]).choice`` over the nodes ordered by partition id, as
``strategies.selection.SeededRosterSelector``), local training (``client_app.training.train`` with the
ClientApp's per-(seed, round, partition) shuffling generator), the server step (the ``aggregate``
of the app's own FedAvg, FedMR or FedCross, on the same updates) and central
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

Every measurement runs in a fresh subprocess (nothing cached between them); with ``--repeats`` a
strategy's runners take turns (plain, app, plain, app, ...), and the whole-process table divides
each app run by the plain loop's run beside it (the median and range of these ratios hold when
the machine's speed drifts during the bench). The app's runs end their process as ``fedmm`` does
(``launch.cli.end_of_process``). Prints a table and writes bench/results/e2e_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import CaseLog  # noqa: E402 - bench/cases.py

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fedmm.observers import RunObserver  # noqa: E402

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# --------------------------------------------------------------------------- whole-process phases
#: Wall-clock instants (time.time()) of the phases of a child process, by name; the parent adds
#: the instant it spawned the child and the instant the child exited.
MARKS: dict[str, float] = {}


def mark(name: str) -> None:
    """Record the first time ``name`` happens in this process."""
    MARKS.setdefault(name, time.time())


def install_phase_marks(ray_engine: bool = True) -> None:
    """Mark Ray's start (``ray_engine``) and Flower's own strategies' start and end in this
    (child) process, by wrapping those (Ray's and Flower's) functions; this app's run is marked by
    :class:`PhaseMarks`, an observer of the run."""
    import functools

    ray = None
    if ray_engine:
        try:
            import ray
        except ImportError:
            pass

    def around(owner: Any, name: str, before: str, after: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            mark(before)
            try:
                return fn(*args, **kwargs)
            finally:
                mark(after)

        setattr(owner, name, wrapper)

    if ray is not None:
        around(ray, "init", "ray_init_start", "ray_init_end")
    from flwr.serverapp.strategy import Strategy

    around(Strategy, "start", "strategy_start", "strategy_end")  # Flower's own FedAvg (the anchor)


class PhaseMarks(RunObserver):
    """The marks of this app's run (:func:`phases`): its ServerApp's main, the strategy's start
    and end, every round's training end (its aggregation done, before its evaluation)."""

    def on_run_start(self, info: Any) -> None:
        mark("server_main")

    def on_strategy_start(self, strategy: Any) -> None:
        mark("strategy_start")

    def on_phase(self, server_round: int, phase: str, seconds: float) -> None:
        if phase == "aggregate":
            mark(f"round_{server_round}_end")

    def on_strategy_end(self) -> None:
        mark("strategy_end")


def phases(marks: dict[str, float], rounds: int) -> dict[str, float]:
    """Seconds of each phase of a whole process from its marks (``spawn`` and ``exit`` included).

    Consecutive segments that add up to ``process``: ``imports`` (python and the imports),
    ``to_server_main`` (until the ServerApp's main runs: the fedmm job starts Ray first, Flower's
    ``run_simulation`` starts the ServerApp while its backend starts Ray), ``server_setup`` (data,
    partition, model, strategy), ``round_1`` (the initial evaluation, the roster query, the
    actors' start and data loading, the first round), ``rounds_2_to_last``,
    ``after_last_round`` (final files, Ray's shutdown, exit). Besides: ``ray_init`` (the
    ``ray.init`` call, inside one of the segments) and ``startup`` (everything before round 2
    minus one steady round)."""
    m = dict(marks)
    main = m.get("server_main", m["imports"])
    out: dict[str, float] = {
        "process": m["exit"] - m["spawn"],
        "imports": m["imports"] - m["spawn"],
        "to_server_main": main - m["imports"],
        "server_setup": m["strategy_start"] - main,
        "round_1": m["round_1_end"] - m["strategy_start"],
        "rounds_2_to_last": m[f"round_{rounds}_end"] - m["round_1_end"],
        "after_last_round": m["exit"] - m[f"round_{rounds}_end"],
    }
    if "ray_init_start" in m:
        out["ray_init"] = m["ray_init_end"] - m["ray_init_start"]
    steady = out["rounds_2_to_last"] / max(rounds - 1, 1)
    out["startup"] = m["round_1_end"] - m["spawn"] - steady
    return out


def num_cores() -> int:
    """Cores this process may use (what Ray detects on a plain Linux machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def compose_cfg(args: argparse.Namespace, strategy: str, client_cpus: float | None, output_dir: Path,
                engine: str = "ray", vectorize: str = "off") -> dict[str, Any]:
    """The resolved run config of one measurement (the app's defaults plus the options) on
    ``engine`` (``client_cpus``: the Ray engine's ``simulation.client_cpus``; ``vectorize``: the
    in-process engine's ``simulation.vectorize``)."""
    from fedmm import config as config_mod

    overrides = [f"strategy={strategy}", f"num_rounds={args.rounds}", f"seed={args.seed}",
                 f"output_dir={output_dir}", f"simulation.engine={engine}"]
    if engine == "ray":
        overrides.append(f"simulation.client_cpus={client_cpus}")
    else:
        overrides.append(f"simulation.vectorize={vectorize}")
    for key, value in (("num_clients", args.num_clients), ("clients_per_round", args.clients_per_round),
                       ("training.local_epochs", args.local_epochs), ("model", args.model)):
        if value is not None:
            overrides.append(f"{key}={value}")
    overrides += args.override
    cfg = config_mod.to_container(config_mod.compose(overrides))
    if cfg["eval_every"] != 1:
        raise SystemExit("e2e_overhead: eval_every must be 1 (seconds per round are read from every round)")
    return cfg


#: Methods whose own server step (their strategy's ``aggregate``) the plain loop runs (others get FedAvg's, see ``main``).
PLAIN_SERVER_STEPS = ("fedavg", "fedmr", "fedcross")

#: Benchmark shapes: the app's default config, and the seed papers' experiments (FedMR / FedCross:
#: 100 clients, 10 per round, Dirichlet 0.1, 5 local epochs, batch 50, the cnn; on mnist5k that is
#: 40 training images per client on average, 1 to 172, so a handful of SGD steps per client; the
#: papers' minimum partition size cannot be met by any Dirichlet(0.1) draw over 4,000 images).
WORKLOADS: dict[str, dict[str, Any]] = {
    "default": {"args": {"rounds": 5}, "override": []},
    "papers": {
        "args": {"rounds": 10, "num_clients": 100, "clients_per_round": 10, "local_epochs": 5, "model": "cnn"},
        "override": ["partition=dirichlet", "partition.alpha=0.1", "partition.min_partition_size=1",
                     "training.batch_size=50"],
    },
}


def per_round(seconds: dict[int, float], rounds: int) -> float | None:
    """(seconds at the last round - seconds at round 1) / (rounds - 1); None for one round."""
    if rounds < 2:
        return None
    return (seconds[rounds] - seconds[1]) / (rounds - 1)


# --------------------------------------------------------------------------- (a) Flower


class ServerTimers(RunObserver):
    """Wall time of the server's phases of each round, an observer of the run (the phases the
    strategy reports, :mod:`fedmm.observers`): ``select`` (the selector, with the roster query in
    round 1), ``configure`` (the train messages), ``exchange`` (their send and the replies, each
    decoded as it arrives), ``aggregate`` (the round's end), ``evaluate`` (the central evaluation),
    ``evaluate_exchange`` (federated evaluation); and the clients' own ``train_time``, summed
    over the updates aggregated."""

    STEPS = ("select", "configure", "exchange", "aggregate", "evaluate", "evaluate_exchange")

    def __init__(self) -> None:
        self.seconds: dict[str, dict[int, float]] = {step: {} for step in self.STEPS}
        self.client_train_s: dict[int, float] = {}  # sum of the clients' own ``train_time`` metric

    def on_phase(self, server_round: int, phase: str, seconds: float) -> None:
        table = self.seconds.setdefault(phase, {})
        table[server_round] = table.get(server_round, 0.0) + seconds

    def on_aggregate(self, server_round: int, updates: Any) -> None:
        total = sum(float(u.metrics.get("train_time", 0.0)) for u in updates)
        self.client_train_s[server_round] = self.client_train_s.get(server_round, 0.0) + total

    def per_round(self, rounds: int, parallel: int) -> dict[str, float] | None:
        """Mean seconds per round over rounds 2..rounds of every phase."""
        if rounds < 2:
            return None
        span = range(2, rounds + 1)

        def mean(table: dict[int, float]) -> float:
            return sum(table.get(r, 0.0) for r in span) / len(span)

        out = {step: mean(self.seconds.get(step, {})) for step in self.STEPS}
        out["client_train_sum"] = mean(self.client_train_s)
        # what the transport and scheduling add on top of the clients' own training time
        out["exchange_minus_client_train"] = out["exchange"] - out["client_train_sum"] / max(parallel, 1)
        return out

    def as_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "client_train_s": self.client_train_s}


def child_flower(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the app through ``run_job`` (on the engine its config names) and read its metrics."""
    ray_engine = spec["cfg"]["simulation"]["engine"] == "ray"
    if ray_engine:
        import flwr.simulation  # noqa: F401 - imported before the clock starts (as the app is)
    import torch  # noqa: F401

    import client_app.client_app  # noqa: F401
    from launch.cli import run_job
    from fedmm.results import read_metrics

    mark("imports")
    install_phase_marks(ray_engine)
    cfg = spec["cfg"]
    timers = ServerTimers()
    start = time.perf_counter()
    run_dir = run_job(cfg, observers=[PhaseMarks(), timers])
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
        "select_round_1_s": timers.seconds["select"].get(1, 0.0),
        "server_timers": timers.as_json(),
    }


# --------------------------------------------------------------------------- (b) plain loop


def _to_numpy(model: Any) -> dict[str, Any]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def _load(model: Any, state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    model.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in state.items()}, strict=True)


def child_plain(spec: dict[str, Any]) -> dict[str, Any]:
    """The same rounds as a plain sequential loop in this process."""
    import numpy as np
    import torch

    from flwr.app import RecordDict

    from objectives.base import build_local_update
    from client_app.training import train
    from client_content import content_for  # bench/client_content.py
    from fedmm.data import input_spec, load_dataset, load_partition, partition_indices
    from fedmm.evaluation import evaluate, resolve_device
    from fedmm.models import model_for
    from fedmm.protocol import ClientUpdate
    from server_app.runner import seed_everything
    from strategies import FedAvg, build_strategy
    from strategies.aggregators import Mean
    from strategies.contract import model_index

    mark("imports")
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
    server_model = model_for(cfg, shape)
    initial = _to_numpy(server_model)
    client_model = model_for(cfg, shape)  # the ClientApp's cached model
    # what a client keeps (MOON's previous model, SCAFFOLD's c_i) and what its message carries
    # (SCAFFOLD's c, FedGen's generator), so that stateful objectives do their full work
    states = {pid: RecordDict() for pid in range(n)}
    content = content_for(cfg, client_model)
    # the server step is the app's own strategy's (FedAvg's for a method the loop does not run)
    strategy = build_strategy(cfg) if name in PLAIN_SERVER_STEPS else FedAvg(k, seed)
    strategy.initialize(initial)
    setup = time.perf_counter() - setup_start
    mark("strategy_start")

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
    central_evaluate(0, global_state)
    for server_round in range(1, rounds + 1):
        # SeededRosterSelector.select over the nodes ordered by "partition:%09d", i.e. by partition id.
        sampled = [int(i) for i in np.random.default_rng([seed, server_round]).choice(n, size=k, replace=False)]
        start = time.perf_counter()
        trained = []
        for index, pid in enumerate(sampled):
            _load(client_model, strategy.models[model_index(strategy, index)])
            data = load_partition(d, cfg["partition"], pid, n, seed)
            generator = torch.Generator().manual_seed(hash((seed, server_round, pid)) % (2**63))
            local = build_local_update(cfg, states[pid], content)
            local.node = pid
            metrics = train(client_model, data, local, local.run.training, server_round, generator, device)
            local.end(client_model)
            trained.append(ClientUpdate(pid, index, _to_numpy(client_model), float(metrics["num-examples"]), dict(metrics),
                                        sent=strategy.models[model_index(strategy, index)]))
        mid = time.perf_counter()
        global_state = strategy.aggregate(server_round, trained, Mean())  # the method's own step, its plain mean
        end = time.perf_counter()
        if server_round >= 2:
            parts["train_s"] += mid - start
            parts["aggregate_s"] += end - mid
        central_evaluate(server_round, global_state)
        mark(f"round_{server_round}_end")

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


# --------------------------------------------------------------------------- (c) Flower as is


def anchor_client_app() -> Any:
    """The ClientApp a user would write around Flower's built-in ``FedAvg``: Flower's PyTorch
    quickstart shape (a fresh model per message, ``to_torch_state_dict`` in, ``ArrayRecord`` of
    the ``state_dict`` out, a ``DataLoader`` over the node's partition) doing the app's local
    training: SGD with the configured lr / momentum / weight decay, ``local_epochs`` over shuffled
    batches of ``batch_size``, cross-entropy. The partition comes from the app's loader, cached per
    worker as the quickstart caches its ``FederatedDataset``, so all three runners train on the
    same rows.
    """
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from torch.utils.data import DataLoader, TensorDataset

    cache: dict[int, Any] = {}
    app = ClientApp()

    def partition(cfg: dict[str, Any], pid: int, num: int) -> Any:
        if pid not in cache:
            from fedmm.data import load_partition

            data = load_partition(cfg["dataset"], cfg["partition"], pid, num, int(cfg["seed"]))
            x = data.transform.prepare("cpu")(data.x) if hasattr(data.transform, "prepare") else data.x
            cache[pid] = TensorDataset(x, data.y)
        return cache[pid]

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        from fedmm.data import input_spec
        from fedmm.models import build_model

        cfg = json.loads(str(msg.content["config"]["run-config"]))
        t = cfg["training"]
        pid, num = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
        dataset = partition(cfg, pid, num)
        model = build_model(cfg["model"]["name"], input_spec(cfg["dataset"]))
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        generator = torch.Generator().manual_seed(hash((int(cfg["seed"]), int(msg.content["config"]["server-round"]), pid)) % (2**63))
        loader = DataLoader(dataset, batch_size=int(t["batch_size"]), shuffle=True, generator=generator)
        optimizer = torch.optim.SGD(model.parameters(), lr=float(t["lr"]), momentum=float(t["momentum"]),
                                    weight_decay=float(t["weight_decay"]))
        start = time.perf_counter()
        model.train()
        for _ in range(int(t["local_epochs"])):
            for x, y in loader:
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
        train_time = time.perf_counter() - start  # for the bench's breakdown only
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord({"num-examples": len(dataset), "train_time": train_time})})
        return Message(content=content, reply_to=msg)

    return app


def child_anchor(spec: dict[str, Any]) -> dict[str, Any]:
    """Flower's built-in ``FedAvg`` (``flwr.serverapp.strategy.FedAvg``) with the ClientApp of
    :func:`anchor_client_app`, on the same simulation engine and resources as the app.

    Two benchmark-only changes keep the work identical to the other runners: the draw of
    Flower's ``sample_nodes`` is replaced by the app's seeded selection of the same partitions
    (the node-to-partition map is read where the simulation registers its nodes; no message is
    added), and the central evaluation is the app's, every round.
    """
    import warnings

    import flwr.simulation  # noqa: F401 - imported before the clock starts
    import numpy as np
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.serverapp.strategy import fedavg as fedavg_module
    from flwr.simulation import run_simulation

    from launch.cli import backend_config
    from fedmm.data import input_spec, load_dataset, partition_indices
    from fedmm.evaluation import evaluate, resolve_device
    from fedmm.models import build_model
    from server_app.runner import seed_everything

    mark("imports")
    install_phase_marks()
    cfg = spec["cfg"]
    seed, n, k, rounds = int(cfg["seed"]), int(cfg["num_clients"]), int(cfg["clients_per_round"]), int(cfg["num_rounds"])
    node_to_partition: dict[int, int] = {}
    register = vce_api._register_nodes

    def capture(*args: Any, **kwargs: Any) -> Any:
        mapping = register(*args, **kwargs)
        node_to_partition.update(mapping)
        return mapping

    vce_api._register_nodes = capture
    current = {"round": 0}

    def same_clients(grid: Any, min_available_nodes: int, sample_size: int) -> tuple[list[int], list[int]]:
        all_nodes = list(grid.get_node_ids())
        while len(all_nodes) < max(min_available_nodes, sample_size):
            time.sleep(0.1)
            all_nodes = list(grid.get_node_ids())
        by_partition = {p: node for node, p in node_to_partition.items()}
        picked = np.random.default_rng([seed, current["round"]]).choice(n, size=sample_size, replace=False)
        return [by_partition[int(p)] for p in picked], all_nodes

    fedavg_module.sample_nodes = same_clients
    seconds: dict[int, float] = {}
    accuracy: dict[int, float] = {}
    clock: dict[str, float] = {}
    client_train: dict[int, float] = {}
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        mark("server_main")
        seed_everything(seed)
        train_data, test_data = load_dataset(cfg["dataset"])
        partition_indices(train_data, cfg["partition"], n, seed)
        model = build_model(cfg["model"]["name"], input_spec(cfg["dataset"]))
        device = resolve_device(cfg["training"]["device"])

        def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(arrays.to_torch_state_dict())
            accuracy[server_round] = evaluate(model, test_data, device)["accuracy"]
            if server_round == 0:
                clock["t0"] = time.perf_counter()
            seconds[server_round] = time.perf_counter() - clock["t0"]
            if server_round > 0:
                mark(f"round_{server_round}_end")
            current["round"] = server_round + 1
            return MetricRecord({"accuracy": accuracy[server_round]})

        def train_metrics(records: list[Any], weighting_key: str) -> MetricRecord:
            total = sum(float(r["metrics"]["train_time"]) for r in records)
            client_train[current["round"]] = total
            return MetricRecord({"train_time_sum": total})

        strategy = FedAvg(fraction_train=k / n, fraction_evaluate=0.0, min_train_nodes=k, min_available_nodes=n,
                          train_metrics_aggr_fn=train_metrics)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds,
                                train_config=ConfigRecord({"run-config": json.dumps(cfg)}), evaluate_fn=central)
        final = result.arrays.to_torch_state_dict()
        torch.save(final, Path(spec["workdir"]) / "final_model.pt")

    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        run_simulation(server_app=server_app, client_app=anchor_client_app(), num_supernodes=n,
                       backend_config=backend_config(cfg))
    wall = time.perf_counter() - start
    if rounds not in seconds:
        raise RuntimeError("the Flower FedAvg run did not finish its rounds (see the log above)")
    pr = per_round(seconds, rounds)
    span = range(2, rounds + 1)
    return {
        "wall_s": wall,
        "seconds": seconds,
        "accuracy": accuracy,
        "per_round_s": pr,
        "startup_s": wall - rounds * pr,
        "first_round_s": seconds[1] - seconds[0],
        "final_model": str(Path(spec["workdir"]) / "final_model.pt"),
        "client_train_sum_per_round_s": sum(client_train.get(r, 0.0) for r in span) / len(span),
    }


# --------------------------------------------------------------------------- driver


def run_child(kind: str, spec: dict[str, Any], workdir: Path, verbose: bool, repeats: int = 1) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter (``repeats`` times, each in its own fresh
    interpreter and folder); return the first run's result dict with every run's whole-process
    phases and their medians (``phases_median``)."""
    return run_children([(kind, spec, workdir)], verbose, repeats)[0]


def run_children(jobs: list[tuple[str, dict[str, Any], Path]], verbose: bool, repeats: int = 1,
                 log: CaseLog | None = None, cases: list[dict[str, Any]] | None = None) -> list[dict[str, Any] | None]:
    """Run each ``(kind, spec, workdir)`` measurement ``repeats`` times, interleaved: the first run
    of every job, then the second of every job, and so on, so that a drift of the machine's speed
    during the bench falls on every runner alike and run i of one job can be paired with run i of
    another (:func:`paired_ratio`). Return one result per job, as :func:`run_child` does.

    With ``log`` (``cases[i]``: job i's case key), every run is written to the log's file as it
    ends (the header's ``runs``), and a run that fails is recorded as the case's error: that job's
    result is None and the other jobs go on (without ``log`` the failure raises)."""
    import statistics
    import traceback

    runs: list[list[dict[str, Any]]] = [[] for _ in jobs]
    failed = [False] * len(jobs)
    for index in range(repeats):
        for position, (kind, spec, workdir) in enumerate(jobs):
            if failed[position]:
                continue
            sub = workdir if index == 0 else workdir / f"repeat{index}"
            one = dict(spec)
            if index and "cfg" in one and one["cfg"].get("output_dir"):
                one["cfg"] = dict(one["cfg"], output_dir=str(sub / "run"))
            start = time.monotonic()
            try:
                result = _run_child_once(kind, one, sub, verbose)
                if log is not None:
                    log.checkpoint()
            except Exception:  # noqa: BLE001 - with a log: this job's failure, recorded
                if log is None:
                    raise
                failed[position] = True
                log.failed(dict(cases[position], repeat=index), traceback.format_exc(), time.monotonic() - start)
                continue
            runs[position].append(result)
            if log is not None:
                rounds = int(spec["cfg"]["num_rounds"])
                log.header.setdefault("runs", []).append(
                    dict(cases[position], repeat=index, seconds_s=round(time.monotonic() - start, 2),
                         per_round_s=result.get("per_round_s"), accuracy=result.get("accuracy"),
                         phases=phases(result["marks"], rounds)))
                log.save()
    results: list[dict[str, Any] | None] = []
    for (_, spec, _), job_runs, bad in zip(jobs, runs, failed):
        if bad:
            results.append(None)
            continue
        result = job_runs[0]
        rounds = int(spec["cfg"]["num_rounds"])
        result["phases_runs"] = [phases(r["marks"], rounds) for r in job_runs]
        result["phases_median"] = {key: statistics.median(p[key] for p in result["phases_runs"])
                                   for key in result["phases_runs"][0]}
        results.append(result)
    return results


def paired_ratio(row: dict[str, Any], reference: dict[str, Any], key: str = "process") -> dict[str, float] | None:
    """Run i of ``row`` over run i of ``reference`` (interleaved runs, :func:`run_children`):
    the median, least and largest of these ratios; None without two runs of each."""
    import statistics

    mine, theirs = row.get("phases_runs") or [], reference.get("phases_runs") or []
    if min(len(mine), len(theirs)) < 2:
        return None
    ratios = [a[key] / b[key] for a, b in zip(mine, theirs)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "pairs": len(ratios)}


def _run_child_once(kind: str, spec: dict[str, Any], workdir: Path, verbose: bool) -> dict[str, Any]:
    shutil.rmtree(workdir, ignore_errors=True)  # an earlier attempt's run there (--resume, same --workdir) is not this one
    workdir.mkdir(parents=True)
    spec = dict(spec, workdir=str(workdir), verbose=verbose)
    (workdir / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, str(workdir)]
    log_path = workdir / "log.txt"
    spawn = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=None if verbose else log, stderr=subprocess.STDOUT if not verbose else None)
    exited = time.time()
    if proc.returncode != 0:
        tail = "" if verbose else "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"e2e_overhead: {kind} measurement failed (exit {proc.returncode}); log: {log_path}\n{tail}")
    result = json.loads((workdir / "result.json").read_text())
    for key in ("seconds", "accuracy"):
        result[key] = {int(r): v for r, v in result[key].items()}
    result["marks"] = {**result.get("marks", {}), "spawn": spawn, "exit": exited}
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
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="default",
                        help="default: the app's default config; papers: the seed papers' shape (100 clients, 10 per "
                             "round, Dir(0.1), 5 local epochs, batch 50, cnn); the options below override it")
    parser.add_argument("--strategies", nargs="+", default=["fedavg", "fedmr", "fedcross"],
                        help="any strategy option (declared, or a preset of conf/strategy/)")
    parser.add_argument("--runners", nargs="+", choices=["plain", "local", "vectorized", "flower", "anchor"],
                        default=["plain", "local", "flower", "anchor"],
                        help="plain: the sequential loop; local: this app on the in-process engine, one client at a time "
                             "(simulation.vectorize=off); vectorized: the same, each round's clients as one computation "
                             "(simulation.vectorize=on); flower: this app on "
                             "Flower's simulation engine (Ray); anchor: Flower's built-in FedAvg with a minimal ClientApp "
                             "doing the same training on Flower's simulation engine (run once)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (>= 2; default: the workload's)")
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
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each measurement, each a fresh process, a strategy's runners taking turns (A B A B ...); "
                             "the whole-process table gives medians and run-by-run ratios to the plain loop")
    parser.add_argument("--out", default=None,
                        help="default: bench/results/e2e_overhead.json (default workload), e2e_overhead_<workload>.json")
    parser.add_argument("--resume", action="store_true",
                        help="keep the strategies whose every runner is already in --out, run the others (each "
                             "measurement's folder under --workdir cleared before it runs)")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        kind, workdir = args.child
        spec = json.loads((Path(workdir) / "spec.json").read_text())
        result = {"flower": child_flower, "plain": child_plain, "anchor": child_anchor}[kind](spec)
        result["marks"] = dict(MARKS)
        (Path(workdir) / "result.json").write_text(json.dumps(result))
        if kind == "flower":  # the app's runs end as `fedmm` ends its process
            from launch.cli import end_of_process

            end_of_process()
        return

    workload = WORKLOADS[args.workload]
    for key, value in workload["args"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.override = list(workload["override"]) + args.override
    if args.rounds < 2:
        parser.error("--rounds must be >= 2: seconds per round are measured from round 1 to the last round")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fedmm-e2e-")).resolve()
    cores = num_cores()
    print(f"e2e_overhead: {cores} cores, runs and logs in {workdir}", flush=True)
    name = "e2e_overhead.json" if args.workload == "default" else f"e2e_overhead_{args.workload}.json"
    out = Path(args.out or Path(__file__).parent / "results" / name)
    machine = {"platform": platform.platform(), "processor": platform.processor(), "cpus": cores,
               "python": platform.python_version()}
    # Written as each run ends (the header's ``runs``) and as each strategy's rows are complete
    log = CaseLog(out, {"machine": machine, "argv": sys.argv[1:], "workload": args.workload, "workdir": str(workdir)},
                  key=("strategy", "runner"), resume=args.resume)
    log.header["runs"] = list(log.earlier.get("runs", []))
    rows: list[dict[str, Any]] = log.rows
    header = (f"{'strategy':<10}{'runner':<36}{'parallel':>9}{'threads':>8}{'s/round':>9}{'vs plain':>9}{'vs Flower':>10}"
              f"{'startup s':>11}{'1st round s':>12}{'final acc':>10}{'Δacc':>9}{'max|Δw|':>10}")
    anchor: dict[str, Any] | None = None
    if "anchor" in args.runners:
        # Flower's own FedAvg: the same per-client work whatever the app's strategy, so run once.
        cfg = compose_cfg(args, "fedavg", args.client_cpus[0], workdir / "anchor" / "run")
        parallel = max(1, int(cores // args.client_cpus[0]))
        anchor = run_child("anchor", {"cfg": cfg, "parallel": parallel}, workdir / "anchor", args.verbose, args.repeats)
        anchor.update(strategy="fedavg", runner=f"Flower FedAvg as is, client_cpus={args.client_cpus[0]:g}",
                      parallel=parallel, threads=max(1, int(args.client_cpus[0])), client_cpus=args.client_cpus[0],
                      num_clients=cfg["num_clients"], clients_per_round=cfg["clients_per_round"],
                      local_epochs=cfg["training"]["local_epochs"], model=cfg["model"]["name"])
    print(header, flush=True)

    def show(strategy: str, row: dict[str, Any]) -> None:
        def fmt(key: str, spec: str, width: int) -> str:
            return f"{format(row[key], spec) if row.get(key) is not None else '—':>{width}}"

        # another method's server step, or no plain loop with this one: nothing to compare
        other = (row["runner"].startswith("Flower FedAvg") and strategy != "fedavg") or (
            row["runner"].startswith("this app") and "delta_accuracy" not in row)
        delta = f"{row['delta_accuracy']:+.4f}" if "delta_accuracy" in row else "—" if other else "ref"
        diff = f"{row['max_weight_diff']:.1e}" if "max_weight_diff" in row else "—" if other else "ref"
        print(f"{strategy:<10}{row['runner']:<36}{row['parallel']:>9}{row['threads']:>8}{row['per_round_s']:>9.3f}"
              f"{fmt('ratio', '.2f', 9)}{fmt('vs_anchor', '.2f', 10)}{row['startup_s']:>11.2f}{row['first_round_s']:>12.2f}"
              f"{row['final_accuracy']:>10.4f}{delta:>9}{diff:>10}", flush=True)

    for strategy in args.strategies:
        # Every runner of this strategy, run interleaved (run_children): plain loops, in process, on Ray.
        jobs: list[tuple[str, dict[str, Any], Path]] = []
        plain_cfgs, local_cfgs, flower_cfgs = [], [], []
        for threads in args.threads if "plain" in args.runners else []:
            cfg = compose_cfg(args, strategy, args.client_cpus[0], workdir / strategy / f"plain-t{threads}")
            plain_cfgs.append((threads, cfg))
            jobs.append(("plain", {"cfg": cfg, "threads": threads}, workdir / strategy / f"plain-t{threads}"))
        for runner, vectorize, label in (("local", "off", "this app, in-process"),
                                         ("vectorized", "on", "this app, in-process, vectorized")):
            if runner in args.runners:
                cfg = compose_cfg(args, strategy, None, workdir / strategy / runner / "run", engine="local", vectorize=vectorize)
                local_cfgs.append((label, cfg))
                jobs.append(("flower", {"cfg": cfg, "parallel": 1}, workdir / strategy / runner))
        for client_cpus in args.client_cpus if "flower" in args.runners else []:
            tag = f"flower-c{client_cpus:g}"
            cfg = compose_cfg(args, strategy, client_cpus, workdir / strategy / tag / "run")
            parallel = max(1, int(cores // client_cpus))
            flower_cfgs.append((client_cpus, parallel, cfg))
            jobs.append(("flower", {"cfg": cfg, "parallel": parallel}, workdir / strategy / tag))
        expected = len(jobs) + (anchor is not None)
        if len(log.rows_where(strategy=strategy)) >= expected:
            print(f"{strategy}: every runner kept from the earlier run (--resume)", flush=True)
            continue
        # a partial strategy runs again: its rows and the runs of its cut-off attempt go
        log.rows[:] = [row for row in log.rows if row["strategy"] != strategy]
        log.header["runs"] = [run for run in log.header["runs"] if run["strategy"] != strategy]
        case_keys = [{"strategy": strategy, "runner": kind if kind != "flower" else Path(workdir).name}
                     for kind, _, workdir in jobs]
        results = iter(run_children(jobs, args.verbose, args.repeats, log=log, cases=case_keys))

        plain_rows: list[dict[str, Any]] = []
        for threads, cfg in plain_cfgs:
            res = next(results)
            if res is None:  # failed: recorded in the log's errors
                continue
            # The plain loop has the server step of FedAvg, FedMR and FedCross; for any other method
            # it does the same client work with FedAvg's server step (so no accuracy comparison).
            # Likewise it samples clients uniformly: a run with another selector (CluSamp) is compared
            # on the same amount of client work.
            runner = "plain loop" if cfg["strategy"]["name"] in PLAIN_SERVER_STEPS else "plain loop, FedAvg's step"
            if (cfg.get("selection") or {}).get("name", "uniform") != "uniform":
                runner += ", uniform sampling"
            plain_rows.append(dict(res, strategy=strategy, runner=runner, parallel=1, threads=threads, client_cpus=None,
                                   num_clients=cfg["num_clients"], clients_per_round=cfg["clients_per_round"],
                                   local_epochs=cfg["training"]["local_epochs"], model=cfg["model"]["name"]))
        reference = plain_rows[0] if plain_rows else None
        flower_rows: list[dict[str, Any]] = []
        for label, cfg in local_cfgs:
            res = next(results)
            if res is None:
                continue
            row = dict(res, strategy=strategy, runner=label, parallel=1, threads=cores, client_cpus=None)
            match = next((p for p in plain_rows if p["threads"] == cores), reference)
            if match is not None and match["runner"] == "plain loop":
                row.update(compared_with_threads=match["threads"],
                           delta_accuracy=res["accuracy"][args.rounds] - match["accuracy"][args.rounds],
                           max_weight_diff=max_weight_diff(res["final_model"], match["final_model"]))
            flower_rows.append(row)
        for client_cpus, parallel, cfg in flower_cfgs:
            res = next(results)
            if res is None:
                continue
            threads = max(1, int(client_cpus))
            row = dict(res, strategy=strategy, runner=f"this app, Ray, client_cpus={client_cpus:g}",
                       parallel=parallel, threads=threads, client_cpus=client_cpus)
            # Compare with the plain loop of the same per-client thread count when there is one.
            match = next((p for p in plain_rows if p["threads"] == threads), reference)
            if match is not None and match["runner"] == "plain loop":
                row.update(compared_with_threads=match["threads"],
                           delta_accuracy=res["accuracy"][args.rounds] - match["accuracy"][args.rounds],
                           max_weight_diff=max_weight_diff(res["final_model"], match["final_model"]))
            flower_rows.append(row)
        for p in plain_rows[1:]:
            p["compared_with_threads"] = reference["threads"]
            p["delta_accuracy"] = p["accuracy"][args.rounds] - reference["accuracy"][args.rounds]
            p["max_weight_diff"] = max_weight_diff(p["final_model"], reference["final_model"])
        group = list(flower_rows)
        if anchor is not None:
            group.append(dict(anchor))
        group += plain_rows
        for row in group:
            row["final_accuracy"] = row["accuracy"][args.rounds]
            row["ratio"] = row["per_round_s"] / reference["per_round_s"] if reference else None
            row["vs_anchor"] = row["per_round_s"] / anchor["per_round_s"] if anchor else None
            if row.get("runner", "").startswith("Flower FedAvg") and reference is not None and "delta_accuracy" not in row:
                if strategy == "fedavg":
                    row["delta_accuracy"] = row["final_accuracy"] - reference["accuracy"][args.rounds]
                    row["max_weight_diff"] = max_weight_diff(row["final_model"], reference["final_model"])
            show(strategy, row)
            log.add(dict(row, strategy=strategy, workload=args.workload))
        for row in flower_rows:
            b = row.get("breakdown_per_round_s")
            if b:
                print(f"{'':<10}{row['runner']} per round: select {b['select']:.3f}s, configure {b['configure']:.3f}s, "
                      f"exchange {b['exchange']:.3f}s (clients' own training {b['client_train_sum']:.3f}s summed, "
                      f"/{row['parallel']} parallel), aggregate {b['aggregate']:.3f}s, evaluate "
                      f"{b['evaluate']:.3f}s; select in round 1 (the roster query) {row['select_round_1_s']:.3f}s", flush=True)
        if anchor is not None and anchor.get("client_train_sum_per_round_s") is not None:
            print(f"{'':<10}Flower FedAvg as is per round: clients' own training {anchor['client_train_sum_per_round_s']:.3f}s "
                  f"summed, /{anchor['parallel']} parallel", flush=True)
        b = reference.get("breakdown_per_round_s") if reference else None
        if b:
            print(f"{'':<10}plain loop threads={reference['threads']} per round: train {b['train_s']:.3f}s, "
                  f"aggregate {b['aggregate_s']:.3f}s, evaluate {b['evaluate_s']:.3f}s", flush=True)
    print(f"\nWhole process, spawn to exit, median of {args.repeats} run(s) each (seconds):", flush=True)
    keys = ["process", "startup", "imports", "ray_init", "to_server_main", "server_setup", "round_1", "rounds_2_to_last",
            "after_last_round"]
    print(f"{'strategy':<10}{'runner':<36}{'vs plain':>9}{'paired (min–max)':>22}{'vs Flower':>10}"
          + "".join(f"{k:>17}" for k in keys), flush=True)
    for row in rows:
        med = row.get("phases_median") or {}
        plain = next((r for r in rows if r["strategy"] == row["strategy"] and r["runner"].startswith("plain")), None)
        flower = next((r for r in rows if r["runner"].startswith("Flower FedAvg")), None)
        row["process_vs_plain"] = med["process"] / plain["phases_median"]["process"] if plain else None
        row["process_vs_anchor"] = med["process"] / flower["phases_median"]["process"] if flower else None
        row["process_vs_plain_paired"] = paired_ratio(row, plain) if plain and plain is not row else None
        ratio = lambda v: f"{v:.2f}" if v is not None else "—"  # noqa: E731
        pair = row["process_vs_plain_paired"]
        paired = f"{pair['median']:.3f} ({pair['min']:.3f}–{pair['max']:.3f})" if pair else "—"
        print(f"{row['strategy']:<10}{row['runner']:<36}{ratio(row['process_vs_plain']):>9}{paired:>22}"
              f"{ratio(row['process_vs_anchor']):>10}"
              + "".join(f"{med[k]:>17.2f}" if k in med else f"{'—':>17}" for k in keys), flush=True)
    print("paired: run i's whole process / the plain loop's run i (the runners of a strategy run interleaved), median "
          "and range over the pairs.")
    print("vs plain: seconds per round / those of the plain loop with the first --threads value; vs Flower: / those of "
          "Flower's built-in FedAvg with a minimal ClientApp (same clients, same work); Δacc and max|Δw|: final "
          "accuracy and largest weight difference of the final global model against the plain loop with the same "
          "per-client threads (else the first).")
    log.finish()
    print(f"wrote {out}")
    if log.exit_status():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
