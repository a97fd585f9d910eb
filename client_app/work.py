"""The node's heavy work: its data, the model, local training and evaluation.

Imported by the ClientApp's handlers when a message needs it, so that a message that moves no
model through torch (a roster query, the relay stages of secure recombination) does not pay for
importing torch and the data stack: a deployed SuperNode starts a fresh ClientApp process for
every message.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord

from objectives.base import build_local_update
from client_app.node_data import DATA_PATH_KEY, NodeDataError, load_node_data
from client_app.training import train as train_model
from fedmm import protocol
from fedmm.config import RunSettings, client_run
from fedmm.data import InputSpec, TensorData, input_spec, load_partition, local_split
from fedmm.evaluation import evaluate as evaluate_model
from fedmm.evaluation import resolve_device
from fedmm.models import LayeredModel, build_model, model_options


def local_data(run: RunSettings, context: Context, part: str = "train") -> TensorData:
    """This node's data: its own folder in deployment, its partition in simulation.

    ``part="train"`` are the rows it trains on; ``part="test"`` the ``partition.local_test_fraction``
    of its rows held out for federated evaluation (never trained on).
    """
    node_config = context.node_config
    if DATA_PATH_KEY in node_config:
        # Raises NodeDataError naming the node and the problem: Flower sends it back as the
        # error reply's reason, the server logs it and goes on with the other nodes.
        data = load_node_data(run.dataset, node_config[DATA_PATH_KEY], context.node_id)
        held_out = run.partition.local_test_fraction
        if part == "train" and not held_out:
            return data
        train_rows, test_rows = local_split(np.arange(len(data)), held_out, run.seed, 0)
        return data.subset(train_rows if part == "train" else test_rows)
    if "partition-id" not in node_config or "num-partitions" not in node_config:
        raise NodeDataError(
            f"node {context.node_id}: the node config has neither {DATA_PATH_KEY} (deployment) nor "
            f"partition-id/num-partitions (simulation); start the SuperNode with "
            f"--node-config \"{DATA_PATH_KEY}='/path/to/its/dataset'\""
        )
    return load_partition(
        run.dataset,
        run.partition,
        int(node_config["partition-id"]),
        int(node_config["num-partitions"]),
        run.seed,
        part,
    )


@functools.lru_cache(maxsize=4)
def _cached_model(name: str, spec: InputSpec, projection_dim: int | None, options: tuple[tuple[str, Any], ...]) -> LayeredModel:
    # Built once per worker process; every message loads its own weights into it.
    return build_model(name, spec, projection_dim, dict(options))


def _model(run: RunSettings) -> LayeredModel:
    """The run's architecture (with its options and projection head), as the server builds it."""
    return _cached_model(run.model.name, input_spec(run.dataset), run.model.projection_dim, model_options(run.model))


def model_from_message(run: RunSettings, msg: Message) -> LayeredModel:
    """The configured architecture with the weights of the received ``arrays``.

    The arrays are read as views of the message's bytes and copied once, into the model
    (``load_state_dict`` copies; nothing writes into the views).
    """
    model = _model(run)
    arrays = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        state = {key: torch.from_numpy(value) for key, value in arrays.items()}
    model.load_state_dict(state, strict=True)
    return model


def model_record(model: torch.nn.Module) -> ArrayRecord:
    """The model's ``state_dict`` as the reply's ArrayRecord (the bytes of ``ArrayRecord(state_dict)``,
    with one copy of each tensor instead of two)."""
    return protocol.model_to_record({key: value.detach().cpu().numpy() for key, value in model.state_dict().items()})


def reserved_cpus(run: RunSettings) -> int | None:
    """CPU cores a Ray simulation reserved for this ClientApp (``flwr run``'s
    ``client-resources-num-cpus`` or fedmm's ``simulation.client_cpus``), as Ray assigned them to
    the worker's actor; None outside a Ray worker (a deployed SuperNode, the in-process engine),
    where the ClientApp keeps the process's thread count."""
    return _ray_assigned_cpus()


@functools.lru_cache(maxsize=1)
def _ray_assigned_cpus() -> int | None:
    # What Ray reserved for this worker's actor: fixed for the worker's life, asked once. A Ray
    # worker has imported ray before it runs any ClientApp; elsewhere ray is not imported for it.
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
            if cpus:
                return max(1, int(cpus))
    except Exception:  # not running in a Ray worker
        pass
    return None


def _set_threads(run: RunSettings, context: Context) -> None:
    # In a Ray simulation several ClientApps share the machine: use only the reserved cores.
    # A deployed SuperNode owns its machine, and the in-process engine runs one ClientApp at a
    # time in the ServerApp's process: both keep the process's thread count.
    if "partition-id" in context.node_config:
        threads = reserved_cpus(run)
        if threads and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def seed_for(run: RunSettings, server_round: int, context: Context, repeat: int = 0) -> int:
    """The seed of this node's round: batch order and dropout depend on (seed, round, node) only,
    and on ``repeat`` (``round-repeat``) for a node's further jobs of one round (asynchronous
    strategies)."""
    node = int(context.node_config.get("partition-id", context.node_id % (2**31)))
    return hash((run.seed, server_round, node) + ((repeat,) if repeat else ())) % (2**63)


