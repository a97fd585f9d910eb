"""The trust stage (FLTrust, Cao et al. NDSS 2021): the paper's rule by hand, then through a round."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Message, MetricRecord, RecordDict

from fedmm import protocol
from fedmm.config import compose
from strategies import build_strategy
from strategies.trust import fltrust, trust_scores
from tests.fakes import FakeGrid


def test_the_papers_rule_by_hand() -> None:
    """Eq. 3-5 on five updates against g₀ = (1, 0): along it (cos 1, ‖g‖ 2 → rescaled to 1),
    orthogonal (cos 0), opposite (cos −1: ReLU makes it 0, not −1), at 45° (cos 1/√2, rescaled to
    norm 1) and a zero update. g = (1·(1, 0) + 1/√2·(1/√2, 1/√2)) / (1 + 1/√2)."""
    g0 = np.array([1.0, 0.0])
    updates = [np.array([2.0, 0.0]), np.array([0.0, 3.0]), np.array([-1.0, 0.0]), np.array([5.0, 5.0]), np.zeros(2)]
    np.testing.assert_allclose(trust_scores(updates, [g0] * 5), [1.0, 0.0, 0.0, 1 / math.sqrt(2), 0.0])
    r = 1 / math.sqrt(2)
    expected = (np.array([1.0, 0.0]) + r * np.array([r, r])) / (1 + r)
    np.testing.assert_allclose(fltrust(updates, g0), expected)  # (0.8787, 0.2929)
    # the reference's norm, not the updates': a reference half as long halves the aggregate
    np.testing.assert_allclose(fltrust(updates, g0 / 2), expected / 2)
    # every score 0: nothing moves
    np.testing.assert_array_equal(fltrust([np.array([-1.0, 0.0])], g0), np.zeros(2))


def node_fn(steps: dict[int, np.ndarray]):  # noqa: ANN201 - a FakeGrid node function
    """Each node's model is its sent model plus ``steps[partition]`` on ``w``."""
    def node(msg: Message, key: str) -> RecordDict:
        sent = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=True)
        out = {"w": (sent["w"] + steps[int(key[-1])]).astype(np.float32), "n": sent["n"] + 1}
        return RecordDict({protocol.ARRAYS: protocol.model_to_record(out),
                           protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 10.0 * (1 + int(key[-1]))})})
    return node


STEPS = {0: np.array([2.0, 0.0]), 1: np.array([0.0, 3.0]), 2: np.array([-1.0, 0.0]), 3: np.array([5.0, 5.0])}


def one_round(strategy_name: str, reference) -> tuple[object, list[str]]:  # noqa: ANN001
    cfg = compose([f"strategy={strategy_name}", "num_clients=4", "clients_per_round=4", "strategy.defence.trust_root=10"])
    strategy = build_strategy(cfg)
    strategy.context.reference = reference
    initial = {"w": np.zeros(2, np.float32), "n": np.array(0)}
    strategy.start(FakeGrid(node_fn(STEPS), num_nodes=4), protocol.model_to_record(initial), num_rounds=1, final_report=False)
    return strategy, strategy.context.last_round.rejections


def test_fedavg_takes_the_papers_aggregate_whatever_its_example_counts() -> None:
    """FedAvg weighs by num-examples (10, 20, 30, 40 here); under trust its global model is eq. 5
    exactly, the opposite and orthogonal updates rejected with their cosine."""
    calls = []

    def reference(sent, server_round):  # noqa: ANN001, ANN202
        calls.append(server_round)
        return {"w": sent["w"] + np.array([1.0, 0.0], np.float32), "n": sent["n"]}

    strategy, rejections = one_round("fedavg", reference)
    r = 1 / math.sqrt(2)  # by hand, as in the test above: ((1, 0) + r·(r, r)) / (1 + r)
    expected = (np.array([1.0, 0.0]) + r * np.array([r, r])) / (1 + r)
    np.testing.assert_allclose(strategy.global_model["w"], expected, rtol=1e-6)
    assert calls == [1]  # one sent model: one reference
    assert len(rejections) == 2 and all("defence.trust_root: cosine" in r for r in rejections)
    assert any("cosine -1.000" in r for r in rejections) and any("cosine 0.000" in r for r in rejections)
    assert strategy.round_log["updates_distrusted"] == 2.0


