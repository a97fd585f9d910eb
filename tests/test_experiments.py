"""The papers' presets (conf/experiment/): each composes and validates, and so does every point of
its sweep grid, expanded as hydra's basic sweeper expands it for ``fedmm -m +experiment=<name>``;
the table presets' grids are exactly their paper tables' cells, at the paper's scale; and a real
first round (the strategy and the ClientApp, in process) runs for every (dataset, model) and every
method variant of any grid, on tiny data shaped like the preset's dataset. No network, no Ray.

Composing each of the ~700 grid points with hydra would take minutes, so a point is assembled
from compositions hydra makes once per preset and once per swept option: the option's nodes, then
the preset's own values, then the point's value overrides (existing keys only, as hydra's struct
mode). A few points are checked against hydra's own composition.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, MessageType, RecordDict
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from client_app import client_app
from fedmm import protocol
from fedmm.config import CONF_DIR, GROUPS, compose, validate
from fedmm.data import input_spec, load_partition
from fedmm.models import model_for
from analysis.paper_numbers import PAPER_TABLES, Setting
from analysis.report import method_label, paper_maps, paper_setting
from strategies import build_strategy
from tests.fakes import FakeGrid
from tests.test_text import sent140_users, shakespeare_users, write_leaf

EXPERIMENTS = CONF_DIR / "experiment"
PRESETS = sorted(p.stem for p in EXPERIMENTS.glob("*.yaml"))
#: The config nodes a group option decides: a strategy preset may pick its objective and selection.
NODES_OF = {"strategy": ("strategy", "objective", "selection")}


# ------------------------------------------------------------------------------ the sweep grid
@functools.cache
def preset_file(name: str) -> DictConfig:
    return OmegaConf.load(EXPERIMENTS / f"{name}.yaml")


@functools.cache
def sweep_points(name: str) -> tuple[tuple[str, ...], ...]:
    """The jobs of ``fedmm -m +experiment=<name>``: the overrides of each, from the file's
    ``hydra.sweeper.params``, in the order hydra's basic sweeper runs them."""
    params = OmegaConf.select(preset_file(name), "hydra.sweeper.params") or {}
    overrides = OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in params.items()])
    (jobs,) = BasicSweeper.split_arguments(overrides, None)
    return tuple(tuple(job) for job in jobs)


@functools.cache
def preset_config(name: str) -> dict[str, Any]:
    """``compose(["+experiment=<name>"])``, unresolved (validated by the first test)."""
    return OmegaConf.to_container(compose([f"+experiment={name}"], validate_config=False), resolve=False)


@functools.cache
def preset_body(name: str) -> dict[str, Any]:
    """The preset's own values: what it merges after the config groups it chose."""
    body = OmegaConf.to_container(preset_file(name), resolve=False)
    return {key: value for key, value in body.items() if key not in ("defaults", "hydra")}


def group_override(item: str) -> tuple[str, str] | None:
    key, _, option = item.partition("=")
    return (key, option) if key in GROUPS else None


@functools.cache
def option_nodes() -> dict[tuple[str, str], dict[str, Any]]:
    """(group, option) -> the config of ``<group>=<option>``, for every option any grid sweeps.
    Options of different groups share a composition (their nodes do not depend on each other)."""
    wanted: dict[str, list[str]] = {}
    for name in PRESETS:
        for point in sweep_points(name):
            for group, option in filter(None, map(group_override, point)):
                if option not in wanted.setdefault(group, []):
                    wanted[group].append(option)
    nodes = {}
    for i in range(max((len(options) for options in wanted.values()), default=0)):
        pack = [(group, options[i]) for group, options in wanted.items() if i < len(options)]
        cfg = OmegaConf.to_container(compose([f"{g}={o}" for g, o in pack], validate_config=False), resolve=False)
        nodes.update({item: cfg for item in pack})
    return nodes