def measured(run: RunSettings, content: Any, model: torch.nn.Module, data: TensorData) -> dict[str, float]:
    """The measurements the message asks for (``fedmm-measure``: :data:`fedmm.protocol.MEASURABLE`)
    of ``model`` as received, before any training: ``loss-before``, its cross-entropy on ``data``
    (the rows the node trains on; eval mode, no gradient, no random draw)."""
    asked = protocol.measurements_asked(content)
    unknown = [name for name in asked if name not in protocol.MEASURABLE]
    if unknown:
        raise ValueError(f"{protocol.MEASURE}={unknown}: this ClientApp measures {', '.join(protocol.MEASURABLE)}")
    if protocol.LOSS_BEFORE not in asked:
        return {}
    return {protocol.LOSS_BEFORE: evaluate_model(model, data, resolve_device(run.training.device))["loss"]}


def local_training(
    run: RunSettings, context: Context, server_round: int, model: LayeredModel, content: Any = None, repeat: int = 0,
    data: TensorData | None = None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Train ``model`` in place on this node's data (``data``: these rows instead) with the
    configured local-update plugin; return the metrics (with the measurements the message asks
    for, taken before training) and the plugin's extra reply records."""
    _set_threads(run, context)
    data = local_data(run, context) if data is None else data
    before = measured(run, content, model, data)
    seed = seed_for(run, server_round, context, repeat)
    generator = torch.Generator().manual_seed(seed)  # batch order
    torch.manual_seed(seed)  # dropout (VGG-16) draws from the global generator
    update = build_local_update(run, context.state, content)
    update.node = int(context.node_config.get("partition-id", context.node_id % (2**31)))
    metrics = train_model(
        model, data, update, run.training, server_round, generator, resolve_device(run.training.device)
    )
    extra = update.end(model)
    metrics.update(update.metrics())
    metrics.update(before)
    return metrics, extra


class ClientOutOfMemory(RuntimeError):
    """CUDA ran out of memory in this ClientApp; the message says what to change."""


@contextlib.contextmanager
def cuda_memory_advice(run: RunSettings, what: str) -> Iterator[None]:
    """Turn CUDA's out-of-memory error into one the server log makes useful: the node's memory is
    freed first (so the ClientApp's next message, in the same long-lived Ray actor, starts
    clean), then :class:`ClientOutOfMemory` says how much the device has and which settings
    size the demand (the server logs it as the node's rejected reply; the round goes on)."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as err:
        gc.collect()
        free_text = ""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            try:
                free, total = torch.cuda.mem_get_info()
                free_text = f" ({free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB after freeing this client's memory)"
            except RuntimeError:
                pass
        share = run.simulation.client_gpus
        if share > 0:  # Ray runs floor(1 / share) ClientApps on a GPU at once
            advice = (f"simulation.client_gpus={share:g} ({int(1 / share)} ClientApps per GPU); give each ClientApp a "
                      f"larger share (fewer at once), or lower training.batch_size={run.training.batch_size}")
        else:  # one ClientApp at a time (the in-process engine), beside what its process holds on the device
            advice = (f"one ClientApp at a time, beside what its process holds on the device (in-process: the "
                      f"server's central evaluation); lower training.batch_size={run.training.batch_size}, or start "
                      f"fedmm with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        raise ClientOutOfMemory(
            f"CUDA out of memory during {what}{free_text}: {advice}; docs/gpu.md, 'CUDA out of memory'. "
            f"[{str(err).splitlines()[0][:200]}]"
        ) from None


def train_reply(msg: Message, context: Context, data: TensorData | None = None) -> Message:
    """The reply to a train message: the received model trained on the local data (``data``:
    these rows instead, e.g. a ClientApp of one's own that alters a node's data)."""
    run = client_run(protocol.run_config_text(msg))
    _set_threads(run, context)
    with cuda_memory_advice(run, "local training"):
        model = model_from_message(run, msg)
        repeat = int(msg.content[protocol.CONFIG].get(protocol.ROUND_REPEAT, 0))
        metrics, extra = local_training(run, context, protocol.server_round(msg), model, msg.content, repeat, data)
    records = {protocol.ARRAYS: model_record(model), protocol.METRICS: MetricRecord(metrics)}
    records.update(extra)
    return protocol.reply_message(msg, records)


def secure_train(run: RunSettings, context: Context, server_round: int, arrays: protocol.ModelDict) -> tuple[protocol.ModelDict, dict[str, float]]:
    # local training inside secure recombination: the model the node holds at that point
    _set_threads(run, context)
    model = _model(run)
    model.load_state_dict({key: torch.from_numpy(np.array(value)) for key, value in arrays.items()}, strict=True)
    metrics, extra = local_training(run, context, server_round, model)
    if extra:
        raise ValueError(f"objective.name={run.objective.name!r} replies with {sorted(extra)}, which secure recombination does not relay")
    return {key: value.detach().cpu().numpy().copy() for key, value in model.state_dict().items()}, metrics


def evaluate_reply(msg: Message, context: Context) -> Message:
    """The reply to an evaluate message: the received model on this node's held-out rows; when
    the message asks for measurements (``fedmm-measure``: a selector's, e.g. Power-of-Choice's
    losses), those on the rows it trains on, with ``num-examples``."""
    run = client_run(protocol.run_config_text(msg))
    _set_threads(run, context)
    asked = protocol.measurements_asked(msg.content)
    data = local_data(run, context, part="train" if asked else "test")
    with cuda_memory_advice(run, "evaluation"):
        model = model_from_message(run, msg)
        if asked:
            metrics = {**measured(run, msg.content, model, data), protocol.NUM_EXAMPLES: float(len(data))}
        else:
            metrics = evaluate_model(model, data, resolve_device(run.training.device))
    return protocol.reply_message(msg, {protocol.METRICS: MetricRecord(metrics)})
