"""fedmm on a running Ray cluster, on loopback: the module starts one Ray head of its own
(``ray start --head --block`` on free ports, in a private temp dir). On it, a ``fedmm -m`` sweep
on hydra's Ray launcher runs each job as a Ray task (a failed job marked, the other completed);
then two jobs of one process attach to it (``simulation.ray_address``) as a ``fedmm -m`` sweep on
the basic launcher does, the head's GCS shows that the ClientApps ran there, and the head is
stopped, checking that every process it started is gone.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedmm.config import compose, to_container, validate
from fedmm.errors import ConfigError
from fedmm.results import read_metrics

BIN = Path(sys.executable).parent


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that are free now (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.add(pid)
    return out


def wait_for_port(port: int, head: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert head.poll() is None, f"ray start exited with {head.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"no Ray head on port {port} after {timeout}s")


pytestmark = pytest.mark.ray_runtime  # the module's Ray head (tests/conftest.py: one Ray at a time)


@pytest.fixture(scope="module")
def cluster_env():
    """conftest's ``ray_env`` for the module's one head: a private Ray temp dir, and a sweep of
    every process that used it when the module ends."""
    from tests.conftest import private_ray_env

    with private_ray_env() as env:
        yield env


@pytest.fixture(scope="module")
def ray_head(cluster_env, tmp_path_factory):
    """A one-node Ray cluster (2 CPUs) that this module owns: yields (address, Popen, log path).
    The last test that uses it stops it (and checks that it ended everything it started)."""
    ray_env, tmp_path = cluster_env, tmp_path_factory.mktemp("ray-head")
    tmp = ray_env["RAY_TMPDIR"]
    gcs, client, agent_http, agent_grpc, env_agent, metrics, node_manager, object_manager, dashboard = free_ports(9)
    env = dict(ray_env, RAY_USAGE_STATS_ENABLED="0", RAY_worker_niceness="0")  # as docs/ray_cluster.md starts a head
    log = tmp_path / "ray-head.log"
    cmd = [
        str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2", "--num-gpus=0",
        "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={tmp}",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={env_agent}",
        f"--metrics-export-port={metrics}", f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}", f"--dashboard-port={dashboard}",
    ]
    with open(log, "wb") as out:
        head = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port(gcs, head, timeout=60)
        # `ray start` prints this once the raylet is up too (a driver needs the node's raylet)
        deadline = time.time() + 60
        while "Ray runtime started" not in log.read_text(errors="replace"):
            assert head.poll() is None and time.time() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        yield f"127.0.0.1:{gcs}", head, log
    finally:
        if head.poll() is None:  # the test failed before stopping it: end what it started
            started = descendants(head.pid) | {head.pid}
            head.send_signal(signal.SIGTERM)
            try:
                head.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            for pid in alive(started):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def cluster_record(address: str, driver_pid: int, timeout: float = 15) -> tuple[list[str], list[dict], list[str]]:
    """From the head's GCS (via a short-lived driver of its own): the ended jobs whose driver was
    ``driver_pid``, every actor, and the ids of the live nodes."""
    import ray
    from ray._private import state

    sigterm = signal.getsignal(signal.SIGTERM)
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    signal.signal(signal.SIGTERM, sigterm)  # ray.init replaces it: give pytest's back
    try:
        deadline = time.time() + timeout
        while True:  # the GCS marks a job ended shortly after its driver disconnects
            jobs = [j["JobID"] for j in state.jobs() if j["DriverPid"] == driver_pid and j["IsDead"]]
            if len(jobs) >= 2 or time.time() > deadline:
                break
            time.sleep(0.5)
        return jobs, list(state.actors().values()), [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    finally:
        ray.shutdown()


def test_a_sweep_on_hydras_ray_launcher_runs_each_job_as_a_task_on_the_cluster(cluster_env, ray_head, tmp_path: Path) -> None:
    """``fedmm -m hydra/launcher=fedmm_ray hydra.launcher.ray.init.address=<head>``: the fedmm
    process is a driver of the cluster, each job a Ray task there (in a fresh worker process, on
    the in-process engine); job 1 (1 client, 2 a round) fails: it is marked failed in its own
    folder, job 0 completes, and fedmm exits 1 naming job 1. Runs where hydra's Ray launcher is
    installed (``pip install -e ".[raycluster,dev]"``, an environment of its own: the launcher pins
    cloudpickle<3, so it is not in [dev] or [lab]; pyproject.toml says why)."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="hydra's Ray launcher (fedmm[raycluster]) is not "
                        "installed: it pins cloudpickle<3 and lives in an environment of its own")
    address, head, _ = ray_head
    head_session = (Path(cluster_env["RAY_TMPDIR"]) / "session_latest").resolve()
    sweep = tmp_path / "sweep"
    cmd = [str(BIN / "fedmm"), "-m", "hydra/launcher=fedmm_ray", f"hydra.launcher.ray.init.address={address}",
           "hydra.launcher.ray.remote.num_cpus=1",  # the in-process engine's 4 cores fit no node of this 2-core head
           "num_clients=2,1", "clients_per_round=2", "num_rounds=1", "model=lenet", "training.local_epochs=1",
           "training.local_steps=2", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=dict(cluster_env, OMP_NUM_THREADS="1"))
    proc.stdout, proc.stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job0,), (job1,) = sweep.glob("0_*"), sweep.glob("1_*")
    assert json.loads((job0 / "summary.json").read_text())["status"] == "completed"
    assert [r["round"] for r in read_metrics(job0)] == [0, 1] and (job0 / "final_model.pt").is_file()
    failed = json.loads((job1 / "summary.json").read_text())
    assert failed["status"] == "failed" and failed["stage"] == "config" and "clients_per_round=2 is invalid" in failed["reason"]
    assert f"fedmm: 1 job(s) failed:\n  {job1}: config error: clients_per_round=2" in proc.stdout, proc.stdout[-2000:]
    # the jobs ran in the cluster's workers (their stdout is in the worker logs of the head's
    # session: a Ray of the launcher's own would have a session of its own), each in a worker
    # process of its own (max_calls=1)
    assert (Path(cluster_env["RAY_TMPDIR"]) / "session_latest").resolve() == head_session
    logs = {p: p.read_text(errors="replace") for p in head_session.glob("logs/worker-*.out")}
    ran = {p.name.split("-")[-1] for p, text in logs.items() if f"fedmm: results -> {job0}" in text or f"FAILED {job1}" in text}
    assert len(ran) == 2, {p.name: t[-300:] for p, t in logs.items()}  # two worker pids
    assert head.poll() is None  # the cluster outlives the sweep


