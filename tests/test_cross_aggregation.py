"""FedCross arithmetic and strategy: update formula, selection, in-order coverage, dynamic α, failures."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedmm.protocol import model_to_record, record_to_model
from strategies.cross_aggregation import (
    collaborative_models,
    cross_aggregate,
    dynamic_alpha,
    in_order_offset,
    model_similarity,
    propellers,
)
from strategies.fedcross import FedCross
from tests.fakes import FakeGrid


def test_update_formula_on_hand_made_tensors() -> None:
    models = [
        {"w": np.array([1.0, 0.0], np.float32), "n": np.array(5, np.int64)},
        {"w": np.array([0.0, 2.0], np.float32), "n": np.array(7, np.int64)},
        {"w": np.array([4.0, 4.0], np.float32), "n": np.array(9, np.int64)},
    ]
    out = cross_aggregate(models, [1, 2, 0], alpha=0.75)
    np.testing.assert_allclose(out[0]["w"], [0.75, 0.5])  # .75*[1,0] + .25*[0,2]
    np.testing.assert_allclose(out[1]["w"], [1.0, 2.5])   # .75*[0,2] + .25*[4,4]
    np.testing.assert_allclose(out[2]["w"], [3.25, 3.0])  # .75*[4,4] + .25*[1,0]
    assert [int(m["n"]) for m in out] == [5, 7, 9] and out[0]["w"].dtype == np.float32
    # computed from the old set: the inputs are untouched
    np.testing.assert_array_equal(models[0]["w"], [1.0, 0.0])
    # several partners (propellers): the partners' mean
    out = cross_aggregate(models, [[1, 2], [2, 0], [0, 1]], alpha=0.5)
    np.testing.assert_allclose(out[0]["w"], [0.5 * 1 + 0.5 * 2.0, 0.5 * 0 + 0.5 * 3.0])


def test_alpha_one_leaves_models_unchanged() -> None:
    rng = np.random.default_rng(0)
    models = [{"w": rng.standard_normal((3, 3)).astype(np.float32)} for _ in range(4)]
    out = cross_aggregate(models, collaborative_models(model_similarity(models), "lowest-similarity", 1, 4), alpha=1.0)
    for a, b in zip(models, out):
        np.testing.assert_array_equal(a["w"], b["w"])


SIM = np.array([
    [1.0, 0.2, 0.9, 0.5],
    [0.2, 1.0, 0.4, 0.7],
    [0.9, 0.4, 1.0, 0.1],
    [0.5, 0.7, 0.1, 1.0],
])


def test_selection_on_a_known_similarity_table() -> None:
    assert collaborative_models(SIM, "lowest-similarity", 1, 4).tolist() == [1, 0, 3, 2]
    assert collaborative_models(SIM, "highest-similarity", 1, 4).tolist() == [2, 3, 0, 1]
    # offset = r mod (K-1) + 1
    assert collaborative_models(None, "in-order", 1, 4).tolist() == [2, 3, 0, 1]
    assert collaborative_models(None, "in-order", 3, 4).tolist() == [1, 2, 3, 0]


def test_selection_never_picks_the_model_itself() -> None:
    # the diagonal is the largest (highest mode) and an all-equal table (lowest mode) must not pick j
    for mode in ("lowest-similarity", "highest-similarity"):
        for table in (SIM, np.ones((4, 4)), np.eye(4) * 5 - 1):
            assert all(c != j for j, c in enumerate(collaborative_models(table, mode, 1, 4)))
    for r in range(1, 20):
        assert all(c != j for j, c in enumerate(collaborative_models(None, "in-order", r, 5)))


def test_in_order_visits_every_other_model_within_k_minus_one_rounds() -> None:
    k = 6
    seen = {j: set() for j in range(k)}
    for r in range(1, k):
        for j, c in enumerate(collaborative_models(None, "in-order", r, k)):
            seen[j].add(int(c))
    assert all(seen[j] == set(range(k)) - {j} for j in range(k))
    assert sorted(in_order_offset(r, k) for r in range(1, k)) == list(range(1, k))


def test_similarity_is_cosine_and_chunked_sums_chunks() -> None:
    a = {"w": np.array([1.0, 0.0]), "b": np.array([1.0]), "n": np.array(3)}
    b = {"w": np.array([0.0, 1.0]), "b": np.array([1.0]), "n": np.array(1)}
    sim = model_similarity([a, b], "model")
    assert sim[0, 1] == pytest.approx(1 / 2)  # <a,b> = 1, |a| = |b| = sqrt(2)
    assert sim[0, 0] == pytest.approx(1.0)
    chunked = model_similarity([a, b], "chunked", chunk_size=1)  # cos(w) + cos(b) + cos(n) = 0 + 1 + 1
    assert chunked[0, 1] == pytest.approx(2.0)
    chunked2 = model_similarity([a, b], "chunked")  # chunks (w, b) and (n): 1/2 + 1, each once
    assert chunked2[0, 1] == pytest.approx(1.5)


def test_chunked_similarity_is_the_authors_chunks_each_counted_once() -> None:
    """Against a direct computation: every state_dict entry in order (BatchNorm's integer
    counter too), two entries per chunk, the cosine of each chunk's concatenation, summed."""
    import torch
    from torch.nn import functional as F

    nets = []
    for seed in range(3):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(4, 3))
        net[1].running_mean.uniform_(); net[1].num_batches_tracked.fill_(10 + seed)
        nets.append({k: v.numpy() for k, v in net.state_dict().items()})
    keys = list(nets[0])
    assert any(nets[0][k].dtype == np.int64 for k in keys) and len(keys) % 2 == 1  # a lone last chunk too

    def direct(i: int, j: int) -> float:
        total = 0.0
        for start in range(0, len(keys), 2):
            vec = [torch.cat([torch.from_numpy(np.asarray(m[k], dtype=np.float64)).reshape(-1) for k in keys[start:start + 2]]) for m in (nets[i], nets[j])]
            total += float(F.cosine_similarity(vec[0], vec[1], dim=0))
        return total

    sim = model_similarity(nets, "chunked")
    for i in range(3):
        for j in range(3):
            if i != j:
                assert sim[i, j] == pytest.approx(direct(i, j), rel=1e-9)


