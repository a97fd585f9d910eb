"""SCAFFOLD: the server step on a hand case, c = mean of all c_i under partial participation (real
client plugin, per-node state), the first round with c = c_i = 0 equals FedAvg, the explicit
momentum, the lab variant's weights, and the config rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, MetricRecord, RecordDict
from torch import nn

from client_app.training import sgd_steps
from objectives.base import LocalUpdate
from objectives import scaffold as scaffold_client
from objectives.scaffold import Scaffold
from fedmm import protocol
from fedmm.config import compose, to_container
from fedmm.errors import ConfigError
from fedmm.protocol import model_to_record, record_to_model
from fedmm.training import TrainingSettings
from strategies.fedavg import FedAvg
from strategies.scaffold import Scaffold as ScaffoldServer
from strategies.scaffold import scaffold_step
from tests.fakes import FakeGrid

TRAINING = TrainingSettings(lr=0.1, momentum=0.5, weight_decay=0.0, lr_decay_rounds=[], lr_decay_factor=0.1)
OBJECTIVE = {"name": "scaffold", "momentum": 0.0, "clip_norm": None, "control_lr": "used"}


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))  # BN: buffers get no control variate


def load(model: nn.Module, msg) -> nn.Module:
    state = record_to_model(msg.content["arrays"])
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()})
    return model


class Nodes:
    """Node functions running a local-update plugin for 3 SGD steps, each node with its own state."""

    def __init__(self, plugin: type[LocalUpdate] = Scaffold, objective: dict | None = None, training: TrainingSettings | None = None) -> None:
        self.plugin, self.objective, self.training = plugin, objective or OBJECTIVE, training or TRAINING
        self.states: dict[str, RecordDict] = {}

    def __call__(self, msg, key):
        part = int(key.split(":")[1])
        cfg = {"objective": self.objective, "training": self.training, "strategy": {"name": "scaffold"}}
        state = self.states.setdefault(key, RecordDict())
        model = load(tiny(), msg).train()
        update = self.plugin(cfg, state, msg.content)
        update.begin(model, int(msg.content["config"]["x"]))
        opt = torch.optim.SGD(model.parameters(), **update.optimizer_args(self.training, 0.1))
        gen = torch.Generator().manual_seed(part)
        batches = []
        for _ in range(3):
            x = torch.randn(8, 4, generator=gen) + part
            batches.append((x, torch.randint(0, 3, (8,), generator=gen)))
        sgd_steps(model, update, opt, batches)
        extra = update.end(model)
        arrays = model_to_record({k: v.detach().numpy() for k, v in model.state_dict().items()})
        return RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 8.0, **update.metrics()}), **extra})


def initial():
    return model_to_record({k: v.detach().numpy() for k, v in tiny().state_dict().items()})


def run(strategy, grid, rounds):
    arrays = initial()
    for rnd in rounds:
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({"x": rnd}), grid))
        arrays, _ = strategy.aggregate_train(rnd, grid.send_and_receive(msgs))
    return record_to_model(arrays)


def test_server_step_on_a_hand_case() -> None:
    x = {"w": np.array([1.0, 1.0], np.float32), "bn.running_mean": np.zeros(1, np.float32)}
    c = {"w": np.array([0.5, 0.0], np.float32)}
    models = [{"w": np.array([3.0, 1.0], np.float32), "bn.running_mean": np.array([1.0], np.float32)},
              {"w": np.array([1.0, 5.0], np.float32), "bn.running_mean": np.array([4.0], np.float32)}]
    deltas = [{"w": np.array([1.0, 2.0], np.float32)}, {"w": np.array([3.0, -2.0], np.float32)}]
    new_x, new_c = scaffold_step(x, c, models, deltas, examples=[1.0, 3.0], num_clients=10, server_lr=0.5)
    np.testing.assert_allclose(new_x["w"], [1 + 0.5 * 1.0, 1 + 0.5 * 2.0])  # x + η_g·mean(Δy)
    np.testing.assert_allclose(new_x["bn.running_mean"], [3.25])  # buffers: example-weighted mean
    np.testing.assert_allclose(new_c["w"], [0.5 + 4 / 10, 0.0])  # c + ΣΔc/N, not the mean
    lab_x, lab_c = scaffold_step(x, c, models, deltas, [1.0, 3.0], 10, 1.0, model_weights=[1.0, 3.0],
                                 control_weights=[0.5, 2.0])
    np.testing.assert_allclose(lab_x["w"], [1.5, 4.0])
    np.testing.assert_allclose(lab_c["w"], [0.5 + (0.5 + 6) / 10, (1 - 4) / 10])


def test_server_c_is_the_mean_of_every_clients_c_i_under_partial_participation() -> None:
    n = 6
    nodes = Nodes()
    grid = FakeGrid(nodes, num_nodes=n, seed=0)
    strategy = ScaffoldServer(clients_per_round=2, seed=1, num_clients=n)
    run(strategy, grid, [1, 2, 3, 4, 5])
    trained = [ci for ci in effective_controls(nodes, grid, strategy) if ci is not None]
    assert 2 < len(trained) < n  # some clients trained (some twice), some never
    assert all(np.abs(ci["0.weight"]).max() > 1e-3 for ci in trained)
    for key, value in strategy.control.items():
        mean = sum(ci[key].astype(np.float64) for ci in trained) / n  # never-trained clients: c_i = 0
        np.testing.assert_allclose(value, mean, atol=1e-6)
    assert set(strategy.control) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert strategy.round_log["control_rounds"] >= 1.0


def effective_controls(nodes: Nodes, grid: FakeGrid, strategy: ScaffoldServer) -> list[dict | None]:
    """Each node's c_i as the server counts it: the one its last accepted round made (a node
    keeps a round's c_i pending until its next train message says the server accepted it)."""
    from fedmm.protocol import STATE_PENDING

    out = []
    for node_id, key in grid.keys.items():
        state = nodes.states.get(key)
        if state is None:
            out.append(None)
            continue
        pending = f"{STATE_PENDING}/{scaffold_client.CONTROL_STATE}"
        if STATE_PENDING in state and int(state[STATE_PENDING]["round"]) <= strategy.context.replies.accepted_rounds.get(node_id, 0):
            out.append(record_to_model(state[pending]))
        elif scaffold_client.CONTROL_STATE in state:
            out.append(record_to_model(state[scaffold_client.CONTROL_STATE]))
        else:
            out.append(None)
    return out


