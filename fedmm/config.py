"""Compose, validate and serialise the run configuration.

``conf/`` (hydra) is the single source of defaults. Both entry points end up with the same
resolved config:

- ``fedmm ...`` gets it from ``@hydra.main``;
- ``flwr run . -c "..."`` passes the run-config keys declared in ``pyproject.toml`` to
  :func:`compose_from_run_config`, which turns them into hydra overrides.

Validation is one pass (:func:`validate`) over a schema: every config group is checked by the
schema its owner registers next to the code it configures (:func:`register_schema`):
``dataset`` / ``partition`` in :mod:`fedmm.data`, ``model`` in :mod:`fedmm.models`, each
``strategy`` in its module of ``strategies/`` (and ``selection`` in ``strategies/__init__.py``), each ``objective`` (local-update plugin) in
``client_app/plugins.py``; the run-level keys, ``training`` and ``simulation`` are declared
here. This module imports no app and no strategy: the entry points import those, which
registers their schemas. Unknown keys at any depth are errors naming the nearest valid key.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
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
GROUPS = ("strategy", "dataset", "partition", "model", "training", "simulation", "objective", "selection")
#: Top-level scalar keys a ``flwr run -c`` may set directly.
SCALAR_KEYS = (
    "num_rounds", "seed", "eval_every", "num_clients", "clients_per_round", "output_dir", "checkpoint_every", "resume",
)
#: Top-level keys set only in conf/ or by hydra overrides.
OTHER_KEYS = ("round_timeout", "results_root", "max_failed_rounds", "min_nodes_timeout")


# =============================================================================== schema
class Field:
    """One config value's rule: ``check(key, value)`` raises :class:`ConfigError` or passes."""

    allowed = "a value"

    def ok(self, value: Any) -> bool:  # pragma: no cover - every field overrides it
        raise NotImplementedError

    def check(self, key: str, value: Any) -> None:
        if not self.ok(value):
            raise ConfigError(key, value, self.allowed)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Int(Field):
    """An integer, optionally bounded (inclusive)."""

    def __init__(self, min: int | None = None, max: int | None = None, allowed: str | None = None) -> None:  # noqa: A002
        self.min, self.max = min, max
        if allowed:
            self.allowed = allowed
        elif min is not None and max is not None:
            self.allowed = f"an integer from {min} to {max}"
        elif min is not None:
            self.allowed = f"an integer >= {min}"
        else:
            self.allowed = "an integer"

    def ok(self, value: Any) -> bool:
        return _is_int(value) and (self.min is None or value >= self.min) and (self.max is None or value <= self.max)


class Number(Field):
    """A finite number; ``gt``/``ge``/``lt``/``le`` bound it."""

    def __init__(self, gt: float | None = None, ge: float | None = None, lt: float | None = None, le: float | None = None,
                 allowed: str | None = None) -> None:
        self.gt, self.ge, self.lt, self.le = gt, ge, lt, le
        if allowed:
            self.allowed = allowed
        elif (gt is not None or ge is not None) and (lt is not None or le is not None):
            low = f"({gt}" if gt is not None else f"[{ge}"
            high = f"{lt})" if lt is not None else f"{le}]"
            self.allowed = f"a number in {low}, {high}"
        elif gt is not None:
            self.allowed = f"a number > {gt}"
        elif ge is not None:
            self.allowed = f"a number >= {ge}"
        else:
            self.allowed = "a number"

    def ok(self, value: Any) -> bool:
        return _is_number(value) and (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )


class Choice(Field):
    """One of the listed values."""

    def __init__(self, *options: Any) -> None:
        self.options = options
        self.allowed = ", ".join(str(o) for o in options)

    def ok(self, value: Any) -> bool:
        return any(value == o and type(value) is type(o) for o in self.options)


class Bool(Field):
    allowed = "true or false"

    def ok(self, value: Any) -> bool:
        return isinstance(value, bool)


class Str(Field):
    allowed = "a string"

    def ok(self, value: Any) -> bool:
        return isinstance(value, str)


class Nullable(Field):
    """``null`` or what ``inner`` allows."""

    def __init__(self, inner: Field, allowed: str | None = None) -> None:
        self.inner = inner
        self.allowed = allowed or f"null or {inner.allowed}"

    def ok(self, value: Any) -> bool:
        return value is None or self.inner.ok(value)


class ListOf(Field):
    """A list whose items ``inner`` allows."""

    def __init__(self, inner: Field, allowed: str | None = None) -> None:
        self.inner = inner
        self.allowed = allowed or f"a list of {inner.allowed}"

    def ok(self, value: Any) -> bool:
        return isinstance(value, (list, tuple)) and all(self.inner.ok(v) for v in value)