@functools.cache
def parsed(item: str) -> tuple[str, Any]:
    """``key=value`` as hydra reads it from the command line (``null``, numbers, strings)."""
    (override,) = OverridesParser.create().parse_overrides([item])
    return override.key_or_group, override.value()


def merge(into: dict[str, Any], values: dict[str, Any]) -> None:
    """OmegaConf's merge of plain values: mappings key by key, anything else replaced."""
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def point_config(name: str, point: tuple[str, ...]) -> dict[str, Any]:
    """The config of one job of the preset's sweep, unresolved: the preset's composition with the
    point's config-group choices, then the preset's own values, then the point's value overrides
    (each must name an existing key, as hydra's composed config is in struct mode)."""
    cfg = copy.deepcopy(preset_config(name))
    values = []
    for item in point:
        chosen = group_override(item)
        if chosen is None:
            values.append(parsed(item))
            continue
        for node in NODES_OF.get(chosen[0], chosen[:1]):
            cfg[node] = copy.deepcopy(option_nodes()[chosen][node])
    merge(cfg, preset_body(name))
    for key, value in values:
        *path, leaf = key.split(".")
        node = cfg
        for part in path:
            node = node[part]
        if leaf not in node:
            raise KeyError(f"{key}: no such key to override")
        node[leaf] = value
    return cfg


@functools.cache
def preset_points(name: str) -> tuple[tuple[tuple[str, ...], dict[str, Any]], ...]:
    """(point, validated config) of every point of the preset's grid; a failing point names its job."""
    out = []
    for point in sweep_points(name):
        try:
            out.append((point, validate(point_config(name, point)).to_dict()))
        except Exception as err:
            raise AssertionError(f"fedmm -m +experiment={name}: the job {' '.join(point)} fails: {err}") from err
    return tuple(out)


def point_configs() -> list[tuple[str, tuple[str, ...], dict[str, Any]]]:
    """(preset, point, validated config) of every point of every grid."""
    return [(name, point, cfg) for name in PRESETS for point, cfg in preset_points(name)]


@pytest.mark.parametrize("name", PRESETS)
def test_preset_and_every_point_of_its_sweep_validate(name: str) -> None:
    validate(compose([f"+experiment={name}"]))
    # what the assembly of a point relies on: the preset leaves the strategy's objective and
    # selection to it, and sweeps only keys of the config (no +key, no group@package)
    defaults = [str(d) for d in preset_file(name).get("defaults", [])]
    assert not any(g in d for d in defaults for g in ("objective", "selection")), defaults
    assert not {"objective", "selection"} & set(preset_body(name))
    points = sweep_points(name)
    assert points and all(not item.startswith(("+", "~")) and "@" not in item.split("=")[0] for p in points for item in p)
    assert len(set(points)) == len(points)
    assert len(preset_points(name)) == len(points)


# A group choice with an objective and a projection head (MOON), with a selection (CluSamp) and a
# natural partition, the preset's own dataset values (fine CIFAR-100), and value overrides only.
SPOT_CHECKS = [
    ("arxiv_table1_dirichlet", {"strategy=moon", "model=resnet20-preact", "dataset=cifar100", "partition.alpha=0.5"}),
    ("kdd_table1_femnist", {"strategy=clusamp_fedmr_repo", "model=resnet20-preact"}),
    ("fedrl_table1_cifar100", {"strategy=scaffold"}),
    ("fedcross_fig8_alpha", {"strategy.selection=in-order", "strategy.alpha=0.999"}),
]


@pytest.mark.parametrize(("name", "items"), SPOT_CHECKS, ids=[name for name, _ in SPOT_CHECKS])
def test_an_assembled_point_is_hydras_own_composition(name: str, items: set[str]) -> None:
    (point,) = [p for p in sweep_points(name) if set(p) == items]
    ours = OmegaConf.to_container(OmegaConf.create(point_config(name, point)), resolve=True)
    hydras = OmegaConf.to_container(compose([f"+experiment={name}", *point], validate_config=False), resolve=True)
    assert ours == hydras


