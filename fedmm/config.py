"""Compose, validate and serialise the run configuration.

`conf/` (hydra) is the single source of defaults. Both entry points end up with the same
resolved config:

- ``fedmm ...`` gets it from ``@hydra.main``;
- ``flwr run . -c "..."`` passes the run-config keys declared in ``pyproject.toml`` to
  :func:`compose_from_run_config`, which turns them into hydra overrides.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fedmm.errors import ConfigError


def _find_conf_dir() -> Path:
    # Source checkout / FAB: conf/ next to the packages; wheel install: fedmm/conf.
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "conf", here / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    return here.parent / "conf"


CONF_DIR = Path(os.environ.get("FEDMM_CONF_DIR") or _find_conf_dir())

#: Config groups: a run-config key of the same name selects an option of the group.
GROUPS = ("strategy", "dataset", "partition", "model", "training", "simulation", "objective")
#: Top-level scalar keys a ``flwr run -c`` may set directly.
SCALAR_KEYS = ("num_rounds", "seed", "eval_every", "num_clients", "clients_per_round", "output_dir")
#: Top-level keys set only in conf/ or by hydra overrides.
OTHER_KEYS = ("round_timeout", "results_root")


def group_options(group: str) -> list[str]:
    """Names of the options of one config group (the YAML files in ``conf/<group>/``)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def overrides_from_run_config(run_config: Mapping[str, Any]) -> list[str]:
    """Turn Flower run-config values into hydra overrides.

    Empty values keep the defaults of ``conf/``. ``overrides`` holds any further hydra
    overrides separated by spaces, e.g. ``"partition.alpha=0.1 training.lr=0.05"``.
    """
    overrides: list[str] = []
    for key in GROUPS + SCALAR_KEYS:
        value = run_config.get(key, "")
        if value == "" or value is None:
            continue
        overrides.append(f"{key}={value}")
    extra = run_config.get("overrides", "")
    if extra:
        overrides.extend(shlex.split(str(extra)))
    return overrides


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose ``conf/config.yaml`` with hydra overrides and validate the result."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    for item in overrides:
        group = item.split("=", 1)[0].lstrip("+~")
        if group in GROUPS and "=" in item:
            option = item.split("=", 1)[1]
            if option not in group_options(group):
                raise ConfigError(group, option, ", ".join(group_options(group)))
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError("overrides", list(overrides), f"valid hydra overrides ({err})") from err
    validate(cfg)
    return cfg


def compose_from_run_config(run_config: Mapping[str, Any]) -> DictConfig:
    """Resolved config for a ``flwr run`` (run config → hydra overrides → compose)."""
    return compose(overrides_from_run_config(run_config))


