"""FedAvg: the aggregate is the hand-computed example-weighted mean; sampling is reproducible."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedmm.protocol import model_to_record, record_to_model
from strategies.fedavg import FedAvg
from tests.fakes import FakeGrid

# what each node trains to, and how many examples it reports
NODE_W = {f"partition:{i:09d}": np.full((2, 2), float(i + 1), dtype=np.float32) for i in range(4)}
NODE_N = {f"partition:{i:09d}": float(10 * (i + 1)) for i in range(4)}


def node(msg, key):
    model = {"w": NODE_W[key], "steps": np.array(3, dtype=np.int64)}
    return RecordDict({"arrays": model_to_record(model), "metrics": MetricRecord({"num-examples": NODE_N[key], "train_loss": NODE_N[key] / 10})})


def initial():
    return model_to_record({"w": np.zeros((2, 2), np.float32), "steps": np.array(0, dtype=np.int64)})


def test_aggregate_equals_weighted_mean_by_hand() -> None:
    grid = FakeGrid(node, num_nodes=4)
    strategy = FedAvg(clients_per_round=4, seed=0)
    messages = strategy.configure_train(1, initial(), ConfigRecord(), grid)
    arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    out = record_to_model(arrays)
    # (1*10 + 2*20 + 3*30 + 4*40) / (10+20+30+40) = 300 / 100 = 3.0
    np.testing.assert_allclose(out["w"], np.full((2, 2), 3.0), rtol=1e-6)
    assert out["w"].dtype == np.float32
    assert out["steps"].dtype == np.int64 and int(out["steps"]) == 3
    assert metrics["train_loss"] == 3.0


def test_malformed_replies_are_dropped_not_fatal() -> None:
    def bad_node(msg, key):
        if key.endswith("0"):
            return RecordDict({"arrays": model_to_record({"w": np.full((2, 2), np.nan, np.float32), "steps": np.array(1)}),
                               "metrics": MetricRecord({"num-examples": 1.0})})
        if key.endswith("1"):
            raise RuntimeError("out of memory")
        return node(msg, key)

    grid = FakeGrid(bad_node, num_nodes=4)
    strategy = FedAvg(clients_per_round=4, seed=0)
    arrays, _ = strategy.aggregate_train(1, grid.send_and_receive(strategy.configure_train(1, initial(), ConfigRecord(), grid)))
    # only partitions 2 and 3 count: (3*30 + 4*40) / 70
    np.testing.assert_allclose(record_to_model(arrays)["w"], np.full((2, 2), 250 / 70), rtol=1e-6)


def test_sampling_is_reproducible_across_node_id_assignments_when_the_app_opts_in() -> None:
    from strategies.selection import SeededRosterSelector

    def sampled_keys(grid_seed: int, seed: int, query: bool = True) -> tuple[list[list[str]], int]:
        grid = FakeGrid(node, num_nodes=10, seed=grid_seed)  # different random node ids
        strategy = FedAvg(clients_per_round=3, seed=seed, selector=SeededRosterSelector(seed, query=query))
        out = []
        for rnd in (1, 2, 3):
            msgs = strategy.configure_train(rnd, initial(), ConfigRecord(), grid)
            out.append([grid.keys[m.metadata.dst_node_id] for m in msgs])
        return out, len(grid.queries)

    assert sampled_keys(0, seed=5)[0] == sampled_keys(1, seed=5)[0]
    assert sampled_keys(0, seed=5)[0] != sampled_keys(0, seed=6)[0]
    rounds, queries = sampled_keys(0, seed=5)
    assert all(len(set(r)) == 3 for r in rounds) and queries == 10  # one roster query per node, once
    # a strategy made in any Flower app (the default selector) sends no query at all: a plain
    # Flower ClientApp has no query handler
    grid = FakeGrid(node, num_nodes=10, seed=0)
    list(FedAvg(clients_per_round=3, seed=5).configure_train(1, initial(), ConfigRecord(), grid))
    assert grid.queries == []


def test_aggregate_matches_flowers_aggregate_arrayrecords() -> None:
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    rng = np.random.default_rng(0)
    contents = [
        RecordDict({"arrays": model_to_record({"w": rng.standard_normal((3, 4)).astype(np.float32)}),
                    "metrics": MetricRecord({"num-examples": float(n)})})
        for n in (5, 17, 40)
    ]
    expected = record_to_model(aggregate_arrayrecords(contents, "num-examples"))["w"]

    def node(msg, key):
        return contents[int(key.split(":")[1])]

    grid = FakeGrid(node, num_nodes=3)
    strategy = FedAvg(clients_per_round=3, seed=0)
    init = model_to_record({"w": np.zeros((3, 4), np.float32)})
    arrays, _ = strategy.aggregate_train(1, grid.send_and_receive(strategy.configure_train(1, init, ConfigRecord(), grid)))
    np.testing.assert_allclose(record_to_model(arrays)["w"], expected, rtol=1e-6)


def test_federation_size_waits_until_registration_settles() -> None:
    from server_app.runner import federation_size

    class GrowingGrid:
        def __init__(self):
            self.calls = 0

        def get_node_ids(self):
            self.calls += 1
            return list(range(min(1000, 50 * self.calls)))  # 50 more nodes every poll

    assert federation_size(GrowingGrid(), settle=0.3) == 1000

    # the size the caller started: returned once reached, with no settle wait (20 polls, not 20 + 3)
    grid = GrowingGrid()
    assert federation_size(grid, settle=0.3, expected=1000) == 1000 and grid.calls == 20


def test_one_simulated_run_waits_for_its_federation_once() -> None:
    """Several experiments on one simulation (Flower run id) ask for its size once; another run
    id asks again."""
    from types import SimpleNamespace

    from fedmm.config import compose
    from server_app.runner import fit_federation_size

    class Grid:
        def __init__(self, run_id: int) -> None:
            self.run, self.calls = SimpleNamespace(run_id=run_id), 0

        def get_node_ids(self):
            self.calls += 1
            return [1, 2, 3, 4]

    first = Grid(run_id=987_654_321)
    for _ in range(3):
        cfg = compose(["num_clients=20", "clients_per_round=2"])
        settled = fit_federation_size(cfg, first, expected=4)
        assert settled["num_clients"] == 4 and cfg.num_clients == 20  # the federation wins, before validation
    assert first.calls == 1
    other = Grid(run_id=987_654_322)
    fit_federation_size(compose(["num_clients=4", "clients_per_round=2"]), other, expected=4)
    assert other.calls == 1


import pytest  # noqa: E402


@pytest.mark.parametrize("count", [float("nan"), float("inf"), -1000.0, 0.0, 1e30, 2.5])
def test_a_reply_with_a_bad_num_examples_is_rejected_with_its_reason(count: float, caplog) -> None:
    def node_with_bad_count(msg, key):
        content = node(msg, key)
        if key.endswith("0"):
            content["metrics"]["num-examples"] = count
        return content

    grid = FakeGrid(node_with_bad_count, num_nodes=4)
    strategy = FedAvg(clients_per_round=4, seed=0)
    with caplog.at_level("WARNING"):
        arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(strategy.configure_train(1, initial(), ConfigRecord(), grid)))
    assert metrics["replies"] == 3
    # partitions 1..3 only: (2*20 + 3*30 + 4*40) / 90
    np.testing.assert_allclose(record_to_model(arrays)["w"], np.full((2, 2), 290 / 90), rtol=1e-6)
    assert "num-examples" in caplog.text and ("not a count of examples" in caplog.text or "not finite" in caplog.text)


def test_a_timed_out_node_is_named_and_a_client_error_shows_its_message(caplog) -> None:
    def failing(msg, key):
        if key.endswith("1"):
            raise RuntimeError("CUDA out of memory on this node")
        return node(msg, key)

    grid = FakeGrid(failing, num_nodes=4, drop=["partition:000000002"])
    strategy = FedAvg(clients_per_round=4, seed=0)
    messages = list(strategy.configure_train(1, initial(), ConfigRecord(), grid))
    dropped = next(m.metadata.dst_node_id for m in messages if grid.keys[m.metadata.dst_node_id].endswith("2"))
    with caplog.at_level("WARNING"):
        strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert f"node {dropped}: no reply within the round timeout" in caplog.text
    assert "client error: CUDA out of memory on this node" in caplog.text


def test_no_accepted_reply_for_max_failed_rounds_fails_the_run() -> None:
    from strategies.base import RunFailed

    def broken(msg, key):
        raise RuntimeError("the simulation backend is gone")

    grid = FakeGrid(broken, num_nodes=4)
    strategy = FedAvg(clients_per_round=2, seed=0)
    with pytest.raises(RunFailed) as info:
        strategy.start(grid=grid, initial_arrays=initial(), num_rounds=10, max_failed_rounds=3)
    assert "3 consecutive rounds (1..3" in str(info.value) and "the simulation backend is gone" in str(info.value)
    assert strategy.global_model["w"].sum() == 0  # the model was never replaced


def test_an_error_reply_flower_builds_for_a_lost_node_blames_the_node_the_message_went_to(caplog) -> None:
    """Flower's SuperLink answers for a SuperNode killed mid-round with an error reply whose
    source is the ServerApp's own node id ("Reply message objects are unavailable"): the
    rejection names the node the message was sent to."""
    from flwr.app import Error, Message

    grid = FakeGrid(node, num_nodes=3)
    strategy = FedAvg(clients_per_round=3, seed=0)
    messages = list(strategy.configure_train(1, initial(), ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    lost = messages[1]
    error = Message(Error(code=0, reason="Reply message objects are unavailable"), reply_to=lost)
    error.metadata.__dict__["_src_node_id"] = 1  # the ServerApp's node id, as Flower's SuperLink sets it
    assert error.metadata.src_node_id == 1 != lost.metadata.dst_node_id
    replies = [r for r in replies if r.metadata.reply_to_message_id != lost.metadata.message_id] + [error]
    with caplog.at_level("WARNING"):
        strategy.aggregate_train(1, replies)
    assert f"node {lost.metadata.dst_node_id}: client error: Reply message objects are unavailable" in caplog.text
    assert "node 1:" not in caplog.text


def test_an_evaluate_error_reply_for_a_lost_node_blames_the_node_the_message_went_to(caplog) -> None:
    """As for train replies: the evaluate rejection names the node the message was sent to."""
    from flwr.app import Error, Message, MessageType

    class LosingGrid(FakeGrid):
        def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN202
            messages = list(messages)
            replies = super().send_and_receive(messages)
            lost = next((m for m in messages if m.metadata.message_type == MessageType.EVALUATE
                         and self.keys[m.metadata.dst_node_id].endswith("1")), None)
            if lost is None:
                return replies
            self.lost = lost.metadata.dst_node_id
            error = Message(Error(code=0, reason="Reply message objects are unavailable"), reply_to=lost)
            error.metadata.__dict__["_src_node_id"] = 1  # the ServerApp's node id, as Flower's SuperLink sets it
            return [r for r in replies if r.metadata.reply_to_message_id != lost.metadata.message_id] + [error]

    def answering(msg, key):  # noqa: ANN001, ANN202
        if msg.metadata.message_type == MessageType.EVALUATE:
            return RecordDict({"metrics": MetricRecord({"accuracy": 0.5, "loss": 1.0, "num-examples": 10})})
        return node(msg, key)

    grid = LosingGrid(answering, num_nodes=3)
    with caplog.at_level("WARNING"):
        FedAvg(clients_per_round=3, seed=0, fraction_evaluate=1.0).start(grid, initial(), num_rounds=1, final_report=False)
    assert f"1 evaluate reply rejected (node {grid.lost}): client error: Reply message objects are unavailable" in caplog.text


def test_every_default_of_a_method_is_what_the_base_declares() -> None:
    """A method that declares only its aggregate gets: one model, model 0 for every slot, nothing
    sent or needed besides the model, the synchronous driver, its model stepped by a server
    optimizer when one is given, read-only updates, and no differential privacy (it did not say
    what it releases); the run's state is its context's, not the method's."""
    from strategies.contract import ONE_MODEL, SYNC, model_index, release_of, release_refusal, steps_one_model
    from strategies.method import Method, Needs
    from strategies.rounds import SyncRound

    class Minimal(Method):
        def aggregate(self, server_round, updates, mean):  # noqa: ANN001, ANN202
            self.models = [mean([u.model for u in updates])]
            return self.models[0]

    m = Minimal(3, seed=0)
    assert (m.holds, m.drivers, m.global_is_next, release_of(Minimal)) == (ONE_MODEL, (SYNC,), True, None)
    assert "Minimal defines aggregate without declaring what it releases" in release_refusal(Minimal)
    assert steps_one_model(Minimal) and isinstance(m.context.driver, SyncRound)
    m.initialize({"w": np.zeros(2, np.float32)})
    assert m.models[0] is m.global_model and [model_index(m, i) for i in range(3)] == [0, 0, 0]
    assert m.extra_records(1, 0) == {} and m.needs(1) == Needs() and m.models_to_evaluate() is None
    assert m.prepare_round(1, None) is None and m.context.optimizer is None and m.context.privacy is None
    assert set(m.state_dict()) == {"models", "global_model", "rng"}
    assert set(m.context.state_dict()) >= {"models", "global_model", "rng", "selector", "accepted_rounds", "clock"}
