"""Compose, validate and serialise the run configuration.

Every option's defaults are declared in code (:mod:`fedmm.settings`); :func:`register_defaults`
hands them to hydra, and ``conf/`` selects and overrides. Both entry points end up with the same
validated :class:`RunSettings`:

- ``fedmm ...`` gets the composed config from ``@hydra.main`` (:mod:`launch.cli`);
- ``flwr run . -c "..."`` passes the run-config keys declared in ``pyproject.toml`` to
  :func:`compose_from_run_config`, which turns them into hydra overrides.

Validation is one pass (:func:`validate`): each group's values are checked by the declaration
its option names (found by :func:`fedmm.settings.discover`), then each declaration's rules
across groups run with the whole run. This module imports no app and no method: discovery
imports the modules that declare options. Unknown keys at any depth are errors naming the
nearest valid key.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fedmm.errors import ConfigError
from fedmm.training import TrainingSettings
from fedmm.settings import (  # noqa: F401 - the rules, re-exported
    AnyValue,
    Bool,
    Choice,
    Int,
    ListOf,
    MapOf,
    Nullable,
    Number,
    OtherSettings,
    Rule,
    Settings,
    Str,
    discover,
    paired_objectives,
    plain,
    is_int,
    is_number,
    setting,
)


def _find_conf_dir() -> Path:
    # Source checkout / FAB: conf/ next to the packages; wheel install: fedmm/conf.
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "conf", here / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    return here.parent / "conf"


CONF_DIR = Path(os.environ.get("FEDMM_CONF_DIR") or _find_conf_dir())

#: Config groups: a run-config key of the same name selects an option of the group.
GROUPS = ("strategy", "dataset", "partition", "model", "training", "simulation", "objective", "selection", "server_optimizer")
#: Top-level scalar keys a ``flwr run -c`` may set directly.
SCALAR_KEYS = (
    "num_rounds", "seed", "eval_every", "num_clients", "clients_per_round", "output_dir", "checkpoint_every", "resume",
)
#: Top-level keys set only in conf/ or by hydra overrides.
OTHER_KEYS = ("round_timeout", "results_root", "max_failed_rounds", "min_nodes_timeout")


# =============================================================================== settings
# The rules live in fedmm.settings (the ground); re-exported for the modules that import them here.
Field = Rule


class _Gpus(Rule):
    allowed = "a GPU fraction in [0, 1] (or a whole number of GPUs)"

    def ok(self, value: Any) -> bool:
        return (is_number(value) and 0 <= value <= 1) or (is_int(value) and value >= 0)


class _RayAddress(Rule):
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


#: The simulation engines ``fedmm`` runs a job on (``simulation.engine``).
ENGINES = ("local", "ray")
#: Settings of the Ray engine only (another engine takes them at their declared defaults only).
RAY_ONLY = ("client_cpus", "client_gpus", "ray_address", "ray_init_args")
#: ``simulation.vectorize``: the in-process engine trains a round's clients as one computation.
VECTORIZE = ("auto", "on", "off")


@dataclass
class SimulationSettings(Settings):
    """The simulation ``fedmm`` runs a job on: the in-process engine (``local``) or Flower's
    simulation engine (``ray``); flwr run keeps Flower's engine and takes its resources from
    --federation-config instead (docs/usage.md)."""

    group = "simulation"
    option = "default"
    keyed = False
    added = {"ray_address": None, "ray_init_args": {}, "engine": "ray", "vectorize": "off", "vectorize_clients": None,
             "client_app": "client_app.client_app:app"}
    engine: str = setting("local", Choice(*ENGINES),
                          "local: the ServerApp and one ClientApp at a time in fedmm's process, no Ray "
                          "(fedmm/local_engine.py) | ray: Flower's simulation engine, ClientApps in Ray workers "
                          "(several at once, GPU shares, Ray clusters)")
    num_supernodes: int = setting(20, Int(min=1), "virtual SuperNodes (= num_clients)", node="${num_clients}")
    client_cpus: float = setting(1, Number(gt=0), "ray engine: CPU cores reserved per ClientApp")
    client_gpus: float = setting(0.0, _Gpus(), "ray engine: GPU fraction per ClientApp (0.25: four clients share one GPU)")
    ray_address: str | None = setting(None, _RayAddress(), "ray engine: null: a local Ray per job; host:port or auto: attach to a "
                                      "running Ray cluster (docs/ray_cluster.md)")
    ray_init_args: dict = setting({}, MapOf(AnyValue(), "a mapping of ray.init keyword arguments to values ({} for none)"),
                                  "ray engine: further ray.init keyword arguments (e.g. {namespace: fedmm})")
    vectorize: str = setting("auto", Choice(*VECTORIZE),
                             "local engine: train a round's clients as one computation (client_app/vectorized.py). "
                             "auto: on CUDA, where the objective and model allow it; on the CPU one at a time "
                             "(faster there for the papers' shapes, docs/performance.md, 'Vectorized rounds') | on: also on the "
                             "CPU (refuses an objective or model that does not allow it) | off: one at a time (on the ray "
                             "engine auto and off alike: one ClientApp call per message)")
    vectorize_clients: int | None = setting(None, Nullable(Int(min=1), "null (all of a round's) or an integer >= 1"),
                                            "local engine, vectorize: at most this many clients in one computation "
                                            "(null: all of the round's; halved while CUDA runs out of memory)")

    client_app: str = setting("client_app.client_app:app", Str(), "the ClientApp the simulation runs, as "
                              "module:attribute (e.g. this app with Flower's mods: client_app.client_app.build_app(mods=...), "
                              "docs/privacy.md); flwr run takes pyproject.toml's clientapp instead")

    def check_values(self, prefix: str) -> None:
        """The Ray settings only with ``engine: ray``; ``ray_init_args``: ray.init keyword
        arguments that fit ``ray_address``; ``client_app`` as module:attribute."""
        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", str(self.client_app)):
            raise ConfigError(f"{prefix}client_app", self.client_app, "module:attribute (a ClientApp object), e.g. "
                              "client_app.client_app:app")
        if self.engine != "ray":
            declared = type(self)()
            for name in RAY_ONLY:
                unused = getattr(declared, name)
                if getattr(self, name) != unused:
                    raise ConfigError(f"{prefix}{name}", getattr(self, name),
                                      f"{unused!r} on the {self.engine} engine, which runs one ClientApp at a time in "
                                      f"fedmm's own process (on training.device, with all of the process's threads); "
                                      f"set {prefix}engine=ray to run ClientApps in Ray workers")
        if self.engine != "local" and (self.vectorize == "on" or self.vectorize_clients is not None):
            name = "vectorize" if self.vectorize == "on" else "vectorize_clients"
            default = getattr(type(self)(), name)
            raise ConfigError(f"{prefix}{name}", getattr(self, name), f"{'null' if default is None else repr(default)} on the "
                              f"{self.engine} engine, which runs each ClientApp call on its own; set {prefix}engine=local")
        if self.vectorize == "off" and self.vectorize_clients is not None:
            raise ConfigError(f"{prefix}vectorize_clients", self.vectorize_clients,
                              f"null with {prefix}vectorize=off (no clients train together)")
        args, address = self.ray_init_args, self.ray_address
        for name in args:
            key = f"{prefix}ray_init_args.{name}"
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
                    hint = f"; did you mean {prefix}ray_init_args.{near[0]}?" if near else ""
                    raise ConfigError(f"{prefix}ray_init_args.{name}", args[name], f"a keyword argument of ray.init{hint}")

    def check(self, run: Any) -> None:
        """``vectorize: on`` only with an objective and a model that allow it."""
        if self.vectorize == "on":
            problem = not_vectorized(run)
            if problem is not None:
                raise ConfigError("simulation.vectorize", "on", f"auto or off: {problem}")


def not_vectorized(run: Any) -> str | None:
    """Why the run's clients cannot train as one computation (the objective, the model), or None."""
    from fedmm.models import VECTORIZED_MODEL_NAMES

    objective = run.objective
    objective_class = getattr(type(objective), "objective_class", None)
    why = "it is not declared in this process" if objective_class is None else objective_class.vectorizable()
    if why:
        return (f"objective.name={objective.name!r} trains one client at a time ({why}; vectorized objectives: "
                f"{', '.join(vectorized_objectives())})")
    if run.model.name not in VECTORIZED_MODEL_NAMES:
        return (f"model.name={run.model.name!r} trains one client at a time (vectorized models: "
                f"{', '.join(VECTORIZED_MODEL_NAMES)})")
    return None


