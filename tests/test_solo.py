"""SOLO: each client gets its own model back, nothing is averaged, the state survives a resume."""

from __future__ import annotations

import numpy as np
from flwr.app import ConfigRecord

from fedmm.protocol import record_to_model
from strategies.solo import Solo
from tests.fakes import FakeGrid
from tests.test_multimodel import initial, partition, trainer


def test_each_client_trains_only_its_own_model() -> None:
    grid = FakeGrid(trainer, num_nodes=3, seed=0)
    strategy = Solo(clients_per_round=3, seed=0)
    arrays = initial()
    start = record_to_model(arrays)
    for rnd in (1, 2, 3):
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({"x": 1}), grid))
        for msg in msgs:
            p = partition(grid.keys[msg.metadata.dst_node_id])
            sent = record_to_model(msg.content["arrays"])
            # the trainer adds (p + 1) per round: the client's own model after rnd - 1 rounds, never a mix
            np.testing.assert_array_equal(sent["a.weight"], start["a.weight"] + (rnd - 1) * (p + 1))
        arrays, metrics = strategy.aggregate_train(rnd, grid.send_and_receive(msgs))
        assert metrics["replies"] == 3.0
    local = strategy.models_to_evaluate()
    assert sorted(float(m["a.weight"][0]) for m in local) == [3.0, 6.0, 9.0]
    # the saved global artefact is the mean of the local models
    np.testing.assert_allclose(record_to_model(arrays)["a.weight"], 6.0)


def test_state_round_trip_keeps_every_clients_model() -> None:
    grid = FakeGrid(trainer, num_nodes=4, seed=1)
    strategy = Solo(clients_per_round=2, seed=0)
    msgs = list(strategy.configure_train(1, initial(), ConfigRecord({"x": 1}), grid))
    strategy.aggregate_train(1, grid.send_and_receive(msgs))
    state = strategy.context.state_dict()
    again = Solo(clients_per_round=2, seed=0)
    again.load_state_dict(state)
    assert sorted(again.local_models) == sorted(strategy.local_models) and len(again.local_models) == 2
    assert again.initial is strategy.initial


def test_a_resumed_solo_run_continues_every_clients_own_model(tmp_path) -> None:  # noqa: ANN001
    """Through a real checkpoint file: rounds 1-2, save, load into a new server, round 3 gives
    what round 3 of the run never stopped gives."""
    from server_app.checkpoint import load_checkpoint, save_checkpoint

    def rounds(strategy: Solo, grid: FakeGrid, which, arrays):  # noqa: ANN001, ANN202
        for rnd in which:
            msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({"x": 1}), grid))
            arrays, _ = strategy.aggregate_train(rnd, grid.send_and_receive(msgs))
        return arrays

    straight = Solo(clients_per_round=2, seed=0)
    expected = record_to_model(rounds(straight, FakeGrid(trainer, num_nodes=4, seed=1), (1, 2, 3), initial()))
    first = Solo(clients_per_round=2, seed=0)
    arrays = rounds(first, FakeGrid(trainer, num_nodes=4, seed=1), (1, 2), initial())
    save_checkpoint(tmp_path, {"round": 2, "strategy": first.context.state_dict()})
    resumed = Solo(clients_per_round=2, seed=0)
    resumed.context.load_state_dict(load_checkpoint(tmp_path)["strategy"])
    got = record_to_model(rounds(resumed, FakeGrid(trainer, num_nodes=4, seed=1), (3,), arrays))
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value)
    assert sorted(resumed.local_models) == sorted(straight.local_models)
