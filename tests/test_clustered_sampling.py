"""Clustered sampling: the unbiasedness identity of both algorithms, clusters of weight <= 1/K,
the distance kernels, the up-to-date and the ported matrix, and the selector in FedAvg's loop
(roster sizes, duplicate draws, 1/K weights, reproducibility, resume)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedmm import protocol
from fedmm.config import compose, to_container
from fedmm.errors import ConfigError
from fedmm.protocol import model_to_record, record_to_model
from strategies import build_strategy, clustering
from strategies.aggregation import weighted_mean_models
from strategies.clustered_sampling import ClusteredSelector
from strategies.fedavg import FedAvg
from strategies.fedexp import FedExP
from tests.fakes import FakeGrid

QUERY = {protocol.ROSTER_EXAMPLES: 1, protocol.RUN_CONFIG: "{}"}


def identity_error(dist: np.ndarray, weights: np.ndarray) -> float:
    k = len(dist)
    return float(np.abs(dist.sum(axis=0) - k * weights / weights.sum()).max())


@pytest.mark.parametrize("n,k", [(37, 10), (5, 5), (100, 3), (12, 1)])
def test_algorithm1_distributions_are_unbiased(n: int, k: int) -> None:
    rng = np.random.default_rng(n * k)
    weights = rng.integers(1, 500, size=n).astype(float)
    weights[0] = weights.sum()  # one client heavier than 1/K: it is split across distributions
    dist = clustering.algorithm1(weights, k)
    assert dist.shape == (k, n) and (dist >= 0).all()
    np.testing.assert_allclose(dist.sum(axis=1), 1.0, atol=1e-12)
    assert identity_error(dist, weights) < 1e-8  # Σ_k r_{k,i} = K·p_i


def test_algorithm1_pours_clients_in_decreasing_size() -> None:
    # K = 2, p = (0.1, 0.4, 0.3, 0.2): masses 0.2, 0.8, 0.6, 0.4 -> bin 1 = 0.8 + 0.2 of the 0.6
    dist = clustering.algorithm1([1, 4, 3, 2], 2)
    np.testing.assert_allclose(dist, [[0, 0.8, 0.2, 0], [0.2, 0, 0.4, 0.4]], atol=1e-12)


@pytest.mark.parametrize("metric", clustering.DISTANCES)
@pytest.mark.parametrize("linkage_input", ["rows", "condensed"])
def test_algorithm2_distributions_are_unbiased_and_clusters_weigh_at_most_one_kth(metric: str, linkage_input: str) -> None:
    rng = np.random.default_rng(7)
    n, k = 30, 5
    grads = np.concatenate([rng.normal(c, 0.3, size=(6, 40)) for c in range(5)]).astype(np.float32)
    weights = rng.integers(20, 200, size=n).astype(float)
    tree = clustering.ward_linkage(clustering.full_distances(grads, metric), linkage_input)
    dist, labels = clustering.algorithm2(tree, weights, k, np.random.default_rng(0))
    np.testing.assert_allclose(dist.sum(axis=1), 1.0, atol=1e-12)
    assert identity_error(dist, weights) < 1e-8
    p = weights / weights.sum()
    for c in np.unique(labels):
        assert p[labels == c].sum() <= 1 / k + 1e-9
    again, _ = clustering.algorithm2(tree, weights, k, np.random.default_rng(0))
    assert np.array_equal(dist, again)


def test_algorithm2_keeps_the_identity_with_a_client_heavier_than_one_kth() -> None:
    rng = np.random.default_rng(1)
    weights = np.array([500.0] + [10.0] * 19)  # p_0 = 0.72 > 1/K
    grads = rng.normal(size=(20, 8)).astype(np.float32)
    tree = clustering.ward_linkage(clustering.full_distances(grads, "L2"), "rows")
    dist, labels = clustering.algorithm2(tree, weights, 4, np.random.default_rng(0))
    assert identity_error(dist, weights) < 1e-8
    assert (dist[:, 0] > 0).sum() >= 3  # its mass 2.88 fills two distributions and part of a third
    assert np.flatnonzero(labels == labels[0]).tolist() == [0]


def test_distances_on_hand_cases() -> None:
    grads = np.array([[1, 0, 0], [0, 2, 0], [-3, 0, 0], [0, 0, 0]], np.float32)
    angle = clustering.full_distances(grads, "arccos")
    np.testing.assert_allclose(angle[0], [0, np.pi / 2, np.pi, 0])  # a zero gradient: 0, as the original
    np.testing.assert_allclose(clustering.full_distances(grads, "L1")[0], [0, 3, 4, 1])
    np.testing.assert_allclose(clustering.full_distances(grads, "L2")[0], [0, 5, 16, 1])  # squared
    with pytest.raises(ValueError, match="cosine"):
        clustering.full_distances(grads, "cosine")


def test_port_partial_update_writes_only_the_last_drawn_column() -> None:
    grads = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    matrix = np.zeros((6, 6))
    clustering.port_partial_update(matrix, grads, [3, 1, 3, 5], "L1")
    expected = np.zeros((6, 6))
    for i in (3, 1):
        expected[i, 5] = np.abs(grads[i].astype(np.float64) - grads[5]).sum()
    np.testing.assert_allclose(matrix, expected)


# ----------------------------------------------------------------------------- in the loop
def directional_trainer(msg, key):
    """Node i moves the float weights along its own direction (4 groups of alike clients)."""
    part = int(key.split(":")[1])
    model = record_to_model(msg.content["arrays"])
    rng = np.random.default_rng(part % 4)
    out = {k: (v + rng.normal(size=v.shape).astype(v.dtype) + 0.01 * part if v.dtype == np.float32 else v + 1)
           for k, v in model.items()}
    return RecordDict({"arrays": model_to_record(out), "metrics": MetricRecord({"num-examples": 10.0 * (part + 1)})})


def initial():
    return model_to_record({"a.weight": np.zeros((3, 2), np.float32), "a.bias": np.zeros(2, np.float32),
                            "bn.running_mean": np.zeros(2, np.float32), "bn.num_batches_tracked": np.array(0, np.int64)})


def examples(n: int) -> dict[str, int]:
    return {f"partition:{i:09d}": 10 * (i + 1) for i in range(n)}


def run_rounds(strategy, grid, rounds, arrays=None):
    """Run rounds through configure_train / aggregate_train; per round: (sent node keys, sent model,
    new global, the selector's draws by node key)."""
    arrays = arrays or initial()
    out = []
    for rnd in rounds:
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({"x": 1}), grid))
        sent = record_to_model(msgs[0].content["arrays"]) if msgs else None
        keys = [grid.keys[m.metadata.dst_node_id] for m in msgs]
        arrays, _ = strategy.aggregate_train(rnd, grid.send_and_receive(msgs))
        out.append((keys, sent, record_to_model(arrays), dict(strategy.context.selector._draws)))
    return out