def to_container(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Plain, resolved dict (no hydra node) suitable for JSON."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    data = OmegaConf.to_container(node, resolve=True)
    data.pop("hydra", None)
    return data  # type: ignore[return-value]


def dumps(cfg: DictConfig | Mapping[str, Any]) -> str:
    """The resolved config as a compact JSON string (sent to clients in every message)."""
    return json.dumps(to_container(cfg), sort_keys=True)


def _require(cond: bool, key: str, value: object, allowed: str) -> None:
    if not cond:
        raise ConfigError(key, value, allowed)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Check every value before any training starts; raise :class:`ConfigError` on the first bad one."""
    from fedmm.models import MODEL_NAMES
    from strategies import STRATEGIES

    c = to_container(cfg)
    unknown = sorted(set(c) - set(GROUPS) - set(SCALAR_KEYS) - set(OTHER_KEYS))
    if unknown:
        raise ConfigError(unknown[0], c[unknown[0]], "the top-level keys " + ", ".join(GROUPS + SCALAR_KEYS + OTHER_KEYS))
    for group in GROUPS:
        _require(isinstance(c.get(group), dict), group, c.get(group), ", ".join(group_options(group)))

    _require(_is_int(c["num_rounds"]) and c["num_rounds"] >= 1, "num_rounds", c["num_rounds"], "an integer >= 1")
    _require(_is_int(c["seed"]) and c["seed"] >= 0, "seed", c["seed"], "an integer >= 0")
    _require(_is_int(c["eval_every"]) and c["eval_every"] >= 1, "eval_every", c["eval_every"], "an integer >= 1")
    _require(_is_int(c["num_clients"]) and c["num_clients"] >= 1, "num_clients", c["num_clients"], "an integer >= 1")
    k = c["clients_per_round"]
    _require(
        _is_int(k) and 1 <= k <= c["num_clients"],
        "clients_per_round",
        k,
        f"an integer from 1 to num_clients={c['num_clients']}",
    )
    _require(_is_number(c["round_timeout"]) and c["round_timeout"] > 0, "round_timeout", c["round_timeout"], "seconds > 0")

    strategy = c["strategy"].get("name")
    _require(strategy in STRATEGIES, "strategy.name", strategy, ", ".join(sorted(STRATEGIES)))
    fe = c["strategy"].get("fraction_evaluate", 0.0)
    _require(_is_number(fe) and 0.0 <= fe <= 1.0, "strategy.fraction_evaluate", fe, "a number in [0, 1]")
    _require(c["model"].get("name") in MODEL_NAMES, "model.name", c["model"].get("name"), ", ".join(MODEL_NAMES))

    t = c["training"]
    _require(_is_number(t["lr"]) and t["lr"] > 0, "training.lr", t["lr"], "a number > 0")
    _require(_is_number(t["momentum"]) and 0 <= t["momentum"] < 1, "training.momentum", t["momentum"], "a number in [0, 1)")
    _require(
        _is_number(t["weight_decay"]) and t["weight_decay"] >= 0, "training.weight_decay", t["weight_decay"], "a number >= 0"
    )
    _require(_is_int(t["local_epochs"]) and t["local_epochs"] >= 1, "training.local_epochs", t["local_epochs"], "an integer >= 1")
    _require(_is_int(t["batch_size"]) and t["batch_size"] >= 1, "training.batch_size", t["batch_size"], "an integer >= 1")
    _require(t["device"] in ("auto", "cpu", "cuda"), "training.device", t["device"], "auto, cpu, cuda")
    _require(
        isinstance(t["lr_decay_rounds"], list) and all(_is_int(r) and r >= 1 for r in t["lr_decay_rounds"]),
        "training.lr_decay_rounds",
        t["lr_decay_rounds"],
        "a list of rounds >= 1",
    )
    _require(
        _is_number(t["lr_decay_factor"]) and 0 < t["lr_decay_factor"] <= 1,
        "training.lr_decay_factor",
        t["lr_decay_factor"],
        "a number in (0, 1]",
    )

    s = c["simulation"]
    _require(_is_int(s["num_supernodes"]) and s["num_supernodes"] >= 1, "simulation.num_supernodes", s["num_supernodes"], "an integer >= 1")
    _require(_is_number(s["client_cpus"]) and s["client_cpus"] > 0, "simulation.client_cpus", s["client_cpus"], "a number > 0")
    _require(
        _is_number(s["client_gpus"]) and 0 <= s["client_gpus"] <= 1 or (_is_int(s["client_gpus"]) and s["client_gpus"] >= 0),
        "simulation.client_gpus",
        s["client_gpus"],
        "a GPU fraction in [0, 1] (or a whole number of GPUs)",
    )

    from fedmm.data import check_dataset_config, check_partition_config

    check_dataset_config(c["dataset"])
    path = c["dataset"].get("path")
    if path and not Path(os.path.expanduser(str(path))).exists():
        raise ConfigError("dataset.path", path, "an existing local dataset folder (save_to_disk output or CIFAR python batches), or null")
    check_partition_config(c["partition"])

    from strategies import validate_strategy_config

    validate_strategy_config(c)

    from client_app.objectives import validate_objective_config

    validate_objective_config(c)
