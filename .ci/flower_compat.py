"""The Flower-facing tests against another Flower: a release, a nightly, the newest of either.

    python3 .ci/flower_compat.py --flower flwr-nightly==1.43.0.dev20261026 [--venv DIR]
    python3 .ci/flower_compat.py --flower nightly         # the newest flwr-nightly the index holds
    python3 .ci/flower_compat.py --flower latest          # the newest flwr release
    python3 .ci/flower_compat.py --flower flwr==1.42.0 --tests tests/test_dropin.py
    python3 .ci/flower_compat.py --python .venv/bin/python   # the same tests in an existing venv, as it is

Makes (or reuses) a venv of its own for that Flower: the checkout installed as CI installs it
(``pip install -c constraints.txt -e ".[dev]"``, which brings the pinned ``flwr``), then ``flwr``
replaced by the Flower asked for with its ``[simulation,dp]`` extras (``pip uninstall flwr``, then
``pip install --pre``; the other pins of constraints.txt still hold). The replacement is why the
pin in pyproject.toml does not stop it: a nightly is another distribution (``flwr-nightly``, the
same ``flwr`` package), and a release above the pin is tested before the pin admits it. Then it
runs each test file on its own (``pytest -p no:cacheprovider``, offline, telemetry off, no
runtime dependency installation) and prints one row per file and the reason of every failure.
Exit status 0 when every file passed. ``--out FILE`` also writes the table and the failures as
JSON. The venv is kept (default ``~/.cache/fedmm/flower-compat/<distribution>-<version>``) and
reused while pyproject.toml and constraints.txt are unchanged (else installed over);
``--reinstall`` makes it anew.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: The test files that exercise Flower itself: its simulation engine and Grid (engines, in-process
#: engine, drop-in quickstart, DP wrappers and mods, server optimizers against Flower's own
#: strategies), its SuperLink / SuperNode / CLI (deployment, flwr run), its config parser (docs).
FLOWER_TESTS = [
    "tests/test_superlink.py",
    "tests/test_local_engine.py",
    "tests/test_dropin.py",
    "tests/test_wrappers.py",
    "tests/test_server_optimizers.py",
    "tests/test_vectorized_rounds.py",
    "tests/test_deployment_faults.py",
    "tests/test_privacy.py",
    "tests/test_docs.py",
    "tests/test_engines.py",
    "tests/test_simulation.py",
    "tests/test_deployment.py",
]
EXTRAS = "[simulation,dp]"
STAMP = ".fedmm-flower-compat.json"


@dataclass
class FileResult:
    path: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    exit_code: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.failed == 0


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kwargs)


def newest(distribution: str, pre: bool) -> str:
    """The newest version of ``distribution`` the package index holds (``pip index versions``)."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", *(["--pre"] if pre else []), distribution],
                         capture_output=True, text=True, check=True).stdout
    match = re.search(rf"^{re.escape(distribution)} \(([^)]+)\)", out, re.MULTILINE)
    if not match:
        raise SystemExit(f"flower_compat: the index holds no {distribution}:\n{out}")
    return match.group(1)


def resolve_spec(spec: str) -> tuple[str, str]:
    """(distribution, version) of ``--flower``: ``nightly``, ``latest`` or ``<flwr|flwr-nightly>==<version>``."""
    if spec == "nightly":
        return "flwr-nightly", newest("flwr-nightly", pre=True)
    if spec == "latest":
        return "flwr", newest("flwr", pre=False)
    match = re.fullmatch(r"(flwr|flwr-nightly)==([0-9][0-9A-Za-z.+-]*)", spec)
    if not match:
        raise SystemExit(f"flower_compat: --flower {spec!r}: give nightly, latest, flwr==<version> or flwr-nightly==<version>")
    return match.group(1), match.group(2)


