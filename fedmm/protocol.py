"""The wire protocol between the ServerApp and the ClientApps: every name, and the codecs.

Every record name, config key and message action that crosses the wire is defined here and
imported everywhere else. Both apps import this module; it imports only ``flwr.app`` (never
``flwr.serverapp``, so a ClientApp process does not load the server side).

Messages (see docs/architecture.md for who writes and who reads each entry)
------------------------------------------------------------------------------
train (``MessageType.TRAIN``, or ``train.<phase>`` for a method's extra phases)
    down: ``arrays`` (ArrayRecord, the model), ``config`` (ConfigRecord: ``server-round``,
    ``model-index``, ``fedmm-config``), plus any extra records a method adds (e.g. a control
    variate); up: ``arrays`` (the trained model), ``metrics`` (MetricRecord with
    ``num-examples``), plus any extra records the client's local-update plugin adds.
evaluate (``MessageType.EVALUATE``)
    down: ``arrays``, ``config``; up: ``metrics`` (``accuracy``, ``loss``, ``num-examples``).
query (``MessageType.QUERY``) — optional capability
    down: ``config`` with ``fedmm-roster``; up: ``roster`` with ``node-key``, the node's stable
    identity (partition id or data path) used for seeded sampling. A ClientApp without a query
    handler answers with an error; the server then orders that node by its node id.

The first three names (``arrays``, ``config``, ``metrics``, ``num-examples``) are Flower's own
conventions, so the strategies work with any ClientApp that follows Flower's quickstart. The
names of FedMR's secure recombination live beside its code, in :mod:`fedmm.secure_protocol`.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

# ----------------------------------------------------------------------------- record names
#: ArrayRecord holding the model (Flower's convention, as ``FedAvg.arrayrecord_key``).
ARRAYS = "arrays"
#: ConfigRecord of a server message (Flower's convention, as ``FedAvg.configrecord_key``).
CONFIG = "config"
#: MetricRecord of a reply (Flower's convention).
METRICS = "metrics"
#: ConfigRecord of a roster reply.
ROSTER = "roster"

#: ``Context.state`` ConfigRecord: which experiment (a hash of its run config) the node's state belongs to.
STATE_EXPERIMENT = "fedmm-experiment"
#: Node state waiting for the server to accept the reply that made it (Context.state keys).
STATE_PENDING = "fedmm-pending"
#: Train config: the last round whose train reply of this node the server accepted (0: none).
ACCEPTED_ROUND = "accepted-round"

#: Reply metrics of the training loop itself. Every other reply metric (a client objective's own:
#: a contrastive loss, the age of a client's state, ...) is logged by the server per round: the mean
#: over the accepted replies, in ``metrics.jsonl`` with ``_`` for ``-``.
TRAINING_METRICS = ("train_loss", "train_time")

# ----------------------------------------------------------------------------- config keys
#: ``config``: the round being run (Flower's convention).
SERVER_ROUND = "server-round"
#: ``config``: index of the server model a train message carries (multi-model methods).
MODEL_INDEX = "model-index"
#: ``config`` of an asynchronous strategy's train message: how many train messages of the same
#: ``server-round`` this node got before this one (absent: none). The client mixes it into its
#: seed, so that two jobs of one node never share a batch order (strategies/asynchronous.py).
ROUND_REPEAT = "round-repeat"
#: ``config``: the run's resolved configuration as JSON (fedmm ClientApps read it).
RUN_CONFIG = "fedmm-config"
#: ``config`` of a QUERY: asks a node for its stable key.
ROSTER_QUERY = "fedmm-roster"
#: ``roster`` reply: the node's stable key.
NODE_KEY = "node-key"
#: ``config`` of a QUERY (with ``RUN_CONFIG``): asks the node for its number of training
#: examples too, answered as ``NUM_EXAMPLES`` in the ``roster`` reply (clustered sampling).
ROSTER_EXAMPLES = "fedmm-roster-examples"
#: Node config key (``--node-config``) of a deployed SuperNode: the folder of its own dataset.
DATA_PATH_KEY = "data-path"

#: ``metrics`` of a reply: examples the client trained / evaluated on (Flower's convention).
NUM_EXAMPLES = "num-examples"
#: ``metrics`` of a reply: the cross-entropy of the model the node received on the rows it trains
#: on, measured before training (the fedmm ClientApp measures it when a message asks: ``MEASURE``).
LOSS_BEFORE = "loss-before"
#: ``config`` of a train or evaluate message: the measurements a fedmm ClientApp adds to its reply
#: (a list of names; ``LOSS_BEFORE``). An evaluate message that asks measures on the training rows
#: and answers with those measurements and ``num-examples`` only.
MEASURE = "fedmm-measure"
#: What a fedmm ClientApp measures when a message asks (``MEASURE``).
MEASURABLE = (LOSS_BEFORE,)


def measurements_asked(content: Any) -> list[str]:
    """The measurements a message's ``config`` asks for (``MEASURE``; none: [])."""
    try:
        asked = content[CONFIG][MEASURE] if content is not None and CONFIG in content and MEASURE in content[CONFIG] else []
    except (KeyError, TypeError):
        return []
    return [asked] if isinstance(asked, str) else list(asked)

