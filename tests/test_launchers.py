"""Sweeps on hydra's other launchers, and failed jobs on every launcher.

- The fedmm launcher presets (conf/hydra/launcher/fedmm_*.yaml) ask the scheduler for what the
  run's settings need (launch/cli.py: job_cpus, job_gpus, job_mem_gb): checked on the sbatch script
  that submitit writes for SLURM (only ``srun`` and ``sbatch`` are stand-ins: this machine has no
  SLURM) and on the request of a real sweep through submitit's local executor.
- A job that fails, whatever failed (config, data, run), is marked in its own folder
  (``summary.json``: status failed, the stage, the reason) and the sweep's other jobs complete;
  ``fedmm -m`` then exits 1 naming the failed jobs, read from the job folders: on the basic
  launcher (jobs in fedmm's process) and on submitit's local executor (each job in a process of
  its own). The Ray launcher's sweep is in tests/test_ray_cluster.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fedmm.results import read_metrics

BIN = Path(sys.executable).parent
TINY = ["num_rounds=1", "clients_per_round=2", "model=lenet", "training.local_epochs=1", "training.local_steps=2"]


def fedmm_sweep(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", OMP_NUM_THREADS="1")
    return subprocess.run([str(BIN / "fedmm"), "-m", *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def summaries(sweep: Path) -> dict[str, dict]:
    """Job number -> its folder's summary.json."""
    return {p.parent.name.split("_")[0]: json.loads(p.read_text()) for p in sweep.glob("*/summary.json")}


def assert_completed(job: Path) -> None:
    assert json.loads((job / "summary.json").read_text())["status"] == "completed"
    assert [r["round"] for r in read_metrics(job)] == [0, 1]
    assert (job / "final_model.pt").is_file() and (job / "config.yaml").is_file()