def test_two_jobs_attach_to_a_running_cluster_and_leave_it_running(cluster_env, ray_head, tmp_path: Path, monkeypatch) -> None:
    import ray

    from launch.cli import run_job

    address, head, _ = ray_head
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_TMPDIR", cluster_env["RAY_TMPDIR"])
    assert not ray.is_initialized()
    gcs_and_raylet = {p for p in descendants(head.pid)
                      if Path(f"/proc/{p}/comm").read_text().strip() in ("gcs_server", "raylet")}
    assert len(gcs_and_raylet) == 2

    runs = []
    for seed in (0, 1):  # two jobs of one process, as `fedmm -m seed=0,1 simulation.ray_address=...`
        cfg = to_container(compose([
            "num_rounds=1", "num_clients=2", "clients_per_round=2", "model=lenet", "training.local_epochs=1",
            f"seed={seed}", "simulation.engine=ray", f"simulation.ray_address={address}", f"output_dir={tmp_path / f'run{seed}'}",
        ]))
        runs.append(run_job(cfg))
        assert not ray.is_initialized()  # the job disconnected its driver ...
        assert head.poll() is None and alive(gcs_and_raylet) == gcs_and_raylet  # ... and left the cluster running
    for run in runs:
        assert [r["round"] for r in read_metrics(run)] == [0, 1]
        assert f"ray_address: {address}" in (run / "config.yaml").read_text()

    # The head's GCS knows both jobs (this process was their driver, now disconnected) and the
    # ClientApps each ran on its node; had Flower started a Ray of its own, it would know none.
    jobs, actors, nodes = cluster_record(address, os.getpid())
    assert len(jobs) == 2, (jobs, actors)
    assert len(nodes) == 1  # the head
    for job in jobs:
        client_apps = [a for a in actors if a["JobID"] == job and a["ActorClassName"] == "ClientAppActor"]
        assert len(client_apps) == 2, (job, actors)  # the cluster's 2 CPUs / client_cpus=1
        assert {a["Address"]["NodeID"] for a in client_apps} <= set(nodes)
        assert all(a["State"] == "DEAD" for a in client_apps)  # they ended with their job

    # stop the head: `ray start --block` ends what it started on SIGTERM
    started = descendants(head.pid)
    head.send_signal(signal.SIGTERM)
    head.wait(timeout=30)
    deadline = time.time() + 20
    while alive(started) and time.time() < deadline:
        time.sleep(0.2)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_text(errors="replace")[:80] for pid in alive(started)}
    assert not left, left


