"""bench/gpu_session.py, the prepared call for a lent GPU machine: the wheels it carries are the
app's requirements the machine lacks (never Ray); its dry run on the CPU runs every step and writes
every result file (bench/e2e_overhead.py's plain loop and in-process runner among them, whose
whole-process phases add up), also in two calls, the second resuming the first (the first also cut
off inside its e2e step, the second on the same site); a step cut off at its limit keeps the cases
it finished and leaves no process behind; a case that raises is recorded and the next one runs;
unused time rolls over to the next step."""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def dry_run(tmp_path: Path, out: str, *extra: str, timeout: int = 500) -> tuple[subprocess.CompletedProcess, dict]:
    """The quick dry run (``--device cpu --quick``, FedMR, 2 rounds) into ``tmp_path / out``."""
    cmd = [sys.executable, "bench/gpu_session.py", "run", "--device", "cpu", "--rounds", "2", "--strategies", "fedmr",
           "--quick", "--out", str(tmp_path / out), "--site", str(tmp_path / "site"), "--budget-s", "400", *extra]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    record = json.loads((tmp_path / out / "gpu_session.json").read_text())
    return done, record


def test_the_dry_run_cut_off_inside_a_step_is_completed_by_resume_on_the_same_site(tmp_path: Path) -> None:
    """The dry run on the CPU in two calls, as a GPU session would make them when the first is cut
    off: the first runs the CUDA tests and the papers' shape only, and is cut off inside the
    latter, its plain loop and in-process run done, the vectorized run never started (``cut@2``:
    the bench killed at a known point, as its limit would). The second, ``--resume`` of the first
    on the same site, keeps the CUDA tests (not run again, their file carried over), runs the
    papers' shape again in a scratch folder of its own (the cut-off attempt's runs are neither in
    the way nor in its file; the first call's scratch stays as it was) and every other step. Every
    step's result is then in the second folder, within what comes back from the GPU machine."""
    done, first = dry_run(tmp_path, "first", "--steps", "cuda_tests", "e2e", "--fault", "e2e=cut@2")
    assert done.returncode == 1
    assert [(s["step"], s["status"]) for s in first["steps"]] == [("machine", "ok"), ("cuda_tests", "ok"), ("e2e", "failed")]
    assert first["steps"][2]["exit"] == -9 and first["steps"][2]["left_running"] == []
    cut = json.loads((tmp_path / "first" / "e2e.json").read_text())
    assert [r["runner"] for r in cut["runs"]] == ["plain"] and cut["rows"] == [] and not cut["finished"]
    first_scratch = Path(first["scratch"])  # the in-process run, done but not logged: what stood in the way
    assert (first_scratch / "e2e-runs" / "fedmr" / "local" / "run" / "metrics.jsonl").is_file()
    first_logs = {f.name: f.read_bytes() for f in (first_scratch / "logs").iterdir()}

    done, record = dry_run(tmp_path, "second", "--resume", str(tmp_path / "first"))
    out = tmp_path / "second"
    assert done.returncode == 0, json.dumps(record["steps"], indent=1)[-4000:] + done.stderr[-2000:]
    assert [(s["step"], s["status"]) for s in record["steps"]] == [
        ("machine", "ok"), ("cuda_tests", "done earlier"), ("e2e", "ok"), ("vectorized", "ok"),
        ("cifar_round", "ok"), ("throughput", "ok")]
    assert record["earlier_calls"][0]["steps"] == first["steps"]
    assert (out / "cuda_tests.json").read_bytes() == (tmp_path / "first" / "cuda_tests.json").read_bytes()
    e2e = json.loads((out / "e2e.json").read_text())
    assert e2e["errors"] == [] and e2e["finished"] and e2e["rows_from_earlier_run"] == 0
    assert sorted(r["runner"] for r in e2e["runs"]) == ["local", "plain", "vectorized"]  # none of the cut attempt's
    assert Path(record["scratch"]).parent == first_scratch.parent and Path(record["scratch"]) != first_scratch
    assert all(Path(r["final_model"]).is_relative_to(record["scratch"]) for r in e2e["rows"])
    assert {f.name: f.read_bytes() for f in (first_scratch / "logs").iterdir()} == first_logs
    # what the first call left unused rolls over: the vectorized step's limit is its plan and more
    vectorized = next(s for s in record["steps"] if s["step"] == "vectorized")
    assert vectorized["rolled_over_s"] > 100 and vectorized["limit_s"] > vectorized["planned_s"]
    assert record["machine"]["device"] == "cpu" and record["wheels_installed"] is False  # flwr is importable here
    assert record["machine"]["torch"] and "cudnn_allow_tf32" in record["machine"]["tf32"]
    assert record["parent_imported_torch"] is False and record["return_problems"] == []
    assert all(s["left_running"] == [] for s in record["steps"] if "left_running" in s)
    # the CUDA tests ran, each skipped for want of a device, each recorded as it ended
    tests = json.loads((out / "cuda_tests.json").read_text())
    assert tests["finished"] and len(tests["rows"]) == 11 and {r["outcome"] for r in tests["rows"]} == {"skipped"}
    runners = {row["runner"]: row for row in e2e["rows"]}
    assert set(runners) == {"this app, in-process", "this app, in-process, vectorized", "plain loop"}
    assert len(e2e["runs"]) == 3 and e2e["errors"] == [] and e2e["finished"]
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