def vectorized_objectives() -> list[str]:
    """The objectives whose clients can train as one computation."""
    from fedmm.settings import discover

    return sorted(name for name, declared in discover("objective").items()
                  if getattr(declared, "objective_class", None) is not None and not declared.objective_class.vectorizable())


#: ``tracking.loggers``: what follows a run besides ``metrics.jsonl`` (always written: the
#: record). name -> the package it needs (its extra installs it), None for the built-in ones.
LOGGERS: dict[str, str | None] = {"tensorboard": None, "csv": None, "mlflow": "mlflow", "wandb": "wandb"}


class _Loggers(Rule):
    allowed = "a list of " + ", ".join(LOGGERS) + " (each at most once; [] for metrics.jsonl only)"

    def ok(self, value: Any) -> bool:
        return isinstance(value, (list, tuple)) and all(v in LOGGERS for v in value) and len(set(value)) == len(value)

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, (list, tuple)):  # name the bad item, not the whole list
            for item in value:
                if not isinstance(item, str) or item not in LOGGERS:
                    raise ConfigError(key, item, "one of " + ", ".join(LOGGERS) + " in the list")
                if list(value).count(item) > 1:
                    raise ConfigError(key, item, "each logger once in the list")
        super().check(key, value)


class _Name(Rule):
    allowed = "a non-empty string"

    def ok(self, value: Any) -> bool:
        return isinstance(value, str) and bool(value.strip())