def constraints_without_flwr(tmp: Path) -> Path:
    """constraints.txt less its flwr line (the Flower under test replaces it)."""
    lines = (REPO / "constraints.txt").read_text().splitlines()
    out = tmp / "constraints-without-flwr.txt"
    out.write_text("\n".join(line for line in lines if not re.match(r"^\s*flwr\s*[=<>!~]", line)) + "\n")
    return out


def fingerprint(distribution: str, version: str) -> str:
    h = hashlib.sha256(f"{distribution}=={version}\n".encode())
    for name in ("pyproject.toml", "constraints.txt"):
        h.update((REPO / name).read_bytes())
    return h.hexdigest()


def installed_flower(python: Path) -> dict[str, str]:
    """What the venv imports as ``flwr``: the distribution that provides it, its version, its path,
    and the files its record lists that are not there."""
    code = ("import importlib.metadata as m, json, flwr\n"
            "names = {d.metadata['Name'].lower() for d in m.distributions()}\n"
            "dists = [n for n in ('flwr', 'flwr-nightly') if n in names]\n"
            "missing = [str(f) for n in dists for f in m.files(n) or [] if not f.locate().exists()]\n"
            "print(json.dumps({'distribution': ','.join(dists), 'version': ','.join(m.version(n) for n in dists),"
            " 'path': flwr.__path__[0], 'missing': missing}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def intact(python: Path, distribution: str, version: str) -> bool:
    """The venv imports ``flwr`` from that distribution and version, with every file of its record."""
    try:
        found = installed_flower(python)
    except subprocess.CalledProcessError:
        return False
    return (found["distribution"], found["version"], found["missing"]) == (distribution, version, [])


def make_venv(venv: Path, distribution: str, version: str, reinstall: bool) -> Path:
    """The venv with this checkout and the Flower asked for; reused when its stamp matches."""
    python = venv / "bin" / "python"
    stamp = venv / STAMP
    want = fingerprint(distribution, version)
    if not reinstall and python.exists() and stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == want \
            and intact(python, distribution, version):
        print(f"flower_compat: reusing {venv} ({distribution}=={version})", flush=True)
        run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(REPO)])  # this checkout
        return python
    if reinstall and venv.exists():
        shutil.rmtree(venv)
    if not python.exists():
        run([sys.executable, "-m", "venv", str(venv)])
    # (an existing venv without a matching stamp, e.g. an install cut short, is installed over)
    pip = [str(python), "-m", "pip"]
    run([*pip, "install", "--quiet", "--upgrade", "pip"])
    # flwr and flwr-nightly install the same files: uninstalling one deletes the other's, which
    # then counts as installed without them. Neither may be there when the pinned flwr comes in.
    run([*pip, "uninstall", "--yes", "flwr", "flwr-nightly"])
    run([*pip, "install", "--quiet", "-c", str(REPO / "constraints.txt"), "-e", f"{REPO}[dev]"])
    with tempfile.TemporaryDirectory() as tmp:
        constraints = constraints_without_flwr(Path(tmp))
        run([*pip, "uninstall", "--yes", "flwr"])
        run([*pip, "install", "--quiet", "--pre", "-c", str(constraints), f"{distribution}{EXTRAS}=={version}"])
    found = installed_flower(python)
    if found["distribution"] != distribution or found["version"] != version or found["missing"]:
        raise SystemExit(f"flower_compat: the venv imports flwr from {found['distribution']}=={found['version']} "
                         f"({len(found['missing'])} of its files missing), not {distribution}=={version}")
    stamp.write_text(json.dumps({"fingerprint": want, "distribution": distribution, "version": version}))
    return python


def test_env(python: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1", FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO),
               PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}")
    env.pop("VIRTUAL_ENV", None)
    return env


