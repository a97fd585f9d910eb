"""Shared test settings: offline, no telemetry, quiet Ray."""

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


import pytest  # noqa: E402

# The packages that register the schemas of their config groups (as the entry points do).
import client_app.local_update  # noqa: E402, F401
import strategies  # noqa: E402, F401


@pytest.fixture(autouse=True)
def flower_task_identity():
    """Messages built outside a Flower process need a run/node/task identity."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
