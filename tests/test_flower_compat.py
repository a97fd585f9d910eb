""".ci/flower_compat.py's own parts, without a venv or the index: the Flower it is asked for, the
constraints it keeps, how it counts a test file's results and the table it prints."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def load():  # noqa: ANN201 - the script's module
    spec = importlib.util.spec_from_file_location("flower_compat", REPO / ".ci" / "flower_compat.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_flower_asked_for_is_a_release_or_a_nightly() -> None:
    compat = load()
    assert compat.resolve_spec("flwr-nightly==1.43.0.dev20261026") == ("flwr-nightly", "1.43.0.dev20261026")
    assert compat.resolve_spec("flwr==1.43.0") == ("flwr", "1.43.0")
    for bad in ("flwr>=1.43", "flower==1.43.0", "flwr==", "flwr-nightly"):
        with pytest.raises(SystemExit, match="give nightly, latest"):
            compat.resolve_spec(bad)


def test_only_the_flwr_pin_leaves_the_constraints(tmp_path: Path) -> None:
    kept = load().constraints_without_flwr(tmp_path).read_text().splitlines()
    original = (REPO / "constraints.txt").read_text().splitlines()
    assert [line for line in original if line not in kept] == [line for line in original if line.startswith("flwr==")]
    assert any(line.startswith("flwr-datasets==") for line in kept) and any(line.startswith("torch==") for line in kept)


def test_a_files_results_are_counted_from_pytests_report(tmp_path: Path) -> None:
    compat = load()
    report = tmp_path / "r.xml"
    report.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
        '<testcase classname="t" name="test_a"/>'
        '<testcase classname="t" name="test_b"><failure message="AssertionError: 1 != 2">trace</failure></testcase>'
        '<testcase classname="t" name="test_c"><skipped message="no openssl"/></testcase>'
        '<testcase classname="t" name="test_d"><error message="fixture failed&#10;second line">trace</error></testcase>'
        '<testcase classname="t" name="test_e"/>'
        "</testsuite></testsuites>")
    result = compat.FileResult("tests/test_x.py", exit_code=1)
    compat.parse_junit(report, result)
    assert (result.passed, result.failed, result.skipped) == (2, 2, 1)
    assert result.failures == ["test_b: AssertionError: 1 != 2", "test_d: fixture failed"]
    assert not result.ok
    table = compat.table([result, compat.FileResult("tests/test_y.py", passed=3, seconds=2.4)])
    assert table.splitlines()[2:] == ["| tests/test_x.py | 2 | 2 | 1 | 0 |", "| tests/test_y.py | 3 | 0 | 0 | 2 |",
                                      "| all | 5 | 2 | 1 | 2 |"]


def test_every_default_test_file_exists() -> None:
    compat = load()
    assert all((REPO / path).is_file() for path in compat.FLOWER_TESTS)
    assert {"tests/test_engines.py", "tests/test_dropin.py", "tests/test_deployment.py"} <= set(compat.FLOWER_TESTS)
