"""The optional defences: update-norm bounding and robust means, off by default."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedmm import protocol
from fedmm.config import compose
from strategies import build_strategy
from strategies.aggregation import bound_update_norm, robust_mean_models
from tests.fakes import FakeGrid


def test_robust_means_by_hand() -> None:
    models = [{"w": np.array([1.0, 10.0], np.float32), "n": np.array(1)}, {"w": np.array([2.0, 20.0], np.float32), "n": np.array(2)},
              {"w": np.array([3.0, 30.0], np.float32), "n": np.array(3)}, {"w": np.array([400.0, -4000.0], np.float32), "n": np.array(4)}]
    np.testing.assert_allclose(robust_mean_models(models, "median")["w"], [2.5, 15.0])
    np.testing.assert_allclose(robust_mean_models(models, "trimmed", 0.25)["w"], [2.5, 15.0])  # 1 of 4 cut each side
    assert robust_mean_models(models, "median")["w"].dtype == np.float32 and robust_mean_models(models, "median")["n"] == 2


def test_update_norm_bound_by_hand() -> None:
    sent = {"w": np.zeros(2, np.float32), "n": np.array(5)}
    bounded, norm = bound_update_norm({"w": np.array([3.0, 4.0], np.float32), "n": np.array(6)}, sent, 1.0)
    assert norm == pytest.approx(5.0)
    np.testing.assert_allclose(bounded["w"], [0.6, 0.8], rtol=1e-6)
    assert bounded["n"] == 6  # integer buffers are not updates
    same, _ = bound_update_norm({"w": np.array([0.3, 0.4], np.float32), "n": np.array(6)}, sent, 1.0)
    np.testing.assert_array_equal(same["w"], np.array([0.3, 0.4], np.float32))


def one_round(strategy_name: str, defence: list[str], attack: str) -> dict[str, np.ndarray]:
    """One round of 5 clients whose honest update is +1 on every weight; client 4 attacks."""
    strategy = build_strategy(compose([f"strategy={strategy_name}", "num_clients=5", "clients_per_round=5", *defence]))
    initial = {"w": np.zeros(4, np.float32)}
    strategy.initialize(initial)

    def node(msg: Message, key: str) -> RecordDict:
        w = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=True)["w"]
        update = np.ones(4, np.float32)
        if key == "partition:000000004":
            update = update * 100 if attack == "scale" else -update * 10
        return RecordDict({protocol.ARRAYS: protocol.model_to_record({"w": w + update}),
                           protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 10.0})})

    grid = FakeGrid(node, num_nodes=5)
    messages = list(strategy.configure_train(1, protocol.model_to_record(initial), ConfigRecord({"x": 1}), grid))
    out, _ = strategy.aggregate_train(1, grid.send_and_receive(messages))
    return protocol.record_to_model(out)


@pytest.mark.parametrize("name", ["fedavg", "fedmr"])
@pytest.mark.parametrize("attack", ["scale", "flip"])
def test_defences_hold_one_hostile_client_of_five(name: str, attack: str) -> None:
    undefended = one_round(name, [], attack)["w"]
    median = one_round(name, ["strategy.defence.robust_mean=median"], attack)["w"]
    bounded = one_round(name, ["strategy.defence.clip_update_norm=2.0"], attack)["w"]
    assert np.abs(undefended - 1).max() > 2  # the attacker moves the plain mean far from +1
    np.testing.assert_allclose(median, 1.0)  # 4 of 5 honest: the median is theirs
    assert np.abs(bounded - 1).max() < np.abs(undefended - 1).max() / 4  # its pull cut to norm 2


def test_a_non_finite_aggregate_keeps_the_previous_models() -> None:
    """Two finite replies whose extrapolated aggregate overflows float32 (FedExP: opposite huge
    updates make its server step size ~1e76): the round logs an error, counts no reply and the
    server keeps the models it had (nothing non-finite reaches a model)."""
    strategy = build_strategy(compose(["strategy=fedexp", "num_clients=2", "clients_per_round=2"]))
    initial = {"w": np.zeros(2, np.float32)}
    strategy.initialize(initial)

    def node(msg: Message, key: str) -> RecordDict:
        sign = 1.0 if key.endswith("0") else -1.0
        return RecordDict({protocol.ARRAYS: protocol.model_to_record({"w": np.array([sign * 3.0e38, 1.0], np.float32)}),
                           protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 10.0})})

    grid = FakeGrid(node, num_nodes=2)
    messages = list(strategy.configure_train(1, protocol.model_to_record(initial), ConfigRecord({"x": 1}), grid))
    with np.errstate(over="ignore"):
        out, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert out is None and metrics["replies"] == 0.0 and strategy.last_replies == 0
    np.testing.assert_array_equal(strategy.models[0]["w"], initial["w"])
    assert strategy.accepted_rounds == {}  # the nodes' state of this round is not kept either
