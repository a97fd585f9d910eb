"""Shared test settings: offline, no telemetry, quiet Ray."""

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
if "PYTEST_XDIST_WORKER" in os.environ:
    # The README runs the suite on two workers (`pytest -n 2`, one per core): one torch / OpenMP
    # thread per process keeps the cores busy without oversubscribing them (set before torch is
    # imported; the fedmm, Ray and Flower processes a test starts inherit it).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


import copy  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

#: The files that take longest (``--durations``: each is a minute or more of a worker's time,
#: most of it Ray, Flower processes or subprocess runs), in that order, ahead of all others.
#: With ``--dist loadfile`` a file runs on one worker; the long ones first leave the short ones to
#: fill the gaps at the end, instead of one worker finishing a long file alone.
SLOW_FILES_FIRST = ("test_deployment.py", "test_simulation.py", "test_same_results.py", "test_engines.py",
                    "test_interrupt.py", "test_gpu_session.py", "test_ray_cluster.py", "test_vectorized.py",
                    "test_text.py", "test_launchers.py", "test_async.py")


_CACHE_DIR = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """xdist schedules the files in collection order (not by their number of tests, its default).
    The session's partition cache (fedmm.data.partition_cache) is a fresh folder shared by its
    workers and every process the tests start (they inherit the environment), removed at the end:
    each partition is computed once per session, never read from an earlier session's files."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if "PYTEST_XDIST_WORKER" not in os.environ and "FEDMM_CACHE_DIR" not in os.environ:
        config.stash[_CACHE_DIR] = os.environ["FEDMM_CACHE_DIR"] = tempfile.mkdtemp(prefix="fedmm-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _CACHE_DIR in config.stash:
        shutil.rmtree(config.stash[_CACHE_DIR], ignore_errors=True)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """:data:`SLOW_FILES_FIRST` first; the other files, and the tests within each file, keep
    their order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# One Ray runtime at a time: Ray runtimes of several workers started within the same minute
# compete for the cores and ports of one machine. A test marked ``ray_runtime`` holds an exclusive
# lock, shared by the session's workers, while it runs; a module marked so (its Ray started by a
# module fixture) holds it for the whole module. (What looked like a hung ClientApp actor with
# three workers was Ray's worker niceness, 15, starving it beside the other workers' tests; a Ray
# that fedmm starts runs its workers at 0: bench/log/performance.md, section 9.)


@contextlib.contextmanager
def _ray_lock(tmp_path_factory: pytest.TempPathFactory):
    import fcntl

    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # the session's folder
    with open(root / "fedmm-ray.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield


def _module_marked(module: Any) -> bool:
    marks = getattr(module, "pytestmark", [])
    return any(m.name == "ray_runtime" for m in (marks if isinstance(marks, list) else [marks]))


@pytest.fixture(scope="module", autouse=True)
def _one_ray_per_module(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    if _module_marked(request.module):
        with _ray_lock(tmp_path_factory):
            yield
    else:
        yield


@pytest.fixture(autouse=True)
def _one_ray_per_test(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    if request.node.get_closest_marker("ray_runtime") and not _module_marked(request.module):
        with _ray_lock(tmp_path_factory):
            yield
    else:
        yield


@pytest.fixture(autouse=True)
def flower_task_identity():
    """Messages built outside a Flower process need a run/node/task identity."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def clientapp_actors_niceness(ray_tmpdir: str) -> list[int]:
    """The niceness of each ClientApp actor of the Ray whose temp dir is ``ray_tmpdir`` (the
    actors are the raylet's children; their command lines do not name the dir)."""
    raylets = {pid for pid in pids_mentioning(ray_tmpdir) if b"raylet" in Path(f"/proc/{pid}/cmdline").read_bytes()}
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid in raylets and (proc / "cmdline").read_bytes().startswith(b"ray::ClientAppActor"):
                found.append(os.getpriority(os.PRIO_PROCESS, int(proc.name)))
        except (OSError, IndexError, ValueError):
            continue
    return found


def pids_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


@contextlib.contextmanager
def private_ray_env():
    """The environment of a private Ray temp dir (short: Ray's socket paths must fit 107 bytes);
    on exit, every process that used it is killed and the dir removed."""
    tmp = tempfile.mkdtemp(prefix="fr", dir="/tmp")
    try:
        yield dict(os.environ, RAY_TMPDIR=tmp, FLWR_TELEMETRY_ENABLED="0")
    finally:
        for pid in pids_mentioning(tmp):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def ray_env():
    """A private Ray temp dir for one test (:func:`private_ray_env`)."""
    with private_ray_env() as env:
        yield env


@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple[str, ...]) -> Any:
    from fedmm.config import compose

    return compose(list(overrides))


def composed(*overrides: str) -> Any:
    """``fedmm.config.compose(overrides)``, composed once per test session (hydra's compose takes
    a good part of a second); every call gets its own copy."""
    return copy.deepcopy(_composed(tuple(overrides)))



@pytest.fixture
def stacked_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of clients of every vectorized computation (``client_app.vectorized.train_stacked``)."""
    import client_app.vectorized as vectorized

    calls: list[int] = []
    real = vectorized.train_stacked

    def counted(model, states, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        calls.append(len(states))
        return real(model, states, *args, **kwargs)

    monkeypatch.setattr(vectorized, "train_stacked", counted)
    return calls
