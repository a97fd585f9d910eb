"""No client can crash the server: property-based replies of every kind (train, evaluate, roster,
every secure-recombination phase) with NaN, ±inf, huge, negative and zero numbers, wrong types,
bytes, missing and extra keys. The server never raises; every bad reply is rejected and counted."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fedmm import protocol, secure_protocol
from tests.conftest import composed
from tests.fakes import FakeGrid

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

#: Anything a ConfigRecord / MetricRecord value can be, the hostile parts first.
numbers = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, 0, -1, 0.5, 2**31, 2**62, -(2**62), 1e308]),
                    st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-(2**63), max_value=2**63 - 1))
config_values = st.one_of(numbers, st.booleans(), st.text(max_size=300), st.binary(max_size=64),
                          st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=4), st.lists(st.text(max_size=5), max_size=3))


def model() -> dict[str, np.ndarray]:
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32), "n": np.array(4, np.int64)}


# ------------------------------------------------------------------------------------- roster
@FUZZ
@given(record=st.dictionaries(st.sampled_from([protocol.NODE_KEY, protocol.NUM_EXAMPLES, "other"]), config_values, max_size=3))
def test_roster_replies(record: dict) -> None:
    try:
        content = RecordDict({protocol.ROSTER: ConfigRecord(record)})
    except Exception:  # not even a record Flower would carry
        assume(False)
    query = protocol.server_message(protocol.QUERY, 1, {protocol.ROSTER_QUERY: 1})
    key, count, reason = protocol.read_roster(Message(content, reply_to=query))
    good_key = isinstance(record.get(protocol.NODE_KEY), str) and 0 < len(record[protocol.NODE_KEY]) <= protocol.MAX_NODE_KEY \
        and record[protocol.NODE_KEY].isprintable()
    assert (key is not None) == good_key
    assert count is None or (1 <= count <= protocol.MAX_NUM_EXAMPLES)
    assert reason.isprintable() and len(reason) < 1000


@FUZZ
@given(bad=config_values)
def test_a_roster_query_survives_a_bad_node(bad: object) -> None:
    from strategies.selection import SeededRosterSelector

    class Grid(FakeGrid):
        def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN202
            replies = super().send_and_receive(messages, timeout=timeout)
            first = replies[0]  # one node answers with a hostile roster
            try:
                content = RecordDict({protocol.ROSTER: ConfigRecord({protocol.NODE_KEY: bad, protocol.NUM_EXAMPLES: bad})})
            except Exception:
                content = RecordDict({protocol.ROSTER: MetricRecord({protocol.NUM_EXAMPLES: 1.0})})
            replies[0] = Message(content, reply_to=self.queries[[q.metadata.dst_node_id for q in self.queries].index(first.metadata.src_node_id)])
            return replies

    grid = Grid(lambda m, k: RecordDict(), num_nodes=3)
    selector = SeededRosterSelector(seed=0, query_config={protocol.ROSTER_EXAMPLES: 1})
    assert len(selector.select(grid, 1, 2)) == 2
    assert all(v is None or 1 <= v <= protocol.MAX_NUM_EXAMPLES for v in selector.all_num_examples().values())


# ------------------------------------------------------------------------------- train replies
CORRUPTIONS = ("nan", "inf", "shape", "dtype", "missing-arrays", "arrays-as-config", "num-examples", "metric",
               "error", "missing-extra", "bytes")


def corrupted(msg: Message, spec_extras: dict, how: str, value: object) -> RecordDict:
    """A reply to ``msg`` broken in one way (the rest as a good client's)."""
    arrays = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=True)
    extras = {name: protocol.model_to_record({k: np.zeros(shape, dtype) for k, (shape, dtype) in spec.items()})
              for name, spec in spec_extras.items()}
    metrics = {protocol.NUM_EXAMPLES: 10.0, "train_loss": 0.1}
    if how == "nan":
        arrays["w"] = arrays["w"] * np.float32(math.nan)
    elif how == "inf":
        arrays["b"] = arrays["b"] + np.float32(math.inf)
    elif how == "shape":
        arrays["w"] = np.zeros((3, 2), np.float32)
    elif how == "dtype":
        arrays["w"] = arrays["w"].astype(np.float64)
    elif how == "num-examples":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assume(protocol.example_count(value) is None)
            metrics[protocol.NUM_EXAMPLES] = value
        else:
            del metrics[protocol.NUM_EXAMPLES]
    elif how == "metric":
        metrics["train_loss"] = math.nan
    elif how == "error":
        raise RuntimeError(f"hostile client: {value!r}")
    content = {protocol.ARRAYS: protocol.model_to_record(arrays), protocol.METRICS: MetricRecord(metrics), **extras}
    if how == "missing-arrays":
        del content[protocol.ARRAYS]
        content["something"] = ConfigRecord({"x": 1})
    elif how == "arrays-as-config":
        try:
            content[protocol.ARRAYS] = ConfigRecord({"w": value})
        except Exception:
            content[protocol.ARRAYS] = ConfigRecord({"w": 1})
    elif how == "missing-extra":
        if not extras:
            content[protocol.ARRAYS] = protocol.model_to_record({"w": arrays["w"]})  # a key missing
        else:
            del content[next(iter(extras))]
    elif how == "bytes":
        content[protocol.ARRAYS] = ArrayRecord({"w": Array(dtype="float32", shape=(2, 3), stype="numpy.ndarray", data=b"\x00garbage")})
    return RecordDict(content)


