"""FedExP: the server step size on a hand-computed case, its bounds, buffers, and the strategy."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord

from fedmm.protocol import record_to_model
from strategies.extrapolation import average_iterates, fedexp_step, is_buffer, step_size
from strategies.fedexp import FedExP
from tests.fakes import FakeGrid
from tests.test_multimodel import initial, trainer


def test_step_size_on_a_hand_computed_case() -> None:
    # two clients, equal weights, Δ_1 = (2, 0), Δ_2 = (0, 2): A = 4, Δ̄ = (1, 1), ‖Δ̄‖² = 2
    current = {"w": np.zeros(2, np.float32)}
    models = [{"w": np.array([2.0, 0.0], np.float32)}, {"w": np.array([0.0, 2.0], np.float32)}]
    nxt, eta = fedexp_step(current, models, [1.0, 1.0], epsilon=0.0, extrapolate_buffers=False)
    assert eta == pytest.approx(4 / (2 * 2))  # = 1: the max(1, ·) floor
    # opposite updates: Δ_1 = (3, 0), Δ_2 = (-1, 0) -> Δ̄ = (1, 0), A = (9 + 1)/2 = 5, η = 5 / (2·(1 + 2·0.25)) = 5/3
    models = [{"w": np.array([3.0, 0.0], np.float32)}, {"w": np.array([-1.0, 0.0], np.float32)}]
    nxt, eta = fedexp_step(current, models, [1.0, 1.0], epsilon=0.25, extrapolate_buffers=False)
    assert eta == pytest.approx(5 / 3)
    np.testing.assert_allclose(nxt["w"], [5 / 3, 0.0], rtol=1e-6)
    # weights are the clients' example counts: p = (3/4, 1/4) -> Δ̄ = (2, 0), A = 6.75 + 0.25 = 7, η = max(1, 7/8) = 1
    nxt, eta = fedexp_step(current, models, [30.0, 10.0], epsilon=0.0, extrapolate_buffers=False)
    assert eta == 1.0 and np.allclose(nxt["w"], [2.0, 0.0])


def test_step_size_is_never_below_one() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        k = int(rng.integers(1, 6))
        eta = step_size(rng.random(k) * 10, rng.random(k) + 0.1, float(rng.random() * 5), float(rng.random()))
        assert eta >= 1.0


def test_buffers_averaged_keep_running_variance_non_negative_extrapolated_may_not() -> None:
    current = {"conv.weight": np.zeros(3, np.float32), "bn.running_var": np.full(2, 1.0, np.float32),
               "bn.num_batches_tracked": np.array(10, np.int64)}
    # clients move far apart in opposite directions (large η_g) and all shrink their variance
    models = [{"conv.weight": np.array([4.0, 0, 0], np.float32), "bn.running_var": np.full(2, 0.2, np.float32),
               "bn.num_batches_tracked": np.array(15, np.int64)},
              {"conv.weight": np.array([-3.9, 0, 0], np.float32), "bn.running_var": np.full(2, 0.3, np.float32),
               "bn.num_batches_tracked": np.array(15, np.int64)}]
    assert is_buffer("bn.running_var", current["bn.running_var"]) and not is_buffer("conv.weight", current["conv.weight"])
    safe, eta = fedexp_step(current, models, [1.0, 1.0], epsilon=1e-3, extrapolate_buffers=False)
    assert eta > 3
    assert (safe["bn.running_var"] >= 0).all() and np.allclose(safe["bn.running_var"], 0.25)
    assert int(safe["bn.num_batches_tracked"]) == 15
    port, _ = fedexp_step(current, models, [1.0, 1.0], epsilon=1e-3, extrapolate_buffers=True)
    assert (port["bn.running_var"] < 0).all()  # the port's pitfall, kept as its option


def test_strategy_trains_from_the_extrapolated_model_and_reports_the_average() -> None:
    grid = FakeGrid(trainer, num_nodes=4, seed=0)
    strategy = FedExP(clients_per_round=2, seed=0, epsilon=1e-3, epsilon_decay=0.5)
    arrays = initial()
    for rnd in (1, 2):
        before = dict(strategy.models[0]) if strategy.models else record_to_model(arrays)
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({"x": 1}), grid))
        sent = record_to_model(msgs[0].content["arrays"])
        assert all(np.array_equal(sent[k], before[k]) for k in before)  # clients get the training model
        global_arrays, _ = strategy.aggregate_train(rnd, grid.send_and_receive(msgs))
        evaluated = record_to_model(global_arrays)
        assert strategy.round_log["eta_g"] >= 1.0
        assert strategy.round_log["epsilon"] == pytest.approx(1e-3 * 0.5 ** (rnd - 1))
        if rnd == 1:
            assert all(np.array_equal(evaluated[k], strategy.models[0][k]) for k in evaluated)
        else:
            expected = average_iterates(strategy.models[0], before)
            assert all(np.array_equal(evaluated[k], expected[k]) for k in evaluated)
        arrays = global_arrays
