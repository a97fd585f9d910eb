"""``fedmm``: run one experiment or a hydra multirun sweep on a simulation engine.

    fedmm strategy=fedmr partition.alpha=0.1
    fedmm -m seed=0,1,2 strategy=fedavg,fedmr
    fedmm resume=outputs/2026-11-23/10-00-00_fedmr+ce_mnist5k_dirichlet_s0 [num_rounds=50]

Each job composes ``conf/`` with its overrides, validates it once, and runs the ServerApp and
ClientApp of this app with ``simulation.num_supernodes`` virtual SuperNodes on the engine that
``simulation.engine`` names: ``local`` (the default: both apps in this process, one ClientApp at a
time, no Ray; :mod:`fedmm.local_engine`) or ``ray`` (Flower's simulation engine, on a local Ray or
on the running Ray cluster that ``simulation.ray_address`` names); results go to the hydra job
directory (or, with ``resume``, to the run being continued: its log too, :func:`command_line`).
Unknown options and keys are named, with the nearest valid one, before hydra composes
(:func:`check_names`).

This module is the composition root: the only place that imports both apps. Nothing imports it.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.experimental.callback import Callback  # noqa: E402
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


def load_client_app(where: str) -> Any:
    """The ClientApp object ``module:attribute`` names (``simulation.client_app``)."""
    import importlib

    from flwr.clientapp import ClientApp

    module, _, name = where.partition(":")
    try:
        app = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise config_mod.ConfigError("simulation.client_app", where, f"module:attribute of a ClientApp ({err})") from err
    if not isinstance(app, ClientApp):
        raise config_mod.ConfigError("simulation.client_app", where, f"a ClientApp object (it is a {type(app).__name__})")
    return app


def run_job(settings: Any, observers: Any = ()) -> Path:
    """Run one experiment (its settings, or a plain config: validated here) on the simulation
    engine ``simulation.engine`` names and return its results directory; ``observers`` see the
    run (:mod:`fedmm.observers`)."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    from client_app.client_app import train_batch
    from fedmm.interrupt import reset
    from server_app.runner import run_experiment

    reset()
    cfg = config_mod.as_run(settings)
    client_app = load_client_app(cfg.simulation.client_app)
    out: dict[str, Any] = {}
    server_app = ServerApp()
    prepared = None
    if cfg.simulation.engine == "ray":
        prepared = threading.Thread(target=prepare_server_data, args=(cfg,), name="fedmm-prepare", daemon=True)
        prepared.start()  # beside Ray's start; the ServerApp waits for it (no work done twice)

    server_done = threading.Event()  # the ServerApp returned or raised (its files are written)

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        try:
            if prepared is not None:
                prepared.join()
            out["dir"] = run_experiment(grid, cfg, num_supernodes=cfg.simulation.num_supernodes, observers=observers)
        except BaseException as err:  # Flower logs it and returns: keep it to fail the job
            out["error"] = err
            raise
        finally:
            server_done.set()

    if cfg.simulation.engine == "local":
        from fedmm.local_engine import run_local_simulation

        try:
            run_local_simulation(server_app=server_app, client_app=client_app, num_supernodes=cfg.simulation.num_supernodes,
                                 train_batch=None if cfg.simulation.vectorize == "off" else train_batch)
        except Exception as err:  # noqa: BLE001 - the ServerApp's error, kept in out["error"]
            out.setdefault("error", err)
    else:
        _run_on_ray(cfg, server_app, client_app, out, server_done)
    if "error" in out:
        err = out["error"]
        if isinstance(err, (KeyboardInterrupt, JobFailed)):
            raise err
        raise JobFailed(f"{type(err).__name__}: {err}") from err
    if "dir" not in out:
        raise JobFailed("the simulation ended before the experiment finished (the simulation runtime failed; see the log above)")
    return out["dir"]


#: Seconds the job waits, after the simulation runtime stopped, for the ServerApp (stopped by
#: :func:`fedmm.interrupt.abort` at its next message or wait) to write its summary and checkpoint.
SERVER_STOP_WAIT_S = 60.0
#: The niceness of the ClientApp workers of a Ray this job starts (Ray's own default is 15, below
#: the driver's 0): the workers do the simulation's training, and at 15 any other busy process on
#: the machine takes nearly all the CPU from them (a worker that got 8 s of CPU in 6 minutes beside
#: two busy processes on 2 cores, bench/log/performance.md section 9). An environment that sets
#: ``RAY_worker_niceness`` keeps its value; an attached cluster keeps its raylets' setting.
WORKER_NICENESS = ("RAY_worker_niceness", "0")


