"""One experiment on the server side: data for evaluation, initial model, strategy, rounds, results.

Called by the ServerApp with a Flower ``Grid`` and the resolved config; holds no algorithm
logic (that lives in ``strategies/``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from client_app.training import evaluate as evaluate_model
from client_app.training import resolve_device
from fedmm import config as config_mod
from fedmm.data import label_histograms, load_dataset, partition_indices, plot_label_histograms
from fedmm.errors import ConfigError
from fedmm.models import build_model
from fedmm.results import RunRecorder, create_run_dir
from strategies import build_strategy


def payload_bytes(messages: list[Message]) -> int:
    """Model bytes carried by messages (the ArrayRecords' data)."""
    total = 0
    for msg in messages:
        if msg.has_content():
            total += sum(record.count_bytes() for record in msg.content.array_records.values())
    return total


class CountingGrid:
    """A Grid proxy that counts the model bytes sent to and received from the nodes."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid
        self.bytes_sent = 0
        self.bytes_received = 0

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001 - Grid's signature
        messages = list(messages)
        self.bytes_sent += payload_bytes(messages)
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        self.bytes_received += payload_bytes(replies)
        return replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch on the server."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def federation_size(grid: Grid, settle: float = 1.0, timeout: float = 60.0) -> int:
    """Number of SuperNodes once it stops growing (the simulation registers them progressively)."""
    start = changed = time.monotonic()
    last = -1
    while True:
        count = len(list(grid.get_node_ids()))
        now = time.monotonic()
        if count != last:
            last, changed = count, now
        elif count > 0 and now - changed >= settle:
            return count
        if now - start > timeout:
            return count
        time.sleep(0.1)


def _fit_federation_size(cfg: dict[str, Any], grid: Grid) -> None:
    # `flwr run` sets the number of SuperNodes in the federation config; it wins over num_clients.
    connected = federation_size(grid)
    if connected and connected != cfg["num_clients"]:
        log(
            WARNING,
            "num_clients=%d but the federation has %d SuperNodes: using %d clients.",
            cfg["num_clients"],
            connected,
            connected,
        )
        cfg["num_clients"] = connected
        if cfg["clients_per_round"] > connected:
            raise ConfigError("clients_per_round", cfg["clients_per_round"], f"at most the {connected} SuperNodes of the federation")


def run_experiment(grid: Grid, cfg_in: Mapping[str, Any], simulation: bool = True) -> Path:
    """Run the configured experiment on ``grid``; return the run directory."""
    cfg = config_mod.to_container(cfg_in)
    config_mod.validate(cfg)
    if simulation:
        _fit_federation_size(cfg, grid)
    run_dir = create_run_dir(cfg)
    log(INFO, "fedmm run directory: %s", run_dir)
    recorder = RunRecorder(run_dir, cfg)
    seed_everything(int(cfg["seed"]))

    d = cfg["dataset"]
    train, test = load_dataset(d)
    if simulation:
        parts = partition_indices(train, cfg["partition"], cfg["num_clients"], int(cfg["seed"]))
        hist = label_histograms(train.y.numpy(), parts, int(d["num_classes"]))
        recorder.write_json("label_histograms.json", hist.tolist())
        plot_label_histograms(hist, run_dir / "label_histograms.png")

    model = build_model(cfg["model"]["name"], int(d["in_channels"]), int(d["num_classes"]), int(d["image_size"]))
    strategy = build_strategy(cfg)
    counting = CountingGrid(grid)
    device = resolve_device(cfg["training"]["device"])
    num_rounds, eval_every = int(cfg["num_rounds"]), int(cfg["eval_every"])
    t0 = time.perf_counter()

    def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round % eval_every and server_round != num_rounds:
            return None
        model.load_state_dict(arrays.to_torch_state_dict())
        metrics = evaluate_model(model, test, d, device)
        elapsed = time.perf_counter() - t0
        row = {
            "round": server_round,
            "accuracy": metrics["accuracy"],
            "loss": metrics["loss"],
            "seconds": round(elapsed, 3),
            "bytes_sent": counting.bytes_sent,
            "bytes_received": counting.bytes_received,
        }
        if hasattr(strategy, "last_replies") and server_round > 0:
            row["replies"] = strategy.last_replies
        recorder.log_metrics(row)
        left = f"~{elapsed / server_round * (num_rounds - server_round):.0f}s left" if server_round else "starting"
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

    train_config = ConfigRecord({"fedmm-config": config_mod.dumps(cfg)})
    try:
        result = strategy.start(
            grid=counting,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=num_rounds,
            timeout=float(cfg["round_timeout"]),
            train_config=train_config,
            evaluate_config=ConfigRecord({"fedmm-config": config_mod.dumps(cfg)}),
            evaluate_fn=central_evaluate,
        )
        if result.evaluate_metrics_clientapp:
            recorder.write_json(
                "federated_evaluation.json",
                {str(rnd): dict(metrics) for rnd, metrics in result.evaluate_metrics_clientapp.items()},
            )
        final = result.arrays if len(result.arrays) else ArrayRecord(model.state_dict())
        torch.save(final.to_torch_state_dict(), run_dir / "final_model.pt")
        if getattr(strategy, "models", None):
            pool = strategy.pool()
            np.savez(run_dir / "final_models.npz", **{f"{i}/{k}": v for i, m in enumerate(pool) for k, v in m.items()})
    finally:
        if recorder.history:
            recorder.plot_learning_curve(f"{cfg['strategy']['name']} · {d['name']} · {cfg['partition']['name']} · seed {cfg['seed']}")
        recorder.write_json(
            "summary.json",
            {
                "final_accuracy": recorder.history[-1]["accuracy"] if recorder.history else None,
                "best_accuracy": max((r["accuracy"] for r in recorder.history), default=None),
                "seconds": round(time.perf_counter() - t0, 3),
                "bytes_sent": counting.bytes_sent,
                "bytes_received": counting.bytes_received,
            },
        )
    log(INFO, "fedmm results written to: %s", run_dir)
    return run_dir