# ----------------------------------------------------------------------------- actions
TRAIN = MessageType.TRAIN
EVALUATE = MessageType.EVALUATE
QUERY = MessageType.QUERY


def train_action(phase: str | None = None) -> str:
    """Message type of a train phase: ``train`` or ``train.<phase>`` (Flower routes the
    latter to a ClientApp handler registered with ``@app.train("<phase>")``)."""
    return TRAIN if not phase else f"{TRAIN}.{phase}"


# ----------------------------------------------------------------------------- models
#: A model on the server: state_dict key -> numpy array. Treated as immutable: methods build
#: new dicts (sharing untouched arrays) instead of writing into existing ones.
ModelDict = dict[str, np.ndarray]

#: key -> (shape, dtype): what an ArrayRecord of a reply must match.
ArraySpec = dict[str, tuple[tuple[int, ...], np.dtype]]


#: ``Array.stype`` of a numpy array serialized in the ``.npy`` format (Flower's ``SType.NUMPY``).
NUMPY_STYPE = "numpy.ndarray"


def encode_array(value: np.ndarray) -> Array:
    """One array as Flower's ``Array``: the same ``.npy`` bytes as ``Array(ndarray)``, built
    with one copy of the data instead of two (no intermediate buffer)."""
    arr = np.require(value, requirements="C")
    header_fields = np.lib.format.header_data_from_array_1_0(arr)
    header = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(header, header_fields)
    except ValueError:  # a header too long for format 1.0, as np.save falls back
        header = io.BytesIO()
        np.lib.format.write_array_header_2_0(header, header_fields)
    data = b"".join((header.getvalue(), memoryview(arr).cast("B") if arr.size else b""))
    return Array(dtype=str(arr.dtype), shape=tuple(arr.shape), stype=NUMPY_STYPE, data=data)


def decode_array(array: Array, copy: bool = False) -> np.ndarray:
    """One ``Array`` as a numpy array.

    ``copy=False``: a read-only view of the record's bytes (no copy; the bytes live as long as
    the view). ``copy=True`` (or an encoding other than ``.npy`` format 1.0/2.0): a new,
    writable array. Raises ValueError when the bytes do not hold what the header says.
    """
    data = array.data
    if copy or array.stype != NUMPY_STYPE or not isinstance(data, bytes):
        return array.numpy()
    stream = io.BytesIO(data)
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(stream)
    else:
        return array.numpy()
    if dtype.hasobject:
        raise ValueError("object arrays are not accepted")
    count = int(np.prod(shape, dtype=np.int64))
    offset = stream.tell()
    if len(data) - offset != count * dtype.itemsize:
        raise ValueError(f"{len(data) - offset} data bytes for an array of shape {shape} and dtype {dtype}")
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if fortran_order else "C")