@dataclass
class MlflowSettings(Settings):
    """MLflow (``tracking.loggers`` with ``mlflow``; ``pip install "fedmm[mlflow]"``)."""

    keyed = False
    tracking_uri: str | None = setting(None, Nullable(_Name(), "null or a tracking URI (http://host:5000, "
                                                      "sqlite:////abs/path/mlflow.db, databricks, ...)"),
                                       "null: $MLFLOW_TRACKING_URI when set, else sqlite:///<the run folder's parent>/"
                                       "mlflow.db (a sweep's jobs share it; artifacts in mlartifacts/ beside it)")
    experiment: str = setting("fedmm", _Name(), "the MLflow experiment the runs go to (created when missing)")


@dataclass
class WandbSettings(Settings):
    """Weights & Biases (``tracking.loggers`` with ``wandb``; ``pip install "fedmm[wandb]"``)."""

    keyed = False
    project: str = setting("fedmm", _Name(), "the W&B project")
    entity: str | None = setting(None, Nullable(_Name()), "the W&B team or user (null: your default entity)")
    mode: str = setting("online", Choice("online", "offline"),
                        "online: to the W&B server (needs `wandb login`) | offline: only into <run dir>/wandb "
                        "(or $WANDB_DIR), for `wandb sync` from a machine with network")


@dataclass
class TrackingSettings(Settings):
    """What follows a run besides ``metrics.jsonl``, which is always written (the record)."""

    keyed = False
    loggers: list = setting(["tensorboard", "csv"], _Loggers(),
                            "tensorboard: <run dir>/tensorboard | csv: <run dir>/metrics.csv | mlflow | wandb: a run "
                            "per fedmm run (the settings, the rounds' metrics by round, the final files)")
    run_group: str | None = setting(None, Nullable(_Name()),
                                    "groups runs: the W&B group and the name of the MLflow parent run the runs nest under "
                                    "(found by this name). null: in a `fedmm -m` sweep, the sweep folder's last two parts "
                                    "(2026-11-27/09-15-37-123456), one parent per sweep; else no group")
    sweep: str | None = setting(None, Nullable(_Name()),
                                "set by `fedmm -m` for each job: the sweep's folder (the MLflow parent run is found by "
                                "it, under a file lock there, so parallel jobs make one)")
    mlflow: MlflowSettings = setting(MlflowSettings(), help="MLflow")
    wandb: WandbSettings = setting(WandbSettings(), help="Weights & Biases")

    def check_values(self, prefix: str) -> None:
        """A tracker's package must be installed; a tracker's settings only with the tracker."""
        import importlib.util

        for name in self.loggers:
            package = LOGGERS[name]
            if package is not None and importlib.util.find_spec(package) is None:
                raise ConfigError(f"{prefix}loggers", name, f'a logger whose package is installed (pip install "fedmm[{name}]")')
        for name in ("mlflow", "wandb"):
            changed = getattr(self, name).differences()
            if changed and name not in self.loggers:
                key, value = next(iter(changed.items()))
                raise ConfigError(f"{prefix}{name}.{key}", value, f"its default without {name} in {prefix}loggers "
                                  f"(add it: {prefix}loggers=[{', '.join([*self.loggers, name])}])")
        if self.run_group is not None and not {"mlflow", "wandb"} & set(self.loggers):
            raise ConfigError(f"{prefix}run_group", self.run_group, f"null without mlflow or wandb in {prefix}loggers (they group runs)")


