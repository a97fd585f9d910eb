"""Experiment trackers (server_app/tracking.py): MLflow and W&B follow real fedmm runs, offline.

One real 2-job sweep (``fedmm -m``, a subprocess) with every logger: MLflow in the sweep's own
SQLite store, W&B offline into each run folder, read back with MLflow's client and with wandb's
own reader of the ``.wandb`` log (``wandb leet inspect --json``). Its second job fails on
purpose (a deadline no reply meets, ``max_failed_rounds=1``), so the sweep holds one FINISHED
and one FAILED child under one parent. Then: a resumed run written before ``tracking`` existed,
the errors (unknown logger, missing package, a store that does not open: before round 1), a
tracker that fails mid-run, and the ClientApp's imports.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedmm.config import compose, resume_config
from fedmm.errors import ConfigError
from fedmm.results import read_metrics

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TINY = ["num_rounds=1", "num_clients=4", "clients_per_round=2", "training.local_epochs=1", "training.local_steps=2", "model=lenet"]
#: Job 1 of the sweep: every reply is a straggler's, the run stops as failed in round 1.
FAILING = "strategy.heterogeneity.deadline=0.001"


def wandb_env(root: Path) -> dict[str, str]:
    """W&B offline and silent, its caches and staging in ``root`` (never the home folder)."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DATA_DIR": str(root / "wandb-data"),
            "WANDB_CACHE_DIR": str(root / "wandb-cache"), "WANDB_CONFIG_DIR": str(root / "wandb-config"),
            "WANDB_ARTIFACT_DIR": str(root / "wandb-artifacts")}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``fedmm -m strategy.heterogeneity.deadline=null,0.001`` with csv, mlflow and wandb (TensorBoard:
    tests/test_checkpoint.py)."""
    root = tmp_path_factory.mktemp("sweep")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "WANDB_"))}
    env.update(wandb_env(root), FLWR_TELEMETRY_ENABLED="0")
    cmd = [str(BIN / "fedmm"), "-m", f"strategy.heterogeneity.deadline=null,{FAILING.split('=')[1]}", "max_failed_rounds=1",
           *TINY, "tracking.loggers=[csv,mlflow,wandb]", "tracking.wandb.mode=offline",
           f"hydra.sweep.dir={root / 'sweep'}"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    jobs = sorted(p for p in (root / "sweep").iterdir() if (p / "config.yaml").is_file())
    assert len(jobs) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"root": root, "sweep": root / "sweep", "jobs": jobs, "proc": proc}


def mlflow_runs(store: Path, experiment: str = "fedmm") -> tuple:
    """MLflow's client on a SQLite store, and the experiment's runs by name."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name(experiment)
    runs = client.search_runs([experiment.experiment_id])
    assert len({run.info.run_name for run in runs}) == len(runs), "two runs of one name"
    return client, {run.info.run_name: run for run in runs}


