"""The same runs on both engines give the same numbers: Flower's simulation engine (Ray) and the
in-process engine (fedmm/local_engine.py), each running the same list of experiments in one
simulation, write the same ``metrics.jsonl``, every value of every round but the wall-clock
``seconds`` (and the asynchronous methods' ``bytes_received``, see ``ARRIVAL``), **exactly**.

Exactly, because the arithmetic is the same: the Ray side runs one ClientApp at a time with as
many torch threads as this process has (``simulation.client_cpus`` = ``torch.get_num_threads()``),
which is what the in-process engine's ClientApp uses; the server's side is the same code in both.
(With Ray's default of one thread per ClientApp, the clients' sums run in another order and the
numbers agree only within tests/test_same_results.py's cross-host tolerance.)

The runs: FedAvg, FedMR, FedCross, SCAFFOLD (its clients' control variates in ``Context.state``),
FedMR with secure recombination (both exchanges; the nodes' protocol state in ``Context.state``),
FedBuff and asynchronous FedMR on the virtual clock (a 10x slower tier), and FedAvg with a hostile
node as bench/faults.py makes one (partition 0 sends its update x100, the update norm bounded).
Secure recombination draws its layer choices from the OS and orders peers by node id: the test's
ClientApp seeds the draws per message and the in-process run takes the Ray run's node ids
(tests/sim_apps.py: ``engines_client_app``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedmm.results import read_metrics

pytestmark = pytest.mark.ray_runtime  # a Ray simulation (tests/conftest.py: one Ray at a time)

#: name -> overrides of each run (4 nodes, all in every round, 2 rounds of 1 local epoch, the small LeNet).
RUNS = {
    "fedavg": ["strategy=fedavg"],
    "fedmr": ["strategy=fedmr"],
    "fedcross": ["strategy=fedcross"],
    "scaffold": ["strategy=scaffold"],
    "secure": ["strategy=fedmr", "strategy.secure.enabled=true", "clients_per_round=3"],
    "fedbuff": ["strategy=fedbuff", "strategy.asynchronous.buffer_size=2", "strategy.heterogeneity.profile=tiers",
                "strategy.heterogeneity.tiers=[[0.25,10.0]]"],
    "fedmr_async": ["strategy=fedmr_async", "strategy.asynchronous.buffer_size=2", "strategy.heterogeneity.profile=tiers",
                    "strategy.heterogeneity.tiers=[[0.25,10.0]]"],
    "scale": ["strategy=fedavg", "clients_per_round=4", "strategy.defence.clip_update_norm=1.0"],  # bench/faults.py's hostile node
}
NODES = 4


def configs(root: Path, engine: str) -> list[dict]:
    from fedmm.config import compose, to_container

    threads = torch.get_num_threads()
    engine_overrides = [f"simulation.engine={engine}"] + ([f"simulation.client_cpus={threads}"] if engine == "ray" else [])
    return [to_container(compose(["num_rounds=2", f"num_clients={NODES}", f"clients_per_round={NODES}",
                                  "training.local_epochs=1", "model=lenet", "dataset.test_fraction=0.8", "partition.alpha=0.5",
                                  *overrides, *engine_overrides, f"output_dir={root / engine / name}"]))
            for name, overrides in RUNS.items()]


@pytest.fixture(scope="module")
def both_engines(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runs on Ray (one simulation), then in process (one simulation, the Ray run's node ids)."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from fedmm.local_engine import run_local_simulation
    from launch.cli import backend_config
    from server_app.runner import run_experiment
    from tests.sim_apps import engines_client_app, node_ids_by_partition

    root = tmp_path_factory.mktemp("engines")
    seen: dict[str, list[int]] = {}

    def server_app(engine: str) -> ServerApp:
        app = ServerApp()

        @app.main()
        def main(grid: Grid, context: Context) -> None:
            seen[engine] = node_ids_by_partition(grid, NODES)
            for cfg in configs(root, engine):
                run_experiment(grid, cfg)

        return app

    ray_cfg = configs(root, "ray")[0]
    run_simulation(server_app=server_app("ray"), client_app=engines_client_app(), num_supernodes=NODES,
                   backend_config=backend_config(ray_cfg))
    run_local_simulation(server_app=server_app("local"), client_app=engines_client_app(), num_supernodes=NODES,
                         node_ids=seen["ray"])
    assert seen["local"] == seen["ray"]
    return root


#: Not compared: wall-clock seconds, and, for the asynchronous methods, the bytes of the replies
#: pulled by the time a round's row is written (the virtual clock decides which jobs a round
#: uses, not when the others' replies arrive; it moves from one run to the next on one engine too).
WALL_CLOCK = {"seconds"}
ARRIVAL = {"bytes_received"}


@pytest.mark.parametrize("name", list(RUNS))
def test_the_same_run_gives_the_same_numbers_on_both_engines(both_engines: Path, name: str) -> None:
    ray, local = (read_metrics(both_engines / engine / name) for engine in ("ray", "local"))
    for run in (both_engines / "ray" / name, both_engines / "local" / name):
        assert json.loads((run / "summary.json").read_text())["status"] == "completed", run
    assert [r["round"] for r in ray] == [0, 1, 2]
    skip = WALL_CLOCK | (ARRIVAL if name in ("fedbuff", "fedmr_async") else set())
    strip = lambda rows: [{k: v for k, v in row.items() if k not in skip} for row in rows]  # noqa: E731
    assert strip(local) == strip(ray)


def test_the_runs_did_what_they_are_here_for(both_engines: Path) -> None:
    """Each run exercised its part: node state, the secure exchange, the virtual clock, the hostile
    node's bounded update (else equal numbers would prove less)."""
    rows = {name: read_metrics(both_engines / "local" / name) for name in RUNS}
    assert [r["control_rounds"] for r in rows["scaffold"][1:]] == [1.0, 2.0] or all(
        r["control_rounds"] >= 1.0 for r in rows["scaffold"][1:])
    assert all(r["secure_exchanged"] >= 1 and r["secure_relayed_bytes"] > 0 for r in rows["secure"][1:])
    for name in ("fedbuff", "fedmr_async"):
        times = [r["virtual_time"] for r in rows[name][1:]]
        assert 0 < times[0] < times[1], (name, times)
    assert all(r["updates_scaled"] >= 1 and r["largest_update_norm"] > 1.0 for r in rows["scale"][1:])
    assert rows["fedmr"][-1]["accuracy"] > rows["fedmr"][0]["accuracy"]