class MapOf(Field):
    """A mapping from names to values that ``inner`` allows."""

    def __init__(self, inner: Field, allowed: str | None = None) -> None:
        self.inner = inner
        self.allowed = allowed or f"a mapping of names to {inner.allowed}"

    def ok(self, value: Any) -> bool:
        return isinstance(value, Mapping) and all(isinstance(k, str) and self.inner.ok(v) for k, v in value.items())


class AnyValue(Field):
    """Anything (checked elsewhere, e.g. by a group checker)."""

    allowed = "any value"

    def ok(self, value: Any) -> bool:
        return True


#: A group's schema: key -> Field. A callable checker may follow (cross-key rules).
Schema = Mapping[str, Field]
Checker = Callable[[Mapping[str, Any], Mapping[str, Any]], None]


def check_keys(prefix: str, values: Mapping[str, Any], schema: Schema) -> None:
    """Unknown keys name the nearest valid one; missing keys are errors; each field is checked."""
    for key in values:
        if key not in schema:
            near = difflib.get_close_matches(str(key), list(schema), n=1)
            hint = f"; did you mean {prefix}{near[0]}?" if near else ""
            allowed = ", ".join(schema) or "no keys"
            raise ConfigError(f"{prefix}{key}", values[key], f"the keys of {prefix.rstrip('.') or 'the config'}: {allowed}{hint}")
    for key, field in schema.items():
        if key not in values:
            raise ConfigError(f"{prefix}{key}", None, f"a value (the key is missing; {field.allowed})")
        field.check(f"{prefix}{key}", values[key])


class _GroupRule:
    def __init__(self, schema: Schema, checker: Checker | None) -> None:
        self.schema = dict(schema)
        self.checker = checker


#: (group, option name) -> rule. Filled by :func:`register_schema`.
_REGISTRY: dict[tuple[str, str], _GroupRule] = {}


def register_schema(group: str, name: str, schema: Schema, checker: Checker | None = None) -> None:
    """Declare the keys of option ``name`` of config group ``group``.

    ``schema`` lists every key besides ``name`` with its rule; ``checker(group_values, cfg)``
    runs afterwards for rules that span keys or groups. Called by the module that owns the
    option, next to the code it configures.
    """
    _REGISTRY[(group, name)] = _GroupRule(schema, checker)


def registered_names(group: str) -> list[str]:
    """The option names registered for ``group``."""
    return sorted(name for g, name in _REGISTRY if g == group)


# ----------------------------------------------------------------------- run-level schemas
_TOP_SCHEMA: dict[str, Field] = {
    "num_rounds": Int(min=1),
    "seed": Int(min=0),
    "eval_every": Int(min=1),
    "num_clients": Int(min=1),
    "clients_per_round": AnyValue(),  # bounded by num_clients, checked below
    "round_timeout": Number(gt=0, allowed="seconds > 0"),
    "max_failed_rounds": Int(min=0, allowed="an integer >= 0 (0: never stop for lack of replies)"),
    "min_nodes_timeout": Number(ge=0, allowed="seconds >= 0 to wait for enough SuperNodes (0: forever)"),
    "results_root": Str(),
    "output_dir": Nullable(Str(), "null or a directory path"),
    "checkpoint_every": Int(min=0, allowed="an integer >= 0 (0: only at the end)"),
    "resume": Nullable(Str(), "null or the directory of a run to continue"),
}

_TRAINING_SCHEMA: dict[str, Field] = {
    "lr": Number(gt=0),
    "momentum": Number(ge=0, lt=1),
    "weight_decay": Number(ge=0),
    "local_epochs": Int(min=1),
    "batch_size": Int(min=1),
    "lr_decay_rounds": ListOf(Int(min=1), "a list of rounds >= 1"),
    "lr_decay_factor": Number(gt=0, le=1),
    "device": Choice("auto", "cpu", "cuda"),
}


def _gpus_ok(value: Any) -> bool:
    return (_is_number(value) and 0 <= value <= 1) or (_is_int(value) and value >= 0)


class _Gpus(Field):
    allowed = "a GPU fraction in [0, 1] (or a whole number of GPUs)"

    def ok(self, value: Any) -> bool:
        return _gpus_ok(value)


class _RayAddress(Field):
    allowed = ("null (fedmm starts a local Ray), auto, or the host:port of a running Ray head "
               "(its GCS, `ray start --head --port=6379`), e.g. 127.0.0.1:6379")

    def ok(self, value: Any) -> bool:
        if value is None or value == "auto":
            return True
        if not isinstance(value, str) or "://" in value or any(c.isspace() for c in value):
            return False  # ray:// (Ray Client) is not supported: run fedmm on a node of the cluster
        host, sep, port = value.rpartition(":")
        return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


