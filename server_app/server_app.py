"""The ServerApp: validate the config from the run config, then run (or resume) the experiment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from logging import ERROR, INFO
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log
from flwr.superlink.grid import InMemoryGrid

from fedmm.config import compose_from_run_config
from fedmm.errors import ConfigError
from server_app.runner import run_experiment

app = ServerApp()


def is_simulation(grid: Grid) -> bool:
    """True on Flower's simulation engine, False against a deployment SuperLink.

    The simulation engine (``flwr run`` on a simulation federation, ``run_simulation``) drives
    the ServerApp through an in-memory grid whose SuperNodes are partitions of one dataset;
    a deployment SuperLink drives it over its Runtime API, with SuperNodes that bring their own
    data (``data-path`` node config) and may connect after the run has started.
    """
    return isinstance(grid, InMemoryGrid)


def where_the_app_runs() -> str:
    """Who runs this ServerApp, with which Python, from which code: ``flwr run`` joins any local
    SuperLink on its port, so the first log line says whose environment the run is in."""
    import getpass
    import sys
    from pathlib import Path

    import fedmm
    import objectives
    import strategies

    roots = {Path(m.__file__).resolve().parent.parent for m in (fedmm, strategies, objectives)}
    if len(roots) > 1:
        raise ConfigError(
            "app", sorted(map(str, roots)),
            "one copy of the app: its packages come from different folders (another checkout is installed "
            "in this SuperLink's environment); run your own local SuperLink (see README, 'Local SuperLink')",
        )
    return f"user {getpass.getuser()} (uid {os.getuid()}), Python {sys.executable}, app code in {roots.pop()}"


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point of ``flwr run``: ``-c`` keys become hydra overrides of ``conf/``."""
    log(INFO, "fedmm ServerApp: %s", where_the_app_runs())
    simulation = is_simulation(grid)
    try:
        run_config = on_flowers_engine(context.run_config) if simulation else context.run_config
        run = compose_from_run_config(run_config)
    except ConfigError as err:
        log(ERROR, "%s", err)  # one clear line before Flower's own report of the failed run
        raise
    if not simulation:
        log(INFO, "fedmm: deployment runtime: each SuperNode trains on its own data-path; no partitions.")
    run_experiment(grid, run, simulation=simulation)


def on_flowers_engine(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The run config of a ``flwr run`` simulation, which runs on Flower's own engine (Ray): its
    settings are validated, and recorded, with ``simulation.engine=ray``; a run config that asks
    for another engine is refused (the in-process engine is ``fedmm``'s)."""
    from fedmm.config import overrides_from_run_config

    for item in overrides_from_run_config(run_config):
        key, _, value = item.lstrip("+").partition("=")
        if key == "simulation.engine" and value.strip("'\"") != "ray":
            raise ConfigError("simulation.engine", value, "ray under flwr run, whose simulation runtime is Flower's engine "
                              "(the in-process engine is fedmm's: `fedmm simulation.engine=local ...`)")
    return {**run_config, "overrides": f"simulation.engine=ray {run_config.get('overrides', '') or ''}".strip()}
