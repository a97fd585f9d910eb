"""The multi-model base and FedMR on an in-process grid: dispatch, reply mapping, failures, stages."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from strategies.multimodel import MultiModel
from fedmm.protocol import model_to_record, record_to_model
from strategies.fedmr import FedMR
from tests.fakes import FakeGrid

K = 4


def initial():
    return model_to_record({"a.weight": np.zeros((3,), np.float32), "a.bias": np.zeros((2,), np.float32),
                            "b.weight": np.zeros((2, 2), np.float32), "bn.num_batches_tracked": np.array(0, np.int64)})


def partition(key: str) -> int:
    return int(key.split(":")[1])


def trainer(msg, key):
    """Each node adds (partition + 1) to every float weight, so replies are traceable."""
    model = record_to_model(msg.content["arrays"])
    out = {k: (v + (partition(key) + 1) if v.dtype == np.float32 else v + 1) for k, v in model.items()}
    return RecordDict({"arrays": model_to_record(out), "metrics": MetricRecord({"num-examples": 10.0, "train_loss": 1.0})})


def run_round(strategy, grid, rnd, arrays=None):
    msgs = list(strategy.configure_train(rnd, arrays or initial(), ConfigRecord({"x": 1}), grid))
    sent = [record_to_model(m.content["arrays"]) for m in msgs]
    keys = [grid.keys[m.metadata.dst_node_id] for m in msgs]
    global_arrays, metrics = strategy.aggregate_train(rnd, grid.send_and_receive(msgs))
    return msgs, sent, keys, record_to_model(global_arrays), metrics


def test_replies_map_back_by_message_id_not_arrival_order() -> None:
    strategy = MultiModel(clients_per_round=K, seed=0)  # update_models = identity
    grid = FakeGrid(trainer, num_nodes=6, seed=3)  # replies arrive shuffled
    msgs, sent, keys, _, _ = run_round(strategy, grid, 1)
    for i in range(K):
        np.testing.assert_array_equal(strategy.models[i]["a.weight"], sent[i]["a.weight"] + partition(keys[i]) + 1)
    # every message has its own config copy carrying its model index
    assert [m.content["config"]["model-index"] for m in msgs] == list(range(K))
    assert len({id(m.content["config"]) for m in msgs}) == K
    assert all(m.content["config"]["x"] == 1 and m.content["config"]["server-round"] == 1 for m in msgs)


def test_global_model_is_unweighted_mean_of_the_k_models() -> None:
    strategy = MultiModel(clients_per_round=K, seed=0)
    grid = FakeGrid(trainer, num_nodes=K)
    _, _, keys, global_model, metrics = run_round(strategy, grid, 1)
    expected = np.mean([partition(k) + 1 for k in keys])
    np.testing.assert_allclose(global_model["b.weight"], np.full((2, 2), expected))
    assert global_model["bn.num_batches_tracked"].dtype == np.int64
    assert metrics["replies"] == K


@pytest.mark.parametrize("failure", ["exception", "timeout", "nan", "shape", "dtype", "keys"])
def test_a_failed_or_invalid_reply_keeps_the_model_it_was_given(failure: str) -> None:
    bad = "partition:000000001"

    def node(msg, key):
        if key != bad:
            return trainer(msg, key)
        if failure == "exception":
            raise RuntimeError("CUDA out of memory")
        model = record_to_model(trainer(msg, key)["arrays"])
        if failure == "nan":
            model["a.weight"][0] = np.nan
        elif failure == "shape":
            model["a.bias"] = np.zeros((3,), np.float32)
        elif failure == "dtype":
            model["a.bias"] = model["a.bias"].astype(np.float64)
        elif failure == "keys":
            model["extra"] = np.zeros(1, np.float32)
        return RecordDict({"arrays": model_to_record(model), "metrics": MetricRecord({"num-examples": 1.0})})

    strategy = MultiModel(clients_per_round=K, seed=0)
    grid = FakeGrid(node, num_nodes=K, drop=[bad] if failure == "timeout" else [])
    _, sent, keys, _, metrics = run_round(strategy, grid, 1)
    assert len(strategy.models) == K
    assert metrics["replies"] == K - 1
    i = keys.index(bad)
    for key in sent[i]:
        np.testing.assert_array_equal(strategy.models[i][key], sent[i][key])
        assert strategy.models[i][key].dtype == sent[i][key].dtype


def test_fedmr_stage_one_sends_identical_models_then_pairwise_different() -> None:
    strategy = FedMR(clients_per_round=K, seed=0, first_stage_rounds=2)
    grid = FakeGrid(trainer, num_nodes=8)
    arrays = initial()
    sent_by_round = []
    for rnd in (1, 2, 3, 4, 5):
        _, sent, _, global_model, _ = run_round(strategy, grid, rnd, arrays)
        arrays = model_to_record(global_model)
        sent_by_round.append(sent)
    # rounds 1-3 (stage 1 is rounds 1-2; its last reset feeds round 3): every node gets the same model
    for rnd in (0, 1, 2):
        assert all(all(np.array_equal(s[k], sent_by_round[rnd][0][k]) for k in s) for s in sent_by_round[rnd])
    assert not np.array_equal(sent_by_round[1][0]["a.weight"], sent_by_round[0][0]["a.weight"])  # it did train
    for rnd in (3, 4):  # after the first recombination: pairwise different
        sent = sent_by_round[rnd]
        for i in range(K):
            for j in range(i + 1, K):
                assert any(not np.array_equal(sent[i][k], sent[j][k]) for k in sent[i])


def test_fedmr_recombination_keeps_the_mean() -> None:
    strategy = FedMR(clients_per_round=K, seed=0)
    grid = FakeGrid(trainer, num_nodes=K)
    _, _, _, global_model, _ = run_round(strategy, grid, 1)
    recombined_mean = np.mean([m["b.weight"] for m in strategy.models], axis=0)
    np.testing.assert_allclose(recombined_mean, global_model["b.weight"], rtol=1e-6)


def test_fedmr_same_seed_same_models() -> None:
    def run(seed):
        strategy = FedMR(clients_per_round=K, seed=seed)
        grid = FakeGrid(trainer, num_nodes=8, seed=seed + 10)
        arrays = initial()
        for rnd in (1, 2, 3):
            _, _, _, g, _ = run_round(strategy, grid, rnd, arrays)
            arrays = model_to_record(g)
        return [m["a.weight"].tolist() + m["a.bias"].tolist() for m in strategy.models]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_federated_evaluation_goes_to_a_seeded_fraction_and_is_example_weighted() -> None:
    from flwr.app import MessageType

    def evaluator(msg, key):
        assert msg.metadata.message_type == MessageType.EVALUATE
        p = partition(key)
        return RecordDict({"metrics": MetricRecord({"accuracy": p / 10, "num-examples": float(p + 1)})})

    strategy = FedMR(clients_per_round=2, seed=0, fraction_evaluate=0.5)
    grid = FakeGrid(evaluator, num_nodes=4)
    msgs = strategy.configure_evaluate(1, initial(), ConfigRecord(), grid)
    assert len(msgs) == 2 and all(m.metadata.message_type == MessageType.EVALUATE for m in msgs)
    keys = [partition(grid.keys[m.metadata.dst_node_id]) for m in msgs]
    metrics = strategy.aggregate_evaluate(1, grid.send_and_receive(msgs))
    expected = sum((p / 10) * (p + 1) for p in keys) / sum(p + 1 for p in keys)
    assert metrics["accuracy"] == pytest.approx(expected)
    assert FedMR(clients_per_round=2, seed=0).configure_evaluate(1, initial(), ConfigRecord(), grid) == []