#: ray.init arguments that a driver attaching to a running cluster may not pass (Ray refuses
#: them: a cluster's resources are set by `ray start` on each node).
RAY_ATTACH_REFUSED = ("num_cpus", "num_gpus", "resources", "labels", "object_store_memory", "_system_config",
                      "_enable_object_reconstruction", "_node_name")


def _ray_init_parameters() -> set[str] | None:
    """The keyword arguments ``ray.init`` accepts (None when Ray is not installed)."""
    try:
        import inspect

        import ray
    except ImportError:
        return None
    params = set(inspect.signature(ray.init).parameters) - {"kwargs"}
    return params | {"_enable_object_reconstruction", "_plasma_directory", "_object_spilling_directory",
                     "_node_ip_address", "_driver_object_store_memory", "_memory", "_redis_username",
                     "_redis_password", "_temp_dir", "_metrics_export_port", "_system_config",
                     "_tracing_startup_hook", "_node_name", "_skip_env_hook"}


def _check_ray_init_args(sim: Mapping[str, Any]) -> None:
    """``simulation.ray_init_args``: ray.init keyword arguments that fit ``simulation.ray_address``."""
    args, address = sim["ray_init_args"], sim["ray_address"]
    for name in args:
        key = f"simulation.ray_init_args.{name}"
        if name == "address":
            raise ConfigError(key, args[name], "no value here: set simulation.ray_address instead")
        if address is None and name == "runtime_env":
            raise ConfigError(key, args[name], "no value without simulation.ray_address (Flower's own ray.init "
                              "sets runtime_env itself; a local Ray sees this machine's files anyway)")
        if address is not None and name in RAY_ATTACH_REFUSED:
            raise ConfigError(key, args[name], "no value when attaching to a cluster (simulation.ray_address is set): "
                              "a cluster's resources come from `ray start --num-cpus/--num-gpus/--resources` on each node")
    params = _ray_init_parameters() if args else None
    if params is not None:
        for name in args:
            if name not in params:
                near = difflib.get_close_matches(name, sorted(params), n=1)
                hint = f"; did you mean simulation.ray_init_args.{near[0]}?" if near else ""
                raise ConfigError(f"simulation.ray_init_args.{name}", args[name], f"a keyword argument of ray.init{hint}")


_SIMULATION_SCHEMA: dict[str, Field] = {
    "num_supernodes": Int(min=1),
    "client_cpus": Number(gt=0),
    "client_gpus": _Gpus(),
    "ray_address": _RayAddress(),
    "ray_init_args": MapOf(AnyValue(), "a mapping of ray.init keyword arguments to values ({} for none)"),
}


# =============================================================================== compose
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
        try:
            overrides.extend(shlex.split(str(extra)))
        except ValueError as err:  # e.g. an unmatched quote
            raise ConfigError("overrides", str(extra), f"space-separated hydra overrides, quotes balanced ({err})") from None
    return overrides


def compose(overrides: Sequence[str] = (), validate_config: bool = True) -> DictConfig:
    """Compose ``conf/config.yaml`` with hydra overrides (and validate the result)."""
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
    if validate_config:
        validate(cfg)
    return cfg


def compose_from_run_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Validated config of a ``flwr run``: run config → hydra overrides → compose, or, with
    ``resume``, the config of the run to continue (with the changes it allows)."""
    resume = run_config.get("resume", "")
    if resume:
        changes = [o for o in overrides_from_run_config({**run_config, "resume": ""})]
        return resume_config(str(resume), changes)
    return validate(compose(overrides_from_run_config(run_config), validate_config=False))


def to_container(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Plain, resolved dict (no hydra node) suitable for JSON."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    data = OmegaConf.to_container(node, resolve=True)
    data.pop("hydra", None)
    return data  # type: ignore[return-value]


def dumps(cfg: DictConfig | Mapping[str, Any]) -> str:
    """The resolved config as a compact JSON string (sent to clients in every message)."""
    return json.dumps(to_container(cfg), sort_keys=True)


# =============================================================================== validate
def validate(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Check every value before any training starts, in one pass over the schema.

    Returns the plain resolved dict. Raises :class:`ConfigError` on the first bad value,
    naming the key, the value and what is allowed.
    """
    _ensure_core_schemas()
    c = to_container(cfg)
    top = {k: v for k, v in c.items() if k not in GROUPS}
    top_schema = dict(_TOP_SCHEMA)
    known = set(top_schema) | set(GROUPS)
    for key in c:
        if key not in known:
            near = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise ConfigError(key, c[key], "the top-level keys " + ", ".join(GROUPS + SCALAR_KEYS + OTHER_KEYS) + hint)
    for group in GROUPS:
        if not isinstance(c.get(group), dict):
            raise ConfigError(group, c.get(group), ", ".join(group_options(group)))
    check_keys("", top, top_schema)
    k = c["clients_per_round"]
    if not (_is_int(k) and 1 <= k <= c["num_clients"]):
        raise ConfigError("clients_per_round", k, f"an integer from 1 to num_clients={c['num_clients']}")
    check_keys("training.", c["training"], _TRAINING_SCHEMA)
    check_keys("simulation.", c["simulation"], _SIMULATION_SCHEMA)
    _check_ray_init_args(c["simulation"])
    for group in ("dataset", "partition", "model", "strategy", "objective", "selection"):
        values = c[group]
        name = values.get("name")
        options = registered_names(group)
        if (group, name) not in _REGISTRY:
            raise ConfigError(f"{group}.name", name, ", ".join(options) or f"(no {group} registered: import its package)")
        rule = _REGISTRY[(group, name)]
        check_keys(f"{group}.", {k: v for k, v in values.items() if k != "name"}, rule.schema)
        if rule.checker:
            rule.checker(values, c)
    return c