def wandb_records(run_dir: Path) -> list[dict]:
    """The records of the run's offline ``.wandb`` log, as wandb's own reader prints them."""
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run([str(BIN / "wandb"), "leet", "inspect", "--json", str(log)], capture_output=True, text=True,
                         timeout=60, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def scalars(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "round" and isinstance(v, (int, float)) and v == v}


# ----------------------------------------------------------------------------- MLflow
def test_each_job_is_an_mlflow_run_with_its_settings_metrics_files_and_status(sweep: dict) -> None:
    ok, failed = sweep["jobs"]
    client, runs = mlflow_runs(sweep["sweep"] / "mlflow.db")  # the default store: beside the runs, shared
    run = runs[ok.name]
    assert run.info.status == "FINISHED" and run.data.tags["fedmm.status"] == "completed"
    assert {k: run.data.tags[k] for k in ("strategy", "dataset", "seed", "engine")} == {
        "strategy": "fedavg", "dataset": "mnist5k", "seed": "0", "engine": "local"}
    params = run.data.params
    assert params["num_clients"] == "4" and params["training.local_epochs"] == "1" and params["model.name"] == "lenet"
    assert params["tracking.loggers"] == '["csv", "mlflow", "wandb"]'
    assert params["tracking.sweep"] == str(sweep["sweep"])  # job_config set it
    rows = read_metrics(ok)
    assert [r["round"] for r in rows] == [0, 1]
    for key in scalars(rows[-1]):  # every number of metrics.jsonl, by round
        history = client.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in history] == [(r["round"], pytest.approx(r[key])) for r in rows if key in r], key
    assert set(run.data.metrics) == {k for r in rows for k in scalars(r)}
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "metrics.jsonl", "summary.json", "learning_curve.png", "model"} <= top
    assert [a.path for a in client.list_artifacts(run.info.run_id, "model")] == ["model/final_model.pt"]
    summary = json.loads(Path(client.download_artifacts(run.info.run_id, "summary.json", str(sweep["root"]))).read_text())
    assert summary["status"] == "completed"

    bad = runs[failed.name]
    assert json.loads((failed / "summary.json").read_text())["status"] == "failed"
    assert bad.info.status == "FAILED" and bad.data.tags["fedmm.status"] == "failed"
    assert "max_failed_rounds=1" in bad.data.tags["fedmm.reason"]
    assert [m.step for m in client.get_metric_history(bad.info.run_id, "accuracy")] == [0]  # round 0 only
    assert "summary.json" in {a.path for a in client.list_artifacts(bad.info.run_id)}


def test_a_sweep_nests_its_jobs_under_one_parent_run_whose_status_follows_them(sweep: dict) -> None:
    _, runs = mlflow_runs(sweep["sweep"] / "mlflow.db")
    group = f"{sweep['sweep'].parent.name}/{sweep['sweep'].name}"
    assert sorted(runs) == sorted([group, *(job.name for job in sweep["jobs"])])  # one parent, made once
    parent = runs[group]
    assert parent.data.tags["fedmm.sweep"] == str(sweep["sweep"])
    assert {runs[job.name].data.tags["mlflow.parentRunId"] for job in sweep["jobs"]} == {parent.info.run_id}
    assert parent.info.status == "FAILED"  # the last child to end closed it: one child failed
    assert (sweep["sweep"] / ".fedmm-tracking.lock").is_file()


def test_runs_named_into_one_group_share_a_parent_that_ends_with_the_last(sweep: dict, tmp_path: Path) -> None:
    """``tracking.run_group`` groups runs outside a sweep: one parent of that name; it stays
    RUNNING while a child runs and takes the outcome when the last child ends (KILLED: one was
    interrupted)."""
    from server_app.recording import RunRecorder, build_trackers
    from server_app.tracking import run_info

    store = sweep["sweep"] / "mlflow.db"
    cfg = compose([f"tracking.mlflow.tracking_uri=sqlite:///{store}", "tracking.mlflow.experiment=grouped",
                   "tracking.loggers=[mlflow]", "tracking.run_group=lab-week-48"])
    recorders = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        recorders.append(RunRecorder(tmp_path / name, cfg, build_trackers(cfg.tracking, tmp_path / name)))
        recorders[-1].on_run_start(run_info(cfg, tmp_path / name))
    recorders[0].close("completed")
    client, runs = mlflow_runs(store, "grouped")
    assert sorted(runs) == ["a", "b", "lab-week-48"] and runs["lab-week-48"].info.status == "RUNNING"
    recorders[1].close("interrupted")
    client, runs = mlflow_runs(store, "grouped")
    assert {runs[n].data.tags["mlflow.parentRunId"] for n in "ab"} == {runs["lab-week-48"].info.run_id}
    assert [runs[n].info.status for n in ("a", "b", "lab-week-48")] == ["FINISHED", "KILLED", "KILLED"]