@dataclass
class RunSettings(Settings):
    """The run-level keys; a validated run also holds the settings of every config group.

    What the runner and both apps pass around (run.strategy.alpha, run.training.lr); to_dict()
    is the resolved config that config.yaml and the clients' config record hold.
    """

    keyed = False
    #: Declared after runs were made: the values that reproduce those runs (TensorBoard and CSV).
    added = {"tracking": TrackingSettings().to_dict()}
    num_rounds: int = setting(20, Int(min=1), "communication rounds")
    seed: int = setting(0, Int(min=0), "seeds partitioning, model init, client sampling and local shuffling")
    eval_every: int = setting(1, Int(min=1), "evaluate the global model every n rounds (and after the last)")
    num_clients: int = setting(20, Int(min=1), "N: clients in the federation (= SuperNodes in simulation)")
    clients_per_round: int = setting(10, Int(min=1), "K: clients sampled per round (= models kept by FedMR / FedCross)")
    checkpoint_every: int = setting(5, Int(min=0, allowed="an integer >= 0 (0: only at the end)"),
                                    "write checkpoint.pt every n rounds (and after the last)")
    resume: str | None = setting(None, Nullable(Str(), "null or the directory of a run to continue"),
                                 "a run directory to continue from its checkpoint")
    max_failed_rounds: int = setting(3, Int(min=0, allowed="an integer >= 0 (0: never stop for lack of replies)"),
                                     "stop as failed after this many consecutive rounds with no accepted reply or nothing aggregated "
                                     "(the aggregator refused the round's updates, NaN/Inf): the last round's reason is the run's")
    min_nodes_timeout: float = setting(600, Number(ge=0, allowed="seconds >= 0 to wait for enough SuperNodes (0: forever)"),
                                       "seconds to wait for clients_per_round SuperNodes to connect")
    round_timeout: float = setting(3600, Number(gt=0, allowed="seconds > 0"), "seconds to wait for the replies of one round")
    results_root: str = setting("~/fedmm-results", Str(), "`flwr run` results go to <results_root>/<timestamp>_...")
    output_dir: str | None = setting(None, Nullable(Str(), "null or a directory path"), "write into this exact directory")
    tracking: TrackingSettings = setting(TrackingSettings(), help="experiment trackers (docs/lab.md)")
    objective: Settings = field(default=None)  # type: ignore[assignment]
    selection: Settings = field(default=None)  # type: ignore[assignment]
    server_optimizer: Settings = field(default=None)  # type: ignore[assignment]
    strategy: Settings = field(default=None)  # type: ignore[assignment]
    dataset: Settings = field(default=None)  # type: ignore[assignment]
    partition: Settings = field(default=None)  # type: ignore[assignment]
    model: Settings = field(default=None)  # type: ignore[assignment]
    training: TrainingSettings = field(default=None)  # type: ignore[assignment]
    simulation: SimulationSettings = field(default=None)  # type: ignore[assignment]

    @classmethod
    def settings_fields(cls) -> list[dataclasses.Field]:
        return [f for f in fields(cls) if f.init and f.name not in GROUPS]

    @classmethod
    def hydra_node(cls) -> dict[str, Any]:
        """The run-level keys' defaults (the groups are chosen by the defaults list)."""
        return Settings.to_dict(cls())

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for group in GROUPS:
            value = getattr(self, group)
            out[group] = value.to_dict() if isinstance(value, Settings) else copy.deepcopy(value)
        return out

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        setattr(self, key, value)

    def keys(self) -> list[str]:
        return [f.name for f in self.settings_fields()] + list(GROUPS)

    def freeze(self) -> RunSettings:
        """Read-only, every group's settings too (:meth:`Settings.freeze`)."""
        for group in GROUPS:
            value = getattr(self, group)
            if isinstance(value, Settings):
                value.freeze()
        super().freeze()
        return self


