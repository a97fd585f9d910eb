"""One experiment on the server side: evaluation data, initial model, strategy, rounds, results.

Called by the ServerApp (and by ``fedmm``) with a Flower ``Grid`` and the validated config; holds
no algorithm logic (that lives in ``strategies/``). A run with ``resume=<run dir>`` continues
that run from its checkpoint, in the same directory, and gives the same metrics as a run that
was never stopped.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Mapping
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from fedmm import protocol
from fedmm.data import input_spec, label_histograms, load_dataset, partition_indices, plot_label_histograms
from fedmm.config import RunSettings, to_container, validate
from fedmm.errors import ConfigError
from fedmm.evaluation import evaluate as evaluate_model
from fedmm.evaluation import resolve_device
from fedmm.interrupt import raise_if_stopped
from fedmm.observers import Observers, RunObserver, StopRun
from fedmm.models import model_for
from fedmm.root_set import RootTrainer, client_steps, split_root
from server_app.checkpoint import Checkpointer, load_checkpoint, restore_rng_states
from server_app.recording import RunLock, RunRecorder, atomic_file, build_trackers, create_run_dir
from server_app.tracking import run_info
from strategies import build_strategy
from strategies.messaging import exchange
from strategies.contract import PER_CLIENT
from strategies.multimodel import MultiModel


def payload_bytes(messages: list[Message]) -> int:
    """Model bytes carried by messages (the ArrayRecords' data)."""
    total = 0
    for msg in messages:
        if msg.has_content():
            total += sum(record.count_bytes() for record in msg.content.array_records.values())
    return total


class CountingGrid:
    """A Grid proxy that counts the array bytes sent to and received from the nodes, and stops
    waiting for replies as soon as a stop is requested (:mod:`fedmm.interrupt`)."""

    def __init__(self, grid: Grid, poll_interval: float = 0.01) -> None:
        self._grid = grid
        self.poll_interval = poll_interval
        self.bytes_sent = 0
        self.bytes_received = 0

    def push_messages(self, messages):  # noqa: ANN001 - Grid's signature
        """Push, counting the array bytes sent."""
        messages = list(messages)
        self.bytes_sent += payload_bytes(messages)
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids):  # noqa: ANN001 - Grid's signature
        """Pull, counting the array bytes received."""
        replies = list(self._grid.pull_messages(message_ids))
        self.bytes_received += payload_bytes(replies)
        return replies

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001 - Grid's signature
        """Push, then pull until every reply is in or ``timeout`` passes (as Flower's grids do),
        through the counting push/pull above; stops waiting when a stop is requested."""
        return exchange(self, list(messages), timeout, poll_interval=self.poll_interval)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch on the server."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def federation_size(grid: Grid, settle: float = 1.0, timeout: float = 60.0, expected: int | None = None) -> int:
    """Number of SuperNodes once it stops growing (the simulation registers them progressively).

    ``expected``: the number the caller started the simulation with (``fedmm`` knows it); the
    count is returned as soon as it reaches it, without waiting ``settle`` seconds for more."""
    start = changed = time.monotonic()
    last = -1
    while True:
        raise_if_stopped()
        count = len(list(grid.get_node_ids()))
        now = time.monotonic()
        if expected is not None and count >= expected:
            return count
        if count != last:
            last, changed = count, now
        elif count > 0 and now - changed >= settle:
            return count
        if now - start > timeout:
            return count
        time.sleep(0.1)


#: Federation size of each simulated run (Flower's run id): a simulation's SuperNodes are fixed
#: for its lifetime, so several experiments on one simulation wait for it once.
_FEDERATION_SIZES: dict[int, int] = {}


def fit_federation_size(settings: RunSettings | Mapping[str, Any], grid: Grid, expected: int | None = None) -> dict[str, Any]:
    """The run's config with the federation's size settled before it is validated: `flwr run`
    sets the number of SuperNodes in the federation config, and it wins over ``num_clients``."""
    config = settings.to_dict() if isinstance(settings, RunSettings) else to_container(settings)
    try:
        run_id = int(grid.run.run_id)
    except (AttributeError, TypeError, ValueError):  # a grid without a run: no cache
        run_id = None
    connected = _FEDERATION_SIZES.get(run_id) if run_id is not None else None
    if connected is None:
        connected = federation_size(grid, expected=expected)
        if run_id is not None and connected:
            _FEDERATION_SIZES[run_id] = connected
    if connected and connected != config.get("num_clients"):
        log(WARNING, "num_clients=%s but the federation has %d SuperNodes: using %d clients.", config.get("num_clients"),
            connected, connected)
        if int(config.get("clients_per_round", 0)) > connected:
            raise ConfigError("clients_per_round", config["clients_per_round"], f"at most the {connected} SuperNodes of the federation")
        config["num_clients"] = connected
    return config


