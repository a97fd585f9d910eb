"""A pytest plugin that writes each test's outcome as the test ends (``bench/cases.py``'s JSON):
a pytest run cut off by a time limit still says which tests passed, failed or were skipped.

    FEDMM_CASES_JSON=/out/cuda_tests.json python -m pytest -p pytest_cases tests/test_cuda.py   # bench/ on PYTHONPATH

One row per test: ``test`` (its node id), ``outcome`` (passed, failed or skipped, over its setup,
call and teardown), ``seconds`` and, unless it passed, ``message`` (the end of pytest's report).
With ``FEDMM_CASES_RESUME=1`` the rows of an existing file are kept and a test run again
replaces its row. ``bench/gpu_session.py`` runs the CUDA tests with it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from cases import CaseLog

_log: CaseLog | None = None
_reports: dict[str, list[Any]] = {}


def pytest_configure(config: pytest.Config) -> None:
    global _log
    path = os.environ.get("FEDMM_CASES_JSON")
    if path:
        _log = CaseLog(path, {"benchmark": "pytest", "args": list(config.invocation_params.args)}, key=("test",),
                       resume=os.environ.get("FEDMM_CASES_RESUME") == "1")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _log is not None:
        _reports.setdefault(report.nodeid, []).append(report)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    if _log is None:
        return
    reports = _reports.pop(nodeid, [])
    outcome = ("failed" if any(r.failed for r in reports) else "skipped" if any(r.skipped for r in reports)
               else "passed")
    row: dict[str, Any] = {"test": nodeid, "outcome": outcome, "seconds": round(sum(r.duration for r in reports), 3)}
    if outcome != "passed":
        row["message"] = "\n".join(str(r.longrepr) for r in reports if r.longrepr)[-3000:]
    _log.rows[:] = [r for r in _log.rows if r["test"] != nodeid]
    _log.add(row)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _log is not None:
        _log.finish(exit_status=int(exitstatus))
