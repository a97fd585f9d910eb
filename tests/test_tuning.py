"""Hyper-parameter search with Optuna's own study API (launch/search.py, launch/objective.py,
conf/search/): a real 3-trial ``fedmm-search`` whose best value is a trial's validation figure (the
clients' held-out rows, never the test split, the same rows in every trial), one trial pruned by its
pruner (its run says so), the study resumed from its storage; the figure's rule (final, not best);
the searches refused before the first trial."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
import yaml

from fedmm.config import CONF_DIR, compose, validate
from fedmm.data import load_partition
from fedmm.errors import ConfigError
from fedmm.results import read_metrics
from launch.objective import FINAL_ROUNDS, VALIDATION_FILE, NoValidation, check_search_space, record_validation, validation_accuracy
from launch.search import load_space, parse_dimension, run_search

#: A tiny federation: 4 clients, FedCross with K = 3 (with K = 2 the mean model, which clients
#: evaluate, does not depend on α), LeNet, 20 local steps, 2 rounds.
TINY = ["num_rounds=2", "num_clients=4", "clients_per_round=3", "model=lenet", "training.local_steps=20",
        "training.batch_size=20"]
#: The three trials (a grid, in the sampler's seeded order): the learning rate 1e-6 learns nothing,
#: so its first round's validation accuracy (chance, ~0.10) is below the pruner's threshold,
#: which the other two pass (~0.19 after round 1).
GRID = {"strategy.alpha": [0.99], "training.lr": [1e-06, 0.05, 0.1]}
PARAM = "training.lr=choice(1e-06, 0.05, 0.1)"


# ------------------------------------------------------------------------ a real 3-trial search
@pytest.fixture(scope="module")
def search(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``fedmm-search conf/search/fedcross_alpha.yaml`` with 3 trials of α on the embedded data
    (a grid sampler over three values, a threshold pruner that prunes the worst), then resumed
    with one more trial: the study, its storage, the run folders."""
    tmp = tmp_path_factory.mktemp("search")
    storage = f"sqlite:///{tmp / 'optuna.db'}"
    common = [str(CONF_DIR / "search" / "fedcross_alpha.yaml"), *TINY, f"results_root={tmp / 'results'}",
              "--param", PARAM, "--storage", storage, "--sampler", "GridSampler", "--sampler-args", json.dumps({"search_space": GRID, "seed": 0}),
              "--pruner", "ThresholdPruner", "--pruner-args", json.dumps({"lower": PRUNE_BELOW})]
    study = run_search([*common, "--trials", "3"])
    first = [(t.number, t.state) for t in study.trials]
    resumed = run_search([*common, "--trials", "1", "--sampler", "RandomSampler", "--sampler-args", '{"seed": 1}'])
    return {"study": study, "first": first, "resumed": resumed, "storage": storage, "root": tmp / "results" / "search"}


#: The threshold pruner's bound (see GRID).
PRUNE_BELOW = 0.15


def trials(search: dict[str, Any]) -> dict[Path, dict[str, Any]]:
    """Each completed trial's run folder -> its recorded config (config.yaml)."""
    done = [t for t in search["resumed"].trials if t.state == optuna.trial.TrialState.COMPLETE]
    return {Path(t.user_attrs["run_dir"]): yaml.safe_load((Path(t.user_attrs["run_dir"]) / "config.yaml").read_text())
            for t in done}


def test_a_trial_is_pruned_its_run_says_so_and_the_resumed_study_adds_trials(search: dict[str, Any]) -> None:
    states = dict(search["first"])
    assert len(states) == 3 and list(states.values()).count(optuna.trial.TrialState.PRUNED) == 1, states
    pruned = next(t for t in search["study"].trials if t.state == optuna.trial.TrialState.PRUNED)
    assert pruned.params == {"strategy.alpha": 0.99, "training.lr": 1e-06}
    summary = json.loads((Path(pruned.user_attrs["run_dir"]) / "summary.json").read_text())
    assert summary["status"] == "pruned" and "ThresholdPruner after round 1" in summary["reason"]
    assert summary["rounds_completed"] <= 1
    again = optuna.load_study(study_name="fedcross_alpha", storage=search["storage"])
    assert [t.number for t in again.trials] == [0, 1, 2, 3]  # the resumed study added a trial, kept the three