def time_left(history: list[dict[str, Any]], num_rounds: int) -> str:
    """Remaining time from the steady-state rounds: the mean duration of the rounds after the
    first (which carries start-up and warm-up), times the rounds left."""
    rows = [r for r in history if r["round"] >= 1]
    if not rows:
        return "starting"
    last = rows[-1]
    if len(rows) >= 2:
        per_round = (last["seconds"] - rows[0]["seconds"]) / (last["round"] - rows[0]["round"])
    else:
        per_round = last["seconds"] / last["round"]
    return f"~{per_round * (num_rounds - last['round']):.0f}s left"


def exit_status(err: SystemExit, rounds_done: int) -> dict[str, str]:
    """The ``summary.json`` status of a run that ``err`` ended.

    A deployment's ServerApp process exits through Flower's signal handler: ``flwr stop`` (the
    SuperLink then refuses the process's heartbeat, which raises SIGINT in it) and a SIGINT or
    SIGTERM sent to the process all end in ``sys.exit(0)`` raised wherever the ServerApp is, so
    code 0 (or None) is a stop, not a failure; any other code is a failure.
    """
    if err.code in (0, None):
        return {"status": "stopped", "reason": f"stopped by Flower after round {rounds_done} (flwr stop, or SIGINT/SIGTERM "
                                               f"to the ServerApp process; resume=<this run dir> continues it)"}
    return {"status": "failed", "reason": f"SystemExit: {err.code}"}


def plot_title(run: RunSettings, simulation: bool = True) -> str:
    """Method, model, dataset, partition (with α; ``deployment`` where the SuperNodes bring
    their own data) and seed, for plots."""
    p = run.partition
    partition = "deployment" if not simulation else f"Dir(α={p.alpha})" if p.name == "dirichlet" else p.name
    method = run.strategy.name + ("" if run.objective.name == "ce" else f"+{run.objective.name}")
    return f"{method} · {run.model.name} · {run.dataset.name} · {partition} · seed {run.seed}"


def run_experiment(grid: Grid, settings: RunSettings | Mapping[str, Any], simulation: bool = True,
                   num_supernodes: int | None = None, observers: Iterable[RunObserver] = ()) -> Path:
    """Run (or, with ``resume``, continue) the configured experiment on ``grid``; return the run directory.

    ``settings``: the run's settings (:func:`fedmm.config.validate`; a plain config is validated).
    ``num_supernodes``: the size of the simulated federation when the caller started it (no
    waiting for the registration of the SuperNodes to settle). ``observers``: what sees the run
    besides its record, trackers and checkpoints (:mod:`fedmm.observers`).
    """
    # the federation's size is settled first, then the settings are validated once (read-only from then on)
    run = validate(fit_federation_size(settings, grid, expected=num_supernodes) if simulation else settings)
    checkpoint = load_checkpoint(run.resume) if run.resume else None
    if checkpoint is not None:  # its settings are the run's own (resume_config), output_dir its directory
        run_dir = Path(run.resume).expanduser().resolve()
        done = int(checkpoint["round"])
        if done >= run.num_rounds:
            raise ConfigError("num_rounds", run.num_rounds, f"more than the {done} rounds the run in {run_dir} has finished, to continue it")
    else:
        run_dir = create_run_dir(run, simulation)
    log(INFO, "fedmm run directory: %s", run_dir)
    lock = RunLock(run_dir)  # a second run in this directory is refused while this one runs
    try:
        return run_locked(grid, run, run_dir, checkpoint, simulation, observers)
    finally:
        lock.release()


