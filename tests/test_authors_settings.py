"""The authors' settings in the presets and the features behind them: the authors' Dirichlet split,
partition files, a first stage by model, per-objective client training, Indep's per-model curves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedmm.config import compose
from fedmm.data.partition import authors_dirichlet
from fedmm.data.partition_file import read_partition_file, write_partition_file
from fedmm.errors import ConfigError


def test_authors_dirichlet_caps_a_full_client_as_computed_by_hand() -> None:
    # 12 rows, 3 clients: a client holding 12/3 = 4 rows or more gets nothing of later classes.
    labels = np.array([0] * 6 + [1] * 6)
    given = {0: [0.5, 0.5, 0.0], 1: [0.7, 0.1, 0.2]}
    parts = authors_dirichlet(labels, 3, 1.0, 0, seed=0, draw=lambda rng, k, sizes: np.array(given[int(k)]))
    # class 0: cuts at int([0.5, 1.0] * 6) = [3, 6] -> 3, 3, 0 rows.
    # class 1: sizes (3, 3, 0) are all below 4, no cap: cuts int([0.7, 0.8] * 6) = [4, 4] -> 4, 0, 2.
    assert [len(p) for p in parts] == [7, 3, 2]
    # a third class of 6 rows with p = (0.6, 0.2, 0.2): client 0 (7 >= 4) is capped, the rest
    # renormalised to (0.5, 0.5): cuts int([0, 0.5] * 6) = [0, 3] -> 0, 3, 3.
    labels3 = np.array([0] * 6 + [1] * 6 + [2] * 6)
    given[2] = [0.6, 0.2, 0.2]
    parts = authors_dirichlet(labels3, 3, 1.0, 0, seed=0, draw=lambda rng, k, sizes: np.array(given[int(k)]))
    assert [len(p) for p in parts] == [7, 6, 5]
    assert sorted(np.concatenate(parts).tolist()) == list(range(18))  # every row exactly once


def test_authors_dirichlet_redraws_until_every_client_has_min_size() -> None:
    labels = np.repeat(np.arange(10), 100)
    parts = authors_dirichlet(labels, 20, 0.1, 10, seed=1)
    assert min(len(p) for p in parts) >= 10 and sum(len(p) for p in parts) == 1000
    again = authors_dirichlet(labels, 20, 0.1, 10, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))  # seeded
    with pytest.raises(ConfigError, match="min_partition_size"):
        authors_dirichlet(labels, 20, 0.1, 60, seed=1, max_attempts=5)


def test_partition_file_round_trip_and_a_run_reads_it(tmp_path: Path) -> None:
    from fedmm.data import load_dataset, load_partition, partition_indices

    run = compose(["num_clients=5", "clients_per_round=2"])
    train, _ = load_dataset(run.dataset)
    parts = partition_indices(train, run.partition, 5, run.seed)
    path = write_partition_file(tmp_path / "p.json", parts, dataset="mnist5k")
    assert json.loads(path.read_text())["train_data"]["0"] == [int(i) for i in parts[0]]
    read = read_partition_file(path, len(train), 5)
    assert all(np.array_equal(a, b) for a, b in zip(parts, read))
    filed = compose(["num_clients=5", "clients_per_round=2", "partition=file", f"partition.path={path}"])
    got = load_partition(filed.dataset, filed.partition, 3, 5, filed.seed)
    assert np.array_equal(got.y.numpy(), train.y.numpy()[parts[3]])
    # the FedMut repository's files: train_data plus descriptive keys, unsorted lists
    fedmut = tmp_path / "fedmut.json"
    fedmut.write_text(json.dumps({"dataset": "x", "num_users": 2, "iid": 0, "train_data": {"1": [3, 0], "0": [2, 1]}}))
    assert [r.tolist() for r in read_partition_file(fedmut, 4, 2)] == [[1, 2], [0, 3]]


@pytest.mark.parametrize("body, wrong", [
    ({"train_data": {"0": [0], "2": [1]}}, "without gaps"),
    ({"train_data": {"0": [0], "1": [9]}}, "0..3"),
    ({"train_data": {"0": [0, 0], "1": [1]}}, "repeated"),
    ({"train_data": {"0": [0], "1": [1], "2": [2]}}, "num_clients"),
    ({"train_data": {"0": ["a"], "1": [1]}}, "integer row indices"),
])
def test_partition_file_errors_name_the_problem(tmp_path: Path, body: dict, wrong: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(body))
    with pytest.raises(ConfigError, match=wrong):
        read_partition_file(path, 4, 2)


def test_fedmr_paper_sets_the_first_stage_by_model() -> None:
    from strategies import build_strategy

    assert build_strategy(compose(["strategy=fedmr_paper", "model=resnet20-preact", "dataset=cifar10"])).settings.first_stage_rounds == 100
    assert build_strategy(compose(["strategy=fedmr_paper", "model=cnn"])).settings.first_stage_rounds == 0
    assert build_strategy(compose(["strategy=fedmr", "model=resnet20-preact", "dataset=cifar10"])).settings.first_stage_rounds == 0


def test_an_objective_carries_its_original_clients_training() -> None:
    from objectives.base import build_local_update

    run = compose(["strategy=scaffold_lab"])
    local = build_local_update(run).local_training(run.training)
    assert (local.lr_round_decay, local.weight_decay, local.drop_last) == (0.998, 1e-4, True)
    assert local.local_epochs == run.training.local_epochs  # the rest is the training group's
    fedexp = compose(["strategy=fedexp"])  # the original FedExP: its client too
    local = build_local_update(fedexp).local_training(fedexp.training)
    assert (local.local_steps, local.momentum, local.clip_grad_norm, local.weight_decay) == (20, 0.0, 10.0, 1e-4)
    port = compose(["strategy=fedexp_fedmr_repo"])  # the FedMR repository's port: the common client
    assert build_local_update(port).local_training(port.training) == port.training
    with pytest.raises(ConfigError, match="objective.training.local_step"):
        compose(["strategy=fedexp", "+objective.training.local_step=3"])


def test_indep_tracks_each_models_accuracy() -> None:
    from strategies import build_strategy

    strategy = build_strategy(compose(["strategy=indep", "clients_per_round=3"]))
    assert strategy.models_to_evaluate() is None  # before the models exist
    strategy.models = [{"w": np.zeros(1)}, {"w": np.ones(1)}, {"w": np.ones(1)}]
    assert len(strategy.models_to_evaluate()) == 3
    assert build_strategy(compose(["strategy=fedmr"])).settings.track_models is False
