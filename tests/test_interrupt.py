"""Ctrl-C during a real simulation: fedmm stops within seconds, ends Ray and every process it
started, leaves a checkpoint and status `interrupted`; the run then resumes to completion."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from fedmm.results import read_metrics
from tests.conftest import pids_mentioning

BIN = Path(sys.executable).parent


def test_sigint_stops_with_a_checkpoint_and_the_run_resumes(tmp_path: Path, ray_env: dict) -> None:
    run = tmp_path / "run"
    cmd = [str(BIN / "fedmm"), "num_rounds=50", "num_clients=4", "clients_per_round=2", "training.local_epochs=1",
           "checkpoint_every=100", f"hydra.run.dir={run}"]  # no periodic checkpoint: only the stop writes one
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ray_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not ((run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 3):
        assert proc.poll() is None and time.time() < deadline, "the run did not reach round 2"
        time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    start = time.time()
    output, _ = proc.communicate(timeout=60)
    stopped_in = time.time() - start
    assert proc.returncode == 130, output[-3000:]
    assert stopped_in < 30, stopped_in  # measured here: about 8 s, most of it Ray's shutdown
    assert "fedmm resume=" in output
    time.sleep(1)
    assert pids_mentioning(ray_env["RAY_TMPDIR"]) == []  # Ray and its workers are gone
    summary = json.loads((run / "summary.json").read_text())
    done = summary["rounds_completed"]
    assert summary["status"] == "interrupted" and done >= 2
    assert torch.load(run / "checkpoint.pt", weights_only=False)["round"] == done
    resumed = subprocess.run(
        [str(BIN / "fedmm"), f"resume={run}", f"num_rounds={done + 1}", f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=tmp_path, env=ray_env, capture_output=True, text=True, timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert [r["round"] for r in read_metrics(run)] == list(range(done + 2))
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
