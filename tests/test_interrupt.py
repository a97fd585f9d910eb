"""A stop signal during a real simulation, on either engine: fedmm stops within seconds, ends Ray
and every process it started (Ray engine), and leaves the checkpoint of its last completed round
and status `interrupted` (that a checkpoint resumes exactly is tested in
tests/test_same_results.py).

The signal sent is SIGTERM (what a batch scheduler or `kill` sends): Ray's start-up replaces the
process's SIGTERM handler, so it is the case that needs the app to keep its own. On Ray the run
is FedCross with the default config, which then resumes on Ray and gives the recorded results. Ctrl-C (SIGINT)
goes to the same handler (``fedmm.interrupt``). On the in-process engine the ClientApp trains in
fedmm's own thread: the first signal lets the client in training finish, a second one stops it
at once; either way the run's files are written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedmm.results import read_metrics
from server_app.checkpoint import load_checkpoint
from tests.conftest import clientapp_actors_niceness, pids_mentioning

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent


def start_and_reach_round_1(run: Path, env: dict, engine: str, overrides: list[str]) -> subprocess.Popen:
    cmd = [str(BIN / "fedmm"), *overrides, "checkpoint_every=100", f"simulation.engine={engine}",
           f"hydra.run.dir={run}"]  # only the stop writes a checkpoint
    proc = subprocess.Popen(cmd, cwd=run.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not ((run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 2):
        assert proc.poll() is None and time.time() < deadline, "the run did not reach round 1"
        time.sleep(0.3)
    return proc


#: What each engine runs: in process a small job; on Ray FedCross with the default config, which
#: after the stop resumes (in process) to the recorded results of tests/test_same_results.py. Its
#: ClientApps reserve 2 CPUs each: one Ray worker on a 2-core machine (one cold start of torch
#: instead of two; the threads change the sums' order only, within the recorded results' tolerance).
RUNS = {"local": ["num_rounds=50", "num_clients=4", "clients_per_round=2", "training.local_epochs=1"],
        "ray": ["strategy=fedcross", "num_rounds=3", "seed=0", "simulation.client_cpus=2"]}


@pytest.mark.parametrize("engine", ["local", pytest.param("ray", marks=pytest.mark.ray_runtime)])
def test_sigterm_stops_within_seconds_with_a_checkpoint(tmp_path: Path, ray_env: dict, engine: str) -> None:
    run = tmp_path / "run"
    proc = start_and_reach_round_1(run, ray_env, engine, RUNS[engine])
    if engine == "ray":  # the ClientApp actor at the driver's priority, not Ray's default 15
        # (launch.cli.WORKER_NICENESS: at 15 it starved beside other busy processes)
        assert clientapp_actors_niceness(ray_env["RAY_TMPDIR"]) == [0]
    proc.send_signal(signal.SIGTERM)
    start = time.time()
    output, _ = proc.communicate(timeout=60)
    stopped_in = time.time() - start
    assert proc.returncode == 130, output[-3000:]
    # measured here: about 8 s on Ray, most of it Ray's shutdown; 1-2 s in process (the client in training)
    assert stopped_in < 30, stopped_in
    assert "fedmm resume=" in output
    time.sleep(1)
    assert pids_mentioning(ray_env["RAY_TMPDIR"]) == []  # Ray and its workers are gone
    summary = json.loads((run / "summary.json").read_text())
    done = summary["rounds_completed"]
    assert summary["status"] == "interrupted" and done >= 1
    checkpoint = load_checkpoint(run)
    assert checkpoint["round"] == done and [r["round"] for r in checkpoint["metrics"]] == list(range(done + 1))
    assert [r["round"] for r in read_metrics(run)] == list(range(done + 1))
    if engine == "ray":  # resumed on the in-process engine (a checkpoint does not depend on the
        # engine that wrote it; both give the same numbers, tests/test_engines.py): the recorded rounds
        from tests.test_same_results import assert_resumes_to_the_recorded_results

        assert done < 3  # one round more than the stop left (the recorded rows go to round 5)
        assert_resumes_to_the_recorded_results(run, "fedcross", done + 1, tmp_path / "hydra", env=ray_env,
                                               changes=("simulation.engine=local", "simulation.client_cpus=1",
                                                        f"num_rounds={done + 1}"))


#: ``fedmm`` whose clients train for a long time from round 2 on (torch work, as real training).
SLOW_FEDMM = """
import sys, time, torch
from client_app import work
train_reply = work.train_reply
def slow(msg, context):
    if int(msg.content["config"]["server-round"]) >= 2:
        end = time.time() + 60
        while time.time() < end:
            torch.randn(300, 300) @ torch.randn(300, 300)
    return train_reply(msg, context)
work.train_reply = slow
from launch.cli import main
sys.argv = ["fedmm", *sys.argv[1:]]
main()
"""


def test_a_second_signal_stops_the_client_in_training_at_once(tmp_path: Path, ray_env: dict) -> None:
    """The first signal waits for the client in training (a minute of torch work here); a second
    one stops it at once, and the run still writes its checkpoint and its summary (interrupted
    after round 1), with exit status 130."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-c", SLOW_FEDMM, "num_rounds=5", "num_clients=2", "clients_per_round=1",
           "training.local_epochs=1", "checkpoint_every=100", f"hydra.run.dir={run}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ray_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not ((run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 2):
        assert proc.poll() is None and time.time() < deadline, "the run did not reach round 1"
        time.sleep(0.3)
    time.sleep(1)  # round 2's client is training
    proc.send_signal(signal.SIGTERM)
    time.sleep(2)
    assert proc.poll() is None  # the first signal waits for the client
    proc.send_signal(signal.SIGTERM)
    start = time.time()
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output[-3000:]
    assert time.time() - start < 15
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds_completed"] == 1
    assert load_checkpoint(run)["round"] == 1