# ------------------------------------------------------------------ the papers' tables, cell by cell
def table_cells(prefixes: tuple[str, ...], maps: dict[str, dict[str, str]]) -> dict[tuple[Setting, str], str]:
    """(setting, method) as the report names them -> the job that fills the cell."""
    cells: dict[tuple[Setting, str], str] = {}
    for name, point, cfg in point_configs():
        if name.startswith(prefixes):
            cell = (paper_setting(cfg, maps), maps["method"].get(method_label(cfg), method_label(cfg)))
            job = f"{name}: {' '.join(point)}"
            assert cell not in cells, f"{job} and {cells.get(cell)} fill one cell {cell}"
            cells[cell] = job
    return cells


def fedrl_setting(setting: Setting) -> Setting:
    return setting._replace(model=None)  # a FedRL column takes any model (one per dataset)


#: The rows of the FedMR and FedCross tables the app cannot run: FEMNIST is 28×28, vgg16 needs
#: 32×32 and the app does not resize.
NO_VGG16_FEMNIST = {Setting("VGG-16", "FEMNIST", "natural")}


@pytest.mark.parametrize("table", ["kdd_table1", "arxiv_table1"])
def test_fedmr_table_presets_are_their_tables_cells_at_the_papers_scale(table: str) -> None:
    paper = PAPER_TABLES[table]
    cells = table_cells((f"{table}_",), paper_maps())
    expected = {(s, m) for s in paper.values if s not in NO_VGG16_FEMNIST for m in paper.methods}
    assert set(cells) == expected
    for name, _, cfg in point_configs():
        if name.startswith(f"{table}_"):
            femnist, vgg = cfg["dataset"]["name"] == "femnist", cfg["model"]["name"] == "vgg16"
            assert (cfg["num_clients"], cfg["clients_per_round"]) == ((180, 18) if femnist else (100, 10))
            assert cfg["num_rounds"] == (1000 if vgg else 2000)
            t = cfg["training"]
            assert (t["lr"], t["batch_size"], t["local_epochs"], t["lr_decay_rounds"]) == (0.01, 50, 5, [])
            assert cfg["partition"].get("min_samples", 100) == 100 and cfg["dataset"].get("label_type") in (None, "coarse")
            if cfg["strategy"]["name"] == "fedmr" and cfg["strategy"]["partition_ratio"] is None:  # FedMR-100 for the deep models
                first = cfg["strategy"]["first_stage_by_model"].get(cfg["model"]["name"], cfg["strategy"]["first_stage_rounds"])
                assert first == (0 if cfg["model"]["name"] in ("lenet", "cnn") else 100)
            if cfg["partition"]["name"] == "dirichlet":
                assert cfg["partition"]["algorithm"] == "authors"


def test_fedcross_table2_presets_are_its_rows_and_columns() -> None:
    maps = paper_maps(["model.char_lstm=LSTM", "model.sent_lstm=LSTM", "dataset.shakespeare=Shakespeare",
                       "dataset.sent140=Sent140", "method.FedCross (chunked similarity)=FedCross"])
    cells = table_cells(("fedcross_table2_", "fedcross_shakespeare", "fedcross_sent140"), maps)
    rows = {s for s in PAPER_TABLES["kdd_table1"].values if s not in NO_VGG16_FEMNIST}  # FedMR's rows, as printed
    rows |= {Setting("LSTM", "Shakespeare", "natural"), Setting("LSTM", "Sent140", "natural")}
    methods = ("FedAvg", "FedProx", "SCAFFOLD", "FedGen", "CluSamp", "FedCross")
    assert set(cells) == {(s, m) for s in rows for m in methods}
    for name, _, cfg in point_configs():
        if name.startswith("fedcross_table2_"):
            assert cfg["num_rounds"] == (1000 if cfg["model"]["name"] == "vgg16" else 2000)
            assert cfg["training"]["momentum"] == 0.5 and cfg["training"]["local_epochs"] == 5
            if cfg["strategy"]["name"] == "fedcross":  # the authors' code: α, selection, chunked similarity
                assert (cfg["strategy"]["alpha"], cfg["strategy"]["selection"], cfg["strategy"]["similarity"]) == (
                    0.99, "lowest-similarity", "chunked")
            if cfg["partition"]["name"] == "dirichlet":  # the authors' split
                assert (cfg["partition"]["algorithm"], cfg["partition"]["min_partition_size"]) == ("authors", 10)


