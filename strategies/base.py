"""Shared base of the multi-model strategies (FedMR, FedCross, FedMut).

The server keeps K models for the whole run. Each round the i-th sampled node gets model i in
its own message (the random sample is the random dispatch), replies are mapped back to the
model they trained by the id of the message that was sent, and a subclass turns the K trained
models into the K models of the next round (:meth:`MultiModelStrategy.update_models`).

The global model, used only for evaluation and as the run's final model, is the unweighted
mean of the K trained models, taken before the method's update (as the authors' code does).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from logging import INFO

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from strategies.common import (
    ModelDict,
    NodeSampler,
    arrays_to_numpy,
    check_reply,
    evaluation_metrics,
    evaluate_messages,
    log_round_replies,
    mean_models,
    model_spec,
    numpy_to_arrays,
    weighted_metrics,
)


class MultiModelStrategy(Strategy):
    """Keep K models on the server and send a different one to each sampled node.

    Parameters
    ----------
    num_models : int
        K: models kept on the server, and clients sampled per round.
    seed : int
        Seeds client sampling and the method's own randomness (``self.rng``).
    fraction_evaluate : float
        Share of the connected nodes that evaluate the global model each round.

    Notes
    -----
    A node that fails, times out, or sends a reply that :func:`check_reply` rejects loses
    nothing: the model it was given stays in the pool unchanged.
    """

    arrayrecord_key = "arrays"
    configrecord_key = "config"
    weighted_by_key = "num-examples"

    def __init__(self, num_models: int, seed: int, fraction_evaluate: float = 0.0) -> None:
        if num_models < 1:
            raise ValueError(f"num_models must be >= 1, got {num_models}")
        self.num_models = num_models
        self.fraction_evaluate = fraction_evaluate
        self.sampler = NodeSampler(seed, num_models)
        self.rng = np.random.default_rng([seed, 0x5EED])
        self.models: list[ModelDict] | None = None
        self.spec: dict | None = None
        self._sent: dict[str, int] = {}
        self._pending: list[Message] = []
        self.last_replies = 0

    # ------------------------------------------------------------------ method hook
    def update_models(self, server_round: int, models: list[ModelDict], trained: list[int]) -> list[ModelDict]:
        """Turn the K models after local training into the K models of the next round.

        ``models[i]`` is the model node i trained (or, for a failed node, the model it was
        given); ``trained`` lists the indices whose training came back. The dicts belong to the
        method: it may reuse their arrays or empty them to save memory (the global model has
        already been taken). Override this.
        """
        return models

    # ------------------------------------------------------------------ training
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Model i of the pool to the i-th sampled node, each with its own config copy."""
        if self.models is None:
            initial = arrays_to_numpy(arrays)
            self.spec = model_spec(initial)
            self.models = [initial] * self.num_models  # shared, never written in place
        node_ids = self.sampler.sample(grid, server_round)
        messages = []
        for index, node_id in enumerate(node_ids):
            node_config = ConfigRecord(dict(config))
            node_config["server-round"] = server_round
            node_config["model-index"] = index
            content = RecordDict(
                {self.arrayrecord_key: numpy_to_arrays(self.models[index]), self.configrecord_key: node_config}
            )
            messages.append(Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node_id))
        # Message ids are assigned when the grid pushes the messages; keep the objects.
        self._pending = messages
        return messages

    def _model_index_by_message_id(self) -> dict[str, int]:
        return {msg.metadata.message_id: index for index, msg in enumerate(self._pending)}

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Put each trained model back in its slot, take the mean, then apply the method."""
        assert self.models is not None and self.spec is not None
        index_of = self._model_index_by_message_id()
        updated = list(self.models)
        trained: list[int] = []
        accepted: list[Message] = []
        rejected: list[str] = []
        for reply in replies:
            index = index_of.get(reply.metadata.reply_to_message_id)
            if index is None:
                rejected.append(f"node {reply.metadata.src_node_id}: reply to an unknown message")
                continue
            model, reason = check_reply(reply, self.spec, consume=True)
            if model is None:
                rejected.append(f"node {reply.metadata.src_node_id} (model {index}): {reason}")
                continue
            if index in trained:
                rejected.append(f"node {reply.metadata.src_node_id} (model {index}): duplicate reply")
                continue
            updated[index] = model
            trained.append(index)
            accepted.append(reply)
        self._pending = []
        self.last_replies = len(trained)
        log_round_replies(server_round, self.num_models, len(trained), rejected)

        global_model = mean_models(updated)
        self.models = self.update_models(server_round, updated, sorted(trained))
        if len(self.models) != self.num_models:
            raise RuntimeError(f"{type(self).__name__}.update_models returned {len(self.models)} models, expected {self.num_models}")
        metrics = weighted_metrics(accepted, self.weighted_by_key)
        metrics["replies"] = float(len(trained))
        return numpy_to_arrays(global_model), MetricRecord(metrics)

    # ------------------------------------------------------------------ evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation of the global model on ``fraction_evaluate`` of the nodes."""
        return evaluate_messages(self.sampler, grid, server_round, self.fraction_evaluate, arrays, config)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted mean of the clients' evaluation metrics."""
        return evaluation_metrics(replies, self.weighted_by_key)

    # ------------------------------------------------------------------ misc
    def summary(self) -> None:
        """Log the strategy's settings."""
        log(INFO, "\t├──> %s keeps K=%d models", type(self).__name__, self.num_models)
        log(INFO, "\t└──> federated evaluation fraction: %.2f", self.fraction_evaluate)

    def pool(self) -> Sequence[ModelDict]:
        """The K models currently kept (for checkpoints)."""
        return list(self.models or [])
