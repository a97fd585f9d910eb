"""The app against a real Flower deployment: SuperLink, SuperNodes, `flwr run`, on loopback.

What runs (all on 127.0.0.1, offline, with their own FLWR_HOME and temporary folders):

- ``deploy/generate_certs.sh`` makes a CA, the SuperLink's certificate and SuperNode keys;
- ``flower-superlink`` with TLS and SuperNode authentication (``--enable-supernode-auth``);
- the keys of three SuperNodes are registered with ``flwr supernode register``; two SuperNodes
  hold half of the embedded mnist5k data each (``datasets.save_to_disk`` folders, given with
  ``--node-config "data-path='...'"``), the third one points to a folder that does not exist;
- ``flwr run <repo> <connection>``: 2 rounds of SCAFFOLD on all three nodes (the third node's
  error replies are logged and the run completes), then 1 round of FedMR with MOON's objective
  and secure recombination, and 2 aggregations of the asynchronous FedCross, on the two good
  nodes;
- a SuperNode whose key was never registered is refused and exits.

Every process is started in its own session and carries a marker in its environment; the
fixture stops them all (including the SuperExec, ServerApp and ClientApp processes that
Flower starts) when the tests end, whether they pass or fail.

The first tests check the node-data loader on its own (no Flower processes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from client_app.node_data import NodeDataError, load_node_data
from fedmm.config import compose, to_container
from fedmm.data import load_dataset
from fedmm.results import read_metrics

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CONNECTION = "fedmm-test"
#: Images per SuperNode dataset (80% of them are its training rows).
SITE_SIZE = 600
RUN_CONFIG = "num_rounds=2 clients_per_round={k} output_dir='{out}' overrides='training.local_epochs=1 training.lr=0.05'"


# ----------------------------------------------------------------------------- helpers


def mnist_cfg() -> dict:
    return to_container(compose([]))["dataset"]


def write_site(path: Path, x: np.ndarray, y: np.ndarray, num_classes: int = 10) -> Path:
    """A ``datasets.save_to_disk`` folder with an ``image`` and a ``label`` column, like HF MNIST."""
    import datasets as hfds
    from PIL import Image

    features = hfds.Features({"image": hfds.Image(), "label": hfds.ClassLabel(num_classes=num_classes)})
    images = [Image.fromarray(img) for img in x]
    hfds.Dataset.from_dict({"image": images, "label": y.tolist()}, features=features).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def mnist_sites(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two disjoint random samples of the embedded mnist5k training split, one folder each."""
    root = tmp_path_factory.mktemp("sites")
    train, _ = load_dataset(mnist_cfg())
    x, y = train.x.numpy()[:, 0], train.y.numpy()
    rows = np.random.default_rng(0).permutation(len(y))  # the split is ordered by label
    return [
        write_site(root / f"site-{name}", x[np.sort(part)], y[np.sort(part)])
        for name, part in zip("ab", (rows[:SITE_SIZE], rows[SITE_SIZE : 2 * SITE_SIZE]))
    ]


# ------------------------------------------------------------------ node data, no Flower


def test_node_data_loads_a_save_to_disk_folder(mnist_sites: list[Path]) -> None:
    train = load_node_data(mnist_cfg(), mnist_sites[0], node_id=7)
    assert tuple(train.x.shape[1:]) == (1, 28, 28) and len(train) == int(SITE_SIZE * 0.8)
    assert train.y.max() < 10


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda tmp: tmp / "missing", "folder does not exist"),
        (lambda tmp: (tmp / "file.txt").write_text("x") and tmp / "file.txt", "not a folder"),
        (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "no dataset found there"),
    ],
    ids=["missing", "file", "empty"],
)
def test_node_data_errors_name_the_node_and_the_problem(tmp_path: Path, make, problem: str) -> None:
    path = make(tmp_path)
    with pytest.raises(NodeDataError) as err:
        load_node_data(mnist_cfg(), path, node_id=123)
    msg = str(err.value)
    assert msg.startswith(f"node data-path='{path}' (node 123, host ") and problem in msg, msg


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"num_classes": 5}, "dataset.num_classes=5"),
        ({"in_channels": 3, "mean": [0.5] * 3, "std": [0.5] * 3}, "dataset.in_channels=3"),
        ({"image_size": 32}, "dataset.image_size=32"),
    ],
    ids=["classes", "channels", "size"],
)
def test_node_data_that_does_not_fit_the_model_is_refused(mnist_sites: list[Path], override: dict, key: str) -> None:
    with pytest.raises(NodeDataError) as err:
        load_node_data(dict(mnist_cfg(), **override), mnist_sites[0], node_id=5)
    msg = str(err.value)
    assert "(node 5, host" in msg and "does not match the run's model" in msg and key in msg, msg


