"""Config composition, run-config overrides and the clear errors for wrong values."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedmm.config import compose, compose_from_run_config, group_options, overrides_from_run_config, to_container
from fedmm.errors import ConfigError


def test_defaults_compose_and_validate() -> None:
    cfg = compose()
    assert cfg.strategy.name == "fedavg"
    assert cfg.dataset.name == "mnist5k"
    assert cfg.partition.name == "dirichlet"
    assert cfg.model.name == "cnn"
    for key in ("num_rounds", "seed", "eval_every"):
        assert key in cfg


def test_run_config_becomes_hydra_overrides() -> None:
    run_config = {"strategy": "fedmr", "num_rounds": 7, "seed": "", "overrides": "partition.alpha=0.1 training.lr=0.05"}
    assert overrides_from_run_config(run_config) == ["strategy=fedmr", "num_rounds=7", "partition.alpha=0.1", "training.lr=0.05"]
    cfg = compose_from_run_config(run_config)
    assert cfg["strategy"]["name"] == "fedmr" and cfg["num_rounds"] == 7
    assert cfg["partition"]["alpha"] == 0.1 and cfg["training"]["lr"] == 0.05
    assert cfg["seed"] == 0  # empty value keeps the default
    # the selection group is a run-config key of its own
    cfg = compose_from_run_config({"strategy": "fedexp", "selection": "clustered_fedmr_repo"})
    assert cfg["strategy"]["name"] == "fedexp" and cfg["selection"]["mode"] == "fedmr_port"


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (["dataset=imagenet"], "dataset", "cifar10"),
        (["model=resnet"], "model", "resnet20"),
        (["strategy=fedfoo"], "strategy", "fedmr"),
        (["partition=skewed"], "partition", "dirichlet"),
        (["partition.alpha=0"], "partition.alpha", "> 0"),
        (["partition.alpha=-1"], "partition.alpha", "> 0"),
        (["clients_per_round=30"], "clients_per_round", "num_clients=20"),
        (["num_rounds=0"], "num_rounds", ">= 1"),
        (["eval_every=0"], "eval_every", ">= 1"),
        (["training.lr=-0.1"], "training.lr", "> 0"),
        (["training.batch_size=0"], "training.batch_size", ">= 1"),
        (["dataset.path=/nonexistent/fedmm-data"], "dataset.path", "existing local dataset folder"),
        (["strategy=fedmr", "strategy.granularity=block"], "strategy.granularity", "tensor, layer"),
        (["strategy=fedmr", "strategy.partition_ratio=1.5"], "strategy.partition_ratio", "(0, 1]"),
        (["simulation.client_cpus=0"], "simulation.client_cpus", "> 0"),
        (["strategy=fedcross", "strategy.alpha=1.5"], "strategy.alpha", "[0, 1]"),
        (["strategy=fedcross", "strategy.selection=random"], "strategy.selection", "lowest-similarity"),
        (["strategy=fedcross", "strategy.similarity=l2"], "strategy.similarity", "chunked"),
        (["strategy=fedcross", "strategy.num_propellers=0"], "strategy.num_propellers", ">= 1"),
        (["+nonexistent_key=1"], "nonexistent_key", "top-level keys"),
        (["num_rounds=abc"], "num_rounds", ">= 1"),
        (["training.nonexistent=1"], "overrides", "valid hydra overrides"),
        (["+training.lrr=0.1"], "training.lrr", "did you mean training.lr?"),
        (["+strategy.alpah=0.5", "strategy=fedcross"], "strategy.alpah", "did you mean strategy.alpha?"),
        (["+objective.muu=0.1", "objective=fedprox"], "objective.muu", "did you mean objective.mu?"),
        (["+partition.alfa=0.1"], "partition.alfa", "did you mean partition.alpha?"),
        (["+dataset.num_class=3"], "dataset.num_class", "did you mean dataset.num_classes?"),
        (["objective=fedrl", "objective.advance=epoch"], "objective.advance", "batch, round"),
        (["objective=fedprox", "objective.mu=-1"], "objective.mu", ">= 0"),
        (["checkpoint_every=-1"], "checkpoint_every", ">= 0"),
        (["strategy.fraction_evaluate=0.5"], "partition.local_test_fraction", "never on what they train on"),
        (["partition.local_test_fraction=1.0"], "partition.local_test_fraction", "[0, 1)"),
        (["max_failed_rounds=-1"], "max_failed_rounds", ">= 0"),
    ],
)
def test_wrong_values_name_the_key_and_the_allowed_values(overrides, key, allowed) -> None:
    with pytest.raises(ConfigError) as info:
        compose(overrides)
    assert info.value.key == key
    assert key in str(info.value)
    assert allowed in str(info.value)


def test_malformed_overrides_are_one_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        compose_from_run_config({"overrides": "partition.alpha=0.1 training.lr='0.05"})
    assert info.value.key == "overrides" and "quotes balanced" in str(info.value)


def test_an_unknown_option_names_the_nearest_one_or_else_lists_them_all() -> None:
    with pytest.raises(ConfigError) as info:
        compose(["model=resnet"])
    assert str(info.value).endswith("did you mean resnet20?") and "`fedmm --help` lists" in str(info.value)
    assert "char_lstm" not in str(info.value)  # one short line, not the list
    with pytest.raises(ConfigError) as info:
        compose(["model=transformer"])  # none near: every option, on one line
    for option in group_options("model"):
        assert option in str(info.value)


#: (the command line, the key named, the nearest one): an unknown option, a misspelt key with and
#: without ``+``, a key of a group that has no near one (the nearest in any group), a sweep.
MISSPELT = [
    (["strategy=fedcros"], "strategy", "did you mean fedcross?"),
    (["-m", "strategy=fedavg,fedcros"], "strategy", "did you mean fedcross?"),
    (["training.lrr=0.1"], "training.lrr", "did you mean training.lr?"),
    (["+training.lrr=0.1"], "training.lrr", "did you mean training.lr?"),
    (["strategy=fedcross", "strategy.lrr=0.1"], "strategy.lrr", "did you mean training.lr?"),
    (["strategy=fedcross", "+strategy.lrr=0.1"], "strategy.lrr", "did you mean training.lr?"),
    (["strategy=fedcross", "strategy.alpah=0.5"], "strategy.alpah", "did you mean strategy.alpha?"),
    (["num_round=2"], "num_round", "did you mean num_rounds?"),
    (["+experiment=kdd_table1_dirichle"], "experiment", "did you mean kdd_table1_dirichlet?"),
]


@pytest.mark.parametrize(("argv", "key", "nearest"), MISSPELT, ids=[" ".join(argv) for argv, _, _ in MISSPELT])
def test_a_misspelt_option_or_key_names_the_nearest_on_every_form(argv: list[str], key: str, nearest: str) -> None:
    """What ``fedmm`` checks before hydra composes (launch/cli.py, check_names): hydra would print
    its whole list of options, or "not in struct, use +key" for a key without ``+``."""
    from launch.cli import command_line

    with pytest.raises(ConfigError) as info:
        command_line(argv)
    assert info.value.key == key and str(info.value).endswith(nearest), info.value
    assert "`fedmm --help` lists" in str(info.value) or "`fedmm --cfg job` prints" in str(info.value)
    if not argv[-1].startswith(("+", "-")) and "-m" not in argv:  # fedmm-search and flwr run compose the same way
        with pytest.raises(ConfigError) as composed:
            compose(argv)
        assert str(composed.value) == str(info.value)


def test_fedmm_prints_one_line_for_an_unknown_option_and_makes_no_folder(tmp_path) -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0")
    for args, nearest in ((["strategy=fedcros"], "did you mean fedcross?"), (["strategy.lrr=0.1"], "did you mean training.lr?")):
        proc = subprocess.run([str(Path(sys.executable).parent / "fedmm"), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.strip().endswith(nearest), proc.stderr
        assert "Available options" not in proc.stderr and "+strategy" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no outputs/ folder for a command that never ran


def test_validation_is_one_pass_over_registered_schemas() -> None:
    from fedmm.config import registered_names

    assert {"fedavg", "fedmr", "fedcross"} <= set(registered_names("strategy"))
    assert {"ce", "fedprox", "fedrl"} <= set(registered_names("objective"))
    assert set(registered_names("model")) >= {"cnn", "lenet", "resnet20", "resnet20-preact", "vgg16"}


def test_resume_config_continues_the_run_and_allows_only_safe_changes(tmp_path) -> None:
    import yaml

    from fedmm.config import resume_config

    cfg = to_container(compose(["strategy=fedmr", "num_rounds=3"]))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    resumed = resume_config(tmp_path, ["num_rounds=6"])
    assert resumed["num_rounds"] == 6 and resumed["strategy"]["name"] == "fedmr"
    assert resumed["resume"] == str(tmp_path.resolve()) == resumed["output_dir"]
    with pytest.raises(ConfigError) as info:
        resume_config(tmp_path, ["partition.alpha=0.1"])
    assert info.value.key == "partition.alpha" and "no change when resuming" in str(info.value)
    with pytest.raises(ConfigError) as info:
        resume_config(tmp_path / "missing")
    assert info.value.key == "resume"
    # a run written before the selection group existed resumes with uniform selection
    del cfg["selection"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert resume_config(tmp_path).selection.to_dict() == {"name": "uniform"}


def test_flwr_run_records_flowers_engine_and_refuses_another() -> None:
    """A `flwr run` simulation runs on Flower's engine: its config is validated and recorded with
    simulation.engine=ray (so Ray's own settings pass); asking it for the in-process engine is an
    error that names fedmm's."""
    from fedmm.config import compose_from_run_config
    from server_app.server_app import on_flowers_engine

    cfg = compose_from_run_config(on_flowers_engine({"overrides": "simulation.client_cpus=2"}))
    assert cfg.simulation.engine == "ray" and cfg.simulation.client_cpus == 2
    with pytest.raises(ConfigError) as info:
        on_flowers_engine({"overrides": "partition.alpha=0.1 simulation.engine=local"})
    assert info.value.key == "simulation.engine" and "fedmm simulation.engine=local" in str(info.value)


#: Override lists whose composition must equal hydra's own: group selections before and after
#: values, values inside selected groups, lists, nulls, quoted text, interpolations, an
#: experiment (``+``), a deletion, a package and a value that hydra refuses.
HYDRA_CASES = [
    [],
    ["strategy=fedmr", "num_rounds=2"],
    ["num_rounds=2", "strategy=fedmr", "strategy.first_stage_rounds=1"],
    ["strategy=fedcross", "training.lr=0.05", "training.local_epochs=1", "seed=3", "output_dir='/tmp/a b'"],
    ["dataset=shakespeare", "model=char_lstm", "partition=natural", "dataset.seq_len=20"],
    ["strategy=fedcross_async", "strategy.heterogeneity.clock=real", "strategy.asynchronous.buffer_size=1"],
    ["+experiment=fedcross_shakespeare", "strategy=fedcross", "num_rounds=1"],
    ["partition.alpha=0.1", "partition=dirichlet", "clients_per_round=${num_clients}"],
    ["strategy=scaffold", "strategy.defence.screen=0.0", "strategy.defence.sign_screen=0.5"],
    ["+simulation.ray_init_args={num_cpus: 2}", "num_rounds=3"],
    ["simulation.ray_init_args={num_cpus: 2}"],
    ["training.lr=0.1", "~training.lr"],
    ["num_roundz=2"],
    ["training.lr=[1"],
]


def test_compose_gives_what_hydra_composes() -> None:
    """:func:`compose` keeps hydra's composition of each set of group selections and applies the
    value overrides to a copy with hydra's own code: every case equals hydra's compose, and a
    case hydra refuses is refused naming hydra's reason."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from fedmm import config as config_mod

    config_mod.register_defaults()
    for overrides in HYDRA_CASES * 2:  # the second pass from the kept compositions
        try:
            with initialize_config_dir(config_dir=str(config_mod.CONF_DIR), version_base=None):
                theirs = OmegaConf.to_container(hydra_compose(config_name="config", overrides=overrides))
        except Exception as err:  # noqa: BLE001 - the same refusal, below
            with pytest.raises(ConfigError) as refused:
                compose(overrides, validate_config=False)
            # hydra's reason, or for a misspelt key the nearest one (hydra: "not in struct")
            assert str(err).splitlines()[0] in str(refused.value) or "did you mean" in str(refused.value), overrides
            continue
        assert OmegaConf.to_container(compose(overrides, validate_config=False)) == theirs, overrides


def test_a_kept_composition_is_never_handed_out_and_a_changed_conf_composes_anew(tmp_path, monkeypatch) -> None:
    import shutil

    from fedmm import config as config_mod

    first = compose(["strategy=fedmr"], validate_config=False)
    first.num_rounds = 12345
    first.strategy.first_stage_rounds = 777
    again = compose(["strategy=fedmr"], validate_config=False)
    assert again.num_rounds != 12345 and again.strategy.first_stage_rounds != 777
    conf = tmp_path / "conf"
    shutil.copytree(config_mod.CONF_DIR, conf)
    monkeypatch.setattr(config_mod, "CONF_DIR", conf)
    assert compose(["strategy=fedmr"], validate_config=False).model.name == "cnn"
    text = (conf / "config.yaml").read_text()
    assert "  - model: cnn\n" in text
    (conf / "config.yaml").write_text(text.replace("  - model: cnn\n", "  - model: lenet\n"))
    assert compose(["strategy=fedmr"], validate_config=False).model.name == "lenet"
