"""Experiment trackers: what follows a run besides ``metrics.jsonl`` (``tracking.loggers``).

``metrics.jsonl`` is the record of a run and is always written (:class:`~server_app.recording.RunRecorder`);
each tracker is one view of the same rows, one class per backend, an observer of the run
(:mod:`fedmm.observers`) with the same four events, which the recorder hands it:

- ``on_run_start(info)``: before the run's set-up (name = the run folder's name, the resolved
  settings as parameters / config, tags: strategy, objective, dataset, partition, seed, engine).
  An error here fails the run before its first round;
- ``on_restore(rows)``: a resumed run's rows up to its checkpoint (MLflow and W&B start a new
  run and log them again, so every tracked run's history is its ``metrics.jsonl``);
- ``on_metrics(row)``: each evaluated round, the round as the step, the row's numbers (the
  scalars TensorBoard gets);
- ``on_run_end(status, reason, files)``: the run's status (``completed``, ``failed``,
  ``interrupted``, ``stopped``, as in ``summary.json``) in the backend's terms, and the run's final files.

A tracker that fails after its start (an MLflow server gone) is dropped by the recorder with one
warning; the run goes on. In a ``fedmm -m`` sweep (``tracking.sweep``, set by ``launch/cli.py``)
or with ``tracking.run_group``, MLflow nests the runs under one parent run, found by a tag
under a file lock (parallel jobs make one parent), and W&B puts them in one group.

This module runs in the ServerApp only: a ClientApp never imports it (nor mlflow or wandb).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from fedmm.errors import ConfigError
from fedmm.observers import RunObserver
from fedmm.results import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, json_safe

#: The run's files a tracker keeps at the end (those present): settings, record, outcome, plot, models.
FINAL_FILES = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, "learning_curve.png", "final_model.pt", "final_models.npz")
#: The model files among them (a W&B model artifact; MLflow keeps them under ``model/``).
MODEL_FILES = ("final_model.pt", "final_models.npz")
#: ``summary.json`` status -> MLflow's run status.
MLFLOW_STATUS = {"completed": "FINISHED", "failed": "FAILED", "interrupted": "KILLED", "stopped": "KILLED"}
#: ``summary.json`` status -> the exit code a W&B run ends with (``fedmm`` exits 130 when interrupted).
WANDB_EXIT_CODE = {"completed": 0, "failed": 1, "interrupted": 130, "stopped": 143}
#: The file a sweep's jobs lock while they find or make the sweep's MLflow parent run.
SWEEP_LOCK = ".fedmm-tracking.lock"


@dataclass
class RunInfo:
    """What a tracker records of a run when it starts."""

    run_dir: Path
    name: str  #: the run folder's name
    config: dict[str, Any]  #: the resolved settings (``config.yaml``)
    tags: dict[str, str]  #: strategy, objective, dataset, partition, seed, engine
    group: str | None = None  #: the W&B group / MLflow parent run's name
    group_key: str | None = None  #: what identifies the group: ``run_group:<name>`` or ``sweep:<folder>``
    sweep: Path | None = None  #: the ``fedmm -m`` sweep folder
    resumed_at: int | None = None  #: the first round of a resumed run


def run_info(run: Any, run_dir: Path, simulation: bool = True, resumed_at: int | None = None) -> RunInfo:
    """The :class:`RunInfo` of a validated run (``simulation``: else the engine is ``deployment``)."""
    tracking = run.tracking
    sweep = Path(os.path.expanduser(tracking.sweep)).resolve() if tracking.sweep else None
    group = tracking.run_group or (f"{sweep.parent.name}/{sweep.name}" if sweep is not None else None)
    key = f"run_group:{group}" if tracking.run_group else f"sweep:{sweep}" if sweep is not None else None
    tags = {"strategy": run.strategy.name, "objective": run.objective.name, "dataset": run.dataset.name,
            "partition": run.partition.name if simulation else "deployment", "seed": str(run.seed),
            "engine": run.simulation.engine if simulation else "deployment"}
    return RunInfo(run_dir=Path(run_dir), name=Path(run_dir).name, config=run.to_dict(), tags=tags, group=group,
                   group_key=key, sweep=sweep, resumed_at=resumed_at)


def round_scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row besides ``round`` (NaN left out, as TensorBoard leaves it)."""
    return {k: v for k, v in row.items() if k != "round" and isinstance(v, (int, float)) and v == v}


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"strategy": {"alpha": 0.5}}`` -> ``{"strategy.alpha": "0.5"}`` (lists and null as JSON)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(json_safe(value))
    return out


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created), held for the ``with`` block; the kernel
    releases it when the process ends in any way."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class Tracker(RunObserver):
    """One backend that follows a run, an observer of its run-level events (see the module's
    docstring): ``on_run_start`` opens the backend's run, ``on_restore`` gets the rows a resumed
    run recorded up to its checkpoint, ``on_metrics`` each evaluated round (``row["round"]`` is
    the step), ``on_run_end`` the run's outcome and final files (those in :data:`FINAL_FILES` that exist)."""

    name: ClassVar[str] = ""


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for any other store)."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///"):].split("?", 1)[0]).expanduser().resolve()


