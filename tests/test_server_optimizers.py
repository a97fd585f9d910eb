"""Server optimizers (strategies/server_optimizer.py and one file each) and FedNova (one file per
side): each against Flower's own strategy on the same replies, by hand, and the rules of who
takes one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import strategy as flower

from fedmm import protocol
from fedmm.config import compose
from fedmm.errors import ConfigError
from fedmm.protocol import ClientUpdate
from objectives.fednova import NORMALIZER, normalizer
from strategies import FedAvg, FedMR, FedNova, Scaffold
from strategies.aggregators import Mean
from strategies.fedadam import FedAdam
from strategies.fedavgm import FedAvgM
from tests.fakes import FakeGrid, train_rounds

#: Four nodes whose update depends on the model they get and on the node (float32, two entries).
INITIAL = {"w": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), "b": np.array([0.5, -0.25], np.float32)}


def node(msg: Message, key: str) -> RecordDict:
    """A client: its model moved towards a target of its own, by how far it is from it."""
    k = int(key[-1])
    model = {name: np.asarray(value, np.float32) for name, value in protocol.record_to_model(msg.content["arrays"]).items()}
    target = {name: np.full_like(value, 0.3 * (k + 1) * (-1) ** k) for name, value in model.items()}
    trained = {name: value + 0.5 * (target[name] - value) + 0.01 * k for name, value in model.items()}
    return RecordDict({"arrays": protocol.model_to_record(trained), "metrics": MetricRecord({"num-examples": 10.0 * (k + 1)})})


def rounds_of(strategy, rounds: int = 4) -> list[dict[str, np.ndarray]]:  # noqa: ANN001
    """The global arrays after each round, driving ``strategy`` through Flower's API (as Flower's
    own ``start`` does) over the same four nodes."""
    return train_rounds(strategy, node, INITIAL, rounds)


def flower_strategy(cls, **kwargs):  # noqa: ANN001, ANN003, ANN201
    return cls(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=4, min_available_nodes=4, **kwargs)


@pytest.mark.parametrize(("ours", "theirs"), [
    (FedAvgM(server_momentum=0.9, server_learning_rate=0.7), (flower.FedAvgM, {"server_momentum": 0.9, "server_learning_rate": 0.7})),
    (FedAdam(), (flower.FedAdam, {})),
    (FedAdam(eta=0.05, beta_1=0.8, tau=1e-2), (flower.FedAdam, {"eta": 0.05, "beta_1": 0.8, "tau": 1e-2})),
], ids=["fedavgm", "fedadam-defaults", "fedadam"])
def test_a_server_optimizer_steps_as_flowers_own_strategy(ours, theirs) -> None:  # noqa: ANN001
    """FedAvg with the server optimizer and Flower's strategy of the same name, on the same
    replies round after round: the same global models, to float32 rounding (Flower keeps the
    optimizer's arrays in float64, ours in the model's float32)."""
    cls, kwargs = theirs
    mine = rounds_of(FedAvg(4, 0, server_optimizer=ours))
    flowers = rounds_of(flower_strategy(cls, **kwargs))
    plain = rounds_of(FedAvg(4, 0))
    for round_, (a, b) in enumerate(zip(mine, flowers), start=1):
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=2e-5, atol=2e-6, err_msg=f"round {round_}, {name}")
    assert max(np.abs(a["w"] - p["w"]).max() for a, p in zip(mine, plain)) > 1e-2  # it is not the plain step


def test_flowers_defaults_are_the_declared_ones() -> None:
    """Each optimizer's defaults are those of Flower's strategy of the same name."""
    import inspect

    from strategies.fedadagrad import FedAdagrad
    from strategies.fedyogi import FedYogi

    for ours, theirs in ((FedAvgM, flower.FedAvgM), (FedAdam, flower.FedAdam), (FedYogi, flower.FedYogi),
                         (FedAdagrad, flower.FedAdagrad)):
        flower_defaults = {n: p.default for n, p in inspect.signature(theirs.__init__).parameters.items()}
        declared = ours.Settings().to_dict()
        for name, value in declared.items():
            if name != "name":  # a moment Flower fixes (FedAdagrad's betas: 0) is not in its signature
                assert flower_defaults.get(name, 0.0) == value, (ours.__name__, name)


def test_fedyogi_and_fedadagrad_step_by_hand() -> None:
    """One step of each from zero moments on Δ = x − x̂ = −δ: Yogi's v = −(1 − β₂)·δ²·sign(−δ²)
    = (1 − β₂)·δ², m = (1 − β₁)·δ; Adagrad's v = δ², m = δ."""
    from strategies.fedadagrad import FedAdagrad
    from strategies.fedyogi import FedYogi

    x = {"w": np.array([1.0, -2.0], np.float32)}
    proposed = {"w": np.array([1.5, -2.5], np.float32)}  # δ = [0.5, -0.5]
    delta = np.array([0.5, -0.5])
    yogi = FedYogi().step(1, x, proposed)["w"]
    m, v = 0.1 * delta, 0.01 * delta**2
    np.testing.assert_allclose(yogi, x["w"] + 0.01 * m / (np.sqrt(v) + 1e-3), rtol=1e-6)
    adagrad = FedAdagrad().step(1, x, proposed)["w"]
    np.testing.assert_allclose(adagrad, x["w"] + 0.1 * delta / (np.abs(delta) + 1e-3), rtol=1e-6)
    assert yogi.dtype == adagrad.dtype == np.float32


