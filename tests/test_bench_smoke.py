"""The benches that train clients without a server run against the current client API: a bench
that falls behind a refactor fails here, not in front of a user timing the project."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> None:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_plain_loop_of_the_end_to_end_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    _run(["bench/e2e_overhead.py", "--strategies", "fedmr", "--runners", "plain", "--rounds", "2",
          "--num-clients", "4", "--clients-per-round", "2", "--local-epochs", "1", "--out", str(out)])
    assert out.is_file() and json.loads(out.read_text())


def test_the_objective_cost_bench_runs_the_stateful_objectives(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    _run(["bench/objective_cost.py", "--clients", "2", "--rounds", "1", "--methods", "fedavg", "scaffold", "fedgen",
          "--out", str(out)])
    assert out.is_file() and json.loads(out.read_text())
