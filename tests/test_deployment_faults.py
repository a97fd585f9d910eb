"""What a deployment's ServerApp records when Flower ends it, and how it names its results.

On a deployment, ``flwr stop`` ends the ServerApp process through Flower's signal handler: the
SuperLink refuses the process's next heartbeat, Flower raises SIGINT in it and its handler ends
in ``sys.exit(0)``, raised wherever the ServerApp is (usually in ``grid.pull_messages``). The
runs here raise that ``SystemExit`` from the grid in the middle of round 2 of a small in-process
simulation, which is what the ServerApp sees.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flwr.app import MessageType
from flwr.serverapp import Grid

from fedmm import protocol
from fedmm.config import to_container
from fedmm.results import read_metrics
from server_app.checkpoint import load_checkpoint
from tests.conftest import composed


class ExitingGrid:
    """A grid proxy whose pulls raise ``SystemExit(code)`` once round ``at_round``'s train
    messages are out, as Flower's signal handler does in a stopped ServerApp."""

    def __init__(self, grid: Grid, at_round: int, code: int | None) -> None:
        self._grid, self.at_round, self.code = grid, at_round, code
        self.round = 0

    def push_messages(self, messages):  # noqa: ANN001 - Grid's signature
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == MessageType.TRAIN:
                self.round = max(self.round, protocol.server_round(m))
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids):  # noqa: ANN001 - Grid's signature
        if self.round >= self.at_round:
            raise SystemExit(self.code)
        return self._grid.pull_messages(message_ids)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._grid, name)


def run_until_exit(run: Path, code: int | None) -> dict:
    """Three rounds, two clients, one a round; ``SystemExit(code)`` in round 2. The summary."""
    from flwr.app import Context
    from flwr.serverapp import ServerApp

    from client_app.client_app import app as client_app
    from fedmm.local_engine import run_local_simulation
    from server_app.runner import run_experiment

    cfg = to_container(composed("num_rounds=3", "num_clients=2", "clients_per_round=1", "training.local_epochs=1",
                                "checkpoint_every=100", f"output_dir={run}"))
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        run_experiment(ExitingGrid(grid, at_round=2, code=code), cfg, num_supernodes=2)

    with pytest.raises(SystemExit):
        run_local_simulation(server_app=server_app, client_app=client_app, num_supernodes=2)
    return json.loads((run / "summary.json").read_text())


def test_a_run_that_flower_stops_ends_as_stopped_with_a_checkpoint_of_its_last_round(tmp_path: Path) -> None:
    """``flwr stop`` (SystemExit 0 in the ServerApp) is a stop, not a failure: status
    ``stopped``, the reason says so, and the last completed round's checkpoint resumes it."""
    run = tmp_path / "run"
    summary = run_until_exit(run, code=0)
    assert summary["status"] == "stopped", summary
    assert "flwr stop" in summary["reason"] and "after round 1" in summary["reason"]
    assert summary["rounds_completed"] == 1
    assert load_checkpoint(run)["round"] == 1
    assert [r["round"] for r in read_metrics(run)] == [0, 1]


def test_exit_codes_other_than_zero_are_failures() -> None:
    from server_app.runner import exit_status

    assert exit_status(SystemExit(None), 3)["status"] == "stopped"  # sys.exit() without a code
    assert exit_status(SystemExit(0), 3)["status"] == "stopped"
    assert exit_status(SystemExit(1), 3) == {"status": "failed", "reason": "SystemExit: 1"}
    assert exit_status(SystemExit("bad config"), 3) == {"status": "failed", "reason": "SystemExit: bad config"}


def test_a_deployments_results_folder_is_not_named_after_a_partition(tmp_path: Path) -> None:
    """A deployment's SuperNodes bring their own data: its folder says ``deployment`` where a
    simulation's names its partition scheme."""
    from server_app.recording import create_run_dir

    cfg = composed("partition=dirichlet", f"results_root={tmp_path}", "seed=4")
    deployed = create_run_dir(cfg, simulation=False)
    simulated = create_run_dir(cfg, simulation=True)
    assert deployed.parent == simulated.parent == tmp_path.resolve()
    assert deployed.name.endswith("_fedavg_mnist5k_deployment_s4") and "dirichlet" not in deployed.name
    assert simulated.name.endswith("_fedavg_mnist5k_dirichlet_s4")


def test_a_deployments_plot_title_names_no_partition() -> None:
    from server_app.runner import plot_title

    cfg = composed("partition=dirichlet")
    assert "deployment" in plot_title(cfg, simulation=False) and "Dir(" not in plot_title(cfg, simulation=False)
    assert "Dir(α=" in plot_title(cfg)