def test_similarity_matches_flattened_cosine_on_random_models() -> None:
    rng = np.random.default_rng(1)
    models = [{"x": rng.standard_normal((4, 5)), "y": rng.standard_normal(7)} for _ in range(5)]
    flat = np.stack([np.concatenate([m["x"].ravel(), m["y"]]) for m in models])
    expected = flat @ flat.T / np.outer(np.linalg.norm(flat, axis=1), np.linalg.norm(flat, axis=1))
    np.testing.assert_allclose(model_similarity(models), expected, rtol=1e-12)


def test_dynamic_alpha_schedule() -> None:
    assert dynamic_alpha(1, 0.99, rounds=10) == pytest.approx(0.5)
    assert dynamic_alpha(6, 0.99, rounds=10) == pytest.approx(0.5 + 0.49 * 0.5)
    assert dynamic_alpha(11, 0.99, rounds=10) == pytest.approx(0.99)
    assert dynamic_alpha(500, 0.99, rounds=10) == pytest.approx(0.99)
    values = [dynamic_alpha(r, 0.99, rounds=10) for r in range(1, 15)]
    assert values == sorted(values)  # never decreases
    assert dynamic_alpha(3, 0.99, rounds=0) == 0.99  # disabled
    assert dynamic_alpha(5, 0.9, rounds=4, start_round=4) == pytest.approx(0.5)  # starts after the propellers


def test_propellers_are_in_order_partners() -> None:
    assert propellers(4, 2) == [[1, 2], [2, 3], [3, 0], [0, 1]]
    assert propellers(3, 5) == [[1, 2], [2, 0], [0, 1]]  # at most K-1


def node(msg, key):
    model = record_to_model(msg.content["arrays"])
    shift = int(key.split(":")[1]) + 1
    if key.endswith("2"):
        raise RuntimeError("node crashed")
    return RecordDict({"arrays": model_to_record({k: v + shift for k, v in model.items()}), "metrics": MetricRecord({"num-examples": 1.0})})