# =============================================================================== resume
#: Keys a resumed run may change: it continues the run's own config otherwise.
RESUME_CHANGEABLE = ("num_rounds", "checkpoint_every", "round_timeout", "max_failed_rounds", "min_nodes_timeout", "simulation")


def resume_config(run_dir: str | os.PathLike, changes: Mapping[str, Any] | Sequence[str] = ()) -> dict[str, Any]:
    """The config of the run in ``run_dir`` (its ``config.yaml``), to continue it.

    ``changes`` are hydra-style ``key=value`` overrides (or a dict) of the keys in
    :data:`RESUME_CHANGEABLE` (e.g. a larger ``num_rounds`` extends the run); any other key is a
    config error, because the continued run must be the same experiment.
    """
    import yaml

    path = Path(os.path.expanduser(str(run_dir))).resolve()
    config_file = path / "config.yaml"
    if not config_file.is_file():
        raise ConfigError("resume", str(run_dir), "the directory of a fedmm run (it holds config.yaml and checkpoint.pt)")
    cfg = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    if isinstance(cfg, dict) and isinstance(cfg.get("simulation"), dict):
        for key, default in _SIMULATION_ADDED.items():
            cfg["simulation"].setdefault(key, copy.deepcopy(default))
    if isinstance(cfg, dict):
        for key, default in _GROUPS_ADDED.items():
            cfg.setdefault(key, copy.deepcopy(default))
        strategy = cfg.get("strategy")
        if isinstance(strategy, dict):
            for key, default in _STRATEGY_KEYS_ADDED.get(strategy.get("name"), {}).items():
                strategy.setdefault(key, copy.deepcopy(default))
        if isinstance(cfg.get("model"), dict):
            cfg["model"].setdefault("projection_dim", None)  # added after runs were made
    items = list(changes.items()) if isinstance(changes, Mapping) else [_split_override(o) for o in changes]
    for key, value in items:
        if key.split(".", 1)[0] not in RESUME_CHANGEABLE:
            raise ConfigError(key, value, "no change when resuming (the run continues its own config); changeable: " + ", ".join(RESUME_CHANGEABLE))
        node = cfg
        parts = key.split(".")
        for part in parts[:-1]:
            node = node[part]
        node[parts[-1]] = value
    cfg["resume"] = str(path)
    cfg["output_dir"] = str(path)
    return validate(cfg)


#: Keys added to ``simulation`` after runs were made: a run written before has none of them,
#: and resumes with these values unless the resume command sets them.
_SIMULATION_ADDED = {"ray_address": None, "ray_init_args": {}}
#: Config groups added after runs were made (a run written before used these options).
_GROUPS_ADDED = {"selection": {"name": "uniform"}}
#: Keys added to a strategy's group after runs were made (their values then: off).
_STRATEGY_KEYS_ADDED = {
    "fedmr": {
        "secure": {"enabled": False, "mode": "both", "repetitions": 2, "min_layers": 1, "max_layers": None, "pad": False, "max_attempts": 2}
    }
}


def _split_override(item: str) -> tuple[str, Any]:
    import yaml

    key, sep, value = item.lstrip("+").partition("=")
    if not sep:
        raise ConfigError("overrides", item, "key=value")
    return key, yaml.safe_load(value)


def _ensure_core_schemas() -> None:
    # fedmm's own groups register on import; strategies and local-update plugins are imported
    # by the entry points (this module imports no app and no strategy).
    import fedmm.data  # noqa: F401
    import fedmm.models  # noqa: F401
