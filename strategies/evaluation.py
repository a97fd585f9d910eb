"""The evaluation half of the round loop, and the metrics of replies.

:class:`FederatedEvaluation` is the part of a run (:class:`~strategies.context.RunContext`) that
evaluates: Flower's ``configure_evaluate`` / ``aggregate_evaluate`` (federated evaluation of the
global model on a seeded ``fraction_evaluate`` of the nodes), the central evaluation of each
round (``evaluate_fn``, also on each of the server's models with ``evaluate_models``) and the
aggregated train metrics of a round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from fedmm import protocol
from fedmm.protocol import ClientUpdate
from strategies.loop_log import MultiModelResult, metrics_text
from strategies.messaging import exchange

#: Flower's metric aggregation function: (the replies' RecordDicts, the weighting key) -> MetricRecord.
MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]

#: A central evaluation: (round, arrays) -> metrics (None: nothing to report).
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]

@dataclass(frozen=True)
class Conventions:
    """Keyword arguments every strategy takes besides its settings, read as the strategy's own
    attributes (``strategy.weighted_by_key``): Flower's record conventions (the keys a ClientApp
    reads and writes, the metric aggregation functions) and per-model evaluation."""

    weighted_by_key: str = protocol.NUM_EXAMPLES
    arrayrecord_key: str = protocol.ARRAYS
    configrecord_key: str = protocol.CONFIG
    train_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None
    evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None
    evaluate_models: bool = False

    def __post_init__(self) -> None:
        for name in ("weighted_by_key", "arrayrecord_key", "configrecord_key"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")

    @classmethod
    def take(cls, changes: dict[str, Any]) -> Conventions:
        """The conventions among ``changes`` (removed from it), the rest left as settings."""
        return cls(**{f.name: changes.pop(f.name) for f in fields(cls) if f.name in changes})


def default_metrics_aggregation(records: list[RecordDict], weighted_by_key: str) -> MetricRecord:
    """Flower's default: the mean of every numeric metric the replies share, weighted by
    ``weighted_by_key`` (summed into the record, as the round's total)."""
    return MetricRecord(protocol.weighted_metrics(
        [{k: float(v) for r in rd.metric_records.values() for k, v in r.items() if isinstance(v, (int, float))}
         for rd in records], weighted_by_key))


class FederatedEvaluation:
    """Evaluation and reply metrics of a run (module docstring).

    Parameters
    ----------
    context : RunContext
        The run (:class:`strategies.context.RunContext`): its selector, its method's models and
        ``fraction_evaluate``, Flower's record conventions (``weighted_by_key``,
        ``arrayrecord_key``, ``configrecord_key``, ``train_metrics_aggr_fn``,
        ``evaluate_metrics_aggr_fn``, ``evaluate_models``), its observers.
    """

    def __init__(self, context: Any) -> None:
        self.context = context
        self.conventions: Conventions = context.conventions
        #: Federated-evaluation metrics of the current round (None when clients did not evaluate).
        self.last_evaluate_metrics: dict[str, float] | None = None

    # ================================================================== Flower Strategy API
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation of the global model on a seeded ``fraction_evaluate`` of the nodes."""
        fraction = self.context.method.settings.fraction_evaluate
        if fraction <= 0.0:
            return []
        num_nodes = len(list(grid.get_node_ids()))
        size = max(1, min(num_nodes, int(num_nodes * fraction)))
        node_config = {**dict(config), protocol.SERVER_ROUND: server_round}
        node_ids = self.context.selector.select(grid, server_round, size, stream=1)
        log(INFO, "configure_evaluate: Sampled %s nodes (out of %s)", len(node_ids), num_nodes)
        return [protocol.server_message(protocol.EVALUATE, n, node_config, arrays, arrays_key=self.conventions.arrayrecord_key,
                                        config_key=self.conventions.configrecord_key) for n in node_ids]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message], sent_to: Mapping[str, int] | None = None
    ) -> MetricRecord | None:
        """Example-weighted mean of the metrics of the valid evaluate replies (no error, every
        metric finite, ``num-examples`` a count, ``accuracy`` in [0, 1], ``loss`` >= 0); each
        rejected reply is logged with its node and reason: the node its message was sent to
        (``sent_to``: message id -> node id), else the reply's source."""
        valid, contents = [], []
        rejected: dict[str, list[int]] = {}  # one line per reason, however many nodes gave it
        replies = list(replies)
        for reply in replies:
            node = (sent_to or {}).get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
            if reply.has_error():
                reason = f"client error: {protocol.printable(protocol.client_error(reply.error.reason))}"
                if "No evaluate function registered" in reply.error.reason:
                    reason = "the ClientApp has no evaluate handler (set fraction_evaluate=0, or add @app.evaluate())"
                rejected.setdefault(reason, []).append(node)
                continue
            metrics = protocol.reply_metrics(reply)
            reason = protocol.check_evaluate_metrics(metrics, self.conventions.weighted_by_key)
            if reason:
                rejected.setdefault(reason, []).append(node)
                continue
            valid.append(metrics)
            contents.append(RecordDict({protocol.METRICS: MetricRecord(metrics)}))
        log(INFO, "aggregate_evaluate: Received %s results and %s failures", len(valid), len(replies) - len(valid))
        for reason, nodes in rejected.items():
            shown = ", ".join(str(n) for n in nodes[:3]) + (f" and {len(nodes) - 3} more" if len(nodes) > 3 else "")
            log(WARNING, "round %d: %d evaluate repl%s rejected (node %s): %s", server_round, len(nodes),
                "y" if len(nodes) == 1 else "ies", shown, reason)
        if not valid:
            return None
        if self.conventions.evaluate_metrics_aggr_fn is not None:
            return self.conventions.evaluate_metrics_aggr_fn(contents, self.conventions.weighted_by_key)
        return MetricRecord(protocol.weighted_metrics(valid, self.conventions.weighted_by_key))

    # ================================================================== one round's evaluation
    def send(self, grid: Grid, messages: list[Message], timeout: float,
             on_reply: Callable[[Message], None] | None = None) -> list[Message]:
        """One phase: push ``messages`` and collect the replies as they arrive (nothing is sent
        for no message); stop waiting after ``timeout`` seconds or when a stop is requested.
        ``messages`` is emptied once pushed (only the grid holds them until their replies are
        in). With ``on_reply`` every reply is handed to it as soon as it is pulled and not kept."""
        if not messages:
            return []
        batch = list(messages)
        messages.clear()
        return exchange(grid, batch, timeout, on_reply)

    def evaluate_initial(self, arrays: ArrayRecord, evaluate_fn: EvaluateFn | None, result: MultiModelResult) -> None:
        """The central evaluation of the initial model (round 0), into ``result``."""
        if evaluate_fn:
            with self.context.observers.phase(0, "evaluate"):
                res = evaluate_fn(0, arrays)
            log(INFO, "Initial global evaluation results: %s", metrics_text(res))
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res

    def evaluate_round(
        self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord, timeout: float,
        evaluate_fn: EvaluateFn | None, result: MultiModelResult,
    ) -> None:
        """The evaluation after a round's training: federated (its aggregate also in
        :attr:`last_evaluate_metrics`), then central with ``evaluate_fn``; results into ``result``."""
        messages = list(self.configure_evaluate(server_round, arrays, config, grid))
        sent = [message.metadata for message in messages]  # their ids are set when pushed
        with self.context.observers.phase(server_round, "evaluate_exchange"):
            eval_replies = self.send(grid, messages, timeout)
        self.last_evaluate_metrics = None
        if eval_replies:
            # an error reply Flower builds for a lost node carries the ServerApp's node id
            sent_to = {metadata.message_id: metadata.dst_node_id for metadata in sent}
            eval_metrics = self.aggregate_evaluate(server_round, eval_replies, sent_to)
            if eval_metrics is not None:
                log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics_text(eval_metrics))
                result.evaluate_metrics_clientapp[server_round] = eval_metrics
                self.last_evaluate_metrics = dict(eval_metrics)
        if evaluate_fn:
            log(INFO, "Global evaluation")
            with self.context.observers.phase(server_round, "evaluate"):
                res = evaluate_fn(server_round, arrays)
            log(INFO, "\t└──> MetricRecord: %s", metrics_text(res))
            if res is not None:
                result.evaluate_metrics_serverapp[server_round] = res
            if self.conventions.evaluate_models and self.context.method.models:
                result.evaluate_metrics_models[server_round] = self.evaluate_each_model(server_round, evaluate_fn)

    def evaluate_each_model(self, server_round: int, evaluate_fn: EvaluateFn) -> list[MetricRecord]:
        """``evaluate_fn`` on each of the server's models (those it sends out next round), logged
        one line per model; a model the function returns None for gets an empty record."""
        records = []
        for index, model in enumerate(self.context.method.models or []):
            res = evaluate_fn(server_round, protocol.model_to_record(model))
            log(INFO, "\t└──> model %d: %s", index, metrics_text(res))
            records.append(res if res is not None else MetricRecord())
        return records

    # ================================================================== train metrics
    def train_metrics(self, updates: list[ClientUpdate]) -> MetricRecord:
        """The round's aggregated train metrics: ``train_metrics_aggr_fn`` over the accepted
        replies' metrics, or the example-weighted mean plus the count of accepted ``replies``."""
        c = self.conventions
        if c.train_metrics_aggr_fn is not None:
            if not updates:
                return MetricRecord()
            return c.train_metrics_aggr_fn(
                [RecordDict({protocol.METRICS: MetricRecord(u.metrics)}) for u in updates], c.weighted_by_key)
        metrics = protocol.weighted_metrics((u.metrics for u in updates), c.weighted_by_key) if updates else {}
        metrics["replies"] = float(len(updates))
        return MetricRecord(metrics)


def client_metrics(updates: list[ClientUpdate], weighted_by_key: str) -> dict[str, float]:
    """The mean over ``updates`` of each metric a client objective reports of its own (not the
    weighting key, not the training metrics every client reports), named with ``_`` for ``-``."""
    logged = sorted({k for u in updates for k in u.metrics} - {weighted_by_key, *protocol.TRAINING_METRICS})
    return {key.replace("-", "_"): float(np.mean([u.metrics[key] for u in updates if key in u.metrics])) for key in logged}