def test_a_rejected_reply_leaves_the_nodes_c_i_as_the_server_counts_it() -> None:
    """Node 0's round-1 reply is rejected (a NaN weight): its c_i of round 1 never counts, on
    the server or on the node, and c = mean(c_i) holds after every round."""
    n = 3

    class Rejecting(Nodes):
        def __call__(self, msg, key):  # noqa: ANN001, ANN202
            content = super().__call__(msg, key)
            if key == "partition:000000000" and int(msg.content["config"]["x"]) == 1:
                arrays = record_to_model(content["arrays"], copy=True)
                arrays["0.weight"] = arrays["0.weight"] * np.float32("nan")
                content["arrays"] = model_to_record(arrays)
            return content

    nodes = Rejecting()
    grid = FakeGrid(nodes, num_nodes=n, seed=0)
    strategy = ScaffoldServer(clients_per_round=n, seed=1, num_clients=n)
    for rnd in (1, 2, 3):
        run(strategy, grid, [rnd])
        if rnd == 1:
            assert strategy.context.last_round.replies == 2
        controls = [ci for ci in effective_controls(nodes, grid, strategy) if ci is not None]
        for key, value in strategy.control.items():
            mean = sum(ci[key].astype(np.float64) for ci in controls) / n
            np.testing.assert_allclose(value, mean, atol=1e-6)


