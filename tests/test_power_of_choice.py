"""Power-of-Choice client selection (strategies/power_of_choice.py, one file): d candidates drawn
by data size, the K with the highest loss of the round's model selected, the replies averaged
unweighted; refused under differential privacy; and a real run on the ClientApp's measurement."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedmm import protocol
from fedmm.config import compose
from fedmm.errors import ConfigError
from strategies import FedAvg
from strategies.power_of_choice import PowerOfChoiceSelector
from tests.fakes import FakeGrid

N = 8
#: Each node's loss of the model it is asked about: partition i has loss 1 + i (partition 7 the highest).
LOSS = {f"partition:{i:09d}": 1.0 + i for i in range(N)}
SIZES = {key: 10 * (i + 1) for i, key in enumerate(LOSS)}


def node(msg: Message, key: str) -> RecordDict:
    if msg.metadata.message_type == MessageType.EVALUATE:
        assert list(msg.content["config"][protocol.MEASURE]) == [protocol.LOSS_BEFORE] and "arrays" in msg.content
        return RecordDict({"metrics": MetricRecord({protocol.LOSS_BEFORE: LOSS[key], protocol.NUM_EXAMPLES: 1.0})})
    model = protocol.record_to_model(msg.content["arrays"])
    index = int(key[-1])
    return RecordDict({"arrays": protocol.model_to_record({"w": model["w"] + index}),
                       "metrics": MetricRecord({protocol.NUM_EXAMPLES: float(SIZES[key])})})


def selector(d: int) -> PowerOfChoiceSelector:
    return PowerOfChoiceSelector(0, d, query_config={protocol.ROSTER_EXAMPLES: 1, protocol.RUN_CONFIG: "{}"})


def one_round(d: int) -> tuple[FedAvg, FakeGrid, list[Message]]:
    strategy = FedAvg(3, seed=0, selector=selector(d))
    grid = FakeGrid(node, num_nodes=N, examples=SIZES)
    messages = list(strategy.configure_train(1, protocol.model_to_record({"w": np.zeros(2, np.float32)}),
                                             ConfigRecord({"x": 1}), grid))
    return strategy, grid, messages


def test_the_k_candidates_with_the_highest_loss_are_selected_and_averaged_unweighted() -> None:
    strategy, grid, messages = one_round(d=5)
    asked = [m for m in grid.sent if m.metadata.message_type == MessageType.EVALUATE]
    candidates = [grid.keys[m.metadata.dst_node_id] for m in asked]
    chosen = [grid.keys[m.metadata.dst_node_id] for m in messages]
    assert len(candidates) == 5 == len(set(candidates))
    assert chosen == sorted(candidates, key=lambda k: -LOSS[k])[:3]  # the highest losses, highest first
    out, _ = strategy.aggregate_train(1, grid.send_and_receive(messages))
    got = protocol.record_to_model(out)["w"]
    np.testing.assert_allclose(got, np.mean([int(k[-1]) for k in chosen]))  # unweighted, whatever the sizes
    assert strategy.round_log["candidates"] == 5.0


def test_with_every_client_a_candidate_the_highest_losses_are_taken_and_draws_follow_the_sizes() -> None:
    _, grid, messages = one_round(d=N)
    assert sorted(grid.keys[m.metadata.dst_node_id] for m in messages) == [f"partition:{i:09d}" for i in (5, 6, 7)]
    counts = {key: 0 for key in LOSS}
    for seed in range(200):  # candidates are drawn in proportion to the clients' sizes
        s = PowerOfChoiceSelector(seed, 2, query_config={protocol.ROSTER_EXAMPLES: 1, protocol.RUN_CONFIG: "{}"})
        s.prepare(1, protocol.model_to_record({"w": np.zeros(2, np.float32)}))
        grid = FakeGrid(node, num_nodes=N, examples=SIZES)
        s.select(grid, 1, 1)
        for m in grid.sent:
            counts[grid.keys[m.metadata.dst_node_id]] += 1
    assert counts["partition:000000007"] > 3 * counts["partition:000000000"]


def test_settings_and_refusals() -> None:
    run = compose(["selection=power_of_choice", "num_clients=10", "clients_per_round=4"])
    assert run.selection.name == "power_of_choice"
    for overrides, key in ((["selection.candidates=3"], "selection.candidates"), (["selection.candidates=11"], "selection.candidates"),
                           (["strategy=fedmr"], "selection"), (["strategy.privacy.clip_norm=1"], "strategy.privacy.clip_norm")):
        with pytest.raises(ConfigError) as err:
            compose(["selection=power_of_choice", "num_clients=10", "clients_per_round=4", *overrides])
        assert err.value.key == key, overrides


def test_a_real_run_selects_by_the_clientapps_measured_losses(tmp_path) -> None:  # noqa: ANN001
    """selection=power_of_choice in a real run: the candidates answer the loss query (the
    ClientApp measures on its training rows), the round's K are selected from them."""
    from tests.test_vectorized_rounds import run

    rows = run(tmp_path, "pow", "selection=power_of_choice", "selection.candidates=5")
    assert all(row["replies"] == 3 and row["candidates"] == 5 for row in rows[1:])
    assert all(row["selected_loss_mean"] >= row["candidate_loss_mean"] for row in rows[1:])
