"""Hyper-parameter search with hydra's Optuna sweeper (launch/objective.py, conf/experiment/tune_*):
a real 3-trial ``fedmm -m`` search whose best value is a trial's validation figure (the clients'
held-out rows, never the test split, the same rows in every trial); the figure's rule (final, not
best); the searches refused before training; a failed trial failing in Optuna while the search
goes on (hydra-optuna-sweeper 1.3.0, optuna 2.10.1)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.utils import JobReturn, JobStatus
from hydra.utils import instantiate
from omegaconf import OmegaConf

from fedmm.config import CONF_DIR, compose, register_defaults, validate
from fedmm.data import load_partition
from fedmm.errors import ConfigError
from fedmm.results import read_metrics
from launch.objective import (
    FINAL_ROUNDS,
    VALIDATION_FILE,
    NoValidation,
    SearchCheck,
    check_search_space,
    task_value,
    validation_accuracy,
)

BIN = Path(sys.executable).parent
#: A tiny federation: 4 clients, FedCross with K = 3 (with K = 2 the mean model, which clients
#: evaluate, does not depend on α), LeNet, 2 local steps, 1 round.
TINY = ["num_rounds=1", "num_clients=4", "clients_per_round=3", "model=lenet", "training.local_steps=2",
        "training.batch_size=20"]


# ------------------------------------------------------------------------ a real 3-trial search
@pytest.fixture(scope="module")
def search(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``fedmm -m +experiment=tune_fedcross_alpha`` with 3 trials on the embedded data: the sweep dir."""
    tmp = tmp_path_factory.mktemp("search")
    sweep = tmp / "sweep"
    cmd = [str(BIN / "fedmm"), "-m", "+experiment=tune_fedcross_alpha", "hydra.sweeper.n_trials=3", *TINY,
           f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return sweep


def trials(sweep: Path) -> dict[Path, dict[str, Any]]:
    """Each trial's run folder -> its recorded config (config.yaml)."""
    return {run: yaml.safe_load((run / "config.yaml").read_text()) for run in sorted(sweep.glob("*_fedcross*"))}


def test_the_search_maximises_the_validation_accuracy_of_its_trials_not_the_test_accuracy(search: Path) -> None:
    runs = trials(search)
    assert len(runs) == 3 and len({cfg["strategy"]["alpha"] for cfg in runs.values()}) >= 2  # α was tuned
    results = yaml.safe_load((search / "optimization_results.yaml").read_text())
    values = {}
    for run, cfg in runs.items():
        rows = read_metrics(run)
        assert [r["round"] for r in rows] == [0, 1]
        # the clients' accuracy on their held-out rows, as the round loop aggregated it
        federated = json.loads((run / "federated_evaluation.json").read_text())
        assert rows[1]["federated_accuracy"] == federated["1"]["accuracy"]
        recorded = json.loads((run / VALIDATION_FILE).read_text())
        assert recorded["rounds"] == [1]  # fewer than FINAL_ROUNDS rounds: all of them
        assert recorded["validation_accuracy"] == rows[1]["federated_accuracy"]
        values[run] = (cfg["strategy"]["alpha"], recorded["validation_accuracy"], [r["accuracy"] for r in rows])
    best_alpha, best_value = results["best_params"]["strategy.alpha"], results["best_value"]
    assert best_value == max(value for _, value, _ in values.values())  # what fedmm returned is what Optuna saw
    (best_run,) = [run for run, (alpha, value, _) in values.items() if alpha == best_alpha and value == best_value]
    test_accuracy = values[best_run][2]
    assert best_value not in (test_accuracy[-1], max(test_accuracy), float(np.mean(test_accuracy[1:])))


def test_every_trial_was_validated_on_the_same_held_out_rows(search: Path) -> None:
    runs = trials(search)
    fingerprints = {json.loads((run / VALIDATION_FILE).read_text())["held_out_rows_sha256"] for run in runs}
    assert len(fingerprints) == 1
    held_out = []
    for run, cfg in runs.items():  # the rows each client evaluated on, rebuilt from the trial's own config
        settings = validate(cfg)
        parts = [load_partition(settings.dataset, settings.partition, pid, settings.num_clients, settings.seed, part="test")
                 for pid in range(settings.num_clients)]
        held_out.append([(p.x.numpy().tobytes(), p.y.numpy().tobytes()) for p in parts])
        # every client evaluated (fraction_evaluate=1.0): the round's examples are all held-out rows
        federated = json.loads((run / "federated_evaluation.json").read_text())
        assert {m["num-examples"] for m in federated.values()} == {sum(len(p.y) for p in parts)}
    assert held_out[0] == held_out[1] == held_out[2]


# ------------------------------------------------------------------------ the figure
def rows_of(federated: list[float | None]) -> list[dict[str, Any]]:
    """metrics.jsonl rows: round 0 (no federated evaluation), then one per value."""
    return [{"round": 0, "accuracy": 0.1}] + [{"round": r, "accuracy": 0.5, "federated_accuracy": v}
                                              for r, v in enumerate(federated, start=1)]


def test_the_figure_is_the_mean_of_the_last_rounds_not_the_best_round() -> None:
    assert FINAL_ROUNDS == 3
    value, rounds = validation_accuracy(rows_of([0.2, 0.9, 0.6, 0.5, 0.7]))  # the curve peaks at round 2
    assert rounds == [3, 4, 5] and value == pytest.approx(0.6)
    assert validation_accuracy(rows_of([0.2, 0.4])) == (pytest.approx(0.3), [1, 2])  # fewer rounds: all of them
    assert validation_accuracy(rows_of([0.2, 0.4, 0.9]), last=1) == (0.9, [3])


@pytest.mark.parametrize("federated", [[0.5, 0.6, None], [0.5, math.nan, 0.6], [0.5, 0.6, "absent"], []],
                         ids=["null", "nan", "absent", "no-rounds"])
def test_a_run_without_a_finite_figure_in_its_last_rounds_has_none(federated: list[Any]) -> None:
    rows = rows_of(federated)
    for row in rows:
        if row.get("federated_accuracy") == "absent":  # no evaluate reply accepted: the runner writes no key
            del row["federated_accuracy"]
    with pytest.raises(NoValidation, match=r"round \d has no finite|no training round"):
        validation_accuracy(rows)


@pytest.fixture(scope="module")
def run_settings() -> Any:
    return compose(["strategy=fedcross", *TINY, "strategy.fraction_evaluate=1.0", "partition.local_test_fraction=0.2"])


def write_run(run_dir: Path, federated: list[float | None]) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows_of(federated)))
    return run_dir


