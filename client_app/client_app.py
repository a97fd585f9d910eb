"""The ClientApp: local training and evaluation of whatever model the server sends.

Every train/evaluate message carries the model (``arrays``) and a ``config`` record holding
the round, the run's resolved configuration as JSON (``fedmm-config``) and, for multi-model
strategies, the index of the model sent. The client needs no config of its own, except
where its data lives:

- simulation: ``partition-id`` / ``num-partitions`` from the node config select a partition;
- deployment: ``data-path`` in the node config points to the node's own dataset folder.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app.node_data import DATA_PATH_KEY, NodeDataError, load_node_data
from client_app.objectives import build_objective
from client_app.training import evaluate as evaluate_model
from client_app.training import resolve_device
from client_app.training import train as train_model
from fedmm.data import ImageData, load_partition
from fedmm.models import LayeredModel, build_model
from strategies.common import ROSTER_KEY

app = ClientApp()


def run_config_of(msg: Message) -> dict[str, Any]:
    """The run's resolved config sent by the server."""
    return json.loads(str(msg.content["config"]["fedmm-config"]))


def node_key(node_config: Mapping[str, Any], node_id: int) -> str:
    """A key that identifies this node's data across runs (used for reproducible sampling)."""
    if "partition-id" in node_config:
        return f"partition:{int(node_config['partition-id']):09d}"
    if "data-path" in node_config:
        return f"data:{node_config['data-path']}"
    return f"node:{node_id:020d}"


def local_data(cfg: Mapping[str, Any], context: Context) -> ImageData:
    """This node's training data: its own folder in deployment, its partition in simulation."""
    node_config = context.node_config
    if DATA_PATH_KEY in node_config:
        # Raises NodeDataError naming the node and the problem: Flower sends it back as the
        # error reply's reason, the server logs it and goes on with the other nodes.
        return load_node_data(cfg["dataset"], node_config[DATA_PATH_KEY], context.node_id)
    if "partition-id" not in node_config or "num-partitions" not in node_config:
        raise NodeDataError(
            f"node {context.node_id}: the node config has neither {DATA_PATH_KEY} (deployment) nor "
            f"partition-id/num-partitions (simulation); start the SuperNode with "
            f"--node-config \"{DATA_PATH_KEY}='/path/to/its/dataset'\""
        )
    return load_partition(
        cfg["dataset"],
        cfg["partition"],
        int(node_config["partition-id"]),
        int(node_config["num-partitions"]),
        int(cfg["seed"]),
    )


@functools.lru_cache(maxsize=4)
def _model(name: str, in_channels: int, num_classes: int, image_size: int) -> LayeredModel:
    # Built once per worker process; every message loads its own weights into it.
    return build_model(name, in_channels, num_classes, image_size)


def model_from_message(cfg: Mapping[str, Any], msg: Message) -> LayeredModel:
    """The configured architecture with the weights of the received ``arrays``."""
    d = cfg["dataset"]
    model = _model(cfg["model"]["name"], int(d["in_channels"]), int(d["num_classes"]), int(d["image_size"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict(), strict=True)
    return model


def reserved_cpus(cfg: Mapping[str, Any]) -> int:
    """CPU cores the simulation reserved for this ClientApp.

    Ray knows what it assigned to the actor (``flwr run``'s ``client-resources-num-cpus`` or
    fedmm's ``simulation.client_cpus``); outside Ray the config value is used.
    """
    try:
        import ray

        if ray.is_initialized():
            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
            if cpus:
                return max(1, int(cpus))
    except Exception:  # not running in a Ray worker
        pass
    return max(1, int(cfg["simulation"]["client_cpus"]))


def _set_threads(cfg: Mapping[str, Any], context: Context) -> None:
    # In simulation several ClientApps share the machine: use only the reserved cores.
    # A deployed SuperNode owns its machine and keeps torch's default.
    if "partition-id" in context.node_config:
        torch.set_num_threads(reserved_cpus(cfg))


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received model on the local data and send it back."""
    cfg = run_config_of(msg)
    _set_threads(cfg, context)
    server_round = int(msg.content["config"]["server-round"])
    data = local_data(cfg, context)
    model = model_from_message(cfg, msg)
    node = int(context.node_config.get("partition-id", context.node_id % (2**31)))
    seed = hash((int(cfg["seed"]), server_round, node)) % (2**63)
    generator = torch.Generator().manual_seed(seed)  # batch order
    torch.manual_seed(seed)  # dropout (VGG-16) draws from the global generator
    metrics = train_model(
        model,
        data,
        build_objective(cfg),
        cfg["training"],
        cfg["dataset"],
        server_round,
        generator,
        resolve_device(cfg["training"]["device"]),
    )
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord(metrics),
        }
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on the local data (federated evaluation)."""
    cfg = run_config_of(msg)
    _set_threads(cfg, context)
    data = local_data(cfg, context)
    model = model_from_message(cfg, msg)
    metrics = evaluate_model(model, data, cfg["dataset"], resolve_device(cfg["training"]["device"]))
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report this node's stable key so the server samples reproducibly."""
    reply = ConfigRecord({ROSTER_KEY: node_key(context.node_config, context.node_id)})
    return Message(content=RecordDict({"roster": reply}), reply_to=msg)