def test_selector_in_fedavg_weights_draws_by_one_kth_and_learns_gradients() -> None:
    n, k = 12, 4
    grid = FakeGrid(directional_trainer, num_nodes=n, seed=0, examples=examples(n))
    selector = ClusteredSelector(seed=3, num_clients=n, query_config=QUERY)
    strategy = FedAvg(clients_per_round=k, seed=3, selector=selector)
    for keys, sent, new, draws in run_rounds(strategy, grid, [1, 2, 3]):
        assert sum(draws.values()) == k and set(draws) == set(keys)  # one message per drawn node
        assert strategy.round_log["distinct_clients"] == len(keys)
        replies = [directional_trainer(protocol.server_message(protocol.TRAIN, 0, {}, model_to_record(sent)), key)
                   for key in keys]
        models = [record_to_model(r["arrays"]) for r in replies]
        expected = weighted_mean_models(models, [draws[key] / k for key in keys])
        for name in expected:
            np.testing.assert_allclose(new[name], expected[name], rtol=1e-6)
            # representative gradient of a trained node: its update minus the model it was sent
        row = selector._grads[selector._grad_row[keys[0]]]
        assert np.allclose(row, np.concatenate([(models[0][x] - sent[x]).ravel() for x in ("a.weight", "a.bias")]))
    # the roster query asked every node for its size once, with the run config
    assert len(grid.queries) == n and all(protocol.ROSTER_EXAMPLES in q.content["config"] for q in grid.queries)
    assert sorted(selector.num_examples(node) for node in grid.keys) == sorted(examples(n).values())
    # the matrix kept up to date row by row equals the full recomputation over the gradients
    order = sorted(grid.keys.values())
    np.testing.assert_allclose(selector._distance_matrix(order), clustering.full_distances(selector._grads_for(order), "arccos"), atol=1e-9)


def test_a_client_drawn_twice_trains_once_and_counts_twice() -> None:
    n, k = 6, 4
    sizes = {f"partition:{i:09d}": (300 if i == 0 else 10) for i in range(n)}  # p_0 = 0.86: mass 3.4 of 4
    grid = FakeGrid(directional_trainer, num_nodes=n, seed=1, examples=sizes)
    selector = ClusteredSelector(seed=0, num_clients=n, query_config=QUERY, algorithm=1)
    strategy = FedAvg(clients_per_round=k, seed=0, selector=selector)
    ((keys, _, _, _),) = run_rounds(strategy, grid, [1])
    heavy = "partition:000000000"
    assert selector._draws[heavy] >= 3 and keys.count(heavy) == 1
    assert len(grid.sent) == len(keys) < k
    updates = [protocol.ClientUpdate(node, i, {}, 1.0, {}) for i, node in enumerate(grid.keys) if grid.keys[node] in keys]
    weights = selector.aggregation_weights(updates)
    assert sum(weights) == pytest.approx(1.0)
    assert max(weights) == pytest.approx(selector._draws[heavy] / k)