def test_each_update_is_judged_against_the_reference_of_the_model_it_was_sent() -> None:
    """FedMR sends a model per node: the reference is trained from each sent model, and each
    update is scored against its own. A reference along (1, 1) keeps the update along (0, 3) that
    a reference along (1, 0) rejects; the K models' moves add up to eq. 5 times the updates kept
    (their equal-mean form; a rejected slot stays as it was sent)."""
    seen = []

    def reference(sent, server_round):  # noqa: ANN001, ANN202
        seen.append(id(sent))
        return {"w": sent["w"] + np.array([1.0, 1.0], np.float32), "n": sent["n"]}

    strategy, rejections = one_round("fedmr", reference)
    g0 = np.array([1.0, 1.0])
    scores = trust_scores(list(STEPS.values()), [g0] * 4)
    assert list(scores > 0) == [True, True, False, True] and len(rejections) == 1 and "node" in rejections[0]
    assert 1 <= len(seen) <= 4 and len(set(seen)) == len(seen)  # once per distinct sent model
    moved = sum(m["w"].astype(np.float64) for m in strategy.models)
    # by hand: TS = (r, r, 0, 1), ĝ = ‖g₀‖ = √2 long: (√2, 0), (0, √2), (1, 1); Σ TS ĝ / Σ TS
    r = 1 / math.sqrt(2)
    expected = (r * np.array([math.sqrt(2), 0.0]) + r * np.array([0.0, math.sqrt(2)]) + np.array([1.0, 1.0])) / (2 * r + 1)
    np.testing.assert_allclose(moved / 3, expected, rtol=1e-5)


def test_without_the_servers_training_the_stage_says_what_is_missing() -> None:
    cfg = compose(["strategy=fedavg", "num_clients=4", "clients_per_round=4", "strategy.defence.trust_root=10"])
    strategy = build_strategy(cfg)
    with pytest.raises(RuntimeError, match=r"strategy.defence.trust_root=10 needs the server's training on its root set"):
        strategy.start(FakeGrid(node_fn(STEPS), num_nodes=4), protocol.model_to_record(
            {"w": np.zeros(2, np.float32), "n": np.array(0)}), num_rounds=1, final_report=False)


def test_the_root_set_is_drawn_from_the_test_split_and_left_out_of_its_evaluation() -> None:
    """The root rows and the rows the server still evaluates on split the test split; the draw
    follows the seed; a root set as large as the split is refused naming the setting."""
    import torch

    from fedmm.data import TensorData
    from fedmm.errors import ConfigError
    from fedmm.root_set import split_root

    test = TensorData(x=torch.arange(40, dtype=torch.float32).reshape(20, 1, 2, 1), y=torch.arange(20) % 10)
    root, rest = split_root(test, 5, seed=0)
    assert len(root) == 5 and len(rest) == 15
    assert sorted(root.x.flatten().tolist() + rest.x.flatten().tolist()) == list(range(40))
    assert torch.equal(split_root(test, 5, seed=0)[0].x, root.x) and not torch.equal(split_root(test, 5, seed=1)[0].x, root.x)
    with pytest.raises(ConfigError) as err:
        split_root(test, 20, seed=0)
    assert err.value.key == "strategy.defence.trust_root" and "20" in str(err.value)


def test_the_reference_takes_a_clients_steps_of_a_round() -> None:
    """A client of the mean partition (4,000 rows over 10 clients, batches of 50) takes 8 steps an
    epoch: the server takes as many over its root set, however small; local_steps when set."""
    import torch

    from fedmm.data import TensorData
    from fedmm.root_set import RootTrainer, client_steps
    from fedmm.training import TrainingSettings

    assert client_steps(TrainingSettings(local_epochs=2), 4000, 10) == 16
    assert client_steps(TrainingSettings(local_steps=5), 4000, 10) == 5
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    root = TensorData(x=torch.randn(10, 1, 2, 2), y=torch.arange(10) % 3)
    counted = []
    trainer = RootTrainer(model, root, TrainingSettings(batch_size=4, lr=0.1), steps=7, seed=0, device=torch.device("cpu"))
    trainer.model.register_forward_hook(lambda *_: counted.append(1))
    sent = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    trained = trainer(sent, 1)
    assert len(counted) == 7 and not np.allclose(trained["1.weight"], sent["1.weight"])
    np.testing.assert_array_equal(trainer(sent, 1)["1.weight"], trained["1.weight"])  # the same round, the same update