def test_an_address_where_no_head_answers_fails_the_job_at_once(tmp_path: Path) -> None:
    from launch.cli import JobFailed, run_job

    (port,) = free_ports(1)
    cfg = to_container(compose([
        "num_rounds=1", "num_clients=2", "clients_per_round=2", "simulation.engine=ray", f"simulation.ray_address=127.0.0.1:{port}",
        f"output_dir={tmp_path / 'run'}",
    ]))
    start = time.time()
    with pytest.raises(JobFailed, match=f"simulation.ray_address=127.0.0.1:{port}: no Ray head answers"):
        run_job(cfg)
    assert time.time() - start < 15


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (["simulation.ray_address=ray://head:10001"], "simulation.ray_address", "host:port"),
        (["simulation.ray_address=head"], "simulation.ray_address", "host:port"),
        (["simulation.ray_address=6379"], "simulation.ray_address", "host:port"),
        (["+simulation.ray_init_args.address=head:6379"], "simulation.ray_init_args.address", "simulation.ray_address"),
        (["simulation.ray_address=auto", "+simulation.ray_init_args.num_cpus=4"], "simulation.ray_init_args.num_cpus", "ray start"),
        (["+simulation.ray_init_args.runtime_env={working_dir: /x}"], "simulation.ray_init_args.runtime_env", "without simulation.ray_address"),
        (["+simulation.ray_init_args.namespce=x"], "simulation.ray_init_args.namespce", "did you mean simulation.ray_init_args.namespace?"),
        ({"ray_init_args": ["namespace"]}, "simulation.ray_init_args", "mapping of ray.init keyword arguments"),
        ({"ray_address": ""}, "simulation.ray_address", "host:port"),
    ],
)
def test_bad_cluster_settings_name_the_key(overrides, key, allowed) -> None:
    with pytest.raises(ConfigError) as info:
        if isinstance(overrides, dict):  # values hydra's override grammar cannot write
            cfg = to_container(compose(["simulation.engine=ray"]))
            cfg["simulation"].update(overrides)
            validate(cfg)
        else:
            compose(["simulation.engine=ray", *overrides])
    assert info.value.key == key and allowed in str(info.value), str(info.value)


@pytest.mark.parametrize("override", ["simulation.ray_address=127.0.0.1:6379", "simulation.client_gpus=0.25",
                                      "simulation.client_cpus=2", "+simulation.ray_init_args.namespace=x"])
def test_the_in_process_engine_refuses_the_ray_settings(override: str) -> None:
    """No Ray setting is taken and then ignored: on the in-process engine (the default) each one
    is an error that says how to run on Ray."""
    with pytest.raises(ConfigError) as info:
        compose([override])
    key = override.lstrip("+").split("=")[0]
    assert info.value.key == key.removesuffix(".namespace") and "set simulation.engine=ray" in str(info.value)


def test_a_run_made_before_these_keys_resumes_on_a_cluster(tmp_path: Path) -> None:
    import yaml

    from fedmm.config import resume_config

    cfg = to_container(compose([f"output_dir={tmp_path}"]))
    del cfg["simulation"]["ray_address"], cfg["simulation"]["ray_init_args"], cfg["simulation"]["engine"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert resume_config(tmp_path)["simulation"]["ray_address"] is None
    assert resume_config(tmp_path)["simulation"]["engine"] == "ray"  # a run made before the engines ran on Ray
    resumed = resume_config(tmp_path, ["simulation.ray_address=127.0.0.1:6379", "+simulation.ray_init_args.namespace=x"])
    assert resumed["simulation"]["ray_address"] == "127.0.0.1:6379"
    assert resumed["simulation"]["ray_init_args"] == {"namespace": "x"}


def test_backend_config_passes_the_address_and_init_args() -> None:
    from launch.cli import backend_config

    local = backend_config(to_container(compose([])))
    assert "address" not in local["init_args"] and local["init_args"]["logging_level"] == "ERROR"
    attached = backend_config(to_container(compose([
        "simulation.engine=ray", "simulation.ray_address=10.0.0.1:6379", "simulation.client_cpus=2", "simulation.client_gpus=0.5",
        "+simulation.ray_init_args.namespace=fedmm", "+simulation.ray_init_args.runtime_env={working_dir: /srv/fedmm}",
    ])))
    assert attached["client_resources"] == {"num_cpus": 2, "num_gpus": 0.5}
    assert attached["init_args"] == {
        "logging_level": "ERROR", "log_to_driver": True, "address": "10.0.0.1:6379", "namespace": "fedmm",
        "runtime_env": {"working_dir": "/srv/fedmm"},
    }


def test_the_servers_data_is_loaded_while_ray_starts_and_a_bad_path_is_left_to_the_serverapp(tmp_path: Path) -> None:
    """launch.cli.prepare_server_data fills the caches the ServerApp's set-up reads (its partition
    call is then a cache hit) and raises nothing itself: the ServerApp meets the error and reports it."""
    from fedmm.data import load_dataset, partition_indices
    from fedmm.data.partition import _partition_cached
    from launch.cli import prepare_server_data

    cfg = validate(compose(["num_clients=7", "clients_per_round=2", "seed=12345"]))
    prepare_server_data(cfg)
    hits = _partition_cached.cache_info().hits
    train, _ = load_dataset(cfg.dataset)
    partition_indices(train, cfg.partition, cfg.num_clients, cfg.seed)
    assert _partition_cached.cache_info().hits == hits + 1

    batches = tmp_path / "cifar-10-batches-py"  # passes validation, fails to load (md5)
    batches.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        (batches / name).write_bytes(b"truncated")
    bad = validate(compose(["dataset=cifar10", f"dataset.path={tmp_path}"]))
    prepare_server_data(bad)  # no exception here
    with pytest.raises(ConfigError, match="md5"):
        load_dataset(bad.dataset)  # the ServerApp's set-up meets it and reports it

