"""The ServerApp: compose the config from the run config, then run the experiment."""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedmm.config import compose_from_run_config
from fedmm.experiment import run_experiment

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point of ``flwr run``: ``-c`` keys become hydra overrides of ``conf/``."""
    cfg = compose_from_run_config(context.run_config)
    run_experiment(grid, cfg)