def test_fedrl_presets_are_its_tables_columns_at_the_papers_scale() -> None:
    maps = paper_maps()
    cells = {(fedrl_setting(s), m): job for (s, m), job in table_cells(("fedrl_table1_",), maps).items()}
    for table in ("fedrl_table1", "fedrl_table2", "fedrl_table3"):
        paper = PAPER_TABLES[table]
        assert {(s, m) for s in paper.values for m in paper.methods} <= set(cells), table
    assert set(cells) == {(s, m) for s in PAPER_TABLES["fedrl_table1"].values for m in PAPER_TABLES["fedrl_table1"].methods}
    for name, _, cfg in point_configs():
        if name.startswith("fedrl_table1_"):
            assert (cfg["num_clients"], cfg["clients_per_round"], cfg["num_rounds"]) == (10, 10, 120)
            assert cfg["partition"] == {**cfg["partition"], "name": "dirichlet", "alpha": 0.5}
            t = cfg["training"]
            assert (t["lr"], t["momentum"], t["weight_decay"], t["batch_size"], t["local_epochs"], t["lr_decay_rounds"]) == \
                (0.01, 0.0001, 0.00001, 32, 3, [40, 80])


#: The ablations: the key each figure or table varies and its values (chosen where the paper lost
#: or never printed them; see each preset's header).
ABLATIONS = {
    "arxiv_fig9_clients_per_round": ("clients_per_round", {5, 10, 20, 50, 100}),
    "fedcross_fig6_clients_per_round": ("clients_per_round", {5, 10, 20, 50, 100}),
    "kdd_fig11_partition_ratio": ("strategy.partition_ratio", {None, 0.2, 0.5, 1.0}),
    "kdd_fig12_first_stage": ("strategy.first_stage_rounds", {0, 20, 50, 100, 200}),
    "fedcross_fig8_alpha": ("strategy.alpha", {0.5, 0.8, 0.9, 0.95, 0.99, 0.999}),
    "fedcross_table3_selection": ("strategy.selection", {"in-order", "highest-similarity", "lowest-similarity"}),
}


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_ablation_presets_vary_their_key_over_every_other_setting(name: str) -> None:
    key, values = ABLATIONS[name]
    group, _, leaf = key.rpartition(".")
    rows: dict[str, set] = {}
    for _, _, cfg in (job for job in point_configs() if job[0] == name):
        node = cfg[group] if group else cfg
        rest = {k: v for k, v in node.items() if k != leaf}
        rows.setdefault(repr({**cfg, group: rest} if group else rest), set()).add(node[leaf])
    assert all(seen == values for seen in rows.values()), rows  # the full product: every value in every setting
    labels = {method_label(cfg) for n, _, cfg in point_configs() if n == name}
    if name == "kdd_fig11_partition_ratio":
        assert labels == {"FedMR", "Indep"}  # x = 1.0 shuffles whole models: the paper's extreme case
    if key == "clients_per_round":
        assert all(cfg["num_clients"] == 100 for n, _, cfg in point_configs() if n == name) and len(labels) > 1


