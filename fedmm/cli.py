"""``fedmm``: run one experiment or a hydra multirun sweep on Flower's simulation engine.

    fedmm strategy=fedmr partition.alpha=0.1
    fedmm -m seed=0,1,2 strategy=fedavg,fedmr

Each job composes ``conf/`` with its overrides, validates it, and runs the ServerApp and
ClientApp of this app on the Ray backend with ``simulation.num_supernodes`` virtual
SuperNodes; results go to the hydra job directory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from fedmm import config as config_mod  # noqa: E402
from fedmm.errors import ConfigError  # noqa: E402


def backend_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Ray backend settings from the ``simulation`` group."""
    sim = cfg["simulation"]
    return {
        "client_resources": {"num_cpus": sim["client_cpus"], "num_gpus": sim["client_gpus"]},
        "init_args": {"logging_level": "ERROR", "log_to_driver": True},
    }


def run_job(cfg: dict[str, Any]) -> Path:
    """Run one experiment on the simulation engine and return its results directory."""
    import warnings

    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from client_app.client_app import app as client_app
    from fedmm.experiment import run_experiment

    out: dict[str, Path] = {}
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        out["dir"] = run_experiment(grid, cfg)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=int(cfg["simulation"]["num_supernodes"]),
            backend_config=backend_config(cfg),
        )
    if "dir" not in out:
        raise RuntimeError("the simulation ended before the experiment finished; see the log above")
    return out["dir"]


@hydra.main(config_path=str(config_mod.CONF_DIR), config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    resolved = config_mod.to_container(cfg)
    resolved["output_dir"] = HydraConfig.get().runtime.output_dir
    try:
        config_mod.validate(resolved)
    except ConfigError as err:
        raise SystemExit(str(err)) from None
    # Flower logs to its own console handler; stop hydra's root handler from printing it twice.
    logging.getLogger("flwr").propagate = False
    print(f"fedmm: results -> {resolved['output_dir']}", flush=True)
    run_dir = run_job(resolved)
    print(f"fedmm: results written to {run_dir}", flush=True)


def main() -> None:
    """Console-script entry point."""
    _hydra_main()
