"""FedDyn: the server and client update rules on hand-computed small cases, the client's linear
term kept across rounds in ``Context.state``, h = the mean of every client's term under partial
participation (both halves together), resume of h, and the config rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, MetricRecord, RecordDict
from torch import nn

from client_app.training import sgd_steps
from fedmm.config import compose
from fedmm.errors import ConfigError
from fedmm.protocol import model_to_record, record_to_model
from objectives.base import build_local_update
from objectives.feddyn import GRADIENT_STATE, FedDynClient, feddyn_client_step
from strategies import build_strategy
from strategies.feddyn import FedDyn, feddyn_server_step
from tests.fakes import FakeGrid

ALPHA = 0.5


def test_server_step_on_a_hand_case() -> None:
    server = {"w": np.array([1.0, 2.0], np.float32), "bn.running_mean": np.zeros(1, np.float32),
              "bn.num_batches_tracked": np.array(4, np.int64)}
    models = [{"w": np.array([2.0, 2.0], np.float32), "bn.running_mean": np.array([1.0], np.float32),
               "bn.num_batches_tracked": np.array(6, np.int64)},
              {"w": np.array([4.0, 0.0], np.float32), "bn.running_mean": np.array([3.0], np.float32),
               "bn.num_batches_tracked": np.array(8, np.int64)}]
    h = {"w": np.zeros(2, np.float32)}
    nxt, h1, mean = feddyn_server_step(server, models, h, alpha=0.5, num_clients=4)
    # drift Σ(θ_k − θ) = [1, 0] + [3, −2] = [4, −2]; h = 0 − (0.5 / 4)·[4, −2]
    np.testing.assert_allclose(h1["w"], [-0.5, 0.25])
    np.testing.assert_allclose(mean["w"], [3.0, 1.0])
    np.testing.assert_allclose(nxt["w"], [3.0 + 1.0, 1.0 - 0.5])  # mean − h/α
    np.testing.assert_allclose(nxt["bn.running_mean"], [2.0])  # buffers: the plain mean
    assert nxt["bn.num_batches_tracked"] == 7 and nxt["w"].dtype == np.float32
    # a second round accumulates into h
    _, h2, _ = feddyn_server_step(nxt, [{**models[0], "w": np.array([4.0, 0.5], np.float32)}], h1, alpha=0.5, num_clients=4)
    np.testing.assert_allclose(h2["w"], [-0.5, 0.25])  # this client did not drift from θ


def test_client_step_and_the_loss_gradient_on_a_hand_case() -> None:
    g = {"w": np.array([0.1, -0.2], np.float32)}
    new = feddyn_client_step(g, {"w": np.array([2.0, 2.0], np.float32)}, {"w": np.array([1.0, 2.0], np.float32)}, 0.5)
    np.testing.assert_allclose(new["w"], [0.1 - 0.5, -0.2])
    # the regularizer's gradient is −g_k at θ_k = θ and −g_k + α(θ_k − θ) elsewhere
    model = nn.Linear(2, 1, bias=False)
    state = RecordDict()
    update = FedDynClient({"objective": {"name": "feddyn"}, "strategy": {"name": "feddyn", "alpha": ALPHA}}, state, RecordDict())
    update.own_state()  # the node's state belongs to this experiment
    state[GRADIENT_STATE] = model_to_record({"weight": np.array([[0.3, -0.4]], np.float32)})
    update.begin(model, 2)
    x, y = torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)
    with torch.no_grad():
        model.weight.add_(torch.tensor([[1.0, 2.0]]))
    loss, logits = update.loss(model, x, y)
    ce = nn.functional.cross_entropy(logits, y)
    (grad,) = torch.autograd.grad(loss - ce, [model.weight])
    np.testing.assert_allclose(grad.numpy(), [[-0.3 + ALPHA * 1.0, 0.4 + ALPHA * 2.0]], rtol=1e-6)


def node_objective(states: dict, alpha: float = ALPHA):
    """Node functions: the real FedDyn objective for 3 SGD steps, each node with its own state."""

    def node(msg, key):
        part = int(key.split(":")[1])
        state = states.setdefault(key, RecordDict())
        model = nn.Linear(4, 3)
        model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in record_to_model(msg.content["arrays"]).items()})
        cfg = {"objective": {"name": "feddyn"}, "strategy": {"name": "feddyn", "alpha": alpha}, "seed": 0}
        update = build_local_update(cfg, state, msg.content)
        assert isinstance(update, FedDynClient)
        update.begin(model, int(msg.content["config"]["x"]))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(part)
        sgd_steps(model, update, opt, [(torch.randn(8, 4, generator=gen) + part, torch.randint(0, 3, (8,), generator=gen))
                                       for _ in range(3)])
        update.end(model)
        arrays = model_to_record({k: v.detach().numpy() for k, v in model.state_dict().items()})
        return RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 8.0})})

    return node


def run(strategy, grid, rounds, arrays):
    for rnd in rounds:
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({"x": rnd}), grid))
        arrays, _ = strategy.aggregate_train(rnd, grid.send_and_receive(msgs))
    return arrays


def test_h_is_the_mean_of_every_clients_term_under_partial_participation() -> None:
    n, states = 6, {}
    torch.manual_seed(0)
    initial = model_to_record({k: v.detach().numpy() for k, v in nn.Linear(4, 3).state_dict().items()})
    strategy = FedDyn(clients_per_round=2, seed=1, num_clients=n, alpha=ALPHA)
    run(strategy, FakeGrid(node_objective(states), num_nodes=n, seed=0), [1, 2, 3, 4, 5], initial)
    from fedmm.protocol import STATE_PENDING

    # every reply was accepted: a node's latest g_k is the one its last round left pending
    terms = [record_to_model(s.get(f"{STATE_PENDING}/{GRADIENT_STATE}") or s[GRADIENT_STATE]) for s in states.values()]
    assert 2 < len(terms) < n  # some clients trained (some several times), some never: their g_k = 0
    assert all(np.abs(g["weight"]).max() > 1e-4 for g in terms)
    for key, value in strategy.h.items():
        np.testing.assert_allclose(value, sum(g[key].astype(np.float64) for g in terms) / n, atol=1e-6)
    # the model the clients train next is the round's mean − h/α
    np.testing.assert_allclose(strategy.models[0]["weight"], strategy.global_model["weight"] - strategy.h["weight"] / ALPHA, atol=1e-6)


def test_h_survives_a_checkpoint() -> None:
    n, states = 4, {}
    torch.manual_seed(0)
    initial = model_to_record({k: v.detach().numpy() for k, v in nn.Linear(4, 3).state_dict().items()})
    strategy = FedDyn(clients_per_round=2, seed=3, num_clients=n)
    arrays = run(strategy, FakeGrid(node_objective(states), num_nodes=n, seed=0), [1, 2], initial)
    again = FedDyn(clients_per_round=2, seed=3, num_clients=n)
    again.context.load_state_dict(strategy.context.state_dict())
    for key in strategy.h:
        np.testing.assert_array_equal(again.h[key], strategy.h[key])
    states_a, states_b = {k: RecordDict(dict(v)) for k, v in states.items()}, {k: RecordDict(dict(v)) for k, v in states.items()}
    a = run(strategy, FakeGrid(node_objective(states_a), num_nodes=n, seed=0), [3], arrays)
    b = run(again, FakeGrid(node_objective(states_b), num_nodes=n, seed=0), [3], arrays)
    for key, value in record_to_model(a).items():
        np.testing.assert_array_equal(value, record_to_model(b)[key])


def test_config_selects_both_halves_and_refuses_either_alone() -> None:
    run_settings = compose(["strategy=feddyn", "strategy.alpha=0.1"])
    assert run_settings.objective.name == "feddyn" and run_settings.strategy.alpha == 0.1
    strategy = build_strategy(run_settings)
    assert isinstance(strategy, FedDyn) and strategy.num_clients == run_settings.num_clients and strategy.settings.alpha == 0.1
    with pytest.raises(ConfigError, match="objective"):
        compose(["strategy=feddyn", "objective=ce"])
    with pytest.raises(ConfigError, match="strategy=feddyn"):
        compose(["objective=feddyn"])
    with pytest.raises(ConfigError) as info:
        compose(["strategy=feddyn", "strategy.alpha=0"])
    assert info.value.key == "strategy.alpha"