# ------------------------------------------------------------------------- the first round runs
@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each dataset of the presets, a few dozen images (or LEAF users) of its shape and labels,
    where ``dataset.path`` can point: the hub's columns in a ``save_to_disk`` folder."""
    import datasets

    root = tmp_path_factory.mktemp("presets-data")
    rng = np.random.default_rng(0)

    def images(n: int, shape: tuple[int, ...]) -> np.ndarray:
        return rng.integers(0, 256, (n, *shape), dtype=np.uint8)

    def save(name: str, splits: dict[str, dict[str, Any]]) -> Path:
        folder = root / name
        datasets.DatasetDict({s: datasets.Dataset.from_dict(cols) for s, cols in splits.items()}).save_to_disk(str(folder))
        return folder

    def cifar(n: int) -> dict[str, Any]:
        return {"img": images(n, (32, 32, 3)), "label": rng.integers(0, 10, n), "fine_label": rng.integers(0, 100, n),
                "coarse_label": rng.integers(0, 20, n)}

    def gray(n: int) -> dict[str, Any]:
        return {"image": images(n, (28, 28)), "label": rng.integers(0, 10, n)}

    return {
        "cifar10": save("cifar10", {"train": cifar(12), "test": cifar(4)}),
        "cifar100": save("cifar100", {"train": cifar(12), "test": cifar(4)}),
        "mnist": save("mnist", {"train": gray(12), "test": gray(4)}),
        "fashion_mnist": save("fashion_mnist", {"train": gray(12), "test": gray(4)}),
        # one split: the test rows are held out; three writers for the natural partition
        "femnist": save("femnist", {"train": {"image": images(18, (28, 28)), "character": rng.integers(0, 62, 18),
                                              "writer_id": np.repeat(["w0", "w1", "w2"], 6)}}),
        "shakespeare": write_leaf(root / "shakespeare", shakespeare_users(3, 4)),
        "sent140": write_leaf(root / "sent140", sent140_users(3, 4)),
    }


@pytest.fixture
def keep_torch_threads():
    threads = torch.get_num_threads()  # a simulated ClientApp sets its reserved cores
    yield
    torch.set_num_threads(threads)


def run_first_round(cfg: dict[str, Any], data: dict[str, Path], num_clients: int, per_round: int) -> None:
    """Round 1 of ``cfg`` on tiny data: the real strategy on an in-process grid whose nodes run the
    real ClientApp (their partitions, their state); every sampled client must reply and the
    trained model must be finite and differ from the initial one."""
    cfg = copy.deepcopy(cfg)
    if cfg["dataset"]["name"] in data:  # the embedded data (mnist5k) needs no folder
        cfg["dataset"]["path"] = str(data[cfg["dataset"]["name"]])
    cfg.update(num_clients=num_clients, clients_per_round=per_round, num_rounds=1)
    cfg["simulation"]["num_supernodes"] = num_clients
    cfg["training"]["local_epochs"] = 1
    cfg["partition"].update({"dirichlet": {"min_partition_size": 1}, "natural": {"min_samples": 0}}.get(cfg["partition"]["name"], {}))
    cfg = validate(cfg)
    contexts: dict[str, Context] = {}
    errors: list[str] = []

    def node(msg, key):  # noqa: ANN001 - FakeGrid's node function
        pid = int(key.split(":")[1])
        context = contexts.setdefault(key, Context(run_id=1, node_id=pid, node_config={"partition-id": pid, "num-partitions": num_clients},
                                                   state=RecordDict(), run_config={}))
        try:
            return client_app.train(msg, context).content
        except Exception as err:  # the grid would turn it into an error reply: keep the reason
            errors.append(f"{key}: {type(err).__name__}: {err}")
            raise

    sizes = {f"partition:{i:09d}": len(load_partition(cfg["dataset"], cfg["partition"], i, num_clients, cfg["seed"])) for i in range(num_clients)}
    torch.manual_seed(cfg["seed"])
    initial = {k: v.detach().numpy().copy() for k, v in model_for(cfg, input_spec(cfg["dataset"])).state_dict().items()}
    strategy = build_strategy(cfg)
    config = ConfigRecord({protocol.RUN_CONFIG: protocol.run_config_record(cfg)})
    grid = FakeGrid(node, num_clients, seed=0, examples=sizes)
    result = strategy.start(grid=grid, initial_arrays=protocol.model_to_record(initial), num_rounds=1, train_config=config,
                            evaluate_config=config)
    assert not errors
    sent_train = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]  # (a tuning preset evaluates too)
    assert strategy.context.last_round.replies == len(sent_train) > 0  # every client sent a model (CluSamp: once even if drawn twice)
    trained = strategy.models_to_evaluate() or [protocol.record_to_model(result.arrays)]
    for model in trained:
        assert set(model) == set(initial) and all(np.isfinite(v).all() for v in model.values())
        assert any(not np.array_equal(model[k], initial[k]) for k in initial)