# ----------------------------------------------------------------------------- W&B
def test_each_job_is_an_offline_wandb_run_in_the_sweeps_group(sweep: dict) -> None:
    ok, failed = sweep["jobs"]
    records = wandb_records(ok)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["display_name"] == ok.name and run["project"] == "fedmm"
    assert run["run_group"] == f"{sweep['sweep'].parent.name}/{sweep['sweep'].name}"
    assert {"strategy:fedavg", "dataset:mnist5k", "seed:0", "engine:local"} <= set(run["tags"])
    config = run["config"]["update"]
    assert config["num_clients"] == 4 and config["training"]["local_epochs"] == 1 and config["model"]["name"] == "lenet"
    history = [r["history"] for r in records if r["type"] == "history"]
    rows = read_metrics(ok)
    assert [h["step"].get("num", 0) for h in history] == [r["round"] for r in rows]
    for h, row in zip(history, rows):
        assert {k: v for k, v in h["item"].items() if not k.startswith("_")} == pytest.approx(scalars(row))
    assert [r["exit"]["exit_code"] if r["exit"] else 0 for r in records if r["type"] == "exit"] == [0]
    summary = {k: v for r in records if r["type"] == "summary" for k, v in r["summary"].get("update", {}).items()}
    assert summary["status"] == "completed"
    saved = {f["path"] for r in records if r["type"] == "files" for f in r["files"]["files"]}
    assert {"config.yaml", "summary.json", "learning_curve.png", "metrics.jsonl"} <= saved
    (artifact,) = [r["artifact"] for r in records if r["type"] == "artifact"]
    assert artifact["type"] == "model" and [c["path"] for c in artifact["manifest"]["contents"]] == ["final_model.pt"]

    records = wandb_records(failed)
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [1]
    summary = {k: v for r in records if r["type"] == "summary" for k, v in r["summary"].get("update", {}).items()}
    assert summary["status"] == "failed" and "max_failed_rounds=1" in summary["reason"]


def test_the_loggers_listed_are_the_loggers_run(sweep: dict) -> None:
    ok = sweep["jobs"][0]
    assert (ok / "metrics.csv").read_text().splitlines()[0].startswith("round,accuracy,loss")
    assert not (ok / "tensorboard").exists()  # not listed: not written