# ------------------------------------------------------------------ the request from the settings
@pytest.mark.parametrize(
    ("overrides", "cpus", "gpus", "mem"),
    [
        ([], 4, 0, 6),  # the in-process engine: one ClientApp at a time; device auto asks for no GPU
        (["training.device=cuda"], 4, 1, 6),
        (["simulation.engine=ray", "clients_per_round=5", "simulation.client_gpus=0.25"], 6, 2, 14),  # 5 x 1 CPU + the server's
        (["simulation.engine=ray", "num_clients=3", "clients_per_round=3", "simulation.client_cpus=2"], 7, 0, 10),
        (["simulation.engine=ray", "num_clients=3", "clients_per_round=3", "hydra.launcher.cpus_per_task=32"], 32, 0, 10),
    ],
)
def test_the_slurm_request_follows_the_runs_settings(tmp_path: Path, monkeypatch, overrides, cpus, gpus, mem) -> None:
    """hydra's SLURM launcher, instantiated from ``hydra/launcher=fedmm_slurm`` as ``fedmm -m``
    does, submits a job array: the sbatch script it hands to ``sbatch`` (a stand-in that keeps the
    script and refuses) asks for the cores, GPUs and memory the run needs."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import launch.cli  # noqa: F401 - registers the presets' resolvers, as fedmm does
    from fedmm import config as config_mod

    for tool, script in (("srun", "exit 0"), ("sbatch", f'cp "$1" {tmp_path}/job.sbatch; echo "sbatch: error: stand-in" >&2; exit 1')):
        path = tmp_path / "bin" / tool
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"#!/bin/sh\n{script}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    config_mod.register_defaults()
    with initialize_config_dir(config_dir=str(config_mod.CONF_DIR), version_base=None):
        cfg = compose(config_name="config", return_hydra_config=True,
                      overrides=["hydra/launcher=fedmm_slurm", f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides])
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=print, config=cfg)
    with pytest.raises(Exception, match="stand-in"):
        launcher.launch([["seed=0"], ["seed=1"]], initial_job_idx=0)
    script = (tmp_path / "job.sbatch").read_text()
    assert f"#SBATCH --cpus-per-task={cpus}\n" in script, script
    assert f"#SBATCH --mem={mem}GB\n" in script and "#SBATCH --time=240\n" in script, script
    assert f"#SBATCH --gpus-per-node={gpus}\n" in script if gpus else "--gpus-per-node" not in script, script
    assert "#SBATCH --array=0-1%2\n" in script and "-m submitit.core._submit" in script  # one array, both jobs


def test_the_mapping_names_its_inputs() -> None:
    from launch.cli import job_cpus, job_gpus, job_mem_gb

    assert job_cpus("ray", 1.5, 10, 4) == 7  # ceil(1.5 x 4 clients at once) + 1: never more clients than the federation
    assert job_gpus("ray", "auto", 0.1, 10, 100) == 1 and job_gpus("ray", "cuda", 0.0, 10, 100) == 1
    assert job_gpus("local", "cpu", 0.0, 10, 100) == 0 and job_mem_gb("local", 10, 100) == 6


# ------------------------------------------------------------------ failed jobs, every launcher
@pytest.fixture(scope="module")
def basic_sweep(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """Job 0 asks for 2 clients a round of 1 (a config error), job 1 runs (the basic launcher:
    both in fedmm's own process, one after the other)."""
    tmp = tmp_path_factory.mktemp("basic")
    sweep = tmp / "sweep"
    return fedmm_sweep(["num_clients=1,4", *TINY, f"hydra.sweep.dir={sweep}"], tmp), sweep


@pytest.fixture(scope="module")
def submitit_sweep(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """Two jobs through submitit's local executor (each a process of its own, both at once): a
    federation of 4 that runs, and one of 1 client asked for 2 a round (a config error)."""
    tmp = tmp_path_factory.mktemp("submitit")
    sweep = tmp / "sweep"
    return fedmm_sweep(["hydra/launcher=fedmm_submitit_local", "num_clients=4,1", *TINY, f"hydra.sweep.dir={sweep}"], tmp), sweep


def test_a_config_error_fails_its_job_and_the_basic_sweep_goes_on(basic_sweep) -> None:
    proc, sweep = basic_sweep
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = summaries(sweep)
    assert set(jobs) == {"0", "1"}
    assert jobs["0"]["status"] == "failed" and jobs["0"]["stage"] == "config"
    assert jobs["0"]["reason"] == "config error: clients_per_round=2 is invalid; allowed: an integer from 1 to num_clients=1"
    (job1,) = sweep.glob("1_*")
    assert_completed(job1)
    (job0,) = sweep.glob("0_*")
    assert f"fedmm: 1 job(s) failed:\n  {job0}: config error: clients_per_round=2" in proc.stdout, proc.stdout[-2000:]


def test_the_submitit_local_sweep_runs_each_job_in_its_own_process_and_marks_the_failed_one(submitit_sweep) -> None:
    proc, sweep = submitit_sweep
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = summaries(sweep)
    assert {k: v["status"] for k, v in jobs.items()} == {"0": "completed", "1": "failed"}
    assert jobs["1"]["stage"] == "config" and "clients_per_round=2 is invalid" in jobs["1"]["reason"]
    (job0,) = sweep.glob("0_*")
    assert_completed(job0)
    assert len(json.loads((job0 / "label_histograms.json").read_text())) == 4  # its own num_clients
    # each job ran in a submitit job process of its own: its stdout is in submitit's log of that job
    logs = [p.read_text(errors="replace") for p in (sweep / ".submitit").glob("*/*_log.out")]
    assert len(logs) == 2 and sum("fedmm: results ->" in log for log in logs) == 1
    assert sum("fedmm: FAILED" in log for log in logs) == 1
    (job1,) = sweep.glob("1_*")
    assert f"fedmm: 1 job(s) failed:\n  {job1}: config error: clients_per_round=2" in proc.stdout, proc.stdout[-2000:]


def test_the_sweep_outcome_reads_every_job_folder_of_this_sweep(tmp_path: Path, monkeypatch) -> None:
    """A job folder without summary.json (a job killed by its scheduler) is a failed job; a resumed
    job's outcome is that of the run it continued; an earlier sweep's job in the same sweep dir
    is not this sweep's."""
    from omegaconf import OmegaConf

    import launch.cli as cli

    def job(name: str, summary: dict | None = None, resume: Path | None = None) -> Path:
        folder = tmp_path / "sweep" / name
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "config.yaml").write_text(f"resume: {resume or 'null'}\n")
        if summary is not None:
            (folder / "summary.json").write_text(json.dumps(summary))
        return folder

    monkeypatch.setattr(cli, "FAILED_JOBS", [])
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}})
    job("0_old", {"status": "failed", "reason": "an earlier sweep's"})
    outcome = cli.SweepOutcome()
    outcome.on_multirun_start(config)
    continued = tmp_path / "run"
    continued.mkdir()
    (continued / "summary.json").write_text(json.dumps({"status": "interrupted", "reason": "after round 3"}))
    job("1_ok", {"status": "completed"})
    killed = job("2_killed")
    resumed = job("3_resumed", resume=continued)
    done = tmp_path / "done"
    done.mkdir()
    (done / "summary.json").write_text(json.dumps({"status": "completed"}))
    job("4_resumed_ok", resume=done)
    outcome.on_multirun_end(config)
    failed = dict(cli.FAILED_JOBS)
    assert set(failed) == {str(killed), str(resumed)}
    assert failed[str(killed)].startswith("missing: no summary.json in") and "killed" in failed[str(killed)]
    assert failed[str(resumed)] == "interrupted: after round 3"