def run_locked(grid: Grid, run: RunSettings, run_dir: Path, checkpoint: dict[str, Any] | None, simulation: bool,
               observers: Iterable[RunObserver] = ()) -> Path:
    """The run in ``run_dir``, its lock held: set-up, the rounds, the final files. Its record
    (:class:`~server_app.recording.RunRecorder` with its trackers), its checkpoints
    (:class:`~server_app.checkpoint.Checkpointer`) and ``observers`` see it through one interface."""
    recorder = RunRecorder(run_dir, run, build_trackers(run.tracking, run_dir))
    watchers = Observers([recorder, *observers])
    counting = CountingGrid(grid)
    num_rounds = run.num_rounds
    t0 = time.perf_counter()
    done = 0 if checkpoint is None else int(checkpoint["round"])
    checkpoints: Checkpointer | None = None
    status: dict[str, Any] = {"status": "failed", "reason": "the run stopped before its first round"}
    strategy: Any = None
    try:
        watchers.on_run_start(run_info(run, run_dir, simulation, resumed_at=None if checkpoint is None else done + 1))
        seed_everything(run.seed)

        d = run.dataset
        train, test = load_dataset(d)
        if simulation and checkpoint is None:
            parts = partition_indices(train, run.partition, run.num_clients, run.seed)
            hist = label_histograms(train.y.numpy(), parts, d.num_classes)
            recorder.write_json("label_histograms.json", hist.tolist())
            plot_label_histograms(hist, run_dir / "label_histograms.png")

        model = model_for(run, input_spec(d))
        if getattr(d, "embeddings_path", None):  # Sent140: pre-trained word vectors into the initial model's embedding
            from fedmm.data.sources import vocabulary
            from fedmm.data.text import load_glove

            table = model.layers[0].weight
            vectors, found = load_glove(d.embeddings_path, vocabulary(d), int(table.shape[1]))
            with torch.no_grad():
                table[: len(vectors)] = torch.from_numpy(vectors[: len(table)])
            log(INFO, "fedmm: %d of %d vocabulary words initialised from %s", found, len(vectors) - 2, d.embeddings_path)
        strategy = build_strategy(run, watchers)
        device = resolve_device(run.training.device)
        if run.strategy.defence.trust_root is not None:  # FLTrust's root set: rows of the test split, no longer scored
            root, test = split_root(test, run.strategy.defence.trust_root, run.seed)
            steps = client_steps(run.training, len(train), run.num_clients)
            strategy.context.reference = RootTrainer(model, root, run.training, steps, run.seed, device)
            log(INFO, "fedmm: the server's root set is %d rows of the test split (it evaluates on the other %d); its "
                "reference update takes %d SGD steps a round, as a client of the mean partition", len(root), len(test), steps)
        eval_every = run.eval_every
        checkpoint_every = run.checkpoint_every
        start_round, seconds_before = 1, 0.0
        if checkpoint is not None:
            strategy.context.load_state_dict(checkpoint["strategy"])
            restore_rng_states(checkpoint["rng"])
            recorder.restore(checkpoint["metrics"], checkpoint["federated"])
            counting.bytes_sent, counting.bytes_received = checkpoint["bytes_sent"], checkpoint["bytes_received"]
            seconds_before = float(checkpoint["seconds"])
            start_round = int(checkpoint["round"]) + 1
            log(INFO, "fedmm: resuming at round %d/%d from %s", start_round, num_rounds, run_dir)
        t0 = time.perf_counter() - seconds_before
        checkpoints = Checkpointer(run_dir, strategy, recorder, counting, lambda: time.perf_counter() - t0, checkpoint_every,
                                   num_rounds, done, None if checkpoint is None else checkpoint["loaded_from"])
        # before the caller's observers: one that ends the run at a round's end (a search's pruner)
        # finds that round recorded and checkpointed
        watchers.add(checkpoints, index=1)

        def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if server_round % eval_every and server_round != num_rounds:
                return None
            more = strategy.models_to_evaluate() if server_round > 0 else None
            several = more if strategy.holds == PER_CLIENT else None
            spread: dict[str, float] = {}
            if several:  # SOLO: the clients' own models, each on the test split, instead of the global model
                results = []
                for state in several:
                    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()})
                    results.append(evaluate_model(model, test, device))
                accuracies = np.array([r["accuracy"] for r in results])
                metrics = {"accuracy": float(accuracies.mean()), "loss": float(np.mean([r["loss"] for r in results]))}
                spread = {"accuracy_std": float(accuracies.std(ddof=1)) if len(results) > 1 else 0.0,
                          "accuracy_min": float(accuracies.min()), "accuracy_max": float(accuracies.max()),
                          "models_evaluated": len(results)}
            else:
                model.load_state_dict(arrays.to_torch_state_dict())
                metrics = evaluate_model(model, test, device)
            tracked = more if strategy.holds != PER_CLIENT else None
            for index, state in enumerate(tracked or []):  # e.g. Indep's K models, each on its own
                model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()})
                spread[f"model_{index}_accuracy"] = evaluate_model(model, test, device)["accuracy"]
            elapsed = time.perf_counter() - t0
            row = {
                "round": server_round,
                "accuracy": metrics["accuracy"],
                "loss": metrics["loss"],
                **spread,
                "seconds": round(elapsed, 3),
                "bytes_sent": counting.bytes_sent,
                "bytes_received": counting.bytes_received,
            }
            if server_round > 0:
                row["replies"] = strategy.context.last_round.replies
                row.update({key: float(value) for key, value in strategy.round_log.items()})
                federated = strategy.context.evaluation.last_evaluate_metrics
                if federated:  # clients' held-out rows, example-weighted
                    row["federated_accuracy"] = federated.get("accuracy")
                    row["federated_loss"] = federated.get("loss")
            watchers.on_metrics(row)
            left = time_left(recorder.history, num_rounds)
            log(
                INFO,
                "[fedmm] round %d/%d  accuracy %.4f  loss %.4f  elapsed %.1fs  %s",
                server_round,
                num_rounds,
                metrics["accuracy"],
                metrics["loss"],
                elapsed,
                left,
            )
            return MetricRecord({"accuracy": metrics["accuracy"], "loss": metrics["loss"]})

        run_config = ConfigRecord({protocol.RUN_CONFIG: protocol.run_config_record(run)})
        result = strategy.start(
            grid=counting,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=num_rounds,
            timeout=float(run.round_timeout),
            train_config=run_config,
            evaluate_config=run_config,
            evaluate_fn=central_evaluate,
            start_round=start_round,
            max_failed_rounds=run.max_failed_rounds or None,
            final_report=False,  # the run directory holds the results
            return_models=False,  # written from the strategy's pool below (no second copy)
        )
        if recorder.federated:
            recorder.write_json("federated_evaluation.json", {str(r): m for r, m in sorted(recorder.federated.items())})
        final = result.arrays if len(result.arrays) else ArrayRecord(model.state_dict())
        with atomic_file(run_dir / "final_model.pt", "wb") as f:  # never half-written
            torch.save(final.to_torch_state_dict(), f)
        if isinstance(strategy, MultiModel):
            pool = strategy.pool()
            with atomic_file(run_dir / "final_models.npz", "wb") as f:
                np.savez(f, **{f"{i}/{k}": v for i, m in enumerate(pool) for k, v in m.items()})
        privacy = strategy.context.privacy
        stopped = privacy.stopped if privacy is not None else ""
        status = {"status": "privacy_budget_spent", "reason": f"stopped before {stopped}"} if stopped else {"status": "completed"}
    except StopRun as err:  # an observer ended the run (a search's pruner): not an error
        status = {"status": err.status, "reason": err.reason}
    except KeyboardInterrupt:
        rounds_done = checkpoints.round if checkpoints else done
        status = {"status": "interrupted", "reason": f"interrupted after round {rounds_done} (resume=<this run dir> continues it)"}
        raise
    except SystemExit as err:
        status = exit_status(err, checkpoints.round if checkpoints else done)
        raise
    except BaseException as err:
        status = {"status": "failed", "reason": f"{type(err).__name__}: {err}"}
        raise
    finally:
        if checkpoints is not None:
            checkpoints.flush()  # an interrupted or failed run can be resumed
        if status["status"] != "completed":
            log(ERROR, "fedmm run %s: %s", status["status"], status.get("reason", ""))
        # The summary before the plot: a stopped deployment's ServerApp has Flower's 5 s (its
        # FORCE_EXIT_TIMEOUT_SECONDS) from the stop to write its files before it is killed.
        try:
            recorder.write_json(
                "summary.json",
                {
                    **status,
                    "rounds_completed": checkpoints.round if checkpoints else done,
                    "num_rounds": num_rounds,
                    "final_accuracy": recorder.history[-1]["accuracy"] if recorder.history else None,
                    "best_accuracy": max((r["accuracy"] for r in recorder.history), default=None),
                    "seconds": round(time.perf_counter() - t0, 3),
                    "bytes_sent": counting.bytes_sent,
                    "bytes_received": counting.bytes_received,
                    **({"privacy": strategy.context.privacy.summary()}
                       if strategy is not None and strategy.context.privacy is not None else {}),
                },
            )
            if recorder.history:
                recorder.plot_learning_curve(plot_title(run, simulation))
        finally:  # the trackers last: they keep summary.json and the plot
            watchers.on_run_end(status["status"], status.get("reason", ""), recorder.final_files())
    log(INFO, "fedmm results written to: %s", run_dir)
    return run_dir