# ----------------------------------------------------------------------------- resume
def test_a_run_written_before_tracking_resumes_with_mlflow_and_its_whole_history(sweep: dict, tmp_path: Path) -> None:
    """An old run's config.yaml has no ``tracking``: it resumes with the loggers it had
    (TensorBoard, CSV), and ``tracking`` may change on resume; the new MLflow run holds the
    checkpoint's rows and the new rounds, each once."""
    from launch.cli import run_job

    old = tmp_path / "old" / "run"
    shutil.copytree(sweep["jobs"][0], old, ignore=shutil.ignore_patterns("wandb", "tensorboard"))
    config = yaml.safe_load((old / "config.yaml").read_text())
    del config["tracking"]
    (old / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    assert resume_config(old).tracking.loggers == ["tensorboard", "csv"]
    with pytest.raises(ConfigError) as info:
        resume_config(old, ["tracking.loggers=[csv,mlflow,neptune]"])
    assert (info.value.key, info.value.value) == ("tracking.loggers", "neptune")

    store = sweep["sweep"] / "mlflow.db"  # its tables exist already
    run_job(resume_config(old, ["num_rounds=2", "tracking.loggers=[csv,mlflow]", f"tracking.mlflow.tracking_uri=sqlite:///{store}",
                                "tracking.mlflow.experiment=resumed"]))
    rows = read_metrics(old)
    assert [r["round"] for r in rows] == [0, 1, 2]
    client, runs = mlflow_runs(store, "resumed")
    run = runs[old.name]
    assert run.info.status == "FINISHED" and run.data.tags["fedmm.resumed_at_round"] == "2"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "accuracy")] == [
        (r["round"], pytest.approx(r["accuracy"])) for r in rows]
    assert (old / "metrics.csv").read_text().count("\n") == 4  # the header and three rounds


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(("override", "key", "value", "allowed"), [
    ("tracking.loggers=[tensorboard,neptune]", "tracking.loggers", "neptune", "one of tensorboard, csv, mlflow, wandb"),
    ("tracking.loggers=[csv,csv]", "tracking.loggers", "csv", "each logger once"),
    ("tracking.wandb.project=mine", "tracking.wandb.project", "mine", "without wandb in tracking.loggers"),
    ("tracking.run_group=g", "tracking.run_group", "g", "null without mlflow or wandb"),
    ("tracking.wandb.mode=shared", "tracking.wandb.mode", "shared", "online, offline"),
])
def test_bad_tracking_settings_name_the_key_and_value(override: str, key: str, value: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose([override])
    assert (info.value.key, info.value.value) == (key, value) and allowed in info.value.allowed


@pytest.mark.parametrize("package", ["mlflow", "wandb"])
def test_a_tracker_without_its_package_is_refused_at_validation(package: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed: import fails, find_spec finds nothing
    with pytest.raises(ConfigError) as info:
        compose([f"tracking.loggers=[csv,{package}]"])
    assert (info.value.key, info.value.value) == ("tracking.loggers", package)
    assert f'pip install "fedmm[{package}]"' in str(info.value)


def test_a_store_that_does_not_open_fails_the_run_before_round_one(tmp_path: Path) -> None:
    from launch.cli import JobFailed, run_job

    (tmp_path / "a-file").write_text("")
    uri = f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}"  # a folder inside a file
    cfg = compose([*TINY, "tracking.loggers=[mlflow]", f"tracking.mlflow.tracking_uri={uri}", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(JobFailed) as info:
        run_job(cfg)
    assert "tracking.mlflow.tracking_uri" in str(info.value) and uri in str(info.value)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_completed"] == 0 and "tracking.mlflow.tracking_uri" in summary["reason"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # not even round 0


def test_a_tracker_that_fails_mid_run_is_dropped_with_one_warning(sweep: dict, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLflow server goes away after round 0: one warning, the rounds go on into metrics.jsonl.
    (In the sweep's store, another experiment: its tables exist already.)"""
    from mlflow import MlflowClient

    from server_app.recording import CsvTracker, RunRecorder
    from server_app.tracking import MlflowTracker, RunInfo

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    store = sweep["sweep"] / "mlflow.db"
    settings = compose([f"tracking.mlflow.tracking_uri=sqlite:///{store}", "tracking.mlflow.experiment=midrun",
                        "tracking.loggers=[mlflow]"]).tracking.mlflow
    tracker, run = MlflowTracker(settings), tmp_path / "run"
    run.mkdir()
    recorder = RunRecorder(run, {"seed": 0}, [tracker, CsvTracker(run)])
    recorder.on_run_start(RunInfo(run_dir=run, name="run", config={"seed": 0}, tags={}))
    recorder.on_metrics({"round": 0, "accuracy": 0.1, "loss": 2.3})
    with socket.socket() as s:  # a port nothing listens on: the server is gone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tracker.client = MlflowClient(tracking_uri=f"http://127.0.0.1:{port}")
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("flwr").addHandler(handler)
    try:
        for rnd in (1, 2):
            recorder.on_metrics({"round": rnd, "accuracy": 0.5, "loss": 1.0})
        recorder.close("completed")
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    assert [w for w in warnings if "tracker failed" in w] == [warnings[0]] and "the mlflow tracker failed" in warnings[0]
    assert [r["round"] for r in read_metrics(run)] == [0, 1, 2]
    assert (run / "metrics.csv").read_text().count("\n") == 4  # the other tracker went on
    client, runs = mlflow_runs(store, "midrun")
    assert [m.step for m in client.get_metric_history(runs["run"].info.run_id, "accuracy")] == [0]


def test_the_client_app_loads_no_tracker() -> None:
    """A ClientApp reads a run config that names mlflow and wandb without importing them (or our
    tracking module)."""
    cfg = compose(["tracking.loggers=[mlflow,wandb]"]).to_dict()
    code = (
        "import sys, json\n"
        "import client_app.client_app\n"
        "from fedmm.config import client_run\n"
        f"run = client_run({json.dumps(json.dumps(cfg))})\n"
        "assert run.tracking.loggers == ['mlflow', 'wandb']\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('mlflow', 'wandb') or m == 'server_app.tracking')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