def live_processes_of_group(group: int) -> list[str]:
    """The command lines of the live processes (zombies left out) of process group ``group``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == group:
            found.append(cmdline)
    return found


def test_a_step_cut_off_keeps_its_finished_cases_and_leaves_no_process(tmp_path: Path) -> None:
    """Two faults planted in the dry run: the vectorized bench's second case never ends (after
    starting a helper process, as the benches' own workers are), so the step is cut off at its
    limit; the CIFAR-shaped round's first case raises. The cut-off step's file holds the case it
    finished, and no process of its group is left; the raised case is recorded with its error and
    the next case ran."""
    done, record = dry_run(tmp_path, "out", "--steps", "vectorized", "cifar_round", "--fault", "vectorized=overrun@2",
                           "--limit", "machine=10", "--limit", "vectorized=12", "--fault", "cifar_round=raise@1")
    out = tmp_path / "out"
    assert done.returncode == 1  # not every step ended well
    steps = {s["step"]: s for s in record["steps"]}
    assert list(steps) == ["machine", "vectorized", "cifar_round"]
    cut = steps["vectorized"]
    assert cut["status"] == "timed out" and cut["exit"] == 124 and cut["limit_s"] <= cut["seconds"] < cut["limit_s"] + 10
    assert cut["left_running"] == [] and live_processes_of_group(cut["process_group"]) == []
    vectorized = json.loads((out / "vectorized_throughput.json").read_text())
    assert [(r["model"], r["clients"]) for r in vectorized["rows"]] == [("lenet", 2)] and not vectorized["finished"]
    assert cut["cases"] == 1 and "vectorized_throughput" in cut["stdout_tail"]
    raised = steps["cifar_round"]
    assert raised["status"] == "failed" and raised["case_errors"] == 1 and raised["cases"] == 1
    cifar = json.loads((out / "cifar_round.json").read_text())
    assert [r["model"] for r in cifar["rows"]] == ["resnet20"] and cifar["finished"]
    assert cifar["errors"][0]["case"]["model"] == "lenet" and "a fault planted by FEDMM_BENCH_FAULT" in cifar["errors"][0]["error"]
    assert "a fault planted" in raised["stderr_tail"]  # the step's stderr is kept beside its stdout
    assert not list(out.glob("*.tmp")) and record["return_problems"] == []


def test_unused_seconds_roll_over_and_a_step_left_behind_is_ended(tmp_path: Path) -> None:
    """Session: a step that ends early leaves its unused seconds to the next; a step whose child
    leaves a process running has it ended with the step."""
    session = load_session()
    record: dict = {}
    sess = session.Session(tmp_path, 60, dict(os.environ), record, tmp_path / "logs")
    quick = sess.step("quick", [sys.executable, "-c", "pass"], 10)
    leaves = sess.step("leaves", [sys.executable, "-c", "import subprocess, sys; "
                                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])"], 10)
    assert quick["status"] == leaves["status"] == "ok"
    assert leaves["limit_s"] == pytest.approx(20 - quick["seconds"], abs=0.2)  # its 10 s and what the first left
    assert leaves["left_running"] == [] and live_processes_of_group(leaves["process_group"]) == []


def test_what_would_not_come_back_from_the_gpu_machine_is_named(tmp_path: Path) -> None:
    session = load_session()
    for i in range(8):
        (tmp_path / f"f{i}.json").write_text("{}")
    assert session.return_problems(tmp_path) == []
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "deep.json").write_text("{}")
    (tmp_path / "bad name.json").write_text("{}")
    problems = "\n".join(session.return_problems(tmp_path))
    assert "10 files, more than 8" in problems and "a/b/c/deep.json: more than 2 folders down" in problems
    assert "bad name.json: a name with characters other than" in problems


def test_a_case_log_keeps_every_finished_case_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/cases.py: the file holds each case as it ends (a raised case as an error, the next
    case run); resumed, the finished cases are kept and only the others run again."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from cases import CaseLog
    finally:
        sys.path.remove(str(REPO / "bench"))
    path = tmp_path / "cases.json"
    log = CaseLog(path, {"bench": "x"}, key=("k",))
    with log.case(k=1) as row:
        row["v"] = 10
    assert [r["k"] for r in json.loads(path.read_text())["rows"]] == [1]  # written before the next case
    with log.case(k=2):
        raise ValueError("case two")
    with log.case(k=3) as row:
        row["v"] = 30
    saved = json.loads(path.read_text())
    assert [r["k"] for r in saved["rows"]] == [1, 3] and not saved["finished"]
    assert saved["errors"][0]["case"] == {"k": 2} and "ValueError: case two" in saved["errors"][0]["error"]
    again = CaseLog(path, {"bench": "x"}, key=("k",), resume=True)
    assert [k for k in (1, 2, 3) if not again.finished(k=k)] == [2]
    with again.case(k=2) as row:
        row["v"] = 20
    again.finish()
    saved = json.loads(path.read_text())
    assert [r["k"] for r in saved["rows"]] == [1, 3, 2] and saved["errors"] == [] and saved["finished"]
    assert saved["rows_from_earlier_run"] == 2 and not (tmp_path / "cases.json.tmp").exists()