def _run_on_ray(cfg: Any, server_app: Any, client_app: Any, out: dict[str, Any], server_done: threading.Event) -> None:
    """Run ``server_app`` and ``client_app`` on Flower's simulation engine (Ray backend): a local
    Ray of this job's, or the Ray cluster ``simulation.ray_address`` names. The ServerApp's
    outcome goes into ``out`` (``dir`` or ``error``); when the runtime itself stops, ``error`` is
    a :class:`JobFailed` naming the runtime's own error, once the ServerApp has stopped."""
    import warnings

    from flwr.simulation import run_simulation

    from fedmm.interrupt import abort

    backend = backend_config(cfg)
    attached = attach_ray(backend["init_args"])
    started = False
    if not attached:
        os.environ.setdefault(*WORKER_NICENESS)
        started = start_local_ray(backend["init_args"])
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
                # thread would wait for replies that cannot come; stop it now, as failed, and let
                # it finish its files before the job reports (Flower does not join its thread)
                reason = f"the simulation runtime stopped: {root_cause(err)}"
                abort(reason)
                server_done.wait(SERVER_STOP_WAIT_S)
                out["error"] = JobFailed(reason)
                out["error"].__cause__ = err
        finally:
            if "dir" not in out and "error" not in out:
                abort("the simulation runtime stopped before the experiment finished")
            if attached or started:
                _disconnect_ray()  # Flower's backend shuts Ray down; this covers a runtime that failed first


def root_cause(err: BaseException) -> str:
    """``Type: message`` of the innermost error ``err`` was raised from (Flower wraps the
    runtime's error twice: "An error was encountered. Ending simulation." and "Simulation Runtime
    crashed."), with the outer messages after it when the innermost says nothing."""
    chain = [err]
    while chain[-1].__cause__ is not None and chain[-1].__cause__ not in chain:
        chain.append(chain[-1].__cause__)
    inner = chain[-1]
    text = f"{type(inner).__name__}: {inner}" if str(inner) else type(inner).__name__
    return text if len(chain) == 1 else f"{text} ({'; '.join(str(e) for e in reversed(chain[:-1]))})"


