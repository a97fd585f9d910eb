"""bench/gpu_throughput.py runs the app's local training where only PyTorch and numpy are installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Not importable in the benchmark's processes (its client processes included, through PYTHONPATH).
BLOCKED = ("flwr", "ray", "hydra", "omegaconf", "yaml")


def test_benchmark_runs_without_flower_ray_or_hydra(tmp_path: Path) -> None:
    blocker = tmp_path / "blocked"
    for name in BLOCKED:
        (blocker / name).mkdir(parents=True)
        (blocker / name / "__init__.py").write_text(f"raise ImportError('{name} is blocked by the test')\n")
    out = tmp_path / "gpu_throughput.json"
    code = (
        "import sys\n"
        f"for name in {BLOCKED!r}: sys.modules[name] = None\n"
        "sys.path.insert(0, 'bench')\n"
        "import gpu_throughput\n"  # a module by name, so that its client processes (spawn) find it
        f"gpu_throughput.main(['--device', 'cpu', '--models', 'cnn', '--clients', '1', '2', '--samples-per-client', '50',\n"
        f"               '--repeats', '1', '--out', {str(out)!r}])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(REPO)])}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]

    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    assert result["machine"]["torch"] and result["machine"]["cpu_count"] >= 1
    assert result["settings"]["training"]["batch_size"] == 50 and result["settings"]["training"]["local_epochs"] == 1
    rows = result["models"]["cnn"]["rows"]
    assert [row["clients"] for row in rows] == [1, 2]
    for row in rows:
        assert row["total_samples_per_s"] > 0 and row["per_client_samples_per_s"] > 0
        assert row["s_per_client_round"] > 0 and row["peak_rss_mib_per_client"] > 0
        assert len(row["final_train_loss"]) == row["clients"]
        assert row["frameworks_loaded"] == []  # no client process loaded Flower, Ray or hydra
    assert result["stand_ins"] == ["omegaconf"]  # fedmm.config's top-level import, never called
    assert result["models"]["cnn"]["suggested_clients"] in (1, 2)
    assert "| cnn | 2 |" in result["table"]