def fuzzed_methods() -> list[str]:
    """Every method the app finds by discovery (a new one is fuzzed with no list edited)."""
    from fedmm.settings import discover

    return sorted(discover("strategy"))


#: A model every method takes: entries to corrupt (``w``, ``b``, an integer counter) and a
#: classifier head (FedGen shapes its generator for it).
def fuzz_model() -> dict[str, np.ndarray]:
    return {**model(), "fc.weight": np.zeros((10, 4), np.float32), "fc.bias": np.zeros(10, np.float32)}


def train_replies_of(name: str, how: str, value: object) -> None:
    """One round of method ``name`` (through its own loop, whichever driver) over three nodes,
    one hostile in the way ``how``: the server does not raise, the hostile reply is rejected
    and counted out, the global model stays finite. Every reply carries what the method needs
    (its ``needs``: records and metrics), so the hostile one is wrong in that one way only."""
    from strategies import build_strategy

    strategy = build_strategy(composed(f"strategy={name}", "num_clients=3", "clients_per_round=3"))

    def node(msg: Message, key: str) -> RecordDict:
        needs = strategy.needs(1)
        if key == "partition:000000000":  # one hostile client
            content = corrupted(msg, dict(needs.arrays), how, value)
            if protocol.METRICS in content:
                for metric in needs.metrics:
                    content[protocol.METRICS][metric] = 1.0
            return content
        extras = {n: protocol.model_to_record({k: np.zeros(shape, dtype) for k, (shape, dtype) in spec.items()})
                  for n, spec in needs.arrays.items()}
        metrics = {protocol.NUM_EXAMPLES: 10.0, "train_loss": 0.1, **dict.fromkeys(needs.metrics, 1.0)}
        arrays = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=True)
        return RecordDict({protocol.ARRAYS: protocol.model_to_record(arrays), protocol.METRICS: MetricRecord(metrics), **extras})

    grid = FakeGrid(node, num_nodes=3)
    result = strategy.start(grid, protocol.model_to_record(fuzz_model()), num_rounds=1, final_report=False)  # never raises
    hostile = next(n for n, key in grid.keys.items() if key == "partition:000000000")
    outcome = strategy.context.last_round
    assert any(r.startswith(f"node {hostile}") for r in outcome.rejections)  # rejected with its reason
    # counted out: the two honest replies of a synchronous round; an asynchronous round ends after
    # B = 2 ended jobs, which the hostile node's retried jobs may be
    assert outcome.replies == 2 if strategy.settings.driver != "async" else outcome.replies in (0, 2)
    assert all(np.isfinite(v).all() for v in protocol.record_to_model(result.arrays).values() if v.dtype.kind == "f")


@pytest.mark.parametrize("name", fuzzed_methods())
@settings(max_examples=12, deadline=None)
@given(how=st.sampled_from(CORRUPTIONS), value=config_values)
def test_train_replies_of_every_strategy(name: str, how: str, value: object) -> None:
    train_replies_of(name, how, value)


# ---------------------------------------------------------------------------- evaluate replies
@FUZZ
@given(metrics=st.dictionaries(st.sampled_from([protocol.NUM_EXAMPLES, "accuracy", "loss", "other"]), numbers, max_size=4),
       error=st.booleans())
