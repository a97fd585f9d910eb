"""What the round loop returns and logs: :class:`MultiModelResult`, the start lines, the final report.

The lines follow Flower's own strategies (``Starting ... strategy:``, ``[ROUND r/n]``, ``Final
results:``), so a log of this package reads as a Flower log.
"""

from __future__ import annotations

import io
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

if TYPE_CHECKING:
    from strategies.selection import ClientSelector


@dataclass
class MultiModelResult(Result):
    """Flower's :class:`~flwr.serverapp.strategy.Result` plus the server's models.

    ``arrays`` stays the global model (for the multi-model methods the mean of the K models);
    ``models`` holds the models the server kept after the last round (K for FedMR / FedCross,
    one for FedAvg), in model-index order; ``evaluate_metrics_models[round]`` holds the
    ``evaluate_fn`` result of each of them, when the strategy was made with
    ``evaluate_models=True``.
    """

    models: list[ArrayRecord] = field(default_factory=list)
    evaluate_metrics_models: dict[int, list[MetricRecord]] = field(default_factory=dict)

    def __repr__(self) -> str:
        rep = super().__repr__()
        if self.models:
            size = sum(len(a.data) for a in self.models[0].values()) / (1024**2)
            rep += f"\nServer models:\n\t{len(self.models)} ArrayRecord(s) ({size:.3f} MB each)\n"
        if self.evaluate_metrics_models:
            rep += "\nServerApp-side Evaluate Metrics of each model:\n"
            for server_round, records in sorted(self.evaluate_metrics_models.items()):
                rep += f"\t{server_round}: " + "; ".join(metrics_text(r) for r in records) + "\n"
        return rep


def metrics_text(record: Mapping[str, Any] | None) -> str:
    """A metric record as one short line (4 significant digits)."""
    if record is None:
        return "None"
    return "{" + ", ".join(f"'{k}': {v:.4g}" if isinstance(v, float) else f"'{k}': {v}" for k, v in record.items()) + "}"


def config_text(config: ConfigRecord | None) -> str:
    """A ConfigRecord for the start lines: keys and short values (a long value by its size)."""
    if not config:
        return "(empty!)"
    parts = []
    for key, value in config.items():
        text = repr(value)
        parts.append(f"'{key}': {text if len(text) <= 40 else f'<{len(text)} characters>'}")
    return "{" + ", ".join(parts) + "}"


def log_start(name: str, num_rounds: int, start_round: int, initial_arrays: ArrayRecord,
              train_config: ConfigRecord | None, evaluate_config: ConfigRecord | None) -> None:
    """The first lines of ``start`` (the strategy's summary follows)."""
    log(INFO, "Starting %s strategy:", name)
    log(INFO, "\t├── Number of rounds: %d%s", num_rounds, f" (from round {start_round})" if start_round > 1 else "")
    log(INFO, "\t├── ArrayRecord (%.2f MB)", sum(len(a.data) for a in initial_arrays.values()) / (1024**2))
    log(INFO, "\t├── ConfigRecord (train): %s", config_text(train_config))
    log(INFO, "\t├── ConfigRecord (evaluate): %s", config_text(evaluate_config))


def log_summary(context: Any) -> None:
    """A run's sampling, models, record keys and settings (its strategy's ``summary``;
    ``context``: its :class:`~strategies.context.RunContext`)."""
    m, c = context.method, context.conventions
    log(INFO, "\t├──> Sampling:")
    log(INFO, "\t│\t├──Nodes per round: train (%d) | evaluate (fraction %.2f)", m.clients_per_round,
        m.settings.fraction_evaluate)
    log(INFO, "\t│\t└──Selector: %s", context.selector.describe())
    if len(m.models or []) > 1 or m.holds == "a model per node":
        kept = m.settings.privacy.models_kept(m.clients_per_round) if m.holds == "a model per node" else m.clients_per_round
        log(INFO, "\t├──> Models: %d on the server, %s%s", kept, "one per selected node" if kept == m.clients_per_round
            else f"one per group of the selected nodes (differential privacy's groups: node i gets model i mod {kept})",
            " (each evaluated after every round)" if c.evaluate_models else "")
    log(INFO, "\t├──> Keys in records:")
    log(INFO, "\t│\t├── Weighted by: '%s'", c.weighted_by_key)
    log(INFO, "\t│\t├── ArrayRecord key: '%s'", c.arrayrecord_key)
    log(INFO, "\t│\t└── ConfigRecord key: '%s'", c.configrecord_key)
    log(INFO, "\t└──> Settings: %s", ", ".join(f"{k}={v}" for k, v in m.settings.to_dict().items() if k != "name"))


def log_round(name: str, train_metrics: MetricRecord | None, round_log: Mapping[str, float]) -> None:
    """A round's aggregated train metrics and the method's own quantities of the round."""
    if train_metrics is not None:
        log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics_text(train_metrics))
    if round_log:
        log(INFO, "\t└──> %s: %s", name, metrics_text(round_log))


def log_train_round(server_round: int, accepted: int, sent: int, rejected: list[str], failure: str = "") -> None:
    """The line of a round's train replies, one per rejection, and why the round's end failed (when it did)."""
    log(INFO, "aggregate_train: Received %s results and %s failures (round %d: %d/%d replies accepted)",
        accepted, sent - accepted, server_round, accepted, sent)
    for reason in rejected:
        log(WARNING, "\t> rejected: %s", reason)
    if failure:
        log(WARNING, "\t> the round's end failed, nothing aggregated: %s", failure)


def log_end(result: MultiModelResult, started: float, final_report: bool) -> None:
    """The closing lines of ``start``: its duration and, with ``final_report``, the whole result."""
    log(INFO, "")
    log(INFO, "Strategy execution finished in %.2fs", time.time() - started)
    if final_report:
        log(INFO, "")
        log(INFO, "Final results:")
        log(INFO, "")
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        log(INFO, "")


def connected(selector: ClientSelector, grid: Grid) -> int | str:
    """How many nodes the selector saw connected (for the sampling log line)."""
    if selector.last_connected is not None:
        return selector.last_connected
    try:
        return len(list(grid.get_node_ids()))
    except Exception:  # noqa: BLE001 - a log line must not stop the round
        return "?"

