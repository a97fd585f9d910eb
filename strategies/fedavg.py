"""FedAvg (McMahan et al. 2017): Flower's strategy with reproducible sampling and reply checks.

The aggregate is the sample-size weighted mean, as Flower's ``aggregate_arrayrecords``; this
subclass changes *which* nodes are sampled (seeded, see :class:`NodeSampler`), drops malformed
replies instead of failing the round, and decodes each reply only once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from strategies.common import (
    NodeSampler,
    num_examples,
    weighted_mean_models,
    weighted_metrics,
    arrays_to_numpy,
    check_reply,
    evaluation_metrics,
    evaluate_messages,
    log_round_replies,
    model_spec,
    numpy_to_arrays,
)


class FedAvg(FlowerFedAvg):
    """Sample K clients per round, average their models weighted by ``num-examples``.

    Parameters
    ----------
    clients_per_round : int
        K, the number of clients sampled per round.
    seed : int
        Seeds the client sampling.
    fraction_evaluate : float
        Share of the connected clients that run federated evaluation each round.
    """

    def __init__(self, clients_per_round: int, seed: int, fraction_evaluate: float = 0.0) -> None:
        super().__init__(
            fraction_train=1.0,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=clients_per_round,
            min_available_nodes=clients_per_round,
        )
        self.clients_per_round = clients_per_round
        self.sampler = NodeSampler(seed, clients_per_round)
        self._spec: dict | None = None
        self._expected = 0

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global model to K seeded-sampled nodes."""
        if self._spec is None:
            self._spec = model_spec(arrays_to_numpy(arrays))
        node_ids = self.sampler.sample(grid, server_round)
        self._expected = len(node_ids)
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, node_ids, MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Drop failed or malformed replies, then the ``num-examples`` weighted mean of the rest.

        Same arithmetic as Flower's ``aggregate_arrayrecords``, computed from the arrays the
        reply check already decoded (each reply is decoded once), keeping every dtype.
        """
        models, accepted, rejected = [], [], []
        for reply in replies:
            model, reason = check_reply(reply, self._spec or {}, consume=True)
            if model is None:
                rejected.append(f"node {reply.metadata.src_node_id}: {reason}")
            else:
                models.append(model)
                accepted.append(reply)
        log_round_replies(server_round, self._expected, len(models), rejected)
        if not models:
            return None, None
        weights = [num_examples(r, self.weighted_by_key) for r in accepted]
        if sum(weights) <= 0:
            weights = [1.0] * len(models)
        metrics = MetricRecord(weighted_metrics(accepted, self.weighted_by_key))
        return numpy_to_arrays(weighted_mean_models(models, weights)), metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation on a seeded sample of ``fraction_evaluate`` of the nodes."""
        return evaluate_messages(self.sampler, grid, server_round, self.fraction_evaluate, arrays, config)


    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted mean of the clients' evaluation metrics (with the total ``num-examples``)."""
        return evaluation_metrics(replies, self.weighted_by_key)


def from_config(cfg: Mapping[str, Any]) -> FedAvg:
    """Build FedAvg from the resolved run config."""
    return FedAvg(
        clients_per_round=cfg["clients_per_round"],
        seed=cfg["seed"],
        fraction_evaluate=cfg["strategy"].get("fraction_evaluate", 0.0),
    )