def test_a_trial_returns_its_figure_and_records_it(tmp_path: Path, run_settings: Any, capsys: pytest.CaptureFixture) -> None:
    run = write_run(tmp_path / "run", [0.2, 0.4, 0.5, 0.6])
    assert task_value(run_settings, run, search=True) == pytest.approx(0.5)
    recorded = json.loads((run / VALIDATION_FILE).read_text())
    assert recorded["validation_accuracy"] == pytest.approx(0.5) and recorded["rounds"] == [2, 3, 4]
    assert len(recorded["held_out_rows_sha256"]) == 64
    assert "validation accuracy 0.5000" in capsys.readouterr().out


def test_a_failed_trial_returns_none_never_nan(tmp_path: Path, run_settings: Any, capsys: pytest.CaptureFixture) -> None:
    run = write_run(tmp_path / "run", [0.4, 0.5, None])  # e.g. a diverged model: every NaN evaluate reply rejected
    assert task_value(run_settings, run, search=True) is None
    assert "round 3 has no finite federated_accuracy" in capsys.readouterr().out
    assert not (run / VALIDATION_FILE).exists()


def test_a_trial_without_validation_settings_is_a_config_error_under_optuna_only(tmp_path: Path) -> None:
    plain = compose(["strategy=fedcross", *TINY])  # fraction_evaluate 0, local_test_fraction 0: the defaults
    run = write_run(tmp_path / "run", [])
    with pytest.raises(SystemExit, match=r"strategy\.fraction_evaluate=0\.0 is invalid"):
        task_value(plain, run, search=True)
    assert task_value(plain, run, search=False) is None  # a plain run or sweep: no figure, no error


# ------------------------------------------------------------------------ refused before training
@pytest.mark.parametrize("override", ["seed=choice(0,1)", "partition=iid,dirichlet", "partition.alpha=interval(0.1,1.0)",
                                      "num_clients=range(4,8)", "strategy.fraction_evaluate=choice(0.5,1.0)",
                                      "dataset=mnist5k,mnist"])