#: Settings of the run-level groups (one declaration each; their yaml files are presets).
RUN_GROUPS: dict[str, type[Settings]] = {"training": TrainingSettings, "simulation": SimulationSettings}
#: Groups whose options a ClientApp reads (its process loads no server code: the strategy and
#: selection settings reach it as sent, unvalidated).
CLIENT_GROUPS = ("objective", "dataset", "partition", "model", "training", "simulation")


def options(group: str) -> dict[str, type[Settings]]:
    """option -> settings class of a config group (declared in code, found by discovery)."""
    if group in RUN_GROUPS:
        return {"default": RUN_GROUPS[group]}
    return discover(group)


def registered_names(group: str) -> list[str]:
    """The option names declared for ``group``."""
    return sorted(options(group))


# =============================================================================== compose
#: Hydra group of the schema nodes that option files extend (``defaults: [/_defaults/<Class>@_here_]``).
DEFAULTS_GROUP = "_defaults"


def group_options(group: str) -> list[str]:
    """Names of the options of one config group: the declared ones and the presets in ``conf/<group>/``."""
    files = {p.stem for p in (CONF_DIR / group).glob("*.yaml")}
    return sorted(files | set(options(group)))


def register_defaults() -> None:
    """Hand every declaration's defaults to hydra (its ConfigStore), so that ``conf/`` only
    selects and overrides: an option without a yaml file of its own is its declaration's
    defaults (``strategy=fedmr``); an option file extends its class's schema node
    (``defaults: [/_defaults/ImageDatasetSettings@_here_]``). A strategy whose clients need an
    objective of their own (``companions``) selects it."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    _store_once(store, DEFAULTS_GROUP, RunSettings.__name__, RunSettings.hydra_node())
    for group in GROUPS:
        for option, cls in options(group).items():
            node = cls.hydra_node()
            _store_once(store, DEFAULTS_GROUP, cls.__name__, node)
            if (CONF_DIR / group / f"{option}.yaml").is_file():
                continue
            if cls.options_for:  # one declaration of several options: the option is its name
                node = {**node, "name": option}
            companions = {**companion_objectives(option), **getattr(cls, "companions", {})} if group == "strategy" else {}
            if companions:
                node = {"defaults": [{f"override /{g}@_global_.{g}": o} for g, o in companions.items()] + ["_self_"], **node}
            _store_once(store, group, option, node)


def companion_objectives(strategy: str) -> dict[str, str]:
    """``{"objective": X}`` when objective X's clients need the server method ``strategy`` (its
    declared ``server``): ``strategy=<it>`` selects that objective too."""
    paired = paired_objectives(strategy)
    return {"objective": paired[0]} if paired else {}


#: (group, name) -> (the node, hydra's entry) of each node :func:`register_defaults` stored.
_STORED: dict[tuple[str, str], tuple[dict[str, Any], Any]] = {}


def _store_once(store: Any, group: str, name: str, node: dict[str, Any]) -> None:
    """``store.store`` unless the ConfigStore still holds this very node there: hydra converts
    every node it is given to an OmegaConf config (a third of a second for all of them, on every
    compose before this)."""
    entry = store.repo.get(group, {}).get(f"{name}.yaml")
    kept = _STORED.get((group, name))
    if kept is not None and kept[1] is entry and kept[0] == node:
        return
    store.store(group=group, name=name, node=node)
    _STORED[(group, name)] = (copy.deepcopy(node), store.repo[group][f"{name}.yaml"])
    _COMPOSED.clear()  # a changed store composes anew


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


def compose(overrides: Sequence[str] = (), validate_config: bool = True) -> Any:
    """Compose ``conf/config.yaml`` with hydra overrides; validated (:class:`RunSettings`) unless
    ``validate_config`` is False (then the raw ``DictConfig``)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_defaults()
    for item in overrides:
        group = item.split("=", 1)[0].lstrip("+~")
        if group in GROUPS and "=" in item:
            error = unknown_option(group, item.split("=", 1)[1])
            if error is not None:
                raise error
    try:
        selecting, values = _split_overrides(overrides)
        key = (tuple(selecting), _conf_signature())
        base = _COMPOSED.pop(key, None)
        if base is None:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
                base = hydra_compose(config_name="config", overrides=selecting)
        _COMPOSED[key] = base  # the most recently used last
        while len(_COMPOSED) > COMPOSED_KEPT:
            _COMPOSED.pop(next(iter(_COMPOSED)))
        cfg = copy.deepcopy(base)
        for override in values:  # hydra would say "not in struct" and suggest the + form
            error = None if has_key(cfg, override.key_or_group) else unknown_key(cfg, override.key_or_group, override.value())
            if error is not None:
                raise error
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError("overrides", list(overrides), f"valid hydra overrides ({err})") from err
    if validate_config:
        return validate(cfg)
    return cfg