def cell(cfg: dict[str, Any]) -> tuple[str, str | None, str]:
    return cfg["dataset"]["name"], cfg["dataset"].get("label_type"), cfg["model"]["name"]


def shape(value: Any) -> Any:
    """What decides a round's code path: which options are on, not their magnitudes."""
    if isinstance(value, dict):
        return tuple(sorted((k, shape(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(shape(v) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value != 0
    return value


def method_variant(cfg: dict[str, Any]) -> Any:
    return tuple(shape(cfg[node]) for node in NODES_OF["strategy"])


#: Cheapest first: the model a method variant runs its round on.
MODEL_COST = {"lenet": 0, "cnn": 1, "char_lstm": 2, "sent_lstm": 2, "resnet20-preact": 3, "resnet20": 3, "vgg16": 9}


def test_first_round_of_every_dataset_and_model_of_any_grid(tiny_data: dict[str, Path], keep_torch_threads: None) -> None:
    """Each (dataset, labels, model) of any preset's grid, with the method of the first preset that
    has it (its own method when its grid has it), one client per round."""
    first: dict[tuple, tuple[str, tuple[str, ...], dict]] = {}
    for name in PRESETS:
        own = method_label(preset_config(name))
        jobs = [(point, cfg) for n, point, cfg in point_configs() if n == name]
        for point, cfg in sorted(jobs, key=lambda job: method_label(job[1]) != own):  # its own method first
            first.setdefault(cell(cfg), (name, point, cfg))
    assert {c[2] for c in first} >= {"lenet", "cnn", "resnet20-preact", "resnet20", "vgg16", "char_lstm", "sent_lstm"}
    for name, point, cfg in first.values():
        try:
            run_first_round(cfg, tiny_data, num_clients=2, per_round=1)
        except Exception as err:
            raise AssertionError(f"fedmm -m +experiment={name}: round 1 of {' '.join(point)} fails: {err}") from err


def test_first_round_of_every_method_variant_of_any_grid(tiny_data: dict[str, Path], keep_torch_threads: None) -> None:
    """Each method of any grid (strategy, objective and selection, up to magnitudes), on its
    cheapest (dataset, model) of the grids, two clients of three per round."""
    cheapest: dict[Any, tuple[str, tuple[str, ...], dict]] = {}
    for name, point, cfg in point_configs():
        variant = method_variant(cfg)
        if variant not in cheapest or MODEL_COST[cfg["model"]["name"]] < MODEL_COST[cheapest[variant][2]["model"]["name"]]:
            cheapest[variant] = (name, point, cfg)
    labels = {method_label(cfg) for _, _, cfg in cheapest.values()}
    assert {"FedAvg", "FedMR", "FedCross (chunked similarity)", "FedMR (first stage 20)", "SOLO", "FedRL", "MOON"} <= labels
    for name, point, cfg in cheapest.values():
        try:
            run_first_round(cfg, tiny_data, num_clients=3, per_round=2)
        except Exception as err:
            raise AssertionError(f"fedmm -m +experiment={name}: round 1 of {' '.join(point)} fails: {err}") from err