def test_a_search_that_tunes_the_held_out_rows_is_refused(override: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_search_space(["strategy.alpha=choice(0.5,0.9)", override])
    assert err.value.key == override.split("=")[0]


def test_a_search_with_fixed_held_out_keys_is_fine() -> None:
    check_search_space(["seed=1", "partition.alpha=0.1", "strategy.alpha=interval(0.5,0.999)",
                        "objective.mu=tag(log, interval(0.001, 1.0))", "training.lr=choice(0.01,0.05)"])


def preset_config(name: str, *overrides: str) -> Any:
    """The preset as hydra composes it for ``fedmm -m``, hydra node included."""
    register_defaults()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=[f"+experiment={name}", *overrides], return_hydra_config=True)
    OmegaConf.update(cfg, "hydra.mode", "MULTIRUN", force_add=True)
    return cfg


@pytest.mark.parametrize("name", ["tune_fedcross_alpha", "tune_fedprox_mu"])
def test_the_presets_search_check_refuses_bad_searches(name: str) -> None:
    cfg = preset_config(name)
    assert cfg.hydra.sweeper.direction == "maximize" and cfg.hydra.sweeper.sampler.seed == 0
    assert cfg.strategy.fraction_evaluate == 1.0 and cfg.partition.local_test_fraction > 0
    check = instantiate(cfg.hydra.callbacks.fedmm_search)  # every fedmm run has it (conf/config.yaml)
    assert isinstance(check, SearchCheck)
    check.on_multirun_start(cfg)
    check.on_job_start(cfg, task_function=None)  # the preset itself passes
    OmegaConf.update(cfg, "hydra.sweeper.params", {**cfg.hydra.sweeper.params, "seed": "choice(0,1)"}, merge=False)
    with pytest.raises(SystemExit, match=r"seed='choice\(0,1\)' is invalid"):
        check.on_multirun_start(cfg)
    with pytest.raises(SystemExit, match=r"partition\.local_test_fraction=0\.0 is invalid"):
        check.on_job_start(preset_config(name, "partition.local_test_fraction=0.0"), task_function=None)
    OmegaConf.update(cfg, "hydra.sweeper._target_", "hydra._internal.core_plugins.basic_sweeper.BasicSweeper")
    check.on_multirun_start(cfg)  # another sweeper: nothing to check


# ------------------------------------------------------------------------ a failed trial in Optuna
class Launcher:
    """The sweeper's launcher, returning what ``fedmm`` returns for each trial's run."""

    def __init__(self, returns: list[Any]) -> None:
        self.returns = list(returns)

    def launch(self, job_overrides: list[Any], initial_job_idx: int) -> list[JobReturn]:
        out = []
        for _ in job_overrides:
            ret = JobReturn(overrides=[], status=JobStatus.COMPLETED)
            ret.return_value = self.returns.pop(0)
            out.append(ret)
        return out


def optuna_search(tmp_path: Path, returns: list[Any], monkeypatch: pytest.MonkeyPatch) -> optuna.Study:
    """hydra-optuna-sweeper's own search loop over 3 trials of ``strategy.alpha`` whose jobs
    return ``returns``; the study it made."""
    from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl

    studies = []
    create_study = optuna.create_study
    monkeypatch.setattr(optuna, "create_study", lambda **kw: studies.append(create_study(**kw)) or studies[-1])
    sweeper = OptunaSweeperImpl(sampler=optuna.samplers.TPESampler(seed=0), direction="maximize", storage=None,
                                study_name="s", n_trials=len(returns), n_jobs=1, max_failure_rate=0.0, search_space=None,
                                custom_search_space=None, params=OmegaConf.create({"strategy.alpha": "choice(0.5,0.9,0.99)"}))
    sweeper.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    sweeper.hydra_context, sweeper.launcher = object(), Launcher(returns)
    sweeper.sweep([])
    return studies[0]


def test_a_failed_trial_fails_in_optuna_and_the_search_goes_on(tmp_path: Path, run_settings: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    returns = [task_value(run_settings, write_run(tmp_path / f"run{i}", federated), search=True)
               for i, federated in enumerate([[0.3, 0.4], [0.5, None], [0.6, 0.7]])]
    assert returns[1] is None
    study = optuna_search(tmp_path, returns, monkeypatch)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL,
                                               optuna.trial.TrialState.COMPLETE]
    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert results["best_value"] == pytest.approx(0.65)


def test_nan_would_end_the_search_in_this_sweeper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why a failed trial returns None: the sweeper tells NaN as COMPLETE, optuna refuses it, and
    the sweeper's fallback (FAIL with the NaN value) raises out of the search."""
    with pytest.raises(ValueError, match="Values were told"):
        optuna_search(tmp_path, [0.4, math.nan, 0.6], monkeypatch)