#: How a reader lists the options and the keys (what an unknown one's error ends with).
LIST_OPTIONS = "`fedmm --help` lists every group's options"
LIST_KEYS = "`fedmm --cfg job` prints every key"


def unknown_option(group: str, option: str) -> ConfigError | None:
    """None when ``option`` is an option of ``group``; else its error: the nearest option and how
    to list them, or, with none near, all of them (never hydra's list of one option per line)."""
    known = group_options(group)
    if option in known:
        return None
    near = difflib.get_close_matches(option, known, n=1, cutoff=0.75)  # options share prefixes (fed...)
    if near:
        return ConfigError(group, option, f"an option of {group} ({LIST_OPTIONS}); did you mean {near[0]}?")
    return ConfigError(group, option, ", ".join(known))


def has_key(cfg: DictConfig, key: str) -> bool:
    """Whether the composed ``cfg`` holds the dotted ``key``."""
    node: Any = OmegaConf.to_container(cfg, resolve=False)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def unknown_key(cfg: DictConfig, key: str, value: Any) -> ConfigError | None:
    """The error of a dotted ``key`` the composed ``cfg`` lacks, naming the nearest key: a near
    name beside it (``training.lrr`` -> ``training.lr``), else, for a key of a group or of the
    top level, a near name in any group (``strategy.lrr`` -> ``training.lr``). None when no key
    is near, or when ``key`` adds to an empty mapping (``+simulation.ray_init_args.namespace=x``):
    hydra's own message (use the ``+`` form) then stands."""
    data = OmegaConf.to_container(cfg, resolve=False)
    parent, _, leaf = key.rpartition(".")
    node: Any = data
    for part in parent.split(".") if parent else []:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict):  # the parent is unknown too: the nearest whole dotted key
        near = difflib.get_close_matches(key, _dotted_keys(data), n=1)
    elif not node:
        return None
    else:
        near = [f"{parent}.{n}" if parent else n for n in difflib.get_close_matches(leaf, [str(k) for k in node], n=1)]
        if not near and "." not in parent:  # a group's key or a top-level one: a near name in any group
            names: dict[str, str] = {}  # a name -> the first dotted key of that name
            for top, sub in data.items():
                names.setdefault(str(top), str(top))
                for name in sub if isinstance(sub, dict) else ():
                    names.setdefault(str(name), f"{top}.{name}")
            near = [names[n] for n in difflib.get_close_matches(leaf, list(names), n=1)]
    if not near:
        return None
    return ConfigError(key, value, f"an existing key ({LIST_KEYS}); did you mean {near[0]}?")


def _dotted_keys(data: Any, prefix: str = "") -> list[str]:
    out = []
    for k, v in (data.items() if isinstance(data, dict) else []):
        out.append(f"{prefix}{k}")
        out += _dotted_keys(v, f"{prefix}{k}.")
    return out


#: How many composed defaults lists :func:`compose` keeps (per process).
COMPOSED_KEPT = 32
#: (the overrides that shape the defaults list, conf/'s files) -> hydra's composed config, before
#: the value overrides. Hydra composes in ~0.3 s of CPU (it copies its whole config store and
#: re-reads every file each time); the tests and sweeps compose hundreds of times, mostly the same
#: few selections with other values. Cleared when :func:`register_defaults` stores anything new.
_COMPOSED: dict[tuple[Any, ...], DictConfig] = {}


