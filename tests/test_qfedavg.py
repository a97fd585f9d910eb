"""q-FedAvg (strategies/qfedavg.py, one file; the client's loss before training is the
ClientApp's measurement): held to Flower's own ``QFedAvg`` on the same replies, round after round,
for three (q, lr) settings; a wrong step fails the comparison; the loss it needs is measured on
both training paths and refused when missing; and it runs in a real simulation."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import strategy as flower

from fedmm import protocol
from strategies.qfedavg import QFedAvg
from tests.fakes import FakeGrid, train_rounds

#: A model of two floating entries.
INITIAL = {"w": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), "b": np.array([0.5, -0.25], np.float32)}


def node(msg: Message, key: str) -> RecordDict:
    """A client: its loss before training grows with its distance to a target of its own, and it
    moves half way to that target."""
    k = int(key[-1])
    model = {name: np.asarray(value, np.float32) for name, value in protocol.record_to_model(msg.content["arrays"]).items()}
    target = {name: np.full_like(value, 0.4 * (k + 1) * (-1) ** k) for name, value in model.items()}
    loss = 0.2 + sum(float(np.sum((target[n] - v) ** 2)) for n, v in model.items())
    trained = {name: value + 0.5 * (target[name] - value) for name, value in model.items()}
    return RecordDict({"arrays": protocol.model_to_record(trained),
                       "metrics": MetricRecord({"num-examples": 10.0 * (k + 1), protocol.LOSS_BEFORE: loss})})


def rounds_of(strategy, rounds: int = 4) -> list[dict[str, np.ndarray]]:  # noqa: ANN001
    """The global arrays after each round, driving ``strategy`` through Flower's API over the same four nodes."""
    return train_rounds(strategy, node, INITIAL, rounds)


def flowers(q: float, lr: float) -> list[dict[str, np.ndarray]]:
    return rounds_of(flower.QFedAvg(client_learning_rate=lr, q=q, train_loss_key=protocol.LOSS_BEFORE, fraction_train=1.0,
                                    fraction_evaluate=0.0, min_train_nodes=4, min_available_nodes=4))


def assert_same(mine: list[dict[str, np.ndarray]], theirs: list[dict[str, np.ndarray]]) -> None:
    for round_, (a, b) in enumerate(zip(mine, theirs), start=1):
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=f"round {round_}, {name}")


@pytest.mark.parametrize(("q", "lr"), [(0.1, 0.05), (1.0, 0.1), (5.0, 0.01)])
def test_q_fedavg_steps_as_flowers_qfedavg(q: float, lr: float) -> None:
    """The same global models as Flower's ``QFedAvg`` on the same replies, four rounds, to float32
    rounding; not FedAvg's step (the comparison can fail)."""
    mine = rounds_of(QFedAvg(4, seed=0, q=q, client_learning_rate=lr))
    assert_same(mine, flowers(q, lr))
    plain = rounds_of(QFedAvg(4, seed=0, q=0.0, client_learning_rate=lr))
    assert max(np.abs(a["w"] - p["w"]).max() for a, p in zip(mine, plain)) > 1e-3


def test_a_wrong_step_fails_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: h without its q·F^(q−1)·‖L·Δw‖² term (a first-order step): the comparison with
    Flower's fails in the first round."""
    monkeypatch.setattr(QFedAvg, "aggregate", _first_order)
    with pytest.raises(AssertionError, match="round 1"):
        assert_same(rounds_of(QFedAvg(4, seed=0, q=1.0, client_learning_rate=0.1)), flowers(1.0, 0.1))


def _first_order(strategy: QFedAvg, server_round: int, updates, mean):  # noqa: ANN001, ANN202
    """q-FFL's step with h_k = L·F_k^q only (the planted error)."""
    q, lipschitz = strategy.settings.q, 1.0 / strategy.settings.client_learning_rate
    current = strategy.models[0]
    proposals, weights = [], []
    for update in updates:
        loss = float(update.metrics[protocol.LOSS_BEFORE]) + 1e-10
        h = lipschitz * loss ** q
        proposals.append({k: (v - loss ** q * lipschitz * (v - update.model[k]) / h).astype(v.dtype) for k, v in current.items()})
        weights.append(h)
    strategy.models = [mean(proposals, weights)]
    return strategy.models[0]


def test_a_reply_without_the_loss_before_training_is_rejected_and_the_clients_are_asked_for_it() -> None:
    """Every train message asks the ClientApp to measure the loss before training
    (``fedmm-measure``); a reply without it is rejected when it arrives, naming the metric."""
    def forgetful(msg: Message, key: str) -> RecordDict:
        content = node(msg, key)
        if key.endswith("0"):
            del content["metrics"][protocol.LOSS_BEFORE]
        return content

    strategy = QFedAvg(4, seed=0, q=1.0, client_learning_rate=0.1)
    grid = FakeGrid(forgetful, num_nodes=4)
    messages = list(strategy.configure_train(1, protocol.model_to_record(INITIAL), ConfigRecord({"x": 1}), grid))
    assert all(list(m.content["config"][protocol.MEASURE]) == [protocol.LOSS_BEFORE] for m in messages)
    strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert strategy.context.last_round.replies == 3
    assert any(f"metric {protocol.LOSS_BEFORE} is None" in r for r in strategy.context.last_round.rejections)


def test_its_client_learning_rate_defaults_to_the_runs_and_dp_is_refused_with_its_reason() -> None:
    from fedmm.config import compose
    from fedmm.errors import ConfigError
    from strategies import build_strategy

    assert build_strategy(compose(["strategy=qfedavg", "training.lr=0.03"])).settings.client_learning_rate == 0.03
    with pytest.raises(ConfigError) as err:
        compose(["strategy=qfedavg", "strategy.privacy.clip_norm=1"])
    assert err.value.key == "strategy.privacy.clip_norm" and "reported loss" in str(err.value)


def test_a_whole_run_measures_the_loss_on_both_training_paths(tmp_path, stacked_calls) -> None:  # noqa: ANN001
    """A real run (the ClientApp measures the received model's loss before training): one client
    at a time and all of a round's clients as one computation give the same numbers, and the
    clients' mean loss before training is in every round's row."""
    from tests.test_same_results import assert_same_results
    from tests.test_vectorized_rounds import ON, run

    one_at_a_time = run(tmp_path, "off", "strategy=qfedavg", "strategy.q=1.0", "simulation.vectorize=off")
    together = run(tmp_path, "on", "strategy=qfedavg", "strategy.q=1.0", ON)
    assert stacked_calls == [3, 3]
    assert_same_results(together, one_at_a_time)
    assert all(row["loss_before"] > 0 and row["replies"] == 3 for row in one_at_a_time[1:])
