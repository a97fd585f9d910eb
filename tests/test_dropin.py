"""FedMR and FedCross as drop-in strategies of any Flower app: a real simulation (the in-process
engine, a Flower ``Grid`` that calls the ClientApp through Flower's own path; the Ray engine
gives the same numbers, tests/test_engines.py) against the quickstart-style ClientApp of
tests/quickstart_app.py, which has no query handler
and knows nothing of this project; the log reads like Flower's FedAvg's, and the Result holds
what Flower's holds plus the K models (and their own evaluation when asked for)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedmm import protocol
from fedmm.local_engine import run_local_simulation
from strategies import FedCross, FedMR
from strategies.base import MultiModelResult
from tests.fakes import FakeGrid
from tests.quickstart_app import Net, load_data
from tests.quickstart_app import app as quickstart_client_app

K, NODES, ROUNDS = 3, 4, 2


class SpyGrid:
    """Grid proxy that keeps the arrays of every train message, per round."""

    def __init__(self, grid: Grid) -> None:
        self.grid, self.sent = grid, {}

    def push_messages(self, messages):  # noqa: ANN001
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == "train":
                rnd = int(m.content["config"]["server-round"])
                self.sent.setdefault(rnd, []).append(m.content["arrays"].to_torch_state_dict())
        return self.grid.push_messages(messages)

    def __getattr__(self, name):  # noqa: ANN001
        return getattr(self.grid, name)


def central_accuracy(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """The user's ``evaluate_fn``: accuracy on the union of every node's data."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    correct = total = 0
    with torch.no_grad():
        for partition in range(NODES):
            x, y = load_data(partition)
            correct += int((model(x).argmax(1) == y).sum())
            total += len(y)
    return MetricRecord({"accuracy": correct / total})


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def quickstart_runs() -> dict:
    """One real simulation: FedMR (each model evaluated too) then FedCross, with federated
    evaluation on half the nodes and a central ``evaluate_fn``; the flwr log captured."""
    out: dict = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        torch.manual_seed(0)
        initial = ArrayRecord(Net().state_dict())
        for name, strategy in (("fedmr", FedMR(clients_per_round=K, seed=0, fraction_evaluate=0.5, evaluate_models=True)),
                               ("fedcross", FedCross(clients_per_round=K, seed=0, alpha=0.9, fraction_evaluate=0.5))):
            spy = SpyGrid(grid)
            capture = Capture()
            logging.getLogger("flwr").addHandler(capture)
            try:
                result = strategy.start(grid=spy, initial_arrays=initial, num_rounds=ROUNDS,
                                        train_config=ConfigRecord({"lr": 0.1}), evaluate_fn=central_accuracy)
            finally:
                logging.getLogger("flwr").removeHandler(capture)
            out[name] = (strategy, spy.sent, result, capture.records)

    run_local_simulation(server_app=server, client_app=quickstart_client_app, num_supernodes=NODES)
    return out


def test_fedmr_and_fedcross_run_against_a_plain_flower_clientapp(quickstart_runs: dict) -> None:
    out = {name: run[:3] for name, run in quickstart_runs.items()}
    torch.manual_seed(0)
    initial = Net().state_dict()
    for name in ("fedmr", "fedcross"):
        strategy, sent, result = out[name]
        assert sorted(sent) == [1, 2] and all(len(v) == K for v in sent.values())
        assert all(torch.equal(s[k], initial[k]) for s in sent[1] for k in initial)  # round 1: the initial model
        # round 2: K different models, none equal to the initial one: each node got its own
        for i in range(K):
            assert any(not torch.equal(sent[2][i][k], initial[k]) for k in initial)
            for j in range(i + 1, K):
                assert any(not torch.equal(sent[2][i][k], sent[2][j][k]) for k in initial), (name, i, j)
        assert strategy.context.last_round.replies == K
        assert len(strategy.pool()) == K
        final = result.arrays.to_torch_state_dict()
        assert all(torch.isfinite(v).all() for v in final.values())
        # the global model is the unweighted mean of the K trained models
        assert result.train_metrics_clientapp[ROUNDS]["replies"] == K
        assert result.train_metrics_clientapp[ROUNDS]["num-examples"] == 64 * K
    _, _, fedmr_result = out["fedmr"]
    np.testing.assert_allclose(fedmr_result.arrays["fc2.bias"].numpy(),
                               np.mean([m["fc2.bias"] for m in out["fedmr"][0].pool()], axis=0), rtol=1e-6)