def _conf_signature() -> tuple[tuple[str, int, int], ...]:
    """Every file of ``conf/`` with its size and modification time: an edited file composes anew."""
    found = []
    for path in CONF_DIR.rglob("*"):
        if path.is_file():
            stat = path.stat()
            found.append((str(path), stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(found))


def _split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[Any]]:
    """(the overrides that shape hydra's defaults list, the parsed value overrides that hydra
    applies after composing it). A value override is a plain ``key=value`` whose key is no config
    group (hydra's rule); a package, sweep or ``hydra`` key keeps an override with the defaults
    list, and any ``+``, ``++`` or ``~`` keeps them all there (hydra applies those in order with
    the value overrides)."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    if any(o.is_delete() or o.is_add() or o.is_force_add() for o in parsed):  # order then matters: all to hydra
        return list(overrides), []
    groups = set(ConfigStore.instance().repo) | {p.name for p in CONF_DIR.iterdir() if p.is_dir()} | {"hydra"}
    selecting: list[str] = []
    values: list[Any] = []
    for text, override in zip(overrides, parsed):
        key = override.key_or_group
        plain = override.package is None and not override.is_sweep_override() and "/" not in key
        if plain and key.split(".")[0] != "hydra" and ("." in key or key not in groups):
            values.append(override)
        else:
            selecting.append(text)
    return selecting, values


def compose_from_run_config(run_config: Mapping[str, Any]) -> RunSettings:
    """Validated settings of a ``flwr run``: run config → hydra overrides → compose, or, with
    ``resume``, the config of the run to continue (with the changes it allows)."""
    resume = run_config.get("resume", "")
    if resume:
        changes = [o for o in overrides_from_run_config({**run_config, "resume": ""})]
        return resume_config(str(resume), changes)
    return validate(compose(overrides_from_run_config(run_config), validate_config=False))


def to_container(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Plain, resolved dict (no hydra node, no settings object) suitable for JSON."""
    if isinstance(cfg, Settings):
        return cfg.to_dict()
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(plain(cfg))
    data = OmegaConf.to_container(node, resolve=True)
    data.pop("hydra", None)
    return data  # type: ignore[return-value]



def dumps(cfg: DictConfig | Mapping[str, Any]) -> str:
    """The resolved config as a compact JSON string (sent to clients in every message)."""
    return json.dumps(to_container(cfg), sort_keys=True)


# =============================================================================== validate
def declaration_of(group: str, values: Mapping[str, Any]) -> type[Settings]:
    """The settings class that a group's values select (``name``; the one declaration of the
    run-level groups); a ConfigError naming the options when none is declared in this process."""
    from fedmm.settings import renamed_option

    declared = options(group)
    cls = declared.get("default") if group in RUN_GROUPS else declared.get(values.get("name"))
    if cls is None and group not in RUN_GROUPS:
        cls = renamed_option(group, str(values.get("name")))
    if cls is None:
        raise ConfigError(f"{group}.name", values.get("name"),
                          ", ".join(declared) or f"(no {group} declared in this process: install its package)")
    return cls


def validate(cfg: DictConfig | Mapping[str, Any], groups: Sequence[str] = GROUPS) -> RunSettings:
    """Check every value before any training starts, in one pass over the declarations.

    Returns the run's :class:`RunSettings`. ``groups`` are the groups validated with their
    declarations (a ClientApp passes :data:`CLIENT_GROUPS`: the others are kept as sent). Raises
    :class:`ConfigError` on the first bad value, naming the key, the value and what is allowed.
    """
    if isinstance(cfg, RunSettings) and tuple(groups) == GROUPS:
        cfg = cfg.to_dict()
    c = to_container(cfg)
    top = {k: v for k, v in c.items() if k not in GROUPS}
    known = {f.name for f in RunSettings.settings_fields()} | set(GROUPS)
    for key in c:
        if key not in known:
            near = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise ConfigError(key, c[key], "the top-level keys " + ", ".join(sorted(known)) + hint)
    chosen: dict[str, Settings] = {}
    for group in GROUPS:
        values = c.get(group)
        if not isinstance(values, dict):
            raise ConfigError(group, values, ", ".join(group_options(group)))
        if group not in groups:
            chosen[group] = OtherSettings(values=values)
            continue
        chosen[group] = declaration_of(group, values).from_dict(values, f"{group}.")
    run = RunSettings.from_dict(top)
    for group, value in chosen.items():
        setattr(run, group, value)
    k = run.clients_per_round
    if not (is_int(k) and 1 <= k <= run.num_clients):
        raise ConfigError("clients_per_round", k, f"an integer from 1 to num_clients={run.num_clients}")
    for group in groups:
        getattr(run, group).check(run)
    return run.freeze()