def test_same_seed_same_draws_and_models_and_resume_continues_them() -> None:
    def fresh(mode="faithful"):
        n = 10
        grid = FakeGrid(directional_trainer, num_nodes=n, seed=5, examples=examples(n))
        selector = ClusteredSelector(seed=9, num_clients=n, query_config=QUERY, mode=mode, distance="L1")
        return grid, FedAvg(clients_per_round=3, seed=9, selector=selector)

    for mode in ("faithful", "fedmr_port"):
        grid, a = fresh(mode)
        first = run_rounds(a, grid, [1, 2, 3, 4])
        grid, b = fresh(mode)
        second = run_rounds(b, grid, [1, 2, 3, 4])
        assert [r[0] for r in first] == [r[0] for r in second]
        assert all(np.array_equal(x[2]["a.weight"], y[2]["a.weight"]) for x, y in zip(first, second))
        # resume after round 2 in a new strategy (new node ids, same keys): rounds 3-4 are the same
        grid, c = fresh(mode)
        part = run_rounds(c, grid, [1, 2])
        grid2, d = fresh(mode)
        grid2.keys = {node + 1: key for node, key in grid.keys.items()}  # the nodes of a new run
        d.context.load_state_dict(c.context.state_dict())
        rest = run_rounds(d, grid2, [3, 4], arrays=model_to_record(part[-1][2]))
        assert [r[0] for r in rest] == [r[0] for r in first[2:]]
        assert all(np.array_equal(x[2]["a.weight"], y[2]["a.weight"]) for x, y in zip(rest, first[2:]))
    n = 10
    other = FakeGrid(directional_trainer, num_nodes=n, seed=5, examples=examples(n))
    seed_10 = FedAvg(clients_per_round=3, seed=10, selector=ClusteredSelector(seed=10, num_clients=n, query_config=QUERY))
    assert [r[0] for r in run_rounds(seed_10, other, [1, 2, 3, 4])] != [r[0] for r in second]


def test_fedmr_port_weights_by_size_and_its_matrix_only_sees_the_last_draw() -> None:
    n, k = 8, 3
    grid = FakeGrid(directional_trainer, num_nodes=n, seed=2, examples=examples(n))
    selector = ClusteredSelector(seed=1, num_clients=n, query_config=QUERY, mode="fedmr_port", distance="L1")
    strategy = FedAvg(clients_per_round=k, seed=1, selector=selector)
    ((keys, sent, new, _),) = run_rounds(strategy, grid, [1])
    drawn = selector._drawn_keys
    index = {key: i for i, key in enumerate(selector._matrix_keys)}
    nonzero = {(int(i), int(j)) for i, j in zip(*np.nonzero(selector._matrix))}
    assert nonzero <= {(index[key], index[drawn[-1]]) for key in drawn}
    replies = [directional_trainer(protocol.server_message(protocol.TRAIN, 0, {}, model_to_record(sent)), key) for key in keys]
    models = [record_to_model(r["arrays"]) for r in replies]
    sizes = [float(r["metrics"]["num-examples"]) * selector._draws[key] for r, key in zip(replies, keys)]
    np.testing.assert_allclose(new["a.weight"], weighted_mean_models(models, sizes)["a.weight"], rtol=1e-6)


def test_nodes_that_do_not_report_their_size_fail_with_a_clear_error() -> None:
    grid = FakeGrid(directional_trainer, num_nodes=4, seed=0)  # a ClientApp that reports no size
    strategy = FedAvg(clients_per_round=2, seed=0, selector=ClusteredSelector(seed=0, num_clients=4, query_config=QUERY))
    with pytest.raises(RuntimeError, match="number of training examples.*selection=uniform"):
        run_rounds(strategy, grid, [1])


def test_fedexp_takes_the_selectors_weights() -> None:
    n = 6
    grid = FakeGrid(directional_trainer, num_nodes=n, seed=0, examples=examples(n))
    strategy = FedExP(clients_per_round=3, seed=0, selector=ClusteredSelector(seed=0, num_clients=n, query_config=QUERY))
    ((keys, _, _, _),) = run_rounds(strategy, grid, [1])
    assert strategy.round_log["eta_g"] >= 1.0 and strategy.round_log["distinct_clients"] == len(keys)


def test_config_presets_and_errors() -> None:
    cfg = to_container(compose(["strategy=clusamp"]))
    assert cfg["strategy"]["name"] == "fedavg" and cfg["selection"] == {
        "name": "clustered", "mode": "faithful", "algorithm": 2, "distance": "arccos", "linkage_input": "rows"}
    port = to_container(compose(["strategy=clusamp_fedmr_repo"]))["selection"]
    assert (port["mode"], port["distance"]) == ("fedmr_port", "L1")
    strategy = build_strategy(cfg)
    assert isinstance(strategy.context.selector, ClusteredSelector)
    assert protocol.ROSTER_EXAMPLES in strategy.context.selector.query_config
    assert to_container(compose([]))["selection"] == {"name": "uniform"}
    with pytest.raises(ConfigError, match="selection.*fedmr"):
        compose(["strategy=fedmr", "selection=clustered"])
    with pytest.raises(ConfigError, match="selection.algorithm"):
        compose(["strategy=clusamp_fedmr_repo", "selection.algorithm=1"])
    with pytest.raises(ConfigError, match="selection.distance"):
        compose(["selection=clustered", "selection.distance=cosine"])