def test_a_coordinate_that_does_not_move_keeps_yogis_moment_at_zero() -> None:
    """Yogi's sign(v − δ²) is 0 where v = δ² (a frozen coordinate: v = 0, δ = 0 from the first
    round): v stays 0 and the model stays where it was (a mutant dividing by the sign made it NaN)."""
    from strategies.fedyogi import FedYogi

    x = {"w": np.array([1.0, -2.0], np.float32)}
    yogi = FedYogi()
    moved = yogi.step(1, x, {"w": np.array([1.0, -2.5], np.float32)})["w"]
    assert moved[0] == 1.0 and yogi.v["w"][0] == 0.0 and np.isfinite(moved).all()


def test_the_optimizers_moments_survive_a_checkpoint() -> None:
    """Rounds 1-2, the state saved, a new strategy loads it: round 3 equals the uninterrupted run's."""
    whole = FedAvg(4, 0, server_optimizer=FedAdam())
    grid = FakeGrid(node, num_nodes=4)
    arrays = protocol.model_to_record(INITIAL)
    for server_round in (1, 2):
        arrays, _ = whole.aggregate_train(server_round, grid.send_and_receive(
            list(whole.configure_train(server_round, arrays, ConfigRecord({}), grid))))
    resumed = FedAvg(4, 0, server_optimizer=FedAdam())
    resumed.context.load_state_dict(whole.context.state_dict())
    assert resumed.context.optimizer.m is not None and resumed.context.optimizer.m is whole.context.optimizer.m
    results = []
    for strategy in (whole, resumed):
        grid3 = FakeGrid(node, num_nodes=4)
        out, _ = strategy.aggregate_train(3, grid3.send_and_receive(list(strategy.configure_train(3, arrays, ConfigRecord({}), grid3))))
        results.append(protocol.record_to_model(out))
    for name in results[0]:
        np.testing.assert_array_equal(results[0][name], results[1][name])


def test_who_takes_a_server_optimizer_is_derived_from_what_a_method_holds() -> None:
    """A method with one model, which is its global model, takes one (SCAFFOLD's step is
    stepped by it too); one with several models, or one evaluating another model (FedExP,
    FedDyn), refuses it, before any round."""
    for strategy in ("fedavg", "scaffold", "fedgen", "fednova", "fedbuff", "fedprox"):
        assert compose([f"strategy={strategy}", "server_optimizer=fedavgm"]).server_optimizer.name == "fedavgm"
    for strategy in ("fedmr", "fedcross", "fedmut", "solo", "fedexp", "feddyn", "fedmr_async"):
        with pytest.raises(ConfigError) as err:
            compose([f"strategy={strategy}", "server_optimizer=fedadam"])
        assert err.value.key == "server_optimizer" and f"strategy={strategy.split('_')[0]}" in str(err.value)
    with pytest.raises(ValueError, match="takes no server optimizer"):
        FedMR(4, 0, server_optimizer=FedAdam())
    assert isinstance(Scaffold(4, 0, 10, server_optimizer=FedAvgM()).context.optimizer, FedAvgM)


# ============================================================================ FedNova
def test_the_clients_normalizer_by_hand() -> None:
    """a = Σ_t Σ_{j<t} ρ^j: τ without momentum; with ρ = 0.5 and 3 steps, 1 + 1.5 + 1.75."""
    assert normalizer(4, 0.0) == 4.0 and normalizer(3, 0.5) == 4.25 and normalizer(0, 0.9) == 0.0


