"""The figure a search maximises: a run's validation accuracy (``fedmm-search``, launch/search.py).

**Validation, never the test split.** The figure is federated evaluation: each client evaluates
the global model on its held-out rows (``partition.local_test_fraction`` of its data, split by
:func:`fedmm.data.local_split`, seeded by (``seed``, partition id); never trained on), and the
runner records the example-weighted ``federated_accuracy`` of every evaluated round in
``metrics.jsonl``. The test split (the ``accuracy`` column) plays no part in the choice. The
held-out rows are the same in every trial as long as the search does not tune ``seed``,
``num_clients``, the partition, the dataset or ``strategy.fraction_evaluate``: a search that does
is refused (:func:`check_search_space`). With ``strategy.fraction_evaluate=1.0`` every client
evaluates every round, so every trial is scored on the same rows; a smaller fraction scores each
round on a seeded sample of the clients (the same clients in every trial, but fewer rows: a
noisier figure).

**Final, not best.** The figure is the mean federated accuracy of the last :data:`FINAL_ROUNDS`
evaluated rounds (the last three rounds with the default ``eval_every=1``; fewer when the run has
fewer). The best round's accuracy would pick, for every trial, the maximum of a noisy curve: an
optimistic figure that favours settings whose curve swings most (FedCross with α far from 1),
and one that describes a model the run does not keep (``final_model.pt`` is the last round's). The
last round alone depends on which clients trained in that one round (under non-IID data the
global model leans towards them); the mean of the last three smooths that out and still measures
the end of training.

**A failed trial.** A run whose last rounds have no finite figure has none (:class:`NoValidation`):
the search records a failed trial and goes on.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fedmm.errors import ConfigError
from fedmm.results import read_metrics

#: The figure is the mean over this many last evaluated rounds (module docstring: why).
FINAL_ROUNDS = 3
#: The metrics.jsonl column of the clients' held-out rows (example-weighted over the clients).
VALIDATION_METRIC = "federated_accuracy"
#: What :func:`record_validation` writes into the run directory: the figure, its rounds, its rows.
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
            raise ConfigError(key, value, f"a value > 0 in a search: it maximises the clients' "
                                          f"accuracy on held-out rows, which needs {' > 0 and '.join(VALIDATION_KEYS)} > 0 "
                                          f"(e.g. strategy.fraction_evaluate=1.0 partition.local_test_fraction=0.2)")


def check_search_space(tuned: Mapping[str, Any]) -> None:
    """Refuse a search that tunes one of :data:`HELD_OUT_KEYS` (``tuned``: key -> its range):
    each trial would be validated on other rows, and the trials' figures would not compare. A
    fixed value of such a key is fine."""
    for key, space in tuned.items():
        if any(key == k or key.startswith(f"{k}.") for k in HELD_OUT_KEYS):
            raise ConfigError(key, space,
                              "a fixed value in a validation search: it decides which rows the clients hold out (and "
                              "which clients evaluate), so each trial would be scored on other rows; run one search "
                              "per value (e.g. fedmm-search ... seed=1)")


def _lookup(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, Mapping) else getattr(node, part, None)
        if node is None:
            return None
    return node


# ------------------------------------------------------------------------------ the record
def record_validation(run: Any, run_dir: Path | str) -> float:
    """The run's validation figure (:func:`validation_accuracy`), written to
    ``<run_dir>/validation.json`` with its rounds and :func:`held_out_fingerprint`; raises
    :class:`NoValidation` when the run has none."""
    value, rounds = validation_accuracy(read_metrics(run_dir))
    record = {
        "validation_accuracy": value,
        "metric": VALIDATION_METRIC,
        "rule": f"mean over the last {FINAL_ROUNDS} evaluated rounds",
        "rounds": rounds,
        "held_out_rows_sha256": held_out_fingerprint(run),
    }
    from server_app.recording import write_atomic

    write_atomic(Path(run_dir, VALIDATION_FILE), json.dumps(record, indent=2) + "\n")
    return value
