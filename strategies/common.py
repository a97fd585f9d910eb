"""Plumbing shared by every strategy: reproducible node sampling, record conversion, reply checks.

The method files (``fedavg.py``, ``fedmr.py``, ...) hold the methods; this file holds what
they all need and none of them is about.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from logging import INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

#: A model on the server: state_dict key -> numpy array. Treated as immutable: methods build
#: new dicts (sharing untouched arrays) instead of writing into existing ones.
ModelDict = dict[str, np.ndarray]

#: ConfigRecord key of the query that asks a node for its stable identity.
ROSTER_QUERY = "fedmm-roster"
ROSTER_KEY = "node-key"


def arrays_to_numpy(record: ArrayRecord) -> ModelDict:
    """Decode an ``ArrayRecord`` into a dict of numpy arrays (order preserved)."""
    return {key: array.numpy() for key, array in record.items()}


def numpy_to_arrays(model: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Encode a dict of numpy arrays as an ``ArrayRecord`` (order preserved)."""
    return ArrayRecord({key: Array(np.require(value, requirements="C")) for key, value in model.items()})


def model_spec(model: Mapping[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Key -> (shape, dtype): what every reply must match."""
    return {key: (tuple(value.shape), value.dtype) for key, value in model.items()}


def check_reply(
    reply: Message, spec: Mapping[str, tuple[tuple[int, ...], np.dtype]], consume: bool = False
) -> tuple[ModelDict | None, str]:
    """Decode and validate the model in a train reply.

    With ``consume=True`` the arrays are popped from the reply while they are decoded, so the
    serialized bytes are freed as the numpy arrays are built (a round then never holds two
    copies of the K uploaded models).

    Returns
    -------
    (model, "") when the reply is usable, (None, reason) otherwise. A reply is rejected when
    it carries an error, has no single ArrayRecord, its keys, shapes or dtypes differ from
    ``spec``, or a floating-point array holds NaN or Inf.
    """
    if reply.has_error():
        return None, f"error reply: {reply.error.reason}"
    records = list(reply.content.array_records.values())
    if len(records) != 1:
        return None, f"expected one ArrayRecord, got {len(records)}"
    try:
        record = records[0]
        if consume:
            model = {key: record.pop(key).numpy() for key in list(record.keys())}
        else:
            model = arrays_to_numpy(record)
    except Exception as err:  # malformed bytes from a client must not stop the server
        return None, f"arrays could not be decoded: {err}"
    if list(model) != list(spec):
        missing = sorted(set(spec) - set(model))
        extra = sorted(set(model) - set(spec))
        return None, f"wrong keys (missing {missing[:5]}, unexpected {extra[:5]})"
    for key, (shape, dtype) in spec.items():
        value = model[key]
        if tuple(value.shape) != shape:
            return None, f"{key}: shape {tuple(value.shape)} != expected {shape}"
        if value.dtype != dtype:
            return None, f"{key}: dtype {value.dtype} != expected {dtype}"
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            return None, f"{key}: contains NaN or Inf"
    return model, ""


def num_examples(reply: Message, key: str = "num-examples") -> float:
    """The weighting value a client reported (0 when absent)."""
    for record in reply.content.metric_records.values():
        if key in record:
            return float(record[key])
    return 0.0


def weighted_metrics(replies: Sequence[Message], weight_key: str = "num-examples") -> dict[str, float]:
    """Example-weighted mean of every numeric metric the replies share."""
    if not replies:
        return {}
    weights = np.array([num_examples(r, weight_key) for r in replies], dtype=np.float64)
    if weights.sum() <= 0:
        weights = np.ones_like(weights)
    records = [next(iter(r.content.metric_records.values()), {}) for r in replies]
    shared = set(records[0]).intersection(*map(set, records[1:])) - {weight_key}
    out = {weight_key: float(weights.sum())}
    for key in sorted(shared):
        values = np.array([float(rec[key]) for rec in records], dtype=np.float64)
        out[key] = float((values * weights).sum() / weights.sum())
    return out


def evaluation_metrics(replies: Iterable[Message], weight_key: str = "num-examples") -> MetricRecord | None:
    """Example-weighted mean of the metrics of the evaluate replies that carry no error."""
    valid = [r for r in replies if not r.has_error()]
    return MetricRecord(weighted_metrics(valid, weight_key)) if valid else None


def mean_models(models: Sequence[Mapping[str, np.ndarray]]) -> ModelDict:
    """Unweighted element-wise mean of K models (integer buffers are averaged, then rounded back)."""
    out: ModelDict = {}
    k = len(models)
    for key, first in models[0].items():
        acc = np.array(first, dtype=np.float64 if not np.issubdtype(first.dtype, np.floating) else first.dtype, copy=True)
        for model in models[1:]:
            acc += model[key]
        acc /= k
        out[key] = acc if acc.dtype == first.dtype else np.rint(acc).astype(first.dtype)
    return out


def weighted_mean_models(models: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> ModelDict:
    """Σ_i p_i·w_i with p_i = weights_i / Σ weights (FedAvg), in each array's own dtype
    (integer buffers are averaged in float64, then rounded back)."""
    p = np.asarray(weights, dtype=np.float64)
    p = p / p.sum()
    out: ModelDict = {}
    for key, first in models[0].items():
        floating = np.issubdtype(first.dtype, np.floating)
        acc = np.multiply(first, p[0], dtype=first.dtype if floating else np.float64)
        tmp = np.empty_like(acc)
        for model, weight in zip(models[1:], p[1:]):
            np.multiply(model[key], weight, out=tmp, casting="unsafe")
            acc += tmp
        out[key] = acc if floating else np.rint(acc).astype(first.dtype)
    return out


class NodeSampler:
    """Seeded node sampling that gives the same clients for the same seed on every run.

    Flower assigns random node ids, so sampling from ``grid.get_node_ids()`` directly would
    pick different partitions on every run. The sampler first asks every new node for a
    stable key (its partition id in simulation, its data path in deployment) with a QUERY
    message, orders the nodes by that key and samples with ``rng(seed, round)``.
    """

    def __init__(self, seed: int, num_per_round: int, timeout: float = 120.0) -> None:
        self.seed = seed
        self.num_per_round = num_per_round
        self.timeout = timeout
        self._keys: dict[int, str] = {}

    def ordered_nodes(self, grid: Grid, minimum: int) -> list[int]:
        """Connected node ids ordered by their stable key; waits until ``minimum`` are connected."""
        waited = 0.0
        while len(node_ids := sorted(grid.get_node_ids())) < minimum:
            if waited % 10 == 0:
                log(INFO, "Waiting for nodes: %d connected, %d required.", len(node_ids), minimum)
            time.sleep(1.0)
            waited += 1.0
        unknown = [n for n in node_ids if n not in self._keys]
        if unknown:
            self._keys.update(self._query_keys(grid, unknown))
        return sorted(node_ids, key=lambda n: (self._keys[n], n))

    def _query_keys(self, grid: Grid, node_ids: list[int], chunk: int = 100) -> dict[int, str]:
        keys = {node_id: f"~node:{node_id:020d}" for node_id in node_ids}
        # In chunks: Flower's in-memory message store scans every pending message for every
        # node, so N messages in flight cost N² (1,000 clients: seconds per poll).
        for start in range(0, len(node_ids), chunk):
            keys.update(self._query_chunk(grid, node_ids[start : start + chunk]))
        return keys

    def _query_chunk(self, grid: Grid, node_ids: list[int]) -> dict[int, str]:
        messages = [
            Message(
                content=RecordDict({"config": ConfigRecord({ROSTER_QUERY: 1})}),
                message_type=MessageType.QUERY,
                dst_node_id=node_id,
            )
            for node_id in node_ids
        ]
        keys: dict[int, str] = {}
        for reply in grid.send_and_receive(messages, timeout=self.timeout):
            if reply.has_error():
                log(WARNING, "Node %d did not report its key: %s", reply.metadata.src_node_id, reply.error.reason)
                continue
            record = next(iter(reply.content.config_records.values()), {})
            if ROSTER_KEY in record:
                keys[reply.metadata.src_node_id] = str(record[ROSTER_KEY])
        return keys

    def sample(self, grid: Grid, server_round: int, size: int | None = None, stream: int = 0) -> list[int]:
        """``size`` (default: ``num_per_round``) distinct nodes, in random order.

        ``stream`` separates independent samples of the same round (0: training, 1: evaluation).
        """
        size = self.num_per_round if size is None else size
        nodes = self.ordered_nodes(grid, size)
        rng = np.random.default_rng([self.seed, server_round] + ([stream] if stream else []))
        return [nodes[i] for i in rng.choice(len(nodes), size=size, replace=False)]


def evaluate_messages(
    sampler: NodeSampler, grid: Grid, server_round: int, fraction: float, arrays: ArrayRecord, config: ConfigRecord
) -> list[Message]:
    """EVALUATE messages carrying the global model to a seeded ``fraction`` of the nodes."""
    if fraction <= 0.0:
        return []
    num_nodes = len(list(grid.get_node_ids()))
    size = max(1, min(num_nodes, int(num_nodes * fraction)))
    config["server-round"] = server_round
    content = RecordDict({"arrays": arrays, "config": config})
    node_ids = sampler.sample(grid, server_round, size=size, stream=1)
    return [Message(content=content, message_type=MessageType.EVALUATE, dst_node_id=n) for n in node_ids]


def log_round_replies(server_round: int, expected: int, accepted: int, rejected: Iterable[str]) -> None:
    """One line per round saying how many replies came back, then one per rejected reply."""
    rejected = list(rejected)
    log(INFO, "round %d: %d/%d replies accepted", server_round, accepted, expected)
    for reason in rejected:
        log(WARNING, "\t> rejected: %s", reason)