def test_the_failed_jobs_report_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's log monitor writes the cluster workers' lines to the driver's stdout from a thread
    of its own: a report written piecewise can have one land inside it (seen: a worker's line
    between "failed:" and its newline). The report is one write."""
    import launch.cli as cli

    monkeypatch.setattr(cli, "FAILED_JOBS", [("/r/1_a", "config error: x"), ("/r/2_b", "missing: y")])
    writes: list[str] = []

    class Out:
        def write(self, text: str) -> None:
            writes.append(text)

        def flush(self) -> None:
            pass

    cli.report_failed_jobs(Out())
    assert writes == ["fedmm: 2 job(s) failed:\n  /r/1_a: config error: x\n  /r/2_b: missing: y\n"]


def test_fedmm_freezes_the_collector_only_after_its_jobs_and_not_when_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    """``main`` ends the process: once every job has ended (and closed its files), the garbage
    collector's last passes over the run's objects are left out (``end_of_process``); never
    before a job ends, and not on the interrupted path."""
    import launch.cli as cli

    events: list[str] = []
    monkeypatch.setattr("fedmm.interrupt.install_signal_handlers", lambda: None)
    monkeypatch.setattr(cli.config_mod, "register_defaults", lambda: None)
    monkeypatch.setattr(cli, "end_of_process", lambda: events.append("freeze"))
    monkeypatch.setattr(cli, "FAILED_JOBS", [])
    monkeypatch.setattr(cli, "_hydra_main", lambda: events.append("jobs"))
    cli.main()
    assert events == ["jobs", "freeze"]

    def interrupted() -> None:
        events.append("jobs")
        raise KeyboardInterrupt

    events.clear()
    monkeypatch.setattr(cli, "_hydra_main", interrupted)
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 130 and events == ["jobs"]


def test_the_end_of_process_freezes_every_object_it_holds() -> None:
    import gc

    import launch.cli as cli

    try:
        cli.end_of_process()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("key", ["output_dir", "results_root"])
def test_fedmm_refuses_the_flwr_run_folder_keys_it_would_ignore(tmp_path: Path, key: str) -> None:
    """``fedmm`` writes into hydra's job folder; ``output_dir`` / ``results_root`` (read by ``flwr
    run`` only) are refused, naming the key that chooses the folder, before anything runs."""
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0")
    proc = subprocess.run([str(BIN / "fedmm"), f"{key}={tmp_path / 'here'}", f"hydra.run.dir={tmp_path / 'job'}"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"config error: {key}=" in proc.stderr and "hydra.run.dir=<dir>" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "here").exists() and not (tmp_path / "job" / "metrics.jsonl").exists()
