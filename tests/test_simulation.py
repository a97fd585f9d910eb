"""Real simulations: `flwr run` on Flower's simulation engine (Ray), and on the in-process engine
(`fedmm`'s default) FedMR / FedCross and every other method with a failing client, an objective
preset with federated evaluation, a sweep with a failed job; a Ray runtime that cannot start.

These are the slow tests of the suite (seconds to tens of seconds each): tiny federations, few
rounds. tests/test_engines.py shows that both engines give the same numbers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from fedmm.config import compose, to_container
from fedmm.results import read_metrics

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (used to find the SuperLink we started)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(proc.name) != os.getpid():
            pids.append(int(proc.name))
    return pids


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on the loopback now (each held until all are chosen)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def stop_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + 15
    while time.time() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.2)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.ray_runtime
def test_flwr_run_simulation_writes_metrics(tmp_path: Path) -> None:
    """``flwr run . -c "strategy='feddyn' ..."``: the method added last, as a user runs it."""
    flwr_home = tmp_path / "flwr-home"
    out = tmp_path / "run"
    http_port, control_port = free_ports(2)
    env = dict(
        os.environ,
        FLWR_HOME=str(flwr_home),
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        FLWR_TELEMETRY_ENABLED="0",
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        RAY_worker_niceness="0",  # the Ray Flower starts: ClientApps not starved by other work (docs/usage.md)
        # A local SuperLink of this test's own: `flwr run` joins whatever SuperLink listens on the
        # local ports, and the users' ports (fedmm.superlink) are one pair per uid, so two suites run
        # by one user (root on a shared machine, CI beside a developer) joined one SuperLink, and the
        # first to finish stopped it under the other: "Connection to the SuperLink is unavailable".
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(http_port),
        FLWR_LOCAL_CONTROL_API_PORT=str(control_port),
    )
    cmd = [
        str(BIN / "flwr"), "run", str(REPO), "--stream",
        "--federation-config", "num-supernodes=4",
        "-c", f"strategy='feddyn' num_rounds=2 clients_per_round=2 output_dir='{out}' overrides='training.local_epochs=1'",
    ]
    try:
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    finally:
        stop_pids(processes_mentioning(str(flwr_home)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[-1]["accuracy"] > 0.3  # 10 classes: chance is 0.1
    assert rows[1]["bytes_sent"] > 0 and rows[2]["bytes_sent"] == 2 * rows[1]["bytes_sent"]
    assert rows[2]["seconds"] > rows[1]["seconds"]
    for name in ("config.yaml", "final_model.pt", "learning_curve.png", "label_histograms.png", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    # the federation had 4 SuperNodes although conf/ says num_clients=20: the run adapts
    assert "num_clients: 4" in (out / "config.yaml").read_text()
    assert "name: feddyn" in (out / "config.yaml").read_text() and rows[2].get("h_norm", 0) > 0  # FedDyn's h moved
    assert "engine: ray" in (out / "config.yaml").read_text()  # flwr run simulates on Flower's engine, and says so
    # `fedmm` with the same settings gives the same curve (docs/usage.md says so)
    from launch.cli import run_job

    same = to_container(compose(["strategy=feddyn", "num_rounds=2", "clients_per_round=2", "num_clients=4",
                                 "training.local_epochs=1", f"output_dir={tmp_path / 'fedmm'}"]))
    ours = read_metrics(run_job(same))
    assert [r["round"] for r in ours] == [0, 1, 2]
    for a, b in zip(rows, ours):
        assert abs(a["accuracy"] - b["accuracy"]) <= 0.005, (rows, ours)


def test_multimodel_simulation_dispatch_stages_and_failing_client(tmp_path: Path) -> None:
    """FedMR, FedCross, FedMut (3 rounds), FedExP, SOLO, SCAFFOLD, MOON, FedGen (2 rounds), then
    CluSamp and FedMR with secure recombination, in one simulation: K = N = 3 so every node trains every round (CluSamp: K = 2 draws);
    partition 0 always fails (a third of the clients: no model may be lost)."""
    from fedmm.local_engine import run_local_simulation
    from tests.sim_apps import failing_client_app, recording_server_app

    strategies = ["fedmr", "fedcross", "fedmut", "fedexp", "solo", "scaffold", "moon", "fedgen"]
    staged = {"fedmr": ["strategy.first_stage_rounds=1"], "fedcross": ["strategy.first_stage_rounds=1"], "fedmut": [],
              "fedexp": [], "solo": [], "scaffold": [], "moon": [], "fedgen": []}
    # the multi-model methods need 3 rounds (stage 1, then pairwise different models); 2 show the rest
    rounds = {s: 3 if s in ("fedmr", "fedcross", "fedmut") else 2 for s in strategies}
    cfgs = [
        to_container(compose([
            f"strategy={strategy}", *staged[strategy], f"num_rounds={rounds[strategy]}", "num_clients=3",
            "clients_per_round=3", "training.local_epochs=1", f"output_dir={tmp_path / strategy}",
            "dataset.test_fraction=0.75",  # 1,250 training images: ~417 per client, enough to show each method
            # the small LeNet, but MOON's CNN: its contrastive term keeps a LeNet at chance for 2 rounds
            f"model={'cnn' if strategy == 'moon' else 'lenet'}",
        ]))
        for strategy in strategies
    ]
    starts = np.cumsum([0] + [3 * rounds[s] for s in strategies])  # where each run's messages begin in the log
    # clustered sampling: the nodes report their sizes in the roster query, two draws per round
    cfgs.append(to_container(compose([
        "strategy=clusamp", "num_rounds=2", "num_clients=3", "clients_per_round=2", "training.local_epochs=1",
        "dataset.test_fraction=0.75", "model=lenet",
        "max_failed_rounds=0", f"output_dir={tmp_path / 'clusamp'}",
    ])))
    # FedMR with secure recombination (both exchanges, 2 repetitions) on the real handlers: the
    # failing node passes the key setup and fails in stage 1, the other two roll back and retry
    cfgs.append(to_container(compose([
        "strategy=fedmr", "strategy.secure.enabled=true", "num_rounds=1", "num_clients=3", "clients_per_round=3",
        "training.local_epochs=1", "dataset.test_fraction=0.75", "model=lenet", f"output_dir={tmp_path / 'secure'}",
    ])))
    log: list = []
    out: dict = {}
    run_local_simulation(server_app=recording_server_app(cfgs, log, out), client_app=failing_client_app, num_supernodes=3)
    assert len(out["dirs"]) == 10
    secure = out["dirs"].pop()
    rows = read_metrics(secure)
    assert json.loads((secure / "summary.json").read_text())["status"] == "completed"
    for row in rows[1:]:
        # keys, the before exchange's failed first stage, its retry (2 repetitions x 2), the after
        # exchange (2 x 2), the upload
        assert (row["secure_exchanged"], row["secure_dropped"], row["secure_attempts"], row["secure_round_trips"]) == (1, 1, 3, 11), row
        assert row["replies"] == 2 and row["secure_relayed_bytes"] > 0
    assert [r["round"] for r in rows] == [0, 1] and rows[1]["loss"] < rows[0]["loss"]  # it learns (the exchange draws from the OS: no fixed accuracy)
    with np.load(secure / "final_models.npz") as pool:
        assert {name.split("/")[0] for name in pool.files} == {"0", "1", "2"}  # no model lost
    clusamp = out["dirs"].pop()
    rows = read_metrics(clusamp)
    assert json.loads((clusamp / "summary.json").read_text())["status"] == "completed"
    assert [r["round"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:  # one message per distinct drawn node; the failing node's draw brings nothing
        assert 1 <= row["distinct_clients"] <= 2 and row["clusters"] >= 2 and row["replies"] <= row["distinct_clients"]
    assert len(log) == starts[-1] + sum(int(r["distinct_clients"]) for r in rows[1:])
    for index, run in enumerate(out["dirs"]):
        digests = defaultdict(list)
        for rnd, _, digest in log[starts[index] : starts[index + 1]]:  # 3 messages per round
            digests[rnd].append(digest)
        assert sorted(digests) == list(range(1, rounds[strategies[index]] + 1)) and all(len(v) == 3 for v in digests.values())
        assert len(set(digests[1])) == 1  # initial model
        if strategies[index] == "fedmut":  # mutated around the mean from round 1 on: 2 mutants + the mean (odd K)
            assert len(set(digests[2])) == 3 and digests[1][0] not in digests[2]
        elif strategies[index] == "fedexp":  # one training model, the extrapolated one; its step is logged
            assert len(set(digests[2])) == 1 and digests[2][0] != digests[1][0]
            rows = read_metrics(run)
            assert all(r["eta_g"] >= 1.0 for r in rows[1:]) and [r.get("replies") for r in rows[1:]] == [2, 2]
            continue
        elif strategies[index] == "scaffold":  # one model; c down, Δc up: 2x the bytes of FedExP's rounds
            assert len(set(digests[2])) == 1 and digests[2][0] != digests[1][0]
            rows, plain = read_metrics(run), read_metrics(out["dirs"][strategies.index("fedexp")])
            assert [r["bytes_sent"] for r in rows] == [2 * r["bytes_sent"] for r in plain]
            assert [r["bytes_received"] for r in rows] == [2 * r["bytes_received"] for r in plain]
            # the nodes kept their c_i across rounds in Context.state: round r's replies had trained r times
            assert [r["control_rounds"] for r in rows[1:]] == [1.0, 2.0]
            continue
        elif strategies[index] == "moon":  # each node keeps its last model as the next round's negative
            rows = read_metrics(run)
            assert [r["moon_rounds"] for r in rows[1:]] == [1.0, 2.0]
            assert rows[1]["moon_contrastive"] == 0.0 and rows[2]["moon_contrastive"] > 0
            assert rows[-1]["accuracy"] > 0.15
            continue
        elif strategies[index] == "fedgen":  # the generator learns every round and travels from round 2 on
            rows, plain = read_metrics(run), read_metrics(out["dirs"][strategies.index("fedexp")])
            assert all(r["generator_loss_end"] < r["generator_loss_start"] for r in rows[1:])
            model_bytes = plain[1]["bytes_sent"] // 3
            generator_bytes = (rows[2]["bytes_sent"] - rows[1]["bytes_sent"]) // 3 - model_bytes
            assert rows[1]["bytes_sent"] == plain[1]["bytes_sent"] and generator_bytes > 0  # round 1: the model only
            continue
        elif strategies[index] == "solo":  # each node gets its own model back: the failing one keeps the initial
            assert len(set(digests[2])) == 3 and digests[1][0] in digests[2]
            rows = read_metrics(run)
            assert [r["models_evaluated"] for r in rows[1:]] == [2, 2] and all("accuracy_std" in r for r in rows[1:])
            continue
        else:
            assert len(set(digests[2])) == 1  # stage 1 reset every model to the aggregate
            assert digests[2][0] != digests[1][0]
        assert len(set(digests[3])) == 3, strategies[index]  # recombined / cross-aggregated: pairwise different
        rows = read_metrics(run)
        assert [r.get("replies") for r in rows[1:]] == [2, 2, 2]  # the failing node never replies with a model
        assert json.loads((run / "summary.json").read_text())["status"] == "completed"
        with np.load(run / "final_models.npz") as pool:
            assert {name.split("/")[0] for name in pool.files} == {"0", "1", "2"}  # still K models


@pytest.mark.parametrize("preset", ["fedprox"])  # FedRL's preset runs in tests/test_same_results.py
def test_objective_presets_run_in_a_real_simulation(tmp_path: Path, preset: str) -> None:
    from launch.cli import run_job

    cfg = to_container(compose([
        f"strategy={preset}", "objective.mu=0.5", "num_rounds=1", "num_clients=4", "clients_per_round=2",
        "strategy.fraction_evaluate=0.5", "partition.local_test_fraction=0.2",
        "training.local_epochs=1", f"output_dir={tmp_path / 'run'}",
    ]))
    run = run_job(cfg)
    rows = read_metrics(run)
    assert [r["round"] for r in rows] == [0, 1]
    assert rows[1]["accuracy"] > rows[0]["accuracy"]
    assert f"name: {preset}" in (run / "config.yaml").read_text()  # the objective the clients used
    # federated evaluation on half of the 4 clients: example-weighted metrics from the ClientApps
    federated = json.loads((run / "federated_evaluation.json").read_text())
    assert 0.0 <= federated["1"]["accuracy"] <= 1.0 and federated["1"]["num-examples"] > 0
    # the clients evaluated on their held-out 20 %, and the round's metrics line says so
    assert rows[1]["federated_accuracy"] == federated["1"]["accuracy"]
    # held-out rows of all 4 clients are ~20 % of the 4,000 training images; their training
    # shards would be ~2,000 for two clients
    assert federated["1"]["num-examples"] <= 0.2 * 4000 + 4


def test_a_run_whose_clients_all_fail_stops_as_failed_and_the_job_fails(tmp_path: Path) -> None:
    """One SuperNode that always fails: after max_failed_rounds=2 rounds with no accepted reply
    the run stops; summary.json says failed (with the client's own error), the job raises."""
    from fedmm.local_engine import run_local_simulation
    from strategies.base import RunFailed
    from tests.sim_apps import failing_client_app, recording_server_app

    cfg = to_container(compose([
        "num_rounds=6", "num_clients=1", "clients_per_round=1", "max_failed_rounds=2", f"output_dir={tmp_path / 'run'}",
    ]))
    out: dict = {}
    with pytest.raises(RunFailed):
        run_local_simulation(server_app=recording_server_app(cfg, [], out), client_app=failing_client_app, num_supernodes=1)
    assert "dir" not in out  # run_experiment raised
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_completed"] == 1
    assert "2 consecutive rounds (1..2" in summary["reason"] and "injected failure on partition 0" in summary["reason"]
    assert [r["round"] for r in read_metrics(tmp_path / "run")] == [0, 1]  # round 2 never evaluated


def test_a_sweep_with_a_failed_job_finishes_the_others_lists_the_failure_and_exits_non_zero(tmp_path: Path) -> None:
    """Job 1 asks every one of 2 clients for 3,000 of the 4,000 training rows: it fails when it
    partitions (on any host, GPU or not); job 0 completes; fedmm exits 1."""
    sweep = tmp_path / "sweep"
    cmd = [
        str(BIN / "fedmm"), "-m", "partition.min_partition_size=1,3000", "num_rounds=1", "num_clients=2", "clients_per_round=1",
        "training.local_epochs=1", f"hydra.sweep.dir={sweep}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    statuses = {p.parent.name.split("_")[0]: json.loads(p.read_text())["status"] for p in sweep.glob("*/summary.json")}
    assert statuses == {"0": "completed", "1": "failed"}
    assert "fedmm: 1 job(s) failed:" in proc.stdout and "partition.min_partition_size=3000" in proc.stdout
    (job0,) = sweep.glob("0_*")
    assert "[fedmm] round 1/1" in (job0 / "cli.log").read_text()  # the hydra job log has the progress lines
    # the report lays this real sweep out as a paper table (the embedded MNIST subset named as the
    # paper's CIFAR-10 only to fill a cell): ours beside the paper's value, the failed job listed
    from analysis.report import main as report

    report([str(sweep), "--out", str(tmp_path / "report" / "kdd"), "--paper", "kdd_table1", "--map", "dataset.mnist5k=CIFAR-10"])
    table = (tmp_path / "report" / "kdd_kdd_table1.md").read_text()
    ours = 100 * read_metrics(job0)[-1]["accuracy"]
    assert f"| CNN | CIFAR-10 | 0.5 | {ours:.2f} (54.42) n=1 |" in table, table  # FedAvg's cell of KDD Table 1
    assert "1_" in table and "failed" in table, table
    for suffix in (".csv", ".tex"):
        assert "54.42" in (tmp_path / "report" / f"kdd_kdd_table1{suffix}").read_text()


@pytest.mark.ray_runtime
def test_a_simulation_runtime_that_cannot_start_fails_the_job_at_once(tmp_path: Path, ray_env: dict) -> None:
    """Ray can place no ClientApp (64 CPUs each on this machine): the runtime stops; the job
    fails at once with status failed and the runtime's reason, instead of waiting for replies."""
    run = tmp_path / "run"
    cmd = [str(BIN / "fedmm"), "num_rounds=3", "num_clients=2", "clients_per_round=1", "simulation.engine=ray",
           "simulation.client_cpus=64",
           "training.local_epochs=1", f"hydra.run.dir={run}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=ray_env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_completed"] == 0
    # the runtime's own error, under Flower's two wrappers; the same whichever thread wrote first
    assert "the simulation runtime stopped: ValueError: ActorPool is empty" in summary["reason"], summary["reason"]


def test_indep_records_each_models_accuracy_in_a_real_run(tmp_path: Path) -> None:
    """Indep (FedMR-p 1.0) with track_models: every evaluated round records each of the K models'
    own accuracy (KDD Fig. 5), and the global row is the mean model's as before."""
    from launch.cli import run_job

    cfg = to_container(compose([
        "strategy=indep", "num_rounds=1", "num_clients=3", "clients_per_round=3", "training.local_epochs=1",
        f"output_dir={tmp_path / 'run'}",
    ]))
    run = run_job(cfg)
    rows = read_metrics(run)
    assert "model_0_accuracy" not in rows[0]  # round 0: one initial model
    per_model = [rows[1][f"model_{i}_accuracy"] for i in range(3)]
    assert all(0.0 <= a <= 1.0 for a in per_model) and "model_3_accuracy" not in rows[1]
    assert len(set(per_model)) > 1  # three models trained on different clients
    from analysis.figures import plot_models  # KDD Fig. 5: the curves of each model

    data = plot_models(run, tmp_path / "models.png")
    assert (tmp_path / "models.png").stat().st_size > 0 and data["model_2_accuracy"] == [per_model[2]]