def _disconnect_ray() -> None:
    """Disconnect this driver from an attached cluster if Flower has not (its backend's
    ``terminate`` does, unless the backend failed to start); the cluster keeps running."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


class JobFailed(RuntimeError):
    """A job of ``fedmm`` did not complete; the message says why."""


#: (job directory, reason) of every failed job of this process's sweep (:class:`SweepOutcome`
#: reads them from the job folders: the jobs may have run in other processes).
FAILED_JOBS: list[tuple[str, str]] = []


# ----------------------------------------------------------------------------- cluster launchers
# What a job asks a scheduler for (hydra's submitit launcher: SLURM or local; hydra's Ray
# launcher), from the run's own settings. The presets in conf/hydra/launcher/ (fedmm_slurm,
# fedmm_submitit_local, fedmm_ray) write ``${fedmm_cpus:...}`` etc.; every value stays overridable
# (``hydra.launcher.cpus_per_task=8``). Hydra resolves the launcher's config once per sweep, from
# the sweep-level config (the command line without its swept values): every job of one
# ``fedmm -m`` gets the same request (docs/lab.md).

#: CPU cores for a job on the in-process engine: one ClientApp trains at a time, in fedmm's own
#: process, on torch's threads (as many as the job gets); the server evaluates between rounds.
#: A default, not a measurement: override ``hydra.launcher.cpus_per_task``.
LOCAL_ENGINE_CPUS = 4
#: GiB for the ServerApp's process (the dataset, the server's models, evaluation), and for each
#: ClientApp process of the Ray engine beyond it (each holds the whole training split and torch).
SERVER_MEM_GB = 4
CLIENT_MEM_GB = 2


def clients_at_once(engine: str, clients_per_round: int, num_supernodes: int) -> int:
    """ClientApps that train at the same time: one on the in-process engine; on Ray a round's
    sampled clients (``clients_per_round``, at most the federation), one actor each."""
    return 1 if engine == "local" else max(1, min(int(clients_per_round), int(num_supernodes)))


def job_cpus(engine: str, client_cpus: float, clients_per_round: int, num_supernodes: int) -> int:
    """CPU cores for one job: :data:`LOCAL_ENGINE_CPUS` on the in-process engine; on the Ray
    engine ``client_cpus`` for each ClientApp that trains at once, plus one for the ServerApp
    (outside Ray's accounting). The job's private Ray sees these cores and sizes its actor pool
    from them (⌊cores / client_cpus⌋ ClientApps)."""
    if engine == "local":
        return LOCAL_ENGINE_CPUS
    return math.ceil(float(client_cpus) * clients_at_once(engine, clients_per_round, num_supernodes)) + 1


def job_gpus(engine: str, device: str, client_gpus: float, clients_per_round: int, num_supernodes: int) -> int:
    """Whole GPUs for one job. In-process engine: 1 with ``training.device=cuda``, else 0
    (``auto`` follows the allocation: a job given no GPU trains on the CPU; ask for one with
    ``hydra.launcher.gpus_per_node=1``). Ray engine: ⌈client_gpus × ClientApps at once⌉, at least
    1 with ``training.device=cuda`` (the ServerApp evaluates there)."""
    wants_cuda = 1 if device == "cuda" else 0
    if engine == "local":
        return wants_cuda
    return max(math.ceil(float(client_gpus) * clients_at_once(engine, clients_per_round, num_supernodes)), wants_cuda)


def job_mem_gb(engine: str, clients_per_round: int, num_supernodes: int) -> int:
    """Memory for one job: :data:`SERVER_MEM_GB`, plus :data:`CLIENT_MEM_GB` per ClientApp process
    (one, in-process, on the local engine; one per ClientApp at once on Ray). An estimate for
    the papers' datasets (50,000 CIFAR images are 150 MB); raise ``hydra.launcher.mem_gb`` for
    larger data or models."""
    return SERVER_MEM_GB + CLIENT_MEM_GB * clients_at_once(engine, clients_per_round, num_supernodes)


def register_resolvers() -> None:
    """The ``fedmm_cpus`` / ``fedmm_gpus`` / ``fedmm_mem_gb`` resolvers of the launcher presets
    (and ``fedmm_null_if_zero``: no GPU request at all rather than one for 0 GPUs).
    Registered when this module is imported: a job process of submitit or Ray imports it when it
    unpickles the task function, and may resolve the presets' values there too."""
    from omegaconf import OmegaConf

    resolvers = {"fedmm_cpus": job_cpus, "fedmm_gpus": job_gpus, "fedmm_mem_gb": job_mem_gb,
                 "fedmm_null_if_zero": lambda value: None if int(value) == 0 else int(value)}  # sbatch: no --gpus-per-node=0
    for name, function in resolvers.items():
        OmegaConf.register_new_resolver(name, function, replace=True)


register_resolvers()


class SweepOutcome(Callback):
    """Hydra callback (``main`` adds it to every ``fedmm -m``): after the sweep, in the process
    that launched it, collect the failed jobs from the job folders into :data:`FAILED_JOBS`.

    The jobs may have run elsewhere (submitit: other processes or SLURM nodes; Ray: tasks on a
    cluster), so their own records are read: each job folder's ``summary.json`` (``_hydra_main``
    writes one for a job that failed before its run did; a resumed job's is in the run it
    continued), and a job folder without one failed without a word (killed, out of memory). The
    job folders of this sweep are those under ``hydra.sweep.dir`` that hold a ``.hydra`` folder
    written since the sweep started (a fixed sweep dir may hold an earlier sweep's jobs).
    """

    def __init__(self) -> None:
        self.before: dict[str, float] = {}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.before = {str(d): m for d, m in _job_folders(Path(str(config.hydra.sweep.dir))).items()}

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        for job_dir, written in sorted(_job_folders(Path(str(config.hydra.sweep.dir))).items()):
            if self.before.get(str(job_dir)) == written:
                continue  # an earlier sweep's job
            status, reason = job_status(job_dir)
            if status != "completed":
                FAILED_JOBS.append((str(job_dir), f"{status}: {reason}" if status != "failed" else reason))


def _job_folders(sweep_dir: Path) -> dict[Path, float]:
    """Hydra job folders under ``sweep_dir`` (any depth of ``hydra.sweep.subdir``) with the time
    their ``.hydra/config.yaml`` was written."""
    if not sweep_dir.is_dir():
        return {}
    found = {}
    for saved in sweep_dir.glob("**/.hydra/config.yaml"):
        if ".submitit" not in saved.parts:
            found[saved.parent.parent] = saved.stat().st_mtime
    return found


def job_status(job_dir: Path) -> tuple[str, str]:
    """(status, reason) of the job in hydra job folder ``job_dir``: its ``summary.json``, or for a
    resumed job without one there, the continued run's."""
    from fedmm.results import SUMMARY_FILE, run_status

    if not (job_dir / SUMMARY_FILE).is_file():
        import yaml

        saved = yaml.safe_load((job_dir / ".hydra" / "config.yaml").read_text(encoding="utf-8")) or {}
        if saved.get("resume"):
            return run_status(Path(str(saved["resume"])).expanduser())
    status, reason = run_status(job_dir)
    if status == "missing":
        reason = f"no summary.json in {job_dir}: the job ended without finishing its run (killed, out of memory?); see its log"
    return status, reason


def fail_job(job_dir: Path, stage: str, err: BaseException, started: float, resumed: bool = False) -> None:
    """Mark the job in ``job_dir`` failed: ``summary.json`` with status ``failed``, the ``stage``
    (config, data, run) and the reason, unless the run itself recorded its failure there during
    this job (the runner's summary says more: rounds completed, accuracy), or ``job_dir`` is the
    run the job was to resume (``resumed``): a refused resume leaves that run's summary as it was
    (the run can still be resumed), the refusal goes to its log."""
    from fedmm.results import SUMMARY_FILE, json_safe, run_status

    summary = job_dir / SUMMARY_FILE
    reason = failure_reason(err)
    if resumed or (summary.is_file() and summary.stat().st_mtime >= started and run_status(job_dir)[0] != "completed"):
        return
    from server_app.recording import write_atomic

    job_dir.mkdir(parents=True, exist_ok=True)
    record = {"status": "failed", "stage": stage, "reason": reason, "rounds_completed": 0}
    write_atomic(summary, json.dumps(json_safe(record), indent=2) + "\n")


def failure_reason(err: BaseException) -> str:
    """One line for a failed job: our errors say it themselves, anything else with its type."""
    return str(err) if isinstance(err, (ConfigError, JobFailed)) else f"{type(err).__name__}: {err}"


def check_launcher(run: Any) -> None:
    """Under hydra's Ray launcher each job is a Ray task on the cluster: it runs on the
    in-process engine there (a Ray task cannot start or attach a Ray of its own)."""
    from omegaconf import OmegaConf

    target = str(OmegaConf.select(HydraConfig.get(), "launcher._target_", default="") or "")
    if "hydra_ray_launcher" in target and run.simulation.engine != "local":
        raise ConfigError("simulation.engine", run.simulation.engine,
                          "local under hydra/launcher=fedmm_ray (each job is already a Ray task on the cluster, which "
                          "runs its ClientApps in its own process); to spread one job's ClientApps over the cluster, "
                          "run fedmm with the basic launcher and simulation.engine=ray simulation.ray_address=<head>")


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
    """The validated config of this hydra job (a fresh run, or the run given by ``resume``).

    A job of ``fedmm -m`` records its sweep's folder as ``tracking.sweep`` (unless the command
    line sets it): MLflow nests a sweep's runs under one parent run, W&B groups them."""
    hydra_cfg = HydraConfig.get()
    for override in hydra_cfg.overrides.task:
        key, _, value = override.lstrip("+~").partition("=")
        if key in ("output_dir", "results_root"):  # `flwr run` keys: fedmm writes to hydra's job folder
            raise ConfigError(key, value, "unset under fedmm, which writes each job's results into its hydra job "
                              "folder: choose that with hydra.run.dir=<dir> (hydra.sweep.dir=<dir> for -m)")
    sweep = os.path.abspath(str(hydra_cfg.sweep.dir)) if hydra_cfg.mode == RunMode.MULTIRUN and hydra_cfg.sweep.dir else None
    if cfg.get("resume"):
        explicit = [o for o in hydra_cfg.overrides.task if not o.lstrip("+").startswith("resume=")]
        if sweep is not None and not any(o.lstrip("+").startswith("tracking.sweep=") for o in explicit):
            explicit.append(f"tracking.sweep={sweep}")
        return config_mod.resume_config(cfg["resume"], explicit)
    resolved = config_mod.to_container(cfg)
    resolved["output_dir"] = hydra_cfg.runtime.output_dir
    tracking = resolved.get("tracking")
    if sweep is not None and isinstance(tracking, dict) and tracking.get("sweep") is None:
        tracking["sweep"] = sweep
    return config_mod.validate(resolved)


def resumes_in_place(cfg: DictConfig, job_dir: Path) -> bool:
    """Whether the job's folder is the run it resumes (:func:`command_line` made it so)."""
    resume = cfg.get("resume")
    return bool(resume) and Path(os.path.expanduser(str(resume))).resolve() == job_dir.resolve()


@hydra.main(config_path=str(config_mod.CONF_DIR), config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> float | None:
    started, job_dir, stage = time.time(), Path(HydraConfig.get().runtime.output_dir), "config"
    resumed = resumes_in_place(cfg, job_dir)
    try:
        resolved = job_config(cfg)
        check_launcher(resolved)
        stage = "data"
        preflight(resolved)
    except Exception as err:  # noqa: BLE001 - whatever stops the job before its run marks it failed
        return _job_failed(job_dir, stage, err, started, resumed)
    # Flower logs to its own console handler; stop hydra's root handler from printing it twice,
    # but send its lines (the round-by-round progress) to this job's hydra log file too.
    logging.getLogger("flwr").propagate = False
    log_to_job_file()
    print(f"fedmm: results -> {resolved.output_dir}", flush=True)
    try:
        run_dir = run_job(resolved)
    except Exception as err:  # noqa: BLE001 - JobFailed, or whatever else the run raised
        return _job_failed(job_dir, "run", err, started, resumed)
    print(f"fedmm: results written to {run_dir}", flush=True)
    return None


def _job_failed(job_dir: Path, stage: str, err: BaseException, started: float, resumed: bool = False) -> None:
    """A job failed at ``stage``: mark it in its folder (:func:`fail_job`) and its log; a single
    run exits non-zero here, a sweep goes on with its other jobs (and ``main`` exits non-zero at
    the end). The job returns None."""
    fail_job(job_dir, stage, err, started, resumed)
    note_in_job_log(f"fedmm: FAILED {job_dir} ({stage}): {failure_reason(err)}")
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        if isinstance(err, ConfigError):
            raise SystemExit(str(err)) from None
        print(f"fedmm: FAILED {job_dir}: {failure_reason(err)}", flush=True)
        raise SystemExit(1) from None
    print(f"fedmm: FAILED {job_dir}: {failure_reason(err)}", flush=True)
    return None


def note_in_job_log(message: str) -> None:
    """``message`` as an error line of the job's log file (hydra's file handler) only: the
    console shows the failure already."""
    record = logging.LogRecord("fedmm", logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def check_names(overrides: list[str]) -> None:
    """Before hydra composes (it would print its whole list of a group's options, one per line,
    or "not in struct" and the ``+`` form): every option and key ``overrides`` name exists, else
    a ConfigError naming the nearest one (:func:`fedmm.config.unknown_option`,
    :func:`fedmm.config.unknown_key`). Each value of a sweep is checked, and a key is known when
    the config of any option its group sweeps holds it. A key no valid one is near is left to
    hydra (e.g. a new key of a mapping, with ``+``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    except HydraException:
        return  # hydra says what is wrong with the syntax
    groups = set(config_mod.GROUPS) | {p.name for p in config_mod.CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra"}
    selecting: list[tuple[str, str, list[str]]] = []  # (prefix, group, options)
    keys = []
    for override in parsed:
        key = override.key_or_group
        if key.split(".")[0].split("/")[0] == "hydra" or override.is_delete() or override.package is not None:
            continue
        if key in groups:
            if isinstance(override.value(), Glob):
                continue
            options = list(override.sweep_string_iterator()) if override.is_sweep_override() else \
                [override.get_value_element_as_str()]
            for option in options:
                error = config_mod.unknown_option(key, option)
                if error is not None:
                    raise error
            selecting.append(("++" if override.is_force_add() else "+" if override.is_add() else "", key, options))
        else:
            keys.append((key, override.get_value_string() if override.is_sweep_override() else override.value()))
    top = {f.name for f in config_mod.RunSettings.settings_fields()}
    if all(key in top for key, _ in keys):
        return  # no composition needed
    first = [f"{prefix}{group}={options[0]}" for prefix, group, options in selecting]
    variants = [first] + [[*first[:i], f"{prefix}{group}={option}", *first[i + 1:]]
                          for i, (prefix, group, options) in enumerate(selecting) for option in options[1:]]
    try:
        configs = [config_mod.compose(variant, validate_config=False) for variant in variants]
    except ConfigError:
        return  # hydra, or the job's validation, says what is wrong
    for key, value in keys:
        if not any(config_mod.has_key(cfg, key) for cfg in configs):
            error = config_mod.unknown_key(configs[0], key, value)
            if error is not None:
                raise error


def command_line(argv: list[str]) -> list[str]:
    """``fedmm``'s arguments, checked before hydra sees them (:func:`check_names`), and, for a
    single run that resumes a run (``resume=<run dir>``), completed so that hydra's job folder is
    that run: the job's log (``cli.log``) goes on in the run it continues, with no ``.hydra``
    folder written over the run's own, and no new folder under ``outputs/`` (unless the command
    line sets ``hydra.run.dir``). A ``resume`` that names no run is refused here, before hydra
    makes a folder for the job."""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    check_names(args.overrides)
    if args.multirun or args.help or args.hydra_help or args.cfg or args.info or args.shell_completion:
        return argv
    resume = None
    for override in args.overrides:
        key, sep, value = override.lstrip("+").partition("=")
        if key == "resume" and sep:
            resume = value.strip("'\"") or None
    if resume in (None, "null") or any(o.lstrip("+").startswith("hydra.run.dir=") for o in args.overrides):
        return argv
    run_dir = str(config_mod.resume_dir(resume))
    if any(c in run_dir for c in "'\\$"):
        return argv  # not writable as an override value: hydra's own job folder
    return [*argv, f"hydra.run.dir='{run_dir}'", "hydra.output_subdir=null"]


def main() -> None:
    """Console-script entry point: exits non-zero when any job of the run or sweep failed
    (whichever launcher ran the jobs: :class:`SweepOutcome`), 130 when it was stopped by
    SIGINT / SIGTERM."""
    from fedmm.interrupt import install_signal_handlers

    install_signal_handlers()
    config_mod.register_defaults()  # every declaration's defaults, before hydra composes
    try:
        sys.argv[1:] = command_line(sys.argv[1:])
    except ConfigError as err:
        raise SystemExit(str(err)) from None
    try:
        _hydra_main()
    except KeyboardInterrupt:
        print("fedmm: interrupted; the run directory holds a checkpoint: continue with fedmm resume=<run dir>", flush=True)
        raise SystemExit(130) from None
    end_of_process()
    if FAILED_JOBS:
        report_failed_jobs(sys.stdout)
        raise SystemExit(1)


def end_of_process() -> None:
    """What the process does between its last job and its exit: every object it holds goes into
    the garbage collector's permanent generation (``gc.freeze``), so that Python's finalization
    does not traverse and free the run's half a million objects (torch, Flower, the datasets)
    one by one: 1.1 s of a 2-round run's exit on 2 cores, for memory the operating system takes
    back at exit anyway. Nothing is lost: every file the run writes is closed when its job ends,
    and the ``atexit`` handlers (logging's, Ray's, the trackers') still run. Called by
    :func:`main` only, which the process leaves right after."""
    gc.freeze()


def report_failed_jobs(out: Any) -> None:
    """Write the list of failed jobs to ``out`` in ONE ``write``: Ray's log monitor forwards the
    cluster workers' lines to the driver's stdout from a thread of its own, and a report made of
    several writes (``print`` writes the text and its newline separately) can have such a line
    land in the middle of it."""
    lines = [f"fedmm: {len(FAILED_JOBS)} job(s) failed:"] + [f"  {job_dir}: {reason}" for job_dir, reason in FAILED_JOBS]
    out.write("\n".join(lines) + "\n")
    out.flush()