def test_the_search_maximises_the_validation_accuracy_of_its_trials_not_the_test_accuracy(search: dict[str, Any]) -> None:
    runs = trials(search)
    study = search["resumed"]
    assert len(runs) >= 2 and len({cfg["training"]["lr"] for cfg in runs.values()}) >= 2  # the learning rate was tuned
    values = {}
    for run, cfg in runs.items():
        rows = read_metrics(run)
        assert [r["round"] for r in rows] == [0, 1, 2]
        # the clients' accuracy on their held-out rows, as the round loop aggregated it
        federated = json.loads((run / "federated_evaluation.json").read_text())
        assert rows[1]["federated_accuracy"] == federated["1"]["accuracy"]
        recorded = json.loads((run / VALIDATION_FILE).read_text())
        assert recorded["rounds"] == [1, 2]  # fewer than FINAL_ROUNDS rounds: all of them
        assert recorded["validation_accuracy"] == pytest.approx(np.mean([rows[1]["federated_accuracy"], rows[2]["federated_accuracy"]]))
        values[run] = (cfg["training"]["lr"], recorded["validation_accuracy"], [r["accuracy"] for r in rows])
    best = study.best_trial
    assert best.value == max(value for _, value, _ in values.values())  # what the run recorded is what Optuna saw
    best_run = Path(best.user_attrs["run_dir"])
    assert values[best_run][0] == best.params["training.lr"]
    test_accuracy = values[best_run][2]
    assert best.value not in (test_accuracy[-1], max(test_accuracy), float(np.mean(test_accuracy[1:])))


def test_every_trial_was_validated_on_the_same_held_out_rows(search: dict[str, Any]) -> None:
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
    assert all(h == held_out[0] for h in held_out)


def test_a_trial_pruned_at_its_last_round_has_a_summary_that_agrees_with_its_metrics(tmp_path: Path) -> None:
    """The pruner decides on round 2's figure (warm-up: not on round 1's), the run's last: its
    summary counts round 2 as metrics.jsonl and its checkpoint do, and its reason says which
    figure it saw (one round's, not the mean a completed trial is scored by)."""
    from server_app.checkpoint import load_checkpoint

    study = run_search([str(CONF_DIR / "search" / "fedcross_alpha.yaml"), *TINY, f"results_root={tmp_path}",
                        "--storage", f"sqlite:///{tmp_path / 's.db'}", "--trials", "1", "--sampler", "RandomSampler",
                        "--pruner", "ThresholdPruner", "--pruner-args", json.dumps({"lower": 1.0, "n_warmup_steps": 2})])
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.PRUNED and list(trial.intermediate_values) == [1, 2]
    run = Path(trial.user_attrs["run_dir"])
    summary = json.loads((run / "summary.json").read_text())
    rows = read_metrics(run)
    assert summary["status"] == "pruned" and rows[-1]["round"] == 2
    assert summary["rounds_completed"] == rows[-1]["round"] == load_checkpoint(run)["round"], summary
    assert f"after round 2 (the validation accuracy of round 2 alone: {rows[-1]['federated_accuracy']:.4f})" in summary["reason"]


def fake_job(figures: Any, ran: list[dict]) -> Any:
    """A stand-in for a trial's job: its run folder with ``figures`` (an iterator of federated
    accuracies per round), its config recorded in ``ran``."""

    def job(cfg: dict, observers: Any = ()) -> Path:
        out = Path(cfg["output_dir"])
        ran.append(cfg)
        write_run(out, next(figures))
        (out / "summary.json").write_text(json.dumps({"status": "completed"}))
        return out

    return job


