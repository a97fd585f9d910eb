"""``fedmm``: run one experiment or a hydra multirun sweep on a simulation engine.

    fedmm strategy=fedmr partition.alpha=0.1
    fedmm -m seed=0,1,2 strategy=fedavg,fedmr
    fedmm resume=outputs/2026-11-23/10-00-00_fedmr+ce_mnist5k_dirichlet_s0 [num_rounds=50]

Each job composes ``conf/`` with its overrides, validates it once, and runs the ServerApp and
ClientApp of this app with ``simulation.num_supernodes`` virtual SuperNodes on the engine that
``simulation.engine`` names: ``local`` (the default: both apps in this process, one ClientApp at a
time, no Ray; :mod:`fedmm.local_engine`) or ``ray`` (Flower's simulation engine, on a local Ray or
on the running Ray cluster that ``simulation.ray_address`` names); results go to the hydra job
directory (or, with ``resume``, to the run being continued).

This module is the composition root: the only place that imports both apps. Nothing imports it.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from fedmm import config as config_mod  # noqa: E402
from fedmm.errors import ConfigError  # noqa: E402


def backend_config(cfg: Any) -> dict[str, Any]:
    """Ray backend settings from the ``simulation`` group: what each ClientApp reserves, and the
    ``ray.init`` arguments (``simulation.ray_init_args``, and ``address`` when
    ``simulation.ray_address`` names a running Ray cluster to attach to)."""
    sim = config_mod.as_run(cfg).simulation
    init_args: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": True}
    init_args.update(copy.deepcopy(dict(sim.ray_init_args)))
    if sim.ray_address is not None:
        init_args["address"] = sim.ray_address
    return {
        "client_resources": {"num_cpus": sim.client_cpus, "num_gpus": sim.client_gpus},
        "init_args": init_args,
    }


def attach_ray(init_args: dict[str, Any]) -> bool:
    """Connect this process to the running Ray cluster at ``init_args["address"]`` (False, doing
    nothing, when there is no address: Flower then starts a local Ray itself).

    Flower's Ray backend calls ``ray.init`` only when Ray is not initialised yet, and passes its
    own ``runtime_env``; connecting here first lets ``simulation.ray_init_args`` carry a
    ``runtime_env`` (e.g. a ``working_dir`` for nodes without the app), fails at once with the
    key's name when no head answers (``ray.init`` would retry for minutes), and keeps fedmm's
    SIGTERM handler (``ray.init`` replaces it). Flower ends the job with ``ray.shutdown()``, which
    for an attached driver only disconnects: the cluster stays up for the next job.
    """
    address = init_args.get("address")
    if address is None:
        return False
    import signal
    import socket
    import threading

    import ray

    if address != "auto":
        host, _, port = str(address).rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
        except OSError as err:
            raise JobFailed(
                f"simulation.ray_address={address}: no Ray head answers there ({err}); start one with "
                f"`ray start --head --port={port}` or correct the address"
            ) from None
    if ray.is_initialized():  # left connected by the caller: every job attaches afresh
        ray.shutdown()
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        ray.init(**copy.deepcopy(init_args))
    except Exception as err:
        raise JobFailed(
            f"simulation.ray_address={address}: could not attach to the Ray cluster there "
            f"(run fedmm on a node of the cluster, with the cluster's Ray and Python versions): {type(err).__name__}: {err}"
        ) from err
    finally:
        if main_thread and sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
    resources = ray.cluster_resources()
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    print(
        f"fedmm: attached to the Ray cluster at {address}: {nodes} node(s), {resources.get('CPU', 0):g} CPU, "
        f"{resources.get('GPU', 0):g} GPU",
        flush=True,
    )
    return True


def start_local_ray(init_args: dict[str, Any]) -> bool:
    """Start the job's private Ray here, as Flower's Ray backend would (its ``init_args``,
    no dashboard, this process's ``sys.path`` as the workers' ``PYTHONPATH``), and keep fedmm's
    SIGINT / SIGTERM handlers, which ``ray.init`` replaces (a SIGTERM then aborted the process
    instead of stopping the run with a checkpoint). Flower sees Ray initialised and uses it; it
    shuts it down at the end of the job. Only from the main thread (signal handlers live there);
    elsewhere Flower starts Ray itself. Returns whether Ray was started here.
    """
    import signal
    import sys
    import threading

    import ray

    if threading.current_thread() is not threading.main_thread() or ray.is_initialized():
        return False
    args = copy.deepcopy(init_args)
    args.setdefault("include_dashboard", False)
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **args)
    finally:
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
    return True


def prepare_server_data(cfg: Any) -> None:
    """Load what the ServerApp's set-up asks for first: the dataset, the partition and the plotting
    classes (all cached per process). Run in a thread while Ray starts (``ray.init`` mostly waits
    for the processes it spawns), so the set-up finds them ready. Draws from no global random
    stream (partitions use their own generators). An error is left for the ServerApp, which
    raises it in context."""
    try:
        from fedmm.data import load_dataset, partition_indices

        train, _ = load_dataset(cfg.dataset)
        if not cfg.resume:
            partition_indices(train, cfg.partition, cfg.num_clients, cfg.seed)
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except Exception:  # noqa: BLE001 (the ServerApp meets it again and reports it)
        pass


def run_job(settings: Any) -> Path:
    """Run one experiment (its settings, or a plain config: validated here) on the simulation
    engine ``simulation.engine`` names and return its results directory."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    from client_app.client_app import app as client_app
    from client_app.client_app import train_batch
    from fedmm.interrupt import reset
    from server_app.runner import run_experiment

    reset()
    cfg = config_mod.as_run(settings)
    out: dict[str, Any] = {}
    server_app = ServerApp()
    prepared = None
    if cfg.simulation.engine == "ray":
        import threading

        prepared = threading.Thread(target=prepare_server_data, args=(cfg,), name="fedmm-prepare", daemon=True)
        prepared.start()  # beside Ray's start; the ServerApp waits for it (no work done twice)

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        try:
            if prepared is not None:
                prepared.join()
            out["dir"] = run_experiment(grid, cfg, num_supernodes=cfg.simulation.num_supernodes)
        except BaseException as err:  # Flower logs it and returns: keep it to fail the job
            out["error"] = err
            raise

    if cfg.simulation.engine == "local":
        from fedmm.local_engine import run_local_simulation

        try:
            run_local_simulation(server_app=server_app, client_app=client_app, num_supernodes=cfg.simulation.num_supernodes,
                                 train_batch=None if cfg.simulation.vectorize == "off" else train_batch)
        except Exception as err:  # noqa: BLE001 - the ServerApp's error, kept in out["error"]
            out.setdefault("error", err)
    else:
        _run_on_ray(cfg, server_app, client_app, out)
    if "error" in out:
        err = out["error"]
        if isinstance(err, KeyboardInterrupt):
            raise err
        raise JobFailed(f"{type(err).__name__}: {err}") from err
    if "dir" not in out:
        raise JobFailed("the simulation ended before the experiment finished (the simulation runtime failed; see the log above)")
    return out["dir"]