class MlflowTracker(Tracker):
    """An MLflow run per fedmm run: parameters (the settings, flattened), tags, metrics by round,
    the final files as artifacts, the status (FINISHED / FAILED / KILLED, and ``fedmm.status``).

    In a sweep or a ``run_group`` the run is a child of the group's parent run (tag
    ``mlflow.parentRunId``), whose status follows its children: RUNNING while one runs, then
    FAILED if one failed, KILLED if one was stopped, else FINISHED.
    """

    name = "mlflow"

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.client: Any = None
        self.run_id = ""
        self.parent_id: str | None = None
        self.uri = ""
        self._locks: list[Path] = []

    def tracking_uri(self, run_dir: Path) -> str:
        """The setting, else ``$MLFLOW_TRACKING_URI``, else a SQLite store beside the run folder."""
        return (self.settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                or f"sqlite:///{run_dir.parent / 'mlflow.db'}")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for path in self._locks:
                stack.enter_context(file_lock(path))
            yield

    def on_run_start(self, info: RunInfo) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.uri = self.tracking_uri(info.run_dir)
        database = _sqlite_path(self.uri)
        # A sweep's jobs find or make its parent under the sweep folder's lock; two runs beside
        # one SQLite file do not create its tables at the same time.
        self._locks = [p for p in (info.sweep / SWEEP_LOCK if info.sweep else None,
                                   database.with_name(database.name + ".lock") if database else None) if p is not None]
        try:
            with self._locked():
                if database is not None:
                    database.parent.mkdir(parents=True, exist_ok=True)
                self.client = MlflowClient(tracking_uri=self.uri)
                experiment_id = self._experiment(database)
                tags = {**info.tags, "fedmm.run_dir": str(info.run_dir)}
                if info.resumed_at is not None:
                    tags["fedmm.resumed_at_round"] = str(info.resumed_at)
                if info.group_key is not None:
                    self.parent_id = self._parent(experiment_id, info)
                    tags["mlflow.parentRunId"] = self.parent_id
                    tags["fedmm.run_group"] = info.group
                run = self.client.create_run(experiment_id, run_name=info.name, tags=tags)
            self.run_id = run.info.run_id
            params = [Param(k, v[:6000]) for k, v in flatten(info.config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - any store error is this setting's problem
            raise ConfigError("tracking.mlflow.tracking_uri", self.settings.tracking_uri,
                              f"a tracking store MLflow opens and writes (it tried {self.uri}: {type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from err

    def _experiment(self, database: Path | None) -> str:
        name = self.settings.experiment
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:  # a local store keeps its artifacts beside the database
            location = (database.parent / "mlartifacts" / name).as_uri() if database is not None else None
            return self.client.create_experiment(name, artifact_location=location)
        if experiment.lifecycle_stage != "active":
            raise ConfigError("tracking.mlflow.experiment", name, f"an experiment that is not deleted in {self.uri} "
                              f"(restore it: `mlflow experiments restore --experiment-id {experiment.experiment_id}`, "
                              "or name another)")
        return experiment.experiment_id

    def _parent(self, experiment_id: str, info: RunInfo) -> str:
        """The group's parent run: found by its key tag (the sweep folder, or the run_group
        name), made by the first job that looks; set RUNNING again while a child runs."""
        key = hashlib.sha256(str(info.group_key).encode()).hexdigest()[:24]  # a tag value without quotes to escape
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`fedmm.parent_key` = '{key}'",
                                        order_by=["attributes.start_time ASC"], max_results=1)
        if found:
            parent = found[0]
            if parent.info.status != "RUNNING":
                self.client.update_run(parent.info.run_id, status="RUNNING")
            return parent.info.run_id
        tags = {"fedmm.parent_key": key, "fedmm.run_group": str(info.group)}
        if info.sweep is not None:
            tags["fedmm.sweep"] = str(info.sweep)
        return self.client.create_run(experiment_id, run_name=info.group, tags=tags).info.run_id

    def on_restore(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for row in rows:
            self.on_metrics(row)

    def on_metrics(self, row: Mapping[str, Any]) -> None:
        import time

        from mlflow.entities import Metric

        stamp, step = int(time.time() * 1000), int(row["round"])
        metrics = [Metric(k, float(v), stamp, step) for k, v in round_scalars(row).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def on_run_end(self, status: str, reason: str, files: Sequence[Path]) -> None:
        for path in files:
            self.client.log_artifact(self.run_id, str(path), artifact_path="model" if path.name in MODEL_FILES else None)
        self.client.set_tag(self.run_id, "fedmm.status", status)
        if reason:
            self.client.set_tag(self.run_id, "fedmm.reason", reason[:5000])
        self.client.set_terminated(self.run_id, MLFLOW_STATUS.get(status, "FAILED"))
        if self.parent_id is not None:
            with self._locked():
                self._end_parent()

    def _end_parent(self) -> None:
        children = self.client.search_runs([self.client.get_run(self.parent_id).info.experiment_id],
                                           filter_string=f"tags.`mlflow.parentRunId` = '{self.parent_id}'")
        statuses = {child.info.status for child in children}
        if "RUNNING" in statuses or "SCHEDULED" in statuses:
            return  # the last child to end closes the parent
        outcome = "FAILED" if "FAILED" in statuses else "KILLED" if "KILLED" in statuses else "FINISHED"
        self.client.set_terminated(self.parent_id, outcome)


class WandbTracker(Tracker):
    """A W&B run per fedmm run: config (the settings), tags, history by round (the round as the
    step), ``summary["status"]`` and the exit code (0 completed, 1 failed, 130 interrupted, 143
    stopped), the final files (the models as a ``model`` artifact). Offline runs are written to
    ``<run dir>/wandb`` (or ``$WANDB_DIR``) for ``wandb sync``."""

    name = "wandb"

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.run: Any = None
        self.run_dir: Path | None = None

    def on_run_start(self, info: RunInfo) -> None:
        import wandb

        s = self.settings
        self.run_dir = info.run_dir
        tags = [f"{k}:{v}"[:64] for k, v in info.tags.items()]
        if info.resumed_at is not None:
            tags.append(f"resumed_at_round:{info.resumed_at}")
        try:
            self.run = wandb.init(project=s.project, entity=s.entity, mode=s.mode, group=info.group, name=info.name,
                                  dir=None if os.environ.get("WANDB_DIR") else str(info.run_dir), config=info.config,
                                  tags=tags, job_type="fedmm", reinit="create_new")
        except Exception as err:  # noqa: BLE001 - no login, no network, a bad entity or project
            raise ConfigError("tracking.wandb.mode", s.mode, "offline, or online with `wandb login` done and the W&B "
                              f"server reachable (project {s.project!r}, entity {s.entity!r}: {type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from err

    def on_restore(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for row in rows:
            self.on_metrics(row)

    def on_metrics(self, row: Mapping[str, Any]) -> None:
        self.run.log(round_scalars(row), step=int(row["round"]))

    def on_run_end(self, status: str, reason: str, files: Sequence[Path]) -> None:
        import wandb

        try:
            models = [p for p in files if p.name in MODEL_FILES]
            for path in files:
                if path not in models:
                    self.run.save(str(path), base_path=str(path.parent), policy="now")
            if models:
                artifact = wandb.Artifact(f"model-{self.run.id}", type="model", metadata={"status": status})
                for path in models:
                    artifact.add_file(str(path))
                self.run.log_artifact(artifact)
            self.run.summary["status"] = status
            if reason:
                self.run.summary["reason"] = reason
        finally:
            self.run.finish(exit_code=WANDB_EXIT_CODE.get(status, 1))


#: The trackers outside the run folder, by their ``tracking.loggers`` name (the run folder's own,
#: TensorBoard and CSV, are in :mod:`server_app.recording`).
BACKENDS: dict[str, type[Tracker]] = {t.name: t for t in (MlflowTracker, WandbTracker)}
