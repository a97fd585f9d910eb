"""A stop signal during a real simulation: fedmm stops within seconds, ends Ray and every process
it started, and leaves the checkpoint of its last completed round and status `interrupted` (that a
checkpoint resumes exactly is tested in tests/test_same_results.py).

The signal sent is SIGTERM (what a batch scheduler or `kill` sends): Ray's start-up replaces the
process's SIGTERM handler, so it is the case that needs the app to keep its own. Ctrl-C (SIGINT)
goes to the same handler (``fedmm.interrupt``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from fedmm.results import read_metrics
from server_app.checkpoint import load_checkpoint
from tests.conftest import pids_mentioning

BIN = Path(sys.executable).parent


def test_sigterm_stops_within_seconds_with_a_checkpoint(tmp_path: Path, ray_env: dict) -> None:
    run = tmp_path / "run"
    cmd = [str(BIN / "fedmm"), "num_rounds=50", "num_clients=4", "clients_per_round=2", "training.local_epochs=1",
           "checkpoint_every=100", f"hydra.run.dir={run}"]  # no periodic checkpoint: only the stop writes one
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ray_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not ((run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 2):
        assert proc.poll() is None and time.time() < deadline, "the run did not reach round 1"
        time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
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
    assert summary["status"] == "interrupted" and done >= 1
    checkpoint = load_checkpoint(run)
    assert checkpoint["round"] == done and [r["round"] for r in checkpoint["metrics"]] == list(range(done + 1))
    assert [r["round"] for r in read_metrics(run)] == list(range(done + 1))