def test_a_finite_space_never_runs_a_completed_value_set_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture) -> None:
    """Three values of α; the same search run again and again: each value runs once, then the
    search says none is left (the same seeded sampler draws the completed values again)."""
    import itertools

    import launch.cli
    from launch.search import main

    ran: list[dict] = []
    monkeypatch.setattr(launch.cli, "run_job", fake_job(itertools.repeat([0.3, 0.4]), ran))
    args = ["--param", "strategy.alpha=choice(0.5, 0.9, 0.99)", "strategy=fedcross", "strategy.fraction_evaluate=1.0",
            "partition.local_test_fraction=0.2", *TINY, f"results_root={tmp_path}", "--storage",
            f"sqlite:///{tmp_path / 's.db'}", "--sampler", "RandomSampler", "--sampler-args", '{"seed": 3}']
    assert main([*args, "--trials", "2"]) == 0
    assert len(ran) == 2
    assert main([*args, "--trials", "2"]) == 0  # one value left: it runs, then none is left
    assert main([*args, "--trials", "2"]) == 0  # nothing runs
    alphas = [cfg["strategy"]["alpha"] for cfg in ran]
    assert sorted(alphas) == [0.5, 0.9, 0.99], alphas
    out = capsys.readouterr().out
    assert out.count("none is left to run") >= 2
    study = optuna.load_study(study_name="fedmm", storage=f"sqlite:///{tmp_path / 's.db'}")
    complete = [t.params["strategy.alpha"] for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert sorted(complete) == [0.5, 0.9, 0.99]
    skipped = [t for t in study.trials if "duplicate_of" in t.user_attrs]
    assert skipped and all(t.state == optuna.trial.TrialState.PRUNED for t in skipped)
    assert out.count("not run again") == len(skipped)
    assert main([*args, "seed=1", "--trials", "1"]) == 0  # another base config in the same study: its values are new
    assert len(ran) == 4 and ran[-1]["seed"] == 1


def test_the_printed_figures_say_what_they_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    import launch.cli
    from launch.search import main

    monkeypatch.setattr(launch.cli, "run_job", fake_job(iter([[0.3, 0.4, 0.5, 0.6]]), []))
    storage = f"sqlite:///{tmp_path / 's.db'}"
    assert main([str(CONF_DIR / "search" / "fedcross_alpha.yaml"), *TINY, f"results_root={tmp_path}", "--storage", storage,
                 "--trials", "1"]) == 0
    out = capsys.readouterr().out
    assert "validation accuracy 0.5000 (the mean of rounds 2-4)" in out, out
    assert f"optuna-dashboard {storage}" in out


def test_the_docs_dashboard_command_opens_the_default_study_store() -> None:
    """docs/lab.md's optuna-dashboard command names the store fedmm-search writes by default:
    <results_root>/search/optuna.db, results_root at its default."""
    import os
    import re

    from fedmm.config import RunSettings

    text = (CONF_DIR.parent / "docs" / "lab.md").read_text()
    (command,) = re.findall(r"^optuna-dashboard (\S+)", text, flags=re.M)
    default = Path(os.path.expanduser(RunSettings().results_root)).resolve() / "search" / "optuna.db"
    assert os.path.expandvars(command) == f"sqlite:///{default}", command


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


def test_a_trial_records_its_figure(tmp_path: Path, run_settings: Any) -> None:
    run = write_run(tmp_path / "run", [0.2, 0.4, 0.5, 0.6])
    assert record_validation(run_settings, run) == pytest.approx(0.5)
    recorded = json.loads((run / VALIDATION_FILE).read_text())
    assert recorded["validation_accuracy"] == pytest.approx(0.5) and recorded["rounds"] == [2, 3, 4]
    assert len(recorded["held_out_rows_sha256"]) == 64


def test_a_run_without_a_figure_records_none(tmp_path: Path, run_settings: Any) -> None:
    run = write_run(tmp_path / "run", [0.4, 0.5, None])  # e.g. a diverged model: every NaN evaluate reply rejected
    with pytest.raises(NoValidation, match="round 3 has no finite federated_accuracy"):
        record_validation(run_settings, run)
    assert not (run / VALIDATION_FILE).exists()


def test_a_failed_trial_fails_in_optuna_and_the_search_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trials whose job fails or records no figure are FAIL; the others count (no training: each
    trial's run is written by a stand-in for the job)."""
    import launch.cli
    from launch.cli import JobFailed

    figures = iter([[0.3, 0.4], "raise", [0.5, None], [0.6, 0.7]])

    def fake_job(cfg: dict, observers: Any = ()) -> Path:
        out = Path(cfg["output_dir"])
        figure = next(figures)
        if figure == "raise":
            raise JobFailed("ClientOutOfMemory: the trial's job failed")
        write_run(out, figure)
        (out / "summary.json").write_text(json.dumps({"status": "completed"}))
        return out

    monkeypatch.setattr(launch.cli, "run_job", fake_job)
    study = run_search([str(CONF_DIR / "search" / "fedcross_alpha.yaml"), *TINY, f"results_root={tmp_path}",
                        "--storage", f"sqlite:///{tmp_path / 's.db'}", "--trials", "4", "--sampler", "RandomSampler",
                        "--sampler-args", '{"seed": 0}'])
    states = [t.state for t in study.trials]
    assert states == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.FAIL,
                      optuna.trial.TrialState.COMPLETE]
    assert study.best_value == pytest.approx(0.65)


# ------------------------------------------------------------------------ refused before the first trial
@pytest.mark.parametrize("key", ["seed", "partition", "partition.alpha", "num_clients", "strategy.fraction_evaluate",
                                 "dataset"])
def test_a_search_that_tunes_the_held_out_rows_is_refused(key: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_search_space({"strategy.alpha": "choice(0.5, 0.9)", key: "choice(...)"})
    assert err.value.key == key


def test_a_search_with_fixed_held_out_keys_is_fine() -> None:
    check_search_space({"strategy.alpha": "float(0.5, 0.999)", "objective.mu": "float(0.001, 1.0, log)",
                        "training.lr": "choice(0.01, 0.05)"})


@pytest.mark.parametrize(("args", "key", "words"), [
    (["--param", "strategy.alpha=choice(0.5, 1.5)"], "search.strategy.alpha", "1.5 is not"),
    (["--param", "training.lr=float(0.3, 0.001)"], "search.training.lr", "low < high"),
    (["--param", "training.lr=float(0, 0.1, log)"], "search.training.lr", "low > 0"),
    (["--param", "training.lr=uniform(0, 1)"], "search.training.lr", "float(low, high"),
    (["--param", "seed=choice(0, 1)"], "seed", "a fixed value"),
    (["--param", "training.lr=float(0.01, 0.1)", "strategy=fedcross"], "strategy.fraction_evaluate", "a value > 0"),
    (["--sampler", "TPE"], "--sampler", "TPESampler"),
    (["--pruner", "MedianPruner", "--pruner-args", '{"n_warmup": 1}'], "--pruner-args", "keyword arguments"),
    (["--param", "training.lr=float(0.01, 0.1)", "strategy=fedcros"], "strategy", "did you mean fedcross?"),
    (["+strategy.lrr=0.1"], "strategy.lrr", "did you mean training.lr?"),
    (["strategy.alpah=0.5"], "strategy.alpah", "did you mean strategy.alpha?"),
])
def test_a_bad_search_is_refused_before_the_first_trial_naming_the_value(tmp_path: Path, args: list[str], key: str,
                                                                          words: str) -> None:
    base = [] if any(a.startswith("strategy=") for a in args) else \
        [str(CONF_DIR / "search" / "fedcross_alpha.yaml")]
    with pytest.raises(ConfigError) as err:
        run_search([*base, *TINY, f"results_root={tmp_path}", "--storage", f"sqlite:///{tmp_path / 's.db'}", *args])
    assert err.value.key == key and words in str(err.value), err.value
    assert not (tmp_path / "search").exists() or not any((tmp_path / "search").rglob("summary.json"))


def test_the_space_files_and_the_parameter_syntax_parse() -> None:
    overrides, space = load_space(CONF_DIR / "search" / "fedprox_mu.yaml", ["training.lr=float(0.001, 0.3, log)",
                                                                           "training.local_epochs=int(1, 5)"])
    assert "strategy=fedprox" in overrides and space["objective.mu"].choices == (0.001, 0.01, 0.1, 0.5, 1.0)
    assert space["training.lr"].log and space["training.local_epochs"].kind == "int"
    assert parse_dimension("x", {"float": [0.5, 0.999]}).high == 0.999
    assert parse_dimension("strategy.selection", "choice(in-order, lowest-similarity)").choices == ("in-order",
                                                                                                  "lowest-similarity")