def test_the_log_reads_like_flowers_fedavg(quickstart_runs: dict) -> None:
    for name, (strategy, _, result, records) in quickstart_runs.items():
        lines = [r.getMessage() for r in records]
        text = "\n".join(lines)
        assert not [r for r in records if r.levelno >= logging.ERROR], text  # no roster query, no traceback
        assert not [r for r in records if r.levelno == logging.WARNING], text  # every reply accepted
        assert f"Starting {type(strategy).__name__} strategy:" in text
        for line in ("\t├── Number of rounds: 2", "\t│\t├── Weighted by: 'num-examples'", "\t│\t├── ArrayRecord key: 'arrays'",
                     "\t│\t└── ConfigRecord key: 'config'", "\t├──> Models: 3 on the server, one per selected node"):
            assert any(line_.startswith(line) for line_ in lines), (line, text)
        assert text.count("configure_train: Sampled 3 nodes (out of 4)") == ROUNDS
        assert text.count("aggregate_train: Received 3 results and 0 failures") == ROUNDS
        assert text.count("configure_evaluate: Sampled 2 nodes (out of 4)") == ROUNDS
        assert text.count("aggregate_evaluate: Received 2 results and 0 failures") == ROUNDS
        assert text.count("Global evaluation") == ROUNDS
        # the initial evaluation, then per round: train and evaluate aggregates, global evaluation
        initial = lines.index(next(line for line in lines if line.startswith("Initial global evaluation results: ")))
        assert initial < lines.index("[ROUND 1/2]")
        aggregated = [line for line in lines if line.startswith("\t└──> Aggregated MetricRecord: ")]
        assert len(aggregated) == 2 * ROUNDS and all("'train_loss'" in a for a in aggregated[::2])
        assert all("'accuracy'" in a for a in aggregated[1::2])
        accuracy = result.evaluate_metrics_serverapp[ROUNDS]["accuracy"]
        assert f"\t└──> MetricRecord: {{'accuracy': {accuracy:.4g}}}" in lines
        assert "Final results:" in text
        # ... and the Result holds all of it
        assert sorted(result.train_metrics_clientapp) == [1, 2] and sorted(result.evaluate_metrics_clientapp) == [1, 2]
        assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]
        assert result.evaluate_metrics_clientapp[ROUNDS]["num-examples"] == 2 * 64
        assert isinstance(result, MultiModelResult) and len(result.models) == K


def test_each_of_the_k_models_is_evaluated_when_asked(quickstart_runs: dict) -> None:
    strategy, _, result, records = quickstart_runs["fedmr"]
    assert sorted(result.evaluate_metrics_models) == [1, 2] and all(len(v) == K for v in result.evaluate_metrics_models.values())
    # the records are the user's evaluate_fn on the server's K models (the ones sent next round)
    for index, arrays in enumerate(result.models):
        np.testing.assert_array_equal(arrays["fc1.weight"].numpy(), strategy.pool()[index]["fc1.weight"])
        assert result.evaluate_metrics_models[ROUNDS][index]["accuracy"] == central_accuracy(ROUNDS, arrays)["accuracy"]
    lines = [r.getMessage() for r in records]
    assert sum(line.startswith("\t└──> model ") for line in lines) == K * ROUNDS
    assert "ServerApp-side Evaluate Metrics of each model:" in str(result)
    assert quickstart_runs["fedcross"][2].evaluate_metrics_models == {}  # off by default