def model_to_record(model: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Encode a dict of numpy arrays as an ``ArrayRecord`` (order preserved)."""
    return ArrayRecord({key: encode_array(value) for key, value in model.items()})


def record_to_model(record: ArrayRecord, consume: bool = False, copy: bool = True) -> ModelDict:
    """Decode an ``ArrayRecord`` into a dict of numpy arrays (order preserved).

    ``copy=False`` returns read-only views of the record's bytes (see :func:`decode_array`):
    no copy, and with ``consume=True`` (each array popped from the record as it is decoded)
    the bytes then belong to the returned arrays alone. ``copy=True``: new writable arrays,
    and with ``consume=True`` each array's bytes are freed as soon as it is decoded.
    """
    if consume:
        return {key: decode_array(record.pop(key), copy) for key in list(record.keys())}
    return {key: decode_array(array, copy) for key, array in record.items()}


def array_spec(model: Mapping[str, np.ndarray]) -> ArraySpec:
    """Key -> (shape, dtype) of a model: what every reply must match."""
    return {key: (tuple(value.shape), value.dtype) for key, value in model.items()}


def check_arrays(model: Mapping[str, np.ndarray], spec: ArraySpec) -> str:
    """Why ``model`` does not match ``spec`` (keys, shapes, dtypes, NaN/Inf), or ``""``."""
    if list(model) != list(spec):
        missing = sorted(set(spec) - set(model))
        extra = sorted(set(model) - set(spec))
        return f"wrong keys (missing {missing[:5]}, unexpected {extra[:5]})"
    for key, (shape, dtype) in spec.items():
        value = model[key]
        if tuple(value.shape) != shape:
            return f"{key}: shape {tuple(value.shape)} != expected {shape}"
        if value.dtype != dtype:
            return f"{key}: dtype {value.dtype} != expected {dtype}"
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            return f"{key}: contains NaN or Inf"
    return ""


# ----------------------------------------------------------------------------- run config
def run_config_record(cfg: Mapping[str, Any]) -> str:
    """The run's resolved config as the JSON string sent in ``config[RUN_CONFIG]``."""
    return json.dumps(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg, sort_keys=True)


def run_config_text(msg: Message) -> str:
    """The run's resolved config sent by the server, as its JSON text."""
    return str(msg.content[CONFIG][RUN_CONFIG])


def read_run_config(msg: Message) -> dict[str, Any]:
    """The run's resolved config sent by the server, as a plain dict."""
    return json.loads(run_config_text(msg))


def server_round(msg: Message) -> int:
    """The round a server message belongs to."""
    return int(msg.content[CONFIG][SERVER_ROUND])


# ----------------------------------------------------------------------------- replies
@dataclass
class ClientUpdate:
    """One decoded, validated train reply.

    Attributes
    ----------
    node_id : int
        The node that sent it.
    slot : int
        Position of the node in the round's selection (= the index of the model it was sent,
        for multi-model methods).
    model : ModelDict
        The trained model (the reply's ``arrays`` record).
    num_examples : float
        The client's ``num-examples`` (0 when it reported none).
    metrics : dict
        Every numeric metric of the reply.
    extras : dict
        Further ArrayRecords the method asked for, by record name, decoded.
    sent : ModelDict or None
        The model the node was sent (set by the server's round: the reference of the update).
    staleness : int
        Aggregations the server made between sending that model and this reply (asynchronous
        rounds; 0 in a synchronous one).
    trained : bool
        False for a stand-in the round's end adds for a model of a method with a model per node
        whose node sent no usable reply: its ``model`` is the model it was sent, untrained.
    """

    node_id: int
    slot: int
    model: ModelDict
    num_examples: float
    metrics: dict[str, float]
    extras: dict[str, ModelDict] = field(default_factory=dict)
    sent: ModelDict | None = field(default=None, repr=False)
    staleness: int = 0
    trained: bool = True


def reply_metrics(reply: Message) -> dict[str, float]:
    """All numeric metrics of a reply (every MetricRecord, later records win)."""
    out: dict[str, float] = {}
    for record in reply.content.metric_records.values():
        for key, value in record.items():
            if isinstance(value, (int, float)):
                out[key] = float(value)
    return out


def decode_train_reply(
    reply: Message,
    slot: int,
    spec: ArraySpec,
    extra_specs: Mapping[str, ArraySpec] | None = None,
    consume: bool = True,
    copy: bool = True,
    *,
    arrays_key: str = ARRAYS,
    weight_key: str = NUM_EXAMPLES,
) -> tuple[ClientUpdate | None, str]:
    """Decode and validate a train reply.

    The model is the reply's ``arrays_key`` record; a reply that carries exactly one ArrayRecord
    under another name is accepted too (Flower's own strategies accept any name). The
    reply's ``weight_key`` metric is its example count. Each record
    named in ``extra_specs`` must be present and match its spec.

    Returns
    -------
    (update, "") when the reply is usable, (None, reason) otherwise. A reply is rejected when
    it carries an error, misses a record, or any array's keys, shapes or dtypes differ from
    the spec, or a floating-point array holds NaN or Inf. ``consume`` and ``copy``: as
    :func:`record_to_model` (``copy=False``: the update's arrays are read-only views of the
    reply's bytes).
    """
    node = reply.metadata.src_node_id
    if reply.has_error():
        return None, f"client error: {printable(client_error(reply.error.reason), 500)}"
    records = reply.content.array_records
    extra_specs = dict(extra_specs or {})
    if arrays_key in records:
        model_record = records[arrays_key]
    elif not extra_specs and len(records) == 1:
        model_record = next(iter(records.values()))
    else:
        return None, f"expected an ArrayRecord {arrays_key!r}, got {sorted(records) or 'none'}"
    missing = [name for name in extra_specs if name not in records]
    if missing:
        return None, f"missing record(s) {missing}"
    try:
        model = record_to_model(model_record, consume=consume, copy=copy)
        extras = {name: record_to_model(records[name], consume=consume, copy=copy) for name in extra_specs}
    except Exception as err:  # malformed bytes from a client must not stop the server
        return None, f"arrays could not be decoded: {printable(str(err))}"
    reason = check_arrays(model, spec)
    if reason:
        return None, reason
    for name, extra_spec in extra_specs.items():
        reason = check_arrays(extras[name], extra_spec)
        if reason:
            return None, f"{name}: {reason}"
    metrics = reply_metrics(reply)
    reason = check_metrics(metrics, weight_key)
    if reason:
        return None, reason
    return ClientUpdate(node, slot, model, metrics[weight_key], metrics, extras), ""


#: The largest ``num-examples`` a reply may report (a count of examples, not a weight to game).
MAX_NUM_EXAMPLES = 2**31 - 1
#: The longest stable node key a roster reply may carry (a partition id or a data path).
MAX_NODE_KEY = 256


def example_count(value: Any) -> int | None:
    """``value`` as a count of examples (a whole number in [1, MAX_NUM_EXAMPLES]), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return None
    if not math.isfinite(value) or value < 1 or value > MAX_NUM_EXAMPLES or value != int(value):
        return None
    return int(value)


def read_roster(reply: Message) -> tuple[str | None, int | None, str]:
    """(stable key, example count, why the reply is malformed or "") of a roster reply; a bad
    field is None and named in the reason, which is safe to log (:func:`printable`)."""
    try:
        record = reply.content.config_records.get(ROSTER)
        if record is None:
            record = next(iter(reply.content.config_records.values()), None)
    except Exception as err:  # noqa: BLE001 - whatever a node sends
        return None, None, f"unreadable roster reply ({printable(str(err))})"
    if record is None:
        return None, None, "no roster record"
    key: str | None = None
    count: int | None = None
    problems: list[str] = []
    if NODE_KEY in record:
        value = record[NODE_KEY]
        if isinstance(value, str) and 0 < len(value) <= MAX_NODE_KEY and value.isprintable():
            key = value
        else:
            problems.append(f"{NODE_KEY}={printable(repr(value))} is not a printable string of 1 to {MAX_NODE_KEY} characters")
    if NUM_EXAMPLES in record:
        count = example_count(record[NUM_EXAMPLES])
        if count is None:
            problems.append(f"{NUM_EXAMPLES}={printable(repr(record[NUM_EXAMPLES]))} is not a count of examples")
    return key, count, "; ".join(problems)


def printable(text: str, limit: int = 200) -> str:
    """``text`` safe for one log line: control characters escaped, at most ``limit`` characters."""
    escaped = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return escaped if len(escaped) <= limit else escaped[: limit - 3] + "..."


def check_metrics(metrics: Mapping[str, float], weight_key: str = NUM_EXAMPLES) -> str:
    """Why a train reply's metrics are unusable, or ``""``: ``weight_key`` (``num-examples``)
    must be a whole number in [1, 2**31 - 1] (it weighs the client's model), every metric finite."""
    for key, value in metrics.items():
        if not math.isfinite(value):
            return f"metric {printable(key)}={value} is not finite"
    if weight_key not in metrics:
        return f"no {printable(weight_key)} in the reply's metrics"
    n = metrics[weight_key]
    if n < 1 or n > MAX_NUM_EXAMPLES or n != int(n):
        return f"{printable(weight_key)}={n!r} is not a count of examples (a whole number from 1 to {MAX_NUM_EXAMPLES})"
    return ""


def check_evaluate_metrics(metrics: Mapping[str, float], weight_key: str = NUM_EXAMPLES) -> str:
    """Why an evaluate reply's metrics are unusable, or ``""``: every metric finite,
    ``weight_key`` a count, ``accuracy`` in [0, 1] and ``loss`` >= 0 where present."""
    for key, value in metrics.items():
        if not math.isfinite(value):
            return f"metric {printable(key)}={value} is not finite"
    if example_count(metrics.get(weight_key)) is None:
        return f"{printable(weight_key)}={metrics.get(weight_key)!r} is not a count of examples"
    if "accuracy" in metrics and not 0.0 <= metrics["accuracy"] <= 1.0:
        return f"accuracy={metrics['accuracy']!r} is not in [0, 1]"
    if "loss" in metrics and metrics["loss"] < 0:
        return f"loss={metrics['loss']!r} is negative"
    return ""


def client_error(reason: str) -> str:
    """The client's own exception from an error reply's reason, as ``Name: message``.

    A deployed SuperNode's reason is ``<class 'pkg.Name'>:<'message'>``; Flower's Ray engine's
    wraps a Ray traceback whose first exception line is the client's own exception (followed by
    Flower's ``ClientAppException`` and Ray's wrappers); the in-process engine's
    (:mod:`fedmm.local_engine`) wraps a ``ClientAppException`` whose message starts with the
    client's own exception line. Falls back to the reason's last line.
    """
    import re

    wrappers = ("ClientAppException", "RayTaskError", "RayActorError")
    wrapped = re.fullmatch(r"<class '([\w.]+)'>:<'(.*)'>", reason.strip(), flags=re.S)
    if wrapped:
        name = wrapped.group(1).rsplit(".", 1)[-1]
        if name not in wrappers:
            return f"{name}: {wrapped.group(2).strip()}"
        reason = wrapped.group(2)  # Flower's wrapper: the client's own exception is inside
    reason = reason.replace("Exception ClientAppException occurred. Message: ", "\n")
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    for line in lines:
        found = re.match(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Interrupt|Exit))(?::\s*(.*))?$", line)
        if found and found.group(1) not in wrappers:
            return f"{found.group(1)}: {found.group(2) or ''}".rstrip(": ")
    return lines[-1] if lines else reason


def weighted_metrics(metric_dicts: Iterable[Mapping[str, float]], weight_key: str = NUM_EXAMPLES) -> dict[str, float]:
    """Example-weighted mean of every numeric metric the dicts share (``weight_key`` summed).

    When no dict reports a positive ``weight_key``, every dict weighs the same.
    """
    records = [dict(m) for m in metric_dicts]
    if not records:
        return {}
    weights = np.array([r.get(weight_key, 0.0) for r in records], dtype=np.float64)
    if weights.sum() <= 0:
        weights = np.ones_like(weights)
    shared = set(records[0]).intersection(*map(set, records[1:])) - {weight_key}
    out = {weight_key: float(weights.sum())}
    for key in sorted(shared):
        values = np.array([rec[key] for rec in records], dtype=np.float64)
        out[key] = float((values * weights).sum() / weights.sum())
    return out


def finite_or_none(value: Any) -> Any:
    """``value``, or None for a non-finite float (JSON has no NaN/Inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# ----------------------------------------------------------------------------- builders
def server_message(
    message_type: str,
    node_id: int,
    config: Mapping[str, Any],
    arrays: ArrayRecord | None = None,
    extra: Mapping[str, Any] | None = None,
    *,
    arrays_key: str = ARRAYS,
    config_key: str = CONFIG,
) -> Message:
    """A server → node message: ``arrays`` (optional), its own ``config`` copy, extra records;
    the two records under ``arrays_key`` and ``config_key`` (a ClientApp's conventions)."""
    content: dict[str, Any] = {}
    if arrays is not None:
        content[arrays_key] = arrays
    content[config_key] = ConfigRecord(dict(config))
    content.update(extra or {})
    return Message(content=RecordDict(content), message_type=message_type, dst_node_id=node_id)


def reply_message(msg: Message, records: Mapping[str, Any]) -> Message:
    """A node's reply carrying ``records``."""
    return Message(content=RecordDict(dict(records)), reply_to=msg)


def metric_record(metrics: Mapping[str, float]) -> MetricRecord:
    """A MetricRecord of floats."""
    return MetricRecord({key: float(value) for key, value in metrics.items()})