def test_fedcross_strategy_round_with_a_failing_client() -> None:
    k = 4
    strategy = FedCross(clients_per_round=k, seed=0, alpha=0.9, selection="in-order")
    grid = FakeGrid(node, num_nodes=k)
    init = model_to_record({"w": np.zeros(3, np.float32)})
    msgs = list(strategy.configure_train(1, init, ConfigRecord(), grid))
    keys = [grid.keys[m.metadata.dst_node_id] for m in msgs]
    global_arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(msgs))
    assert metrics["replies"] == k - 1 and len(strategy.models) == k
    trained = [np.zeros(3) if key.endswith("2") else np.full(3, int(key.split(":")[1]) + 1.0) for key in keys]
    # global: unweighted mean before cross-aggregation
    np.testing.assert_allclose(record_to_model(global_arrays)["w"], np.mean(trained, axis=0), rtol=1e-6)
    partners = collaborative_models(None, "in-order", 1, k)
    for j in range(k):
        np.testing.assert_allclose(strategy.models[j]["w"], 0.9 * trained[j] + 0.1 * trained[partners[j]], rtol=1e-6)


def test_fedcross_phases() -> None:
    strategy = FedCross(clients_per_round=3, seed=0, alpha=0.99, first_stage_rounds=1, propeller_rounds=1, dynamic_alpha_rounds=2)
    models = [{"w": np.array([float(i)])} for i in range(3)]
    out = strategy.update_models(1, models, [0, 1, 2])
    assert all(m["w"][0] == 1.0 for m in out)  # stage 1: reset to the mean
    out = strategy.update_models(2, models, [0, 1, 2])
    assert strategy.last_alpha == 0.5  # propeller round
    np.testing.assert_allclose(out[0]["w"], [0.5 * 0 + 0.5 * 1.5])
    strategy.update_models(3, models, [0, 1, 2])
    assert strategy.last_alpha == pytest.approx(0.5)  # dynamic alpha starts at 0.5
    strategy.update_models(5, models, [0, 1, 2])
    assert strategy.last_alpha == pytest.approx(0.99)


def test_blocked_gram_equals_full_gram() -> None:
    from strategies.cross_aggregation import _gram

    rng = np.random.default_rng(2)
    models = [{"a": rng.standard_normal((30, 7)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)} for _ in range(4)]
    flat = np.stack([np.concatenate([m["a"].ravel(), m["b"]]).astype(np.float64) for m in models])
    np.testing.assert_allclose(_gram(models, ["a", "b"], block_bytes=8 * 4 * 10), flat @ flat.T, rtol=1e-5)
    np.testing.assert_allclose(_gram(models, ["a", "b"]), flat @ flat.T, rtol=1e-5)


def test_consume_writes_in_place_and_gives_the_same_result() -> None:
    rng = np.random.default_rng(3)
    models = [{"a": rng.standard_normal(1000).astype(np.float32), "n": np.array(i)} for i in range(3)]
    expected = cross_aggregate(models, [1, 2, 0], alpha=0.8)

    owned = [{k: v.copy() for k, v in m.items()} for m in models]
    arrays_in = [m["a"] for m in owned]
    out = cross_aggregate(owned, [1, 2, 0], alpha=0.8, consume=True, block_bytes=3 * 4 * 64)  # many blocks
    assert all(m == {} for m in owned)  # inputs handed over
    for a, b, arr in zip(out, expected, arrays_in):
        np.testing.assert_allclose(a["a"], b["a"], rtol=1e-6)
        assert a["a"] is arr  # written in place, no new model arrays

    # the same dict twice, as after a stage-1 reset: no write-through between the aliases
    shared = {k: v.copy() for k, v in models[0].items()}
    aliased = [shared, {k: v.copy() for k, v in models[1].items()}, shared]
    expected_aliased = cross_aggregate([models[0], models[1], models[0]], [1, 2, 0], alpha=0.8)
    out = cross_aggregate(aliased, [1, 2, 0], alpha=0.8, consume=True, block_bytes=3 * 4 * 64)
    for a, b in zip(out, expected_aliased):
        np.testing.assert_allclose(a["a"], b["a"], rtol=1e-6)
    assert out[0]["a"] is not out[2]["a"]
