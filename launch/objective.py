"""The value a ``fedmm`` job returns to hydra: the run's validation accuracy, so that hydra's
Optuna sweeper can tune a setting (FedCross's ``strategy.alpha``, FedProx's ``objective.mu``):

    fedmm -m +experiment=tune_fedcross_alpha
    fedmm -m hydra/sweeper=optuna hydra.sweeper.direction=maximize strategy=fedprox \\
        strategy.fraction_evaluate=1.0 partition.local_test_fraction=0.2 \\
        'objective.mu=tag(log, interval(0.001, 1.0))'

**Validation, never the test split.** The figure is federated evaluation: each client evaluates
the global model on its held-out rows (``partition.local_test_fraction`` of its data, split by
:func:`fedmm.data.local_split`, seeded by (``seed``, partition id); never trained on), and the
runner records the example-weighted ``federated_accuracy`` of every evaluated round in
``metrics.jsonl``. The test split (the ``accuracy`` column) plays no part in the choice. The
held-out rows are the same in every trial as long as the search does not tune ``seed``,
``num_clients``, the partition, the dataset or ``strategy.fraction_evaluate``: a search that does
is refused (:func:`check_search_space`). With ``strategy.fraction_evaluate=1.0`` (the presets) every
client evaluates every round, so every trial is scored on the same rows; a smaller fraction
scores each round on a seeded sample of the clients (the same clients in every trial, but fewer
rows: a noisier figure).

**Final, not best.** The figure is the mean federated accuracy of the last :data:`FINAL_ROUNDS`
evaluated rounds (the last three rounds with the default ``eval_every=1``; fewer when the run has
fewer). The best round's accuracy would pick, for every trial, the maximum of a noisy curve: an
optimistic figure that favours settings whose curve swings most (FedCross with α far from 1),
and one that describes a model the run does not keep (``final_model.pt`` is the last round's). The
last round alone depends on which clients trained in that one round (under non-IID data the
global model leans towards them); the mean of the last three smooths that out and still measures
the end of training.

**A failed trial.** hydra-optuna-sweeper 1.3.0 (with optuna 2.10.1) turns a job's return value
into ``float(value)``: ``None`` fails that conversion and the trial is told ``FAIL``, and the
search goes on (it logs the failure; with ``max_failure_rate`` 0 it then re-reads every job's
return value, which raises only for a job that raised). ``NaN`` is worse there: ``study.tell``
refuses a NaN value, and the sweeper's own fallback ``tell(FAIL, values=[nan])`` raises again,
which ends the whole search. So a job without a finite figure returns ``None``, never NaN, and
never raises. A search whose trials all failed has no best trial: the sweeper then raises at
the end, after every job ran.

**Checked before training.** :class:`SearchCheck` (a hydra callback every ``fedmm`` run has:
``hydra.callbacks.fedmm_search`` in conf/config.yaml) refuses, before the first job, a search that tunes a key which
changes the held-out rows, and, before each job trains, a job that records no validation
figure (``strategy.fraction_evaluate`` or ``partition.local_test_fraction`` 0). Without the
callback (removed from the config) the same job fails after its run (:func:`task_value`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from fedmm.errors import ConfigError
from fedmm.results import read_metrics

#: The figure is the mean over this many last evaluated rounds (module docstring: why).
FINAL_ROUNDS = 3
#: The metrics.jsonl column of the clients' held-out rows (example-weighted over the clients).
VALIDATION_METRIC = "federated_accuracy"
#: What :func:`task_value` writes into the run directory: the figure, its rounds, its rows.
VALIDATION_FILE = "validation.json"
#: Keys whose values decide which rows are held out (or which clients evaluate): a search may
#: not tune them (a group choice, e.g. ``partition=iid,dirichlet``, or any key below it).
HELD_OUT_KEYS = ("seed", "num_clients", "dataset", "partition", "strategy.fraction_evaluate")
#: The settings without which a run records no validation figure.
VALIDATION_KEYS = ("strategy.fraction_evaluate", "partition.local_test_fraction")


class NoValidation(Exception):
    """A run recorded no finite validation figure; the message says which round lacks it."""


# ------------------------------------------------------------------------------ the figure
def validation_accuracy(rows: Iterable[Mapping[str, Any]], last: int = FINAL_ROUNDS) -> tuple[float, list[int]]:
    """(mean ``federated_accuracy`` of the last ``last`` evaluated rounds, those rounds).

    ``rows``: a run's ``metrics.jsonl`` (:func:`fedmm.results.read_metrics`); round 0 (the
    initial model, which no client evaluates) is not a training round. Every one of the last
    rounds must carry a finite figure: a round whose clients all failed to evaluate (a diverged
    model's NaN loss is rejected) makes the trial fail rather than be scored on fewer rounds.
    """
    if last < 1:
        raise ValueError(f"last={last}: at least one round")
    evaluated = [row for row in rows if int(row.get("round", 0)) >= 1]
    if not evaluated:
        raise NoValidation("the run evaluated no training round")
    window = evaluated[-last:]
    for row in window:
        value = row.get(VALIDATION_METRIC)
        if value is None or not math.isfinite(float(value)):
            raise NoValidation(f"round {row['round']} has no finite {VALIDATION_METRIC} ({value!r}): no client's "
                               f"evaluation on its held-out rows was accepted")
    return sum(float(row[VALIDATION_METRIC]) for row in window) / len(window), [int(row["round"]) for row in window]


def held_out_fingerprint(run: Any) -> str:
    """SHA-256 of every client's held-out row indices (partition id, then its sorted rows), as
    the clients draw them (:func:`fedmm.data.partition_indices`, :func:`fedmm.data.local_split`):
    two runs with the same fingerprint were validated on the same rows."""
    import numpy as np

    from fedmm.data import load_dataset, local_split, local_test_fraction, partition_indices

    train, _ = load_dataset(run.dataset)
    parts = partition_indices(train, run.partition, run.num_clients, run.seed)
    fraction = local_test_fraction(run.partition)
    digest = hashlib.sha256()
    for partition_id, rows in enumerate(parts):
        _, held_out = local_split(np.asarray(rows), fraction, run.seed, partition_id)
        digest.update(np.int64(partition_id).tobytes())
        digest.update(np.ascontiguousarray(held_out, dtype=np.int64).tobytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------ the checks
def check_validation(cfg: Any) -> None:
    """A job scored by validation needs clients that evaluate on held-out rows: both
    :data:`VALIDATION_KEYS` > 0 (a ConfigError naming the key otherwise)."""
    for key in VALIDATION_KEYS:
        value = OmegaConf.select(cfg, key, default=0.0) if isinstance(cfg, DictConfig) else _lookup(cfg, key)
        if not value or float(value) <= 0:
            raise ConfigError(key, value, f"a value > 0 under the Optuna sweeper: the search maximises the clients' "
                                          f"accuracy on held-out rows, which needs {' > 0 and '.join(VALIDATION_KEYS)} > 0 "
                                          f"(e.g. strategy.fraction_evaluate=1.0 partition.local_test_fraction=0.2)")


def check_search_space(overrides: Iterable[str]) -> None:
    """Refuse a search (hydra override strings, as ``hydra.sweeper.params`` and the command line
    give them) that tunes one of :data:`HELD_OUT_KEYS`: each trial would be validated on other
    rows, and the trials' figures would not compare. A fixed value of such a key is fine."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if override.is_sweep_override() and any(key == k or key.startswith(f"{k}.") for k in HELD_OUT_KEYS):
            raise ConfigError(key, (override.input_line or "").partition("=")[2],
                              "a fixed value in a validation search: it decides which rows the clients hold out (and "
                              "which clients evaluate), so each trial would be scored on other rows; tune it in an "
                              "outer loop (one search per value), e.g. `fedmm -m ... seed=1`")


def is_optuna_search(hydra_cfg: Any) -> bool:
    """Whether ``hydra_cfg`` (the ``hydra`` node) is a multirun driven by the Optuna sweeper."""
    target = str(OmegaConf.select(hydra_cfg, "sweeper._target_", default="") or "")
    mode = str(OmegaConf.select(hydra_cfg, "mode", default="") or "")
    return "optuna" in target.lower() and mode.endswith("MULTIRUN")


def search_overrides(hydra_cfg: Any) -> list[str]:
    """The overrides that define an Optuna search: ``hydra.sweeper.params`` and the command line's."""
    params = OmegaConf.select(hydra_cfg, "sweeper.params", default=None) or {}
    return [f"{key}={value}" for key, value in params.items()] + list(OmegaConf.select(hydra_cfg, "overrides.task", default=[]) or [])


class SearchCheck(Callback):
    """Hydra callback: refuse a bad Optuna search before anything trains (module docstring).

    ``hydra.callbacks.fedmm_search: {_target_: launch.objective.SearchCheck}``; it does nothing
    under any other sweeper. A refusal ends the search with the ConfigError's one line, as
    ``fedmm`` reports a config error.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Before the first job: no tuned key may change the held-out rows."""
        if is_optuna_search(config.hydra):
            _refuse_with(check_search_space, search_overrides(config.hydra))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Before a job trains: its run records a validation figure (the trial's own config,
        with the sweeper's fixed ``params``)."""
        if is_optuna_search(config.hydra):
            _refuse_with(check_validation, config)


def _refuse_with(check: Any, *args: Any) -> None:
    try:
        check(*args)
    except ConfigError as err:
        raise SystemExit(str(err)) from None


def _lookup(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, Mapping) else getattr(node, part, None)
        if node is None:
            return None
    return node


# ------------------------------------------------------------------------------ the job's value
def task_value(run: Any, run_dir: Path | str, search: bool | None = None) -> float | None:
    """What a ``fedmm`` job returns to hydra: the run's validation figure, also written to
    ``<run_dir>/validation.json`` (with its rounds and :func:`held_out_fingerprint`), or None.

    None, under the Optuna sweeper, is a failed trial and the search goes on (module
    docstring): a run whose last rounds have no finite validation figure. A job without the
    validation settings is a config error there (SystemExit naming the key; :class:`SearchCheck`
    catches it before training); outside an Optuna search it simply has no figure. ``search``:
    whether this job is a trial of an Optuna search (None: as hydra's config of the job says).
    """
    if search is None:
        from hydra.core.hydra_config import HydraConfig

        search = HydraConfig.initialized() and is_optuna_search(HydraConfig.get())
    if search:
        _refuse_with(check_validation, run)
    try:
        value, rounds = validation_accuracy(read_metrics(run_dir))
    except NoValidation as err:
        if search:
            print(f"fedmm: no validation figure in {run_dir}: {err}; Optuna records a failed trial", flush=True)
        return None
    record = {
        "validation_accuracy": value,
        "metric": VALIDATION_METRIC,
        "rule": f"mean over the last {FINAL_ROUNDS} evaluated rounds",
        "rounds": rounds,
        "held_out_rows_sha256": held_out_fingerprint(run),
    }
    from server_app.recording import write_atomic

    write_atomic(Path(run_dir, VALIDATION_FILE), json.dumps(record, indent=2) + "\n")
    print(f"fedmm: validation accuracy {value:.4f} (clients' held-out rows, rounds {rounds[0]}-{rounds[-1]})", flush=True)
    return value