def test_node_data_unreadable_folder(mnist_sites: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder the SuperNode's user cannot read. Root reads every folder, so as root the access
    check is the one an unprivileged user gets: the mode's bits for others (r and x needed)."""
    locked = shutil.copytree(mnist_sites[0], tmp_path / "locked")
    locked.chmod(0)
    if os.geteuid() == 0:
        import client_app.node_data as node_data

        def as_other(path, mode):  # noqa: ANN001, ANN202 - os.access for a user that owns nothing
            bits = os.stat(path).st_mode
            need = (4 if mode & os.R_OK else 0) | (1 if mode & os.X_OK else 0)
            return bits & need == need

        monkeypatch.setattr(node_data.os, "access", as_other)
    try:
        with pytest.raises(NodeDataError, match="folder is not readable"):
            load_node_data(mnist_cfg(), locked, node_id=1)
        locked.chmod(0o755)
        load_node_data(mnist_cfg(), locked, node_id=1)  # readable again: it loads
    finally:
        locked.chmod(0o755)


# ------------------------------------------------------------------- process management


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def marked_pids(marker: str) -> list[int]:
    """PIDs of the live processes whose environment carries ``marker`` (ours, and their children)."""
    needle = f"FEDMM_DEPLOY_TEST={marker}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Deployment:
    """The processes of one test deployment, and the ``flwr`` CLI pointed at its SuperLink."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.marker = uuid.uuid4().hex
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = root / "logs"
        self.logs.mkdir()
        self.port = free_port()
        self.certs = root / "certs"
        self.cli_home = root / "home" / "cli"
        self.node_ids: dict[str, int] = {}
        self.bad_path = root / "no-such-site"

    def env(self, home: Path) -> dict[str, str]:
        home.mkdir(parents=True, exist_ok=True)
        return dict(
            os.environ,
            FEDMM_DEPLOY_TEST=self.marker,
            FLWR_HOME=str(home),
            FLWR_TELEMETRY_ENABLED="0",
            FLWR_DISABLE_UPDATE_CHECK="1",
            OMP_NUM_THREADS="1",
            FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
            HF_DATASETS_OFFLINE="1",
            HF_HUB_OFFLINE="1",
            # SuperLink and SuperNodes start `flower-superexec`, `flwr-serverapp` and
            # `flwr-clientapp` by name: they must come from this venv.
            PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        )

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - closed by the child's exit
        proc = subprocess.Popen(
            [str(BIN / args[0]), *args[1:]],
            env=self.env(self.root / "home" / name),
            cwd=self.root,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop(self, name: str, grace: float = 15.0) -> None:
        """SIGTERM the process group of ``name`` (it deregisters cleanly), then SIGKILL."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)

    def stop_all(self) -> None:
        """Stop everything this deployment started, children included, even after a failure."""
        for name in reversed(list(self.procs)):
            if self.procs[name].poll() is None:
                try:
                    self.stop(name, grace=10.0)
                except Exception:  # noqa: BLE001 - keep stopping the others
                    pass
        # SuperExec (started in a new session by the SuperLink), ServerApp and ClientApp
        # processes: everything that still carries our marker.
        deadline = time.time() + 10
        while (left := marked_pids(self.marker)) and time.time() < deadline:
            signal_pids(left, signal.SIGTERM)
            time.sleep(0.5)
        signal_pids(marked_pids(self.marker), signal.SIGKILL)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def flwr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run the ``flwr`` CLI with this deployment's config (its own session, killed on timeout)."""
        with subprocess.Popen(
            [str(BIN / "flwr"), *args],
            env=self.env(self.cli_home),
            cwd=self.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        ) as proc:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                raise AssertionError(f"flwr {' '.join(args)} timed out after {timeout}s:\n{out[-4000:]}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")

    def nodes(self) -> dict[int, str]:
        """Node id -> status (registered, online, offline, ...) as the SuperLink lists them."""
        res = self.flwr("supernode", "ls", CONNECTION, "--format", "json")
        assert res.returncode == 0, res.stdout
        data = json.loads(res.stdout[res.stdout.index("{") :])
        return {int(n["node-id"]): n["status"] for n in data["nodes"]}

    def wait_for_nodes(self, want: dict[int, str], timeout: float = 90) -> None:
        deadline = time.time() + timeout
        while (got := self.nodes()) != want:
            if time.time() > deadline:
                logs = "\n".join(f"--- {n}\n{self.log(n)[-1500:]}" for n in self.procs)
                raise AssertionError(f"nodes {got}, expected {want}\n{logs}")
            time.sleep(1.0)

    def register(self, key: str) -> int:
        res = self.flwr("supernode", "register", str(self.certs / "supernode-keys" / f"{key}.pub"), CONNECTION, "--format", "json")
        assert res.returncode == 0, res.stdout
        return int(json.loads(res.stdout[res.stdout.index("{") :])["node-id"])

    def start_supernode(self, name: str, key: str, data_path: Path) -> subprocess.Popen:
        return self.start(
            name,
            [
                "flower-supernode",
                "--superlink", f"127.0.0.1:{self.port}",
                "--root-certificates", str(self.certs / "ca.crt"),
                "--auth-supernode-private-key", str(self.certs / "supernode-keys" / key),
                "--node-config", f"data-path='{data_path}'",
                "--port", str(free_port()),  # this SuperNode's Runtime API (for its ClientApps)
            ],
        )

    def run_app(self, name: str, run_config: str, timeout: float = 300) -> tuple[str, int]:
        """``flwr run <repo> <connection> --stream``; returns its output (the ServerApp's log) and the run id."""
        res = self.flwr("run", str(REPO), CONNECTION, "--stream", "-c", run_config, timeout=timeout)
        (self.logs / f"flwr-run-{name}.log").write_text(res.stdout)
        assert res.returncode == 0, res.stdout[-4000:]
        match = re.search(r"run_id `(\d+)`", res.stdout)
        assert match, res.stdout[-4000:]
        return res.stdout, int(match.group(1))

    def run_status(self, run_id: int) -> str:
        res = self.flwr("ls", CONNECTION, "--run-id", str(run_id), "--format", "json")
        assert res.returncode == 0, res.stdout
        runs = json.loads(res.stdout[res.stdout.index("{") :])["runs"]
        return runs[0]["status"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, mnist_sites: list[Path]) -> Iterator[Deployment]:
    """SuperLink (TLS + node auth), three registered SuperNodes: sites a and b, and one bad path."""
    for tool in ("openssl", "ssh-keygen"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is needed by deploy/generate_certs.sh")
    dep = Deployment(tmp_path_factory.mktemp("deployment"))
    try:
        subprocess.run(
            ["bash", str(REPO / "deploy" / "generate_certs.sh"), "--out", str(dep.certs), "--supernodes", "4", "--rsa-bits", "2048"],
            check=True, capture_output=True, timeout=120,
        )
        superlink = dep.start(
            "superlink",
            [
                "flower-superlink",
                "--ssl-ca-certfile", str(dep.certs / "ca.crt"),
                "--ssl-certfile", str(dep.certs / "server.pem"),
                "--ssl-keyfile", str(dep.certs / "server.key"),
                "--enable-supernode-auth",
                "--host", "127.0.0.1",
                "--port", str(dep.port),
            ],
        )
        deadline = time.time() + 60
        while "Uvicorn running on https://" not in dep.log("superlink"):
            assert superlink.poll() is None and time.time() < deadline, dep.log("superlink")
            time.sleep(0.3)
        dep.cli_home.mkdir(parents=True, exist_ok=True)
        (dep.cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{dep.port}"\nroot-certificates = "{dep.certs / "ca.crt"}"\n'
        )
        dep.node_ids = {name: dep.register(key) for name, key in (("a", "supernode-1"), ("b", "supernode-2"), ("bad", "supernode-3"))}
        dep.wait_for_nodes({i: "registered" for i in dep.node_ids.values()})
        for name, key, path in (("a", "supernode-1", mnist_sites[0]), ("b", "supernode-2", mnist_sites[1]), ("bad", "supernode-3", dep.bad_path)):
            dep.start_supernode(f"supernode-{name}", key, path)
        dep.wait_for_nodes({i: "online" for i in dep.node_ids.values()})
        yield dep
    finally:
        dep.stop_all()
    assert not marked_pids(dep.marker), "processes left running"


# -------------------------------------------------------------------------- deployment


def test_unregistered_supernode_is_refused(deployment: Deployment) -> None:
    before = deployment.nodes()
    proc = deployment.start_supernode("supernode-unregistered", "supernode-4", deployment.root)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a SuperNode with an unregistered key kept running:\n" + deployment.log("supernode-unregistered"))
    log = deployment.log("supernode-unregistered")
    # Flower prints its code (305) and exits with status 1, as for every error code
    assert code == 1 and "Exit Code: 305" in log and "Failed to initialize the connection to the SuperLink" in log, log
    assert "No SuperNode found with the given public key" in deployment.log("superlink")
    assert deployment.nodes() == before  # never listed, let alone online


def test_scaffold_runs_keeps_its_control_variates_and_a_node_with_a_bad_data_path_fails_alone(deployment: Deployment) -> None:
    """SCAFFOLD (FedAvg's round loop and aggregation, plus control variates) on the three nodes.
    The bad node answers every train message with an error reply naming it and its problem; the
    server logs it and aggregates the other two. Each good node's c_i lives in its SuperNode's
    Context.state: in round 2 both report a c_i trained in round 1 (a restart would have reset
    the count to 1); every client objective keeps its state there alike (MOON's previous model:
    tests/test_simulation.py checks it across rounds in simulation)."""
    out = deployment.root / "scaffold"
    # SCAFFOLD's N (c += ΣΔc_i / N) is num_clients: in deployment, the federation's size (3)
    stream, run_id = deployment.run_app("scaffold", RUN_CONFIG.format(k=3, out=out) + " strategy='scaffold'")
    bad = deployment.node_ids["bad"]
    assert re.search(rf"rejected: node {bad}: client error: NodeDataError: node data-path='{re.escape(str(deployment.bad_path))}' \(node {bad}, host [^)]*\): folder does not exist", stream), stream[-4000:]
    assert stream.count("2/3 replies accepted") == 2, stream[-4000:]
    assert deployment.run_status(run_id) == "finished:completed"

    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert [r["replies"] for r in rows[1:]] == [2, 2], stream[-4000:]
    assert [r["control_rounds"] for r in rows[1:]] == [1.0, 2.0], rows
    # it learned (10 classes: chance is 0.1). The best round, not the last: a deployment's node ids
    # are random, and with them each node's batch order (seed_for), so the curve differs from run
    # to run; SCAFFOLD on two non-IID sites has been seen at 0.499 after round 1 and 0.256 after round 2
    assert max(r["accuracy"] for r in rows[1:]) > 0.3, rows
    assert rows[-1]["accuracy"] > 0.15, rows
    for name in ("config.yaml", "final_model.pt", "learning_curve.png", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    # deployment: no partitions on the server, so no label histograms
    assert not (out / "label_histograms.json").exists()


def test_fedmr_runs_on_the_two_good_nodes(deployment: Deployment) -> None:
    if deployment.procs["supernode-bad"].poll() is None:
        deployment.stop("supernode-bad")  # deactivates itself on SIGTERM
    ids = deployment.node_ids
    deployment.wait_for_nodes({ids["a"]: "online", ids["b"]: "online", ids["bad"]: "offline"})
    out = deployment.root / "fedmr"
    # one round, with MOON's objective on the clients (any strategy takes it; its state lives in
    # Context.state as SCAFFOLD's does) and secure recombination (the exchange after training, one
    # repetition: 4 round trips, each ~9 s of SuperNode polling and ClientApp start here): the
    # layers travel sealed between the two SuperNodes through the SuperLink, the protocol's state
    # in Context.state from one round trip to the next
    secure = "strategy.secure.enabled=true strategy.secure.mode=after strategy.secure.repetitions=1"
    config = RUN_CONFIG.format(k=2, out=out).replace("num_rounds=2", "num_rounds=1")
    config = config.replace("overrides='", f"overrides='objective=moon {secure} ")
    stream, run_id = deployment.run_app("fedmr", config + " strategy='fedmr'", timeout=600)
    assert deployment.run_status(run_id) == "finished:completed"
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [0, 1]
    assert rows[1]["replies"] == 2 and rows[1]["moon_rounds"] == 1.0, stream[-4000:]
    assert (rows[1]["secure_exchanged"], rows[1]["secure_dropped"], rows[1]["secure_round_trips"]) == (1.0, 0.0, 4.0), rows
    assert rows[1]["secure_relayed_bytes"] > 0
    # the exchange draws from the operating system, so the accuracy is not fixed: it learns (seen:
    # 0.325 after the round), above chance (0.1)
    assert rows[-1]["accuracy"] > 0.15 and rows[-1]["loss"] < rows[0]["loss"], rows
    with np.load(out / "final_models.npz") as pool:
        assert {name.split("/")[0] for name in pool.files} == {"0", "1"}  # K = 2 models kept


def test_async_fedcross_runs_on_real_supernodes_on_the_real_clock(deployment: Deployment) -> None:
    """The asynchronous loop on a real SuperLink (push / pull, no round barrier) with the wall
    clock: the asynchronous FedCross (K = 2, B = 1) on the two good nodes; every aggregation is a
    row with its (wall) virtual_time. (FedBuff runs the same loop with one model: its simulation
    tests, tests/test_async.py and tests/test_engines.py, cover it.)"""
    if deployment.procs["supernode-bad"].poll() is None:
        deployment.stop("supernode-bad")
    for strategy in ("fedcross_async",):
        out = deployment.root / strategy
        config = RUN_CONFIG.format(k=2, out=out).replace(
            "overrides='", "overrides='strategy.heterogeneity.clock=real strategy.asynchronous.buffer_size=1 ")
        stream, run_id = deployment.run_app(strategy, config + f" strategy='{strategy}'", timeout=600)
        assert deployment.run_status(run_id) == "finished:completed", stream[-4000:]
        rows = read_metrics(out)
        assert [r["round"] for r in rows] == [0, 1, 2], stream[-4000:]
        times = [r["virtual_time"] for r in rows[1:]]
        assert times[0] > 0 and times[1] >= times[0], rows
        assert rows[-1]["accuracy"] > 0.1 and rows[-1]["loss"] < rows[0]["loss"], rows


def test_compose_publishes_only_the_superlinks_port_and_on_loopback_by_default() -> None:
    """Only the SuperLink's one port leaves the Compose network, bound to 127.0.0.1 unless the
    operator names the clients' interface; the SuperExecs need the shared secret."""
    import yaml

    text = (Path(__file__).resolve().parents[1] / "deploy" / "compose.yaml").read_text()
    expand = lambda value: re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m.group(1), m.group(2)), str(value))  # noqa: E731
    services = yaml.safe_load(text)["services"]
    published = {name: [expand(p) for p in svc.get("ports", [])] for name, svc in services.items() if svc.get("ports")}
    assert set(published) == {"superlink"}, published
    for port in published["superlink"]:
        host, outside, inside = port.rsplit(":", 2)
        assert host == "127.0.0.1" and outside == inside == "8000", port
    for name in ("superlink", "superexec-serverapp"):
        assert any("superexec-auth-secret-file" in str(arg) for arg in services[name]["command"]), name
        assert any("superexec.secret" in str(v) for v in services[name]["volumes"]), name


def test_pin_images_writes_digest_references_that_compose_and_the_dockerfile_use(tmp_path: Path) -> None:
    """deploy/pin_images.sh resolves each Flower image's tag to a digest (here a stand-in
    `docker` plays the registry) and refuses anything that is not a sha256 digest; with its
    env file every image of the compose file, and the app image's base, is named by digest."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "docker"
    # prints a digest derived from the image name (buildx imagetools inspect REF --format ...)
    fake.write_text('#!/bin/sh\n[ "$1 $2 $3" = "buildx imagetools inspect" ] || exit 2\n'
                    'if [ -n "$BAD_DIGEST" ]; then echo "$BAD_DIGEST"; exit 0; fi\n'
                    'printf "sha256:%s\\n" "$(printf %s "$4" | sha256sum | cut -c1-64)"\n')
    fake.chmod(0o755)
    # the images must be the Flower release the app's set-up pins (constraints.txt, what CI installs
    # and the numbers were made with), not whatever flwr runs the test: .ci/flower_compat.py runs
    # it under other Flower versions, and a nightly installs as another distribution (flwr-nightly)
    version = re.search(r"^flwr==(\S+)$", (root / "constraints.txt").read_text(), re.MULTILINE).group(1)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("FLWR_VERSION", None)
    env.pop("BAD_DIGEST", None)
    out = tmp_path / "images.env"
    done = subprocess.run(["bash", str(root / "deploy" / "pin_images.sh"), str(out)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    pinned = dict(line.split("=", 1) for line in out.read_text().splitlines() if line and not line.startswith("#"))
    for name in ("superlink", "supernode", "superexec"):
        expected = hashlib.sha256(f"flwr/{name}:{version}".encode()).hexdigest()
        assert pinned[f"{name.upper()}_IMAGE"] == f"flwr/{name}:{version}@sha256:{expected}"

    bad = subprocess.run(["bash", str(root / "deploy" / "pin_images.sh"), str(tmp_path / "bad.env")],
                         env={**env, "BAD_DIGEST": "latest"}, capture_output=True, text=True)
    assert bad.returncode != 0 and "not a sha256 digest" in bad.stderr and not (tmp_path / "bad.env").exists()

    def expand(value: str, variables: dict[str, str]) -> str:  # compose's ${VAR:-default}, nested
        pattern = re.compile(r"\$\{(\w+):-((?:[^${}]|\$\{[^}]*\})*)\}")
        while (m := pattern.search(value)) is not None:
            value = value[: m.start()] + variables.get(m.group(1), expand(m.group(2), variables)) + value[m.end():]
        return value

    services = yaml.safe_load((root / "deploy" / "compose.yaml").read_text())["services"]
    for variables, suffix in ((pinned, "@sha256:"), ({}, f":{version}")):
        for name, svc in services.items():
            if "build" in svc:  # the app image: built on the (pinned) SuperExec image
                base = expand(svc["build"]["args"]["SUPEREXEC_IMAGE"], variables)
                assert base.startswith(f"flwr/superexec:{version}") and suffix in base, (name, base)
            else:
                image = expand(svc["image"], variables)
                assert image.startswith("flwr/super") and suffix in image, (name, image)
    dockerfile = (root / "Dockerfile").read_text()
    assert "FROM ${SUPEREXEC_IMAGE}" in dockerfile and f"ARG SUPEREXEC_IMAGE=flwr/superexec:{version}" in dockerfile


def test_the_app_image_installs_the_apps_dependencies_beside_the_images_own_flower(tmp_path: Path) -> None:
    """The Dockerfile's install step, run here with a stand-in ``pip``: pyproject's flwr requirement is
    dropped (the base image holds flwr: a second requirement pulled Ray in, and with a pin below the
    image's Flower it would move the image's flwr), Flower's [dp] extra is asked for at the image's
    own flwr version, and constraints.txt's flwr pin is left out; every other dependency stays."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    lines = (root / "Dockerfile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("RUN sed"))  # the install step
    step = ""
    for line in lines[start:]:
        step += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            break
    for name in ("pyproject.toml", "constraints.txt"):
        shutil.copy(root / name, tmp_path / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "python"  # the image's python: pip only records what it is asked to install
    shim.write_text(f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then shift 2; echo "$@" > pip-args.txt; exit 0; fi\n'
                    f'exec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    done = subprocess.run(["sh", "-c", step.removeprefix("RUN ")], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    import flwr

    requirements = (tmp_path / "requirements.txt").read_text().split()
    wanted = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    assert requirements == [d for d in wanted if not d.startswith("flwr[")] + [f"flwr[dp]=={flwr.__version__}"]
    assert "flwr-datasets>=0.6" in requirements  # a name that starts with flwr stays
    constraints = (tmp_path / "constraints-image.txt").read_text().splitlines()
    assert constraints == [c for c in (root / "constraints.txt").read_text().splitlines() if not c.startswith("flwr==")]
    assert (tmp_path / "pip-args.txt").read_text().split()[-4:] == ["-c", "constraints-image.txt", "-r", "requirements.txt"]
