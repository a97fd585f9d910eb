"""bench/gpu_session.py, the prepared call for a lent GPU machine: the wheels it carries are the
app's requirements the machine lacks (never Ray), and its dry run on the CPU runs every step and
writes every result file (bench/e2e_overhead.py's plain loop and in-process runner among them,
whose whole-process phases add up)."""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import json
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_session():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("gpu_session", REPO / "bench" / "gpu_session.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wheels_are_what_the_app_needs_and_the_gpu_machine_lacks() -> None:
    session = load_session()
    plan = session.wheel_plan()
    assert {"flwr", "hydra-core", "omegaconf", "antlr4-python3-runtime", "mlxtend", "datasets", "flwr-datasets",
            "cryptography"} <= set(plan)
    assert not set(plan) & {"ray", "torch", "torchvision", "numpy", "grpcio", "protobuf", "uv", "fedmm"}
    assert plan["flwr"] == metadata.version("flwr") and plan["hydra-core"] == metadata.version("hydra-core")
    tree = session.requirement_tree()
    assert "ray" not in tree and {"torch", "numpy", "uv"} <= set(tree)  # extras left out; the machine's own dropped


def test_the_dry_run_on_the_cpu_runs_every_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "bench/gpu_session.py", "run", "--device", "cpu", "--rounds", "2", "--strategies", "fedmr",
           "--quick", "--out", str(out), "--site", str(tmp_path / "site"), "--budget-s", "400"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500)
    record = json.loads((out / "gpu_session.json").read_text())
    assert done.returncode == 0, json.dumps(record["steps"], indent=1)[-4000:] + done.stderr[-2000:]
    assert [s["step"] for s in record["steps"]] == ["imports", "cuda_tests", "e2e", "throughput", "vectorized", "cifar_round"]
    assert all(s["status"] == "ok" for s in record["steps"])
    assert record["machine"]["device"] == "cpu" and record["wheels_installed"] is False  # flwr is importable here
    # the CUDA tests ran, each skipped for want of a device
    suite = ElementTree.parse(out / "cuda_tests.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) >= 3 and int(suite.get("skipped")) == int(suite.get("tests"))
    e2e = json.loads((out / "e2e.json").read_text())
    runners = {row["runner"]: row for row in e2e["rows"]}
    assert set(runners) == {"this app, in-process", "this app, in-process, vectorized", "plain loop"}
    for local in (runners["this app, in-process"], runners["this app, in-process, vectorized"]):
        # the same training as the plain loop (which runs on every core; the suite's processes on one thread)
        assert abs(local["delta_accuracy"]) <= 0.005 and local["max_weight_diff"] < 1e-3
    for name in ("vectorized_throughput", "cifar_round"):
        rows = json.loads((out / f"{name}.json").read_text())["rows"]
        assert rows and all(r["max_weight_diff"] < 1e-3 and r["speedup"] > 0 for r in rows)
    cifar = json.loads((out / "cifar_round.json").read_text())["rows"]
    assert {r["model"] for r in cifar} == {"lenet", "resnet20"} and all(r["input_shape"] == [3, 32, 32] for r in cifar)
    assert all(r["vectorized_projected_min"] == r["vectorized_s"] * 2000 / 60 for r in cifar)
    for row in e2e["rows"]:  # the whole process, spawn to exit, cut into phases that add up to it
        for p in row["phases_runs"]:
            parts = (p["imports"] + p["to_server_main"] + p["server_setup"] + p["round_1"] + p["rounds_2_to_last"]
                     + p["after_last_round"])
            assert abs(parts - p["process"]) < 1e-6 and all(v >= 0 for v in p.values()), p
        assert row["phases_median"]["rounds_2_to_last"] > 0 and "ray_init" not in row["phases_median"]
    throughput = json.loads((out / "gpu_throughput.json").read_text())
    assert throughput["device"] == "cpu" and throughput["models"]["cnn"]["rows"][0]["clients"] == 1
