"""FedMR and FedCross as drop-in strategies of any Flower app: a real simulation (Ray backend)
against the quickstart-style ClientApp of tests/quickstart_app.py, which has no query handler
and knows nothing of this project."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from strategies import FedCross, FedMR
from tests.quickstart_app import Net
from tests.quickstart_app import app as quickstart_client_app

K, NODES, ROUNDS = 3, 4, 2


class SpyGrid:
    """Grid proxy that keeps the arrays of every train message, per round."""

    def __init__(self, grid: Grid) -> None:
        self.grid, self.sent = grid, {}

    def push_messages(self, messages):  # noqa: ANN001
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == "train":
                rnd = int(m.content["config"]["server-round"])
                self.sent.setdefault(rnd, []).append(m.content["arrays"].to_torch_state_dict())
        return self.grid.push_messages(messages)

    def __getattr__(self, name):  # noqa: ANN001
        return getattr(self.grid, name)


def test_fedmr_and_fedcross_run_against_a_plain_flower_clientapp() -> None:
    out: dict = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        torch.manual_seed(0)
        initial = ArrayRecord(Net().state_dict())
        for name, strategy in (("fedmr", FedMR(num_models=K, seed=0)), ("fedcross", FedCross(num_models=K, seed=0, alpha=0.9))):
            spy = SpyGrid(grid)
            result = strategy.start(grid=spy, initial_arrays=initial, num_rounds=ROUNDS, train_config=ConfigRecord({"lr": 0.1}))
            out[name] = (strategy, spy.sent, result)

    run_simulation(
        server_app=server,
        client_app=quickstart_client_app,
        num_supernodes=NODES,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"logging_level": "ERROR"}},
    )
    torch.manual_seed(0)
    initial = Net().state_dict()
    for name in ("fedmr", "fedcross"):
        strategy, sent, result = out[name]
        assert sorted(sent) == [1, 2] and all(len(v) == K for v in sent.values())
        assert all(torch.equal(s[k], initial[k]) for s in sent[1] for k in initial)  # round 1: the initial model
        # round 2: K different models, none equal to the initial one: each node got its own
        for i in range(K):
            assert any(not torch.equal(sent[2][i][k], initial[k]) for k in initial)
            for j in range(i + 1, K):
                assert any(not torch.equal(sent[2][i][k], sent[2][j][k]) for k in initial), (name, i, j)
        assert strategy.last_replies == K
        assert len(strategy.pool()) == K
        final = result.arrays.to_torch_state_dict()
        assert all(torch.isfinite(v).all() for v in final.values())
        # the global model is the unweighted mean of the K trained models
        assert result.train_metrics_clientapp[ROUNDS]["replies"] == K
        assert result.train_metrics_clientapp[ROUNDS]["num-examples"] == 64 * K
    _, _, fedmr_result = out["fedmr"]
    np.testing.assert_allclose(fedmr_result.arrays["fc2.bias"].numpy(),
                               np.mean([m["fc2.bias"] for m in out["fedmr"][0].pool()], axis=0), rtol=1e-6)
