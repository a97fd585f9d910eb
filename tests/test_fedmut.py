"""FedMut: the mutation kernel's invariants and the strategy on an in-process grid."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord

from fedmm.protocol import record_to_model
from strategies.fedmut import FedMut
from strategies.mutation import acceleration, mutate, mutation_signs
from tests.fakes import FakeGrid
from tests.test_multimodel import initial, trainer


def models(seed: int = 0) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    old = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32),
           "bn.num_batches_tracked": np.array(10, np.int64)}
    new = {"w": old["w"] + rng.normal(size=(4, 3)).astype(np.float32), "b": old["b"] + 0.5,
           "bn.num_batches_tracked": np.array(13, np.int64)}
    return new, old


def test_acceleration_follows_the_0_based_round() -> None:
    assert acceleration(1, 0.3, 50) == pytest.approx(0.3)  # r = 0
    assert acceleration(26, 0.3, 50) == pytest.approx(0.15)  # r = 25
    assert acceleration(51, 0.3, 50) == 0.0 and acceleration(500, 0.3, 50) == 0.0


def test_signs_are_half_plus_one_and_half_minus_one_plus_c() -> None:
    signs = mutation_signs(np.random.default_rng(0), 7, 0.3)
    assert sorted(signs.tolist()) == pytest.approx([-0.7] * 3 + [1.0] * 3)


@pytest.mark.parametrize("c", [0.3, 0.12])
def test_even_k_mean_is_pushed_forward_by_radius_c_over_2_delta(c: float) -> None:
    new, old = models()
    out = mutate(new, old, 6, 4.0, c, np.random.default_rng(1))
    assert len(out) == 6
    for key in ("w", "b"):
        mean = np.mean([m[key].astype(np.float64) for m in out], axis=0)
        expected = new[key].astype(np.float64) + (4.0 * c / 2) * (new[key].astype(np.float64) - old[key])
        np.testing.assert_allclose(mean, expected, rtol=1e-5, atol=1e-5)


def test_after_the_bound_the_mean_is_the_global_model() -> None:
    new, old = models()
    c = acceleration(60, 0.3, 50)
    out = mutate(new, old, 4, 4.0, c, np.random.default_rng(1))
    for key in ("w", "b"):
        np.testing.assert_allclose(np.mean([m[key] for m in out], axis=0), new[key], rtol=0, atol=1e-5)


def test_odd_k_keeps_the_global_model_last_and_shifts_by_floor_k_over_2() -> None:
    new, old = models()
    out = mutate(new, old, 5, 4.0, 0.3, np.random.default_rng(2))
    assert len(out) == 5 and all(out[-1][k] is new[k] for k in new)
    mean = np.mean([m["w"].astype(np.float64) for m in out], axis=0)
    expected = new["w"] + 4.0 * 0.3 * 2 / 5 * (new["w"].astype(np.float64) - old["w"])
    np.testing.assert_allclose(mean, expected, rtol=1e-5, atol=1e-5)


def test_every_tensor_is_mutated_per_key_and_dtypes_kept() -> None:
    new, old = models()
    out = mutate(new, old, 4, 4.0, 0.3, np.random.default_rng(3))
    for model in out:
        for key in new:
            assert model[key].dtype == new[key].dtype and model[key].shape == new[key].shape
            assert not np.array_equal(model[key], new[key]), key
    # each key has its own shuffled signs: over a few seeds, some model moves forward on one key
    # and backward on another (Δ > 0 for "b"; for "w" the sign is taken relative to Δ)
    def side(model: dict, key: str) -> float:
        return float(np.sign((model[key] - new[key]).ravel()[0] * (new[key] - old[key]).ravel()[0]))

    outs = [mutate(new, old, 4, 4.0, 0.3, np.random.default_rng(s)) for s in range(8)]
    assert any([side(m, "w") for m in o] != [side(m, "b") for m in o] for o in outs)
    # integer buffers: mutated in float64, truncated toward zero (13 + s·4·3 with s in {1, -0.7})
    assert sorted(int(m["bn.num_batches_tracked"]) for m in out) == [4, 4, 25, 25]
    assert int(new["bn.num_batches_tracked"]) == 13 and int(old["bn.num_batches_tracked"]) == 10  # inputs untouched


def test_same_seed_same_models() -> None:
    new, old = models()
    a = mutate(new, old, 4, 4.0, 0.3, np.random.default_rng(7))
    b = mutate(new, old, 4, 4.0, 0.3, np.random.default_rng(7))
    assert all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in new)


def test_strategy_mutates_around_the_mean_and_keeps_k_models_when_a_node_fails() -> None:
    grid = FakeGrid(trainer, num_nodes=6, seed=0, drop={"partition:000000002"})
    strategy = FedMut(clients_per_round=4, seed=0, radius=2.0, acc_rate=0.3, bound=50)
    arrays = initial()
    start = record_to_model(arrays)
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord({"x": 1}), grid))
    global_arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(msgs))
    assert len(strategy.models) == 4
    global_model = record_to_model(global_arrays)
    # the global model is the unweighted mean of the 4 slots (a dropped node keeps the model it was given)
    assert metrics["replies"] == (3.0 if "partition:000000002" in [grid.keys[m.metadata.dst_node_id] for m in msgs] else 4.0)
    c = acceleration(1, 0.3, 50)
    for key in ("a.weight", "b.weight"):
        mean = np.mean([m[key].astype(np.float64) for m in strategy.models], axis=0)
        delta = global_model[key].astype(np.float64) - start[key]
        np.testing.assert_allclose(mean, global_model[key] + 2.0 * c / 2 * delta, atol=1e-5)
        assert len({m[key].tobytes() for m in strategy.models}) == 2  # two signs per key: two distinct models per key