@functools.lru_cache(maxsize=8)
def client_run(config_json: str) -> RunSettings:
    """The run's settings as a ClientApp reads them from a message's config record (the JSON of
    :meth:`RunSettings.to_dict`, validated by the server).

    Built without validation: the server checked every value, and some checks do not hold on a
    node (``dataset.path`` names the server's folder; a deployed node reads its own). The groups
    whose declarations this process does not load (:data:`CLIENT_GROUPS` aside) stay as sent; a
    group the config lacks (a test's or a bench's partial config) is empty. One object per
    distinct config: treat it as read-only.
    """
    c = json.loads(config_json)
    if not isinstance(c, dict):
        raise ConfigError("run config", config_json[:80], "a JSON object of the run's settings")
    run = RunSettings.lenient({k: v for k, v in c.items() if k not in GROUPS})
    for group in GROUPS:
        values = c.get(group, {})
        if not isinstance(values, dict):
            raise ConfigError(group, values, f"the {group} settings (a JSON object) in the run config")
        if group not in CLIENT_GROUPS or (not values and group not in RUN_GROUPS):
            setattr(run, group, OtherSettings(values=values))
            continue
        setattr(run, group, declaration_of(group, values).lenient(values))
    return run.freeze()


def as_run(cfg: RunSettings | DictConfig | Mapping[str, Any]) -> RunSettings:
    """``cfg`` as :class:`RunSettings` (validated when it is a plain config)."""
    return cfg if isinstance(cfg, RunSettings) else validate(cfg)


# =============================================================================== resume
#: Keys a resumed run may change: it continues the run's own config otherwise.
RESUME_CHANGEABLE = ("num_rounds", "checkpoint_every", "round_timeout", "max_failed_rounds", "min_nodes_timeout", "simulation",
                     "tracking")


def resume_config(run_dir: str | os.PathLike, changes: Mapping[str, Any] | Sequence[str] = ()) -> dict[str, Any]:
    """The config of the run in ``run_dir`` (its ``config.yaml``), to continue it.

    ``changes`` are hydra-style ``key=value`` overrides (or a dict) of the keys in
    :data:`RESUME_CHANGEABLE` (e.g. a larger ``num_rounds`` extends the run); any other key is a
    config error, because the continued run must be the same experiment.
    """
    import yaml

    path = resume_dir(run_dir)
    cfg = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8"))
    if isinstance(cfg, dict):  # a group or run-level key added after runs were made: what those runs used
        for key, default in {**_GROUPS_ADDED, **RunSettings.all_added()}.items():
            cfg.setdefault(key, copy.deepcopy(default))
        for group in GROUPS:  # keys declared after runs were made: the values those runs had
            values = cfg.get(group)
            if isinstance(values, dict):
                declared = options(group)
                cls = declared.get("default") if group in RUN_GROUPS else declared.get(values.get("name"))
                for key, value in (cls.all_added() if cls else {}).items():
                    values.setdefault(key, copy.deepcopy(value))
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


def resume_dir(run_dir: str | os.PathLike) -> Path:
    """The absolute directory of the run ``resume`` names; a ConfigError when it holds no run."""
    path = Path(os.path.expanduser(str(run_dir))).resolve()
    if not (path / "config.yaml").is_file():
        raise ConfigError("resume", str(run_dir), "the directory of a fedmm run (it holds config.yaml and checkpoint.pt)")
    return path


#: Config groups added after runs were made (a run written before used these options).
_GROUPS_ADDED = {"selection": {"name": "uniform"}, "server_optimizer": {"name": "none"}}


def _split_override(item: str) -> tuple[str, Any]:
    import yaml

    key, sep, value = item.lstrip("+").partition("=")
    if not sep:
        raise ConfigError("overrides", item, "key=value")
    return key, yaml.safe_load(value)


