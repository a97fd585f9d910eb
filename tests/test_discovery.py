"""Methods are found, not registered: every declared option of this project is discovered, and a
method in another installed package (an ``importlib.metadata`` entry point, as ``pip install``
writes it) is found the same way and runs in a real simulation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fedmm.config import group_options, options

REPO = Path(__file__).resolve().parent.parent

#: A user's own method: a server half (FedAvg whose new model moves only half way) and a client
#: half (CE plus a penalty on the logits' size), in a package of its own.
STRATEGY = '''
from dataclasses import dataclass

from fedmm.settings import Number, setting
from strategies.fedavg import FedAvg
from strategies.strategy_settings import StrategySettings


@dataclass
class HalfwaySettings(StrategySettings):
    option = "halfway"
    title = "Halfway"
    companions = {"objective": "logit_penalty"}
    step: float = setting(0.5, Number(gt=0, le=1), "how far the server model moves towards the clients' mean")


class Halfway(FedAvg):
    Settings = HalfwaySettings

    def aggregate(self, server_round, updates, mean):
        old = self.models[0]
        mean = super().aggregate(server_round, updates, mean)
        s = self.settings.step
        self.models = [{k: (old[k] + s * (mean[k] - old[k])).astype(old[k].dtype) for k in old}]
        return self.models[0]
'''
OBJECTIVE = '''
from dataclasses import dataclass

from fedmm.settings import Number, setting
from objectives.base import LocalUpdate, ObjectiveSettings


@dataclass
class LogitPenaltySettings(ObjectiveSettings):
    option = "logit_penalty"
    weight: float = setting(0.01, Number(ge=0), "weight of the mean squared logit")


class LogitPenalty(LocalUpdate):
    Settings = LogitPenaltySettings

    def loss(self, model, x, y):
        ce, logits = super().loss(model, x, y)
        return ce + self.params.weight * (logits ** 2).mean(), logits
'''


def install_method_package(site: Path) -> None:
    """What ``pip install`` leaves on sys.path: the package and its dist-info with entry points."""
    package = site / "halfway_method"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "server.py").write_text(textwrap.dedent(STRATEGY))
    (package / "client.py").write_text(textwrap.dedent(OBJECTIVE))
    info = site / "halfway_method-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: halfway-method\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[fedmm.strategy]\nhalfway = halfway_method.server\n\n[fedmm.objective]\nlogit_penalty = halfway_method.client\n")


def test_every_option_of_this_project_is_declared_and_found() -> None:
    assert {"fedavg", "fedmr", "fedcross", "fedmut", "fedexp", "solo", "scaffold", "fedgen", "feddyn"} <= set(options("strategy"))
    assert {"ce", "fedprox", "fedrl", "asam", "scaffold", "moon", "fedgen", "feddyn"} <= set(options("objective"))
    assert set(options("selection")) >= {"uniform", "clustered"} and set(options("partition")) == {"iid", "dirichlet", "natural", "file"}
    assert "indep" in group_options("strategy")  # presets are options too


def test_a_method_in_an_installed_package_is_found_and_runs(tmp_path: Path) -> None:
    site = tmp_path / "site"
    install_method_package(site)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "FLWR_TELEMETRY_ENABLED": "0"}
    probe = (
        "import json\n"
        "from fedmm.config import compose, options\n"
        "from strategies import build_strategy\n"
        "run = compose(['strategy=halfway', 'strategy.step=0.25'])\n"
        "print(json.dumps({'strategies': sorted(options('strategy')), 'objective': run.objective.to_dict(),\n"
        "                  'class': type(build_strategy(run)).__name__, 'step': run.strategy.step}))\n"
    )
    found = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr[-3000:]
    seen = json.loads(found.stdout.strip().splitlines()[-1])
    assert "halfway" in seen["strategies"] and seen["class"] == "Halfway" and seen["step"] == 0.25
    assert seen["objective"] == {"name": "logit_penalty", "training": {}, "weight": 0.01}
    job = subprocess.run(
        [sys.executable, "-m", "launch", "strategy=halfway", "num_rounds=2", "num_clients=3", "clients_per_round=2", "model=lenet",
         "training.local_epochs=1", "checkpoint_every=0", f"hydra.run.dir={out}"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2] and all(r.get("replies") == 2 for r in rows[1:])
    assert "name: halfway" in (out / "config.yaml").read_text() and "logit_penalty" in (out / "config.yaml").read_text()


def test_the_settings_reference_page_is_what_the_declarations_generate(tmp_path: Path) -> None:
    from analysis import settings_reference

    committed = (REPO / "docs" / "settings.md").read_text(encoding="utf-8")
    assert committed == settings_reference.render(), "docs/settings.md is stale: run python -m analysis.settings_reference"
    assert "### `strategy=feddyn` (FedDyn)" in committed and "| `strategy.alpha` | `0.01` |" in committed
    stale = tmp_path / "settings.md"
    stale.write_text(committed.replace("`0.01`", "`0.02`", 1), encoding="utf-8")
    assert settings_reference.main(["--check", "--out", str(stale)]) == 1
    assert settings_reference.main(["--check"]) == 0