def keyed_client(msg: Message, key: str) -> RecordDict:
    """A ClientApp with other conventions: model in 'weights', config in 'cfg', weight 'n'."""
    model = {k: v.numpy() for k, v in msg.content["weights"].items()}
    assert "server-round" in msg.content["cfg"]
    n = 10 + int(key.split(":")[1])
    trained = {k: v + n for k, v in model.items()}
    return RecordDict({"weights": protocol.model_to_record(trained),
                       "m": MetricRecord({"n": n, "train_loss": float(n)})})


def test_flowers_record_keys_and_aggregation_functions_are_settable() -> None:
    seen: list = []

    def aggregate(records: list[RecordDict], weighted_by_key: str) -> MetricRecord:
        seen.append((len(records), weighted_by_key))
        return MetricRecord({"largest_n": max(float(r["metrics"][weighted_by_key]) for r in records)})

    initial = {"w": np.zeros(2, np.float32)}
    grid = FakeGrid(keyed_client, num_nodes=3)
    strategy = FedCross(clients_per_round=2, seed=0, alpha=0.5, weighted_by_key="n", arrayrecord_key="weights",
                        configrecord_key="cfg", train_metrics_aggr_fn=aggregate)
    result = strategy.start(grid=grid, initial_arrays=protocol.model_to_record(initial), num_rounds=1, final_report=False)
    assert strategy.context.last_round.replies == 2 and seen == [(2, "n")]
    assert result.train_metrics_clientapp[1]["largest_n"] in (11.0, 12.0)
    assert all("weights" in m.content and "cfg" in m.content for m in grid.sent)
    # the default key would reject these replies: no 'num-examples' in them
    plain = FedCross(clients_per_round=2, seed=0, alpha=0.5, arrayrecord_key="weights", configrecord_key="cfg")
    plain.start(grid=FakeGrid(keyed_client, num_nodes=3), initial_arrays=protocol.model_to_record(initial), num_rounds=1,
                final_report=False)
    assert plain.context.last_round.replies == 0 and all("no num-examples" in r for r in plain.context.last_round.rejections)
    with pytest.raises(ValueError, match="weighted_by_key"):
        FedMR(clients_per_round=2, seed=0, weighted_by_key="")


def test_flowers_should_stop_ends_the_run_after_the_round_it_says_so() -> None:
    """Flower 1.43's ``Strategy.start(..., evaluate_fn, should_stop)``: taken in Flower's place
    (positionally after ``evaluate_fn``) on every Flower; after the round it returns True the run
    ends there with the result so far, and the strategy says why."""
    import inspect

    import numpy as np
    from flwr.app import MetricRecord, RecordDict
    from flwr.serverapp.strategy import Strategy

    from fedmm import protocol
    from strategies import FedCross, FedMR
    from tests.fakes import FakeGrid

    ours = list(inspect.signature(FedMR.start).parameters)
    assert ours[ours.index("evaluate_fn") + 1] == "should_stop"
    if "should_stop" in inspect.signature(Strategy.start).parameters:  # Flower 1.43+: the same place
        theirs = list(inspect.signature(Strategy.start).parameters)
        assert theirs.index("should_stop") == ours.index("should_stop")

    def node(msg, key):  # noqa: ANN001, ANN202
        model = protocol.record_to_model(msg.content["arrays"], copy=True)
        return RecordDict({"arrays": protocol.model_to_record({"w": model["w"] + 1}),
                           "metrics": MetricRecord({protocol.NUM_EXAMPLES: 1.0})})

    for cls in (FedMR, FedCross):
        asked: list[int] = []
        strategy = cls(2, seed=0)
        result = strategy.start(FakeGrid(node, num_nodes=2), protocol.model_to_record({"w": np.zeros(2, np.float32)}), 5,
                                60, None, None, lambda r, a: MetricRecord({"accuracy": 0.1 * r}),
                                lambda r, res: asked.append(r) or r == 2, final_report=False)
        assert asked == [1, 2] and sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]
        assert strategy.context.stopped == "should_stop returned True after round 2"
