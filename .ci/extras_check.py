"""CI: the lab's extras install beside the newest releases of what they need.

    python3 .ci/extras_check.py [--extra lab] [--report out.json]

Resolves ``fedmm[<extra>]`` from this checkout into a fresh environment, as a new user's pip would
(``pip install --dry-run --ignore-installed --report``, no constraints file), then asks the package
index for each resolved distribution's newest release. It fails when a distribution is resolved
more than one major version below its newest release (an extra drags it down), unless
:data:`ALLOWED` names it with the reason. Prints every distribution held below its newest release.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Distributions an extra may hold more than one major version back, with why.
ALLOWED: dict[str, str] = {
    "attrs": "dp-accounting 0.6.0 (its newest release; Flower's [dp] extra, which the privacy accountant needs) "
             "requires attrs<24",
    "python-dateutil": "graphene 3.4.3 (its newest release; mlflow's tracking server, fedmm[mlflow]) requires "
                       "python-dateutil<3",
}


def resolve(extra: str) -> dict[str, str]:
    """name -> version pip resolves for ``fedmm[extra]`` in a fresh environment."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                        "--report", str(report), f"{REPO}[{extra}]"], check=True)
        data = json.loads(report.read_text())
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in data["install"]
            if item["metadata"]["name"].lower() != "fedmm"}


def newest(name: str) -> str | None:
    """The newest release of ``name`` on the index (pip's own view of it), or None."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True)
    match = re.search(rf"^{re.escape(name)} \(([^)]+)\)", out.stdout, re.I | re.M)
    return match.group(1) if match else None


def major(version: str) -> int:
    match = re.match(r"(\d+)", version)
    return int(match.group(1)) if match else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--extra", default="lab")
    parser.add_argument("--report", default=None, help="write the rows here (JSON)")
    args = parser.parse_args(argv)
    resolved = resolve(args.extra)
    with ThreadPoolExecutor(16) as pool:
        latest = dict(zip(resolved, pool.map(newest, resolved)))
    rows, bad = [], []
    for name, version in sorted(resolved.items()):
        top = latest[name]
        behind = (major(top) - major(version)) if top else 0
        rows.append({"name": name, "resolved": version, "newest": top, "majors_behind": behind})
        if top and top != version:
            print(f"  {name} {version} (newest {top})")
        if behind > 1 and name not in ALLOWED:
            bad.append(f"{name} {version}: newest {top}, {behind} major versions below")
    if args.report:
        Path(args.report).write_text(json.dumps(rows, indent=1))
    print(f"extras check: fedmm[{args.extra}] resolves {len(resolved)} distributions; "
          f"{sum(r['newest'] not in (None, r['resolved']) for r in rows)} below their newest release")
    if bad:
        print("extras check FAILED: an extra drags these more than one major version below their newest release "
              "(fix the pin, or add it to ALLOWED in .ci/extras_check.py with the reason):\n  " + "\n  ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