def parse_junit(path: Path, result: FileResult) -> None:
    """Counts and one line per failure from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        name = f"{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            result.failed += 1
            message = (problem.get("message") or problem.text or "").strip().splitlines()
            result.failures.append(f"{name}: {message[0][:300] if message else type(problem).__name__}")
        elif case.find("skipped") is not None:
            result.skipped += 1
        else:
            result.passed += 1


def run_file(python: Path, test: str, tmp: Path, timeout: float) -> FileResult:
    result = FileResult(test)
    xml = tmp / (re.sub(r"\W", "_", test) + ".xml")
    cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "addopts=", f"--junitxml={xml}", test]
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO, env=test_env(python), timeout=timeout)
        result.exit_code = done.returncode
    except subprocess.TimeoutExpired:
        result.exit_code = 124
        result.failures.append(f"timed out after {timeout:.0f} s")
    result.seconds = round(time.perf_counter() - t0, 1)
    if xml.exists():
        parse_junit(xml, result)
    elif result.exit_code not in (0, 124):
        result.failures.append(f"pytest exited {result.exit_code} without a report")
    if result.exit_code not in (0, 1, 124) and not result.failures:  # 5: no tests, 2-4: usage/collection
        result.failures.append(f"pytest exited {result.exit_code}")
    return result


def table(results: list[FileResult]) -> str:
    rows = ["| test file | passed | failed | skipped | seconds |", "|---|---|---|---|---|"]
    rows += [f"| {r.path} | {r.passed} | {r.failed} | {r.skipped} | {r.seconds:.0f} |" for r in results]
    total = [sum(getattr(r, k) for r in results) for k in ("passed", "failed", "skipped", "seconds")]
    rows.append(f"| all | {total[0]} | {total[1]} | {total[2]} | {total[3]:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--flower", help="nightly, latest, flwr==<version> or flwr-nightly==<version> (its [simulation,dp] "
                                        "extras are added)")
    which.add_argument("--python", type=Path, help="run the tests with this environment's Python as it is (nothing "
                                                   "installed), e.g. .venv/bin/python for the pinned Flower")
    parser.add_argument("--venv", type=Path, help="the venv to make or reuse (default ~/.cache/fedmm/flower-compat/<dist>-<version>)")
    parser.add_argument("--tests", nargs="+", default=FLOWER_TESTS, help="test files (default: the Flower-facing ones)")
    parser.add_argument("--reinstall", action="store_true", help="make the venv anew even when its stamp matches")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per test file (default 1200)")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)

    if args.python:
        python = args.python.absolute()  # a venv's python is a link: keep its bin folder
        flower = installed_flower(python)
        distribution, version = flower["distribution"], flower["version"]
        if flower["missing"]:
            raise SystemExit(f"flower_compat: {python} has {distribution}=={version} with {len(flower['missing'])} of its "
                             "files missing (flwr and flwr-nightly share them): install it again")
    else:
        distribution, version = resolve_spec(args.flower)
        venv = args.venv or Path.home() / ".cache" / "fedmm" / "flower-compat" / f"{distribution}-{version}"
        python = make_venv(venv.absolute(), distribution, version, args.reinstall)
        flower = installed_flower(python)
    print(f"flower_compat: {distribution}=={version} with {python} (flwr imported from {flower['path']})", flush=True)
    head = f"Flower {distribution}=={version}, fedmm at {git_head()}, Python {python_version(python)}"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for test in args.tests:
            results.append(run_file(python, test, Path(tmp), args.timeout))
    print(f"\n{head}\n\n{table(results)}\n")
    for r in results:
        for failure in r.failures:
            print(f"FAILED {r.path}::{failure}")
    if args.out:
        args.out.write_text(json.dumps({"flower": f"{distribution}=={version}", "head": head,
                                        "results": [asdict(r) | {"ok": r.ok} for r in results]}, indent=1) + "\n")
    return 0 if all(r.ok for r in results) else 1


def git_head() -> str:
    """The checkout's commit when the tests start, and whether files differ from it."""
    try:
        git = ["git", "-C", str(REPO)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} with uncommitted changes" if dirty else head


def python_version(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import platform; print(platform.python_version())"], capture_output=True,
                          text=True, check=True).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