def test_evaluate_replies(metrics: dict, error: bool) -> None:
    from flwr.app import Error

    from strategies import build_strategy

    strategy = build_strategy(composed("num_clients=3", "clients_per_round=2"))
    query = protocol.server_message(protocol.EVALUATE, 1, {})
    good = Message(RecordDict({protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 5, "accuracy": 0.5, "loss": 1.0})}), reply_to=query)
    try:
        hostile = Message(Error(code=1, reason="\x1b[31mboom\n"), reply_to=query) if error else \
            Message(RecordDict({protocol.METRICS: MetricRecord(metrics)}), reply_to=query)
    except Exception:
        assume(False)
    result = strategy.aggregate_evaluate(1, [good, hostile])
    assert result is not None
    bad = error or bool(protocol.check_evaluate_metrics(protocol.reply_metrics(hostile)))
    if bad:  # only the good reply counts
        assert result["accuracy"] == 0.5 and result[protocol.NUM_EXAMPLES] == 5


# ---------------------------------------------------------------------------- secure phases
@pytest.mark.parametrize("action", [secure_protocol.SECURE_KEYS, secure_protocol.SECURE_SEND, secure_protocol.SECURE_RETURN, secure_protocol.SECURE_UPLOAD])
@settings(max_examples=10, deadline=None)
@given(field=st.sampled_from(["drop-record", "config-value", "swap-record"]), value=config_values)
def test_secure_phase_replies(action: str, field: str, value: object) -> None:
    from client_app import secure as client_secure
    from strategies.fedmr import FedMR
    from strategies.secure_recombination import SecureRecombination
    from tests.test_secure_recombination import RUN_CONFIG, Nodes, RecordingGrid, initial_model

    class Hostile(Nodes):
        def __call__(self, msg: Message, key: str) -> RecordDict:
            content = super().__call__(msg, key)
            if key != "partition:000000001" or msg.metadata.message_type.partition(".")[2] != action:
                return content
            name = next(iter(content.keys()))
            if field == "drop-record":
                del content[name]
            elif field == "config-value":
                record = content[name]
                target = next(iter(record.keys()), "x")
                try:
                    kept = dict(record.items()) if isinstance(record, ConfigRecord) else {}
                    content[name] = ConfigRecord({**kept, target: value})
                except Exception:
                    content[name] = ConfigRecord({target: 1})
            else:
                content[name] = MetricRecord({"x": 1.0})
            return content

    secure = SecureRecombination(mode="after", repetitions=2, min_layers=1)
    strategy = FedMR(clients_per_round=4, seed=1, secure=secure)
    holder: dict = {}
    grid = RecordingGrid(lambda msg, key: holder["nodes"](msg, key), num_nodes=4, seed=1)
    holder["nodes"] = Hostile(grid.keys)
    base = initial_model()
    strategy.initialize(base)
    strategy.global_model = base
    config = ConfigRecord({protocol.RUN_CONFIG: json.dumps(RUN_CONFIG)})
    strategy.context.driver.run(1, grid, protocol.model_to_record(base), config, timeout=10)  # never raises
    assert strategy.context.last_round.replies <= 4
    assert client_secure  # the real client handlers answered the other nodes


# ----------------------------------------------------------------------------- bounded influence
@pytest.mark.parametrize("source", ["roster", "cap"])
def test_a_reply_may_not_claim_more_examples_than_its_node_has(source: str) -> None:
    """A reply's num-examples weighs its model in the mean: above the node's roster size (or the
    configured cap) it is rejected, whatever the method."""
    from fedmm.config import compose
    from strategies import build_strategy
    from strategies.selection import SeededRosterSelector

    overrides = ["num_clients=3", "clients_per_round=3"] + (["strategy.max_num_examples=50"] if source == "cap" else [])
    strategy = build_strategy(compose(overrides))
    if source == "roster":
        strategy.context.selector = SeededRosterSelector(seed=0, query_config={protocol.ROSTER_EXAMPLES: 1})
    strategy.initialize(model())

    def node(msg: Message, key: str) -> RecordDict:
        claimed = 10**6 if key == "partition:000000002" else 10  # one node inflates its weight
        arrays = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=True)
        return RecordDict({protocol.ARRAYS: protocol.model_to_record(arrays),
                           protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: float(claimed)})})

    grid = FakeGrid(node, num_nodes=3, examples={f"partition:{i:09d}": 20 for i in range(3)})
    messages = list(strategy.configure_train(1, protocol.model_to_record(model()), ConfigRecord({"x": 1}), grid))
    strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert strategy.context.last_round.replies == 2
    assert any("exceeds" in r and ("roster" in r if source == "roster" else "max_num_examples" in r) for r in strategy.context.last_round.rejections)