def test_first_round_with_zero_controls_equals_fedavg() -> None:
    n = 4
    sc = run(ScaffoldServer(clients_per_round=3, seed=2, num_clients=n), FakeGrid(Nodes(), num_nodes=n, seed=0), [1])
    plain = Nodes(LocalUpdate, {"name": "ce"}, TRAINING.replace(momentum=0.0))  # SCAFFOLD's explicit momentum 0
    fa = run(FedAvg(clients_per_round=3, seed=2), FakeGrid(plain, num_nodes=n, seed=0), [1])
    for key in fa:
        np.testing.assert_allclose(sc[key], fa[key], rtol=1e-5, atol=1e-6)


def test_scaffold_uses_its_own_momentum_and_the_messages_carry_two_records_each_way() -> None:
    update = Scaffold({"objective": {**OBJECTIVE, "momentum": 0.0}, "training": TRAINING})
    assert update.optimizer_args(TRAINING, 0.1)["momentum"] == 0.0  # not training.momentum = 0.5
    grid = FakeGrid(Nodes(), num_nodes=3, seed=0)
    strategy = ScaffoldServer(clients_per_round=2, seed=0, num_clients=3)
    msgs = list(strategy.configure_train(1, initial(), ConfigRecord({"x": 1}), grid))
    down = {name for name in msgs[0].content.array_records}
    assert down == {"arrays", scaffold_client.CONTROL}
    reply = grid.send_and_receive(msgs)[0]
    assert set(reply.content.array_records) == {"arrays", scaffold_client.CONTROL_DELTA}


def test_lab_variant_sends_data_weights_from_the_roster_sizes() -> None:
    from strategies.selection import SeededRosterSelector

    sizes = {f"partition:{i:09d}": 10 * (i + 1) for i in range(4)}
    lab = {"name": "scaffold", "momentum": 0.5, "clip_norm": 10.0, "control_lr": "initial"}
    grid = FakeGrid(Nodes(objective=lab), num_nodes=4, seed=0, examples=sizes)
    selector = SeededRosterSelector(0, query_config={protocol.ROSTER_EXAMPLES: 1, protocol.RUN_CONFIG: "{}"})
    strategy = ScaffoldServer(clients_per_round=2, seed=0, num_clients=4, weighting="examples", selector=selector)
    msgs = list(strategy.configure_train(1, initial(), ConfigRecord({"x": 1}), grid))
    for m in msgs:
        n_i = sizes[grid.keys[m.metadata.dst_node_id]]
        assert m.content[scaffold_client.CONTROL_CONFIG][scaffold_client.CONTROL_WEIGHT] == pytest.approx(4 * n_i / 100)
    strategy.aggregate_train(1, grid.send_and_receive(msgs))
    assert np.isfinite(strategy.control["0.weight"]).all()


def test_config_rules() -> None:
    assert to_container(compose(["strategy=scaffold"]))["objective"]["name"] == "scaffold"
    with pytest.raises(ConfigError, match="objective"):
        compose(["strategy=scaffold", "objective=ce"])
    with pytest.raises(ConfigError, match="strategy=scaffold"):
        compose(["objective=scaffold"])


def test_a_nodes_state_from_another_experiment_is_not_read() -> None:
    """Several experiments on one Flower run share the nodes' Context: a second experiment (other
    config) starts from zeros, the same experiment keeps its c_i."""
    from fedmm.protocol import STATE_PENDING

    def age(state) -> int:  # noqa: ANN001 - the age of the c_i this round made (pending until accepted)
        pending = f"{STATE_PENDING}/{scaffold_client.CONTROL_AGE_STATE}"
        return int(state[pending if pending in state else scaffold_client.CONTROL_AGE_STATE]["rounds"])

    nodes = Nodes()
    grid = FakeGrid(nodes, num_nodes=2, seed=0)
    server = ScaffoldServer(clients_per_round=2, seed=0, num_clients=2)
    run(server, grid, [1])
    state = next(iter(nodes.states.values()))
    assert age(state) == 1
    run(server, grid, [2])  # same experiment, next round
    assert age(state) == 2
    nodes.objective = {**OBJECTIVE, "clip_norm": 5.0}  # another experiment on the same nodes
    run(ScaffoldServer(clients_per_round=2, seed=0, num_clients=2), grid, [2])
    assert age(state) == 1