def _run_on_ray(cfg: Any, server_app: Any, client_app: Any, out: dict[str, Any]) -> None:
    """Run ``server_app`` and ``client_app`` on Flower's simulation engine (Ray backend): a local
    Ray of this job's, or the Ray cluster ``simulation.ray_address`` names. The ServerApp's
    outcome goes into ``out`` (``dir`` or ``error``)."""
    import warnings

    from flwr.simulation import run_simulation

    from fedmm.interrupt import abort

    backend = backend_config(cfg)
    attached = attach_ray(backend["init_args"])
    started = False if attached else start_local_ray(backend["init_args"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            run_simulation(
                server_app=server_app,
                client_app=client_app,
                num_supernodes=cfg.simulation.num_supernodes,
                backend_config=backend,
            )
        except Exception as err:  # the ServerApp's own error, or the simulation runtime's
            out.setdefault("error", err)
            if out["error"] is err:
                # the runtime itself stopped (e.g. Ray could place no ClientApp): the ServerApp
                # thread would wait for replies that cannot come; stop it now, as failed
                abort(f"the simulation runtime stopped: {type(err).__name__}: {err}")
        finally:
            if "dir" not in out and "error" not in out:
                abort("the simulation runtime stopped before the experiment finished")
            if attached or started:
                _disconnect_ray()  # Flower's backend shuts Ray down; this covers a runtime that failed first


def _disconnect_ray() -> None:
    """Disconnect this driver from an attached cluster if Flower has not (its backend's
    ``terminate`` does, unless the backend failed to start); the cluster keeps running."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


class JobFailed(RuntimeError):
    """A job of ``fedmm`` did not complete; the message says why."""


#: (job directory, reason) of every failed job of this process (a multirun sweep goes on).
FAILED_JOBS: list[tuple[str, str]] = []


_JOB_FILE_HANDLERS: list[logging.Handler] = []


def log_to_job_file() -> None:
    """Attach the hydra job's log file (the root logger's file handler) to Flower's logger,
    replacing the previous job's in a sweep."""
    flwr_logger = logging.getLogger("flwr")
    while _JOB_FILE_HANDLERS:
        flwr_logger.removeHandler(_JOB_FILE_HANDLERS.pop())
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            flwr_logger.addHandler(handler)
            _JOB_FILE_HANDLERS.append(handler)


def preflight(cfg: Any) -> None:
    """Load the dataset before the simulation starts, so that a bad folder or hub id is one line
    now, not a traceback after Ray and the SuperNodes are up (the in-process ServerApp then
    reuses the loaded splits)."""
    from fedmm.data import load_dataset

    try:
        load_dataset(cfg.dataset)
    except ConfigError:
        raise
    except Exception as err:  # hub unreachable, unreadable files, ...
        raise ConfigError("dataset", cfg.dataset.name, f"a dataset that loads ({type(err).__name__}: {err})") from None


def job_config(cfg: DictConfig) -> dict[str, Any]:
    """The validated config of this hydra job (a fresh run, or the run given by ``resume``)."""
    if cfg.get("resume"):
        explicit = [o for o in HydraConfig.get().overrides.task if not o.lstrip("+").startswith("resume=")]
        return config_mod.resume_config(cfg["resume"], explicit)
    resolved = config_mod.to_container(cfg)
    resolved["output_dir"] = HydraConfig.get().runtime.output_dir
    return config_mod.validate(resolved)


@hydra.main(config_path=str(config_mod.CONF_DIR), config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    try:
        resolved = job_config(cfg)
        preflight(resolved)
    except ConfigError as err:
        raise SystemExit(str(err)) from None
    # Flower logs to its own console handler; stop hydra's root handler from printing it twice,
    # but send its lines (the round-by-round progress) to this job's hydra log file too.
    logging.getLogger("flwr").propagate = False
    log_to_job_file()
    print(f"fedmm: results -> {resolved.output_dir}", flush=True)
    try:
        run_dir = run_job(resolved)
    except JobFailed as err:
        FAILED_JOBS.append((str(resolved.output_dir), str(err)))
        print(f"fedmm: FAILED {resolved.output_dir}: {err}", flush=True)
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            raise SystemExit(1) from None
        return  # a sweep goes on with its next job and fails at the end
    print(f"fedmm: results written to {run_dir}", flush=True)


def main() -> None:
    """Console-script entry point: exits non-zero when any job of the run or sweep failed,
    130 when it was stopped by SIGINT / SIGTERM."""
    from fedmm.interrupt import install_signal_handlers

    install_signal_handlers()
    config_mod.register_defaults()  # every declaration's defaults, before hydra composes
    try:
        _hydra_main()
    except KeyboardInterrupt:
        print("fedmm: interrupted; the run directory holds a checkpoint: continue with fedmm resume=<run dir>", flush=True)
        raise SystemExit(130) from None
    if FAILED_JOBS:
        print(f"fedmm: {len(FAILED_JOBS)} job(s) failed:", flush=True)
        for job_dir, reason in FAILED_JOBS:
            print(f"  {job_dir}: {reason}", flush=True)
        raise SystemExit(1)