def test_fednova_normalizes_two_clients_with_different_step_counts_by_hand() -> None:
    """x = 0; client 1 took a = 2 steps to reach y₁ = −2 (d₁ = 1 per step), client 2 a = 4 steps to
    reach y₂ = −8 (d₂ = 2): τ_eff = ½·2 + ½·4 = 3 and x ← x − 3·(½·1 + ½·2) = −4.5, where
    FedAvg's mean is −5 (pulled towards the client that took more steps)."""
    strategy = FedNova(2, 0)
    strategy.initialize({"w": np.zeros(3, np.float32), "bn.running_mean": np.zeros(3, np.float32)})
    updates = [ClientUpdate(1, 0, {"w": np.full(3, -2.0, np.float32), "bn.running_mean": np.full(3, 1.0, np.float32)}, 10.0,
                            {NORMALIZER: 2.0}),
               ClientUpdate(2, 1, {"w": np.full(3, -8.0, np.float32), "bn.running_mean": np.full(3, 3.0, np.float32)}, 10.0,
                            {NORMALIZER: 4.0})]
    out = strategy.aggregate(1, updates, Mean())
    np.testing.assert_allclose(out["w"], -4.5)
    np.testing.assert_allclose(out["bn.running_mean"], 2.0)  # a buffer: the weighted mean, as FedAvg
    assert strategy.round_log["tau_eff"] == 3.0
    # weights by num-examples: p = (1/4, 3/4): τ_eff = 3.5, x = −3.5·(¼·1 + ¾·2) = −6.125
    updates[1].num_examples = 30.0
    np.testing.assert_allclose(_aggregate(updates), -6.125)


def _aggregate(updates: list[ClientUpdate]) -> np.ndarray:
    strategy = FedNova(2, 0)
    strategy.initialize({"w": np.zeros(3, np.float32), "bn.running_mean": np.zeros(3, np.float32)})
    return strategy.aggregate(1, updates, Mean())["w"]


def test_the_client_reports_the_loops_own_step_count() -> None:
    """20 rows, batch 8, 2 epochs: 3 steps an epoch, 6 in all, momentum 0.5 (the training
    group's): a = normalizer(6, 0.5), the same when its clients train as one computation."""
    from client_app.training import train_epochs
    from client_app.vectorized import train_stacked
    from fedmm.data.spec import InputSpec
    from fedmm.models import build_model
    from objectives.base import build_local_update
    from tests.test_vectorized import client_data, starting_states

    run = compose(["strategy=fednova", "training.local_epochs=2", "training.batch_size=8"])
    spec = InputSpec(kind="image", num_classes=10, shape=(1, 28, 28))
    model = build_model("lenet", spec)
    states = starting_states(model, 2)
    one = build_local_update(run)
    train_epochs(model, client_data(20, 0, spec.shape), one, run.training, 1, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert one.metrics() == {NORMALIZER: normalizer(6, 0.5)}
    together = [build_local_update(run) for _ in range(2)]
    for update in together:
        update.begin(model, 1)
    train_stacked(model, states, [client_data(20, 1, spec.shape), client_data(9, 2, spec.shape)], run.training, 1,
                  [torch.Generator().manual_seed(c) for c in range(2)], torch.device("cpu"), together)
    assert [u.metrics()[NORMALIZER] for u in together] == [normalizer(6, 0.5), normalizer(4, 0.5)]  # 9 rows: 2 steps an epoch


def test_a_reply_without_the_normalizer_is_rejected_when_it_arrives() -> None:
    def plain(msg: Message, key: str) -> RecordDict:
        content = node(msg, key)
        if key.endswith("1"):
            return content  # no fednova-a: a client running another objective
        content["metrics"][NORMALIZER] = 2.0
        return content

    strategy = FedNova(4, 0)
    grid = FakeGrid(plain, num_nodes=4)
    arrays = protocol.model_to_record(INITIAL)
    strategy.aggregate_train(1, grid.send_and_receive(list(strategy.configure_train(1, arrays, ConfigRecord({}), grid))))
    assert strategy.context.last_round.replies == 3
    assert any(f"metric {NORMALIZER} is None" in reason for reason in strategy.context.last_round.rejections)
