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


@pytest.fixture(autouse=True)
def flower_task_identity():
    """Messages built outside a Flower process need a run/node/task identity."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


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
