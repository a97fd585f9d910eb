"""Settings declared once: one dataclass per configurable thing, found without registries.

A method, a client objective, a dataset, a partition or a model declares its settings as a
dataclass next to the code that uses them::

    @dataclass
    class FedMRSettings(StrategySettings):
        option = "fedmr"
        title = "FedMR"
        first_stage_rounds: int = setting(0, Int(min=0), "rounds of plain aggregation first",
                                          paper="0 (CNN), 100 (ResNet-20, VGG-16)", label="first stage {}")

That one declaration is at once

- the config schema with validation (:meth:`Settings.from_dict`: unknown keys name the nearest
  valid one, every value is checked by its rule, :meth:`Settings.check` adds rules across keys);
- the defaults: :func:`fedmm.config.compose` hands them to hydra, so ``conf/`` only selects and
  overrides (``strategy=fedmr strategy.first_stage_rounds=5``);
- what ``config.yaml`` and ``summary.json`` record (:meth:`Settings.to_dict`);
- the label of a run in reports (:meth:`Settings.label_parts`: the settings that differ from the
  defaults, each with its ``label`` format);
- the settings reference (``python -m tools.settings_reference``).

Classes register themselves when their module is imported (``option`` names them within their
``group``). :func:`discover` imports the modules that may declare a group's options: this project's
own packages and every package or module named by an ``importlib.metadata`` entry point of the
group ``fedmm.<group>`` (e.g. ``fedmm.strategy``), so that a method in a user's own installed
package is found exactly as ours are.

This module is the ground: it imports nothing of the project but :mod:`fedmm.errors`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import math
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from importlib import metadata
from typing import Any, ClassVar

from fedmm.errors import ConfigError


# =============================================================================== rules
class Rule:
    """One value's rule: ``check(key, value)`` raises :class:`ConfigError` or passes."""

    allowed = "a value"

    def ok(self, value: Any) -> bool:  # pragma: no cover - every rule overrides it
        raise NotImplementedError

    def check(self, key: str, value: Any) -> None:
        if not self.ok(value):
            raise ConfigError(key, value, self.allowed)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Int(Rule):
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
        return is_int(value) and (self.min is None or value >= self.min) and (self.max is None or value <= self.max)


class Number(Rule):
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
        return is_number(value) and (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )


class Choice(Rule):
    """One of the listed values."""

    def __init__(self, *options: Any) -> None:
        self.options = options
        self.allowed = ", ".join(str(o) for o in options)

    def ok(self, value: Any) -> bool:
        return any(value == o and type(value) is type(o) for o in self.options)


class Bool(Rule):
    allowed = "true or false"

    def ok(self, value: Any) -> bool:
        return isinstance(value, bool)


class Str(Rule):
    allowed = "a string"

    def ok(self, value: Any) -> bool:
        return isinstance(value, str)


class Nullable(Rule):
    """``null`` or what ``inner`` allows."""

    def __init__(self, inner: Rule, allowed: str | None = None) -> None:
        self.inner = inner
        self.allowed = allowed or f"null or {inner.allowed}"

    def ok(self, value: Any) -> bool:
        return value is None or self.inner.ok(value)


class ListOf(Rule):
    """A list whose items ``inner`` allows."""

    def __init__(self, inner: Rule, allowed: str | None = None) -> None:
        self.inner = inner
        self.allowed = allowed or f"a list of {inner.allowed}"

    def ok(self, value: Any) -> bool:
        return isinstance(value, (list, tuple)) and all(self.inner.ok(v) for v in value)


class MapOf(Rule):
    """A mapping from names to values that ``inner`` allows."""

    def __init__(self, inner: Rule, allowed: str | None = None) -> None:
        self.inner = inner
        self.allowed = allowed or f"a mapping of names to {inner.allowed}"

    def ok(self, value: Any) -> bool:
        return isinstance(value, Mapping) and all(isinstance(k, str) and self.inner.ok(v) for k, v in value.items())


class AnyValue(Rule):
    """Anything (checked elsewhere, e.g. by :meth:`Settings.check`)."""

    allowed = "any value"

    def ok(self, value: Any) -> bool:
        return True


# =============================================================================== declaration
def setting(default: Any, rule: Rule | None = None, help: str = "", *, paper: str | None = None,  # noqa: A002
            label: str | None = None, node: Any = MISSING) -> Any:
    """One setting: its default, its rule, what it means, the paper's value and how a report
    labels a run whose value differs from the default (``"first stage {}"``; None: not named).

    ``node`` is what hydra gets as the default when it differs from the Python default (an
    interpolation such as ``${oc.select:objective.projection_dim,null}``).
    """
    meta = {"rule": rule or AnyValue(), "help": help, "paper": paper, "label": label, "node": node}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    if dataclasses.is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


#: (group, option) -> settings class; filled as modules declaring settings are imported.
_DECLARED: dict[tuple[str, str], type[Settings]] = {}
#: (group, an option's former name) -> the settings class that took it over (``Settings.renamed``).
_RENAMED: dict[tuple[str, str], type[Settings]] = {}


def merged(base: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``values`` over it, nested mappings merged key by key."""
    out = dict(base)
    for key, value in values.items():
        out[key] = merged(out[key], value) if isinstance(out.get(key), Mapping) and isinstance(value, Mapping) else value
    return out


def renamed_option(group: str, option: str) -> type[Settings] | None:
    """The declaration that took over a former option of ``group`` (None: none did)."""
    return _RENAMED.get((group, option))


@dataclass
class Settings:
    """Base of every settings declaration (a dataclass).

    Class attributes (not settings): ``group`` (the config group), ``option`` (the name that
    selects this class in its group; ``name`` in the config), ``title`` (how papers name it),
    ``keyed`` (False for groups without a ``name`` key: ``training``, ``simulation``, or where
    ``name`` is a setting itself: ``dataset``, with ``options_for`` the names it declares),
    ``added`` (keys declared after runs were made,
    with the value that reproduces those runs: a resumed old run gets it), ``retired`` (keys no
    longer declared, each with a function from its recorded value to the declared keys that do
    what it did: ``{}`` when its value is what the defaults do; it raises a :class:`ConfigError`
    when no declared setting does it), ``renamed`` (options that were declarations of their own,
    each with the values of this one that do what it did: a run made then reads as this option).
    """

    group: ClassVar[str] = ""
    option: ClassVar[str] = ""
    title: ClassVar[str] = ""
    keyed: ClassVar[bool] = True
    added: ClassVar[dict[str, Any]] = {}
    retired: ClassVar[dict[str, Callable[[Any], dict[str, Any]]]] = {}
    renamed: ClassVar[dict[str, dict[str, Any]]] = {}
    options_for: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("option") and cls.group:
            _DECLARED[(cls.group, cls.option)] = cls
        for old in cls.__dict__.get("renamed", {}):  # an option that was its own: a run made then
            _RENAMED[(cls.group, old)] = cls
        for option in cls.__dict__.get("options_for", ()):  # one declaration for several options (datasets)
            _DECLARED[(cls.group, option)] = cls

    # ------------------------------------------------------------------ schema
    @classmethod
    def all_added(cls) -> dict[str, Any]:
        """``added`` of this declaration and every one it extends (a subclass adds its own)."""
        out: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            out.update(klass.__dict__.get("added", {}))
        return out

    @classmethod
    def settings_fields(cls) -> list[dataclasses.Field]:
        return [f for f in fields(cls) if f.init]

    @classmethod
    def defaults(cls) -> Settings:
        """An instance with every default."""
        return cls()

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], prefix: str = "") -> Settings:
        """Validate ``values`` (``name`` aside) against the declaration; return the settings.

        Unknown keys name the nearest valid one; a missing key is an error unless it is in
        ``added``; nested settings are checked with their own declaration.
        """
        declared = {f.name: f for f in cls.settings_fields()}
        values = merged(cls.renamed.get(values.get("name", ""), {}) if cls.keyed else {}, values)
        values = {k: v for k, v in values.items() if not (cls.keyed and k == "name")}
        for key in [k for k in values if k in cls.retired and k not in declared]:  # a run made before they went
            old = values.pop(key)
            values = merged(cls.retired[key](old), values)
        for key in values:
            if key not in declared:
                near = difflib.get_close_matches(str(key), list(declared), n=1)
                hint = f"; did you mean {prefix}{near[0]}?" if near else ""
                allowed = ", ".join(declared) or "no keys"
                raise ConfigError(f"{prefix}{key}", values[key], f"the keys of {prefix.rstrip('.') or 'the config'}: {allowed}{hint}")
        kwargs: dict[str, Any] = {}
        for name, f in declared.items():
            if name in values:
                value = values[name]
            elif name in cls.all_added():
                value = copy.deepcopy(cls.all_added()[name])
            else:
                raise ConfigError(f"{prefix}{name}", None, f"a value (the key is missing; {f.metadata.get('rule', AnyValue()).allowed})")
            nested = _nested_class(f)
            if nested is not None:
                if isinstance(value, Settings):
                    value = value.to_dict()
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{prefix}{name}", value, f"a mapping with the keys {', '.join(x.name for x in nested.settings_fields())}")
                value = nested.from_dict(value, f"{prefix}{name}.")
            else:
                f.metadata.get("rule", AnyValue()).check(f"{prefix}{name}", value)
                value = copy.deepcopy(value)
            kwargs[name] = value
        obj = cls(**kwargs)
        obj.check_values(prefix)
        return obj

    @classmethod
    def lenient(cls, values: Mapping[str, Any]) -> Settings:
        """Settings from recorded values without validation (reports read old runs): keys the
        run did not have get their default, keys no longer declared are left out (or read as the
        settings that took them over: ``renamed``, ``retired``, where that can be done)."""
        values = merged(cls.renamed.get(values.get("name", ""), {}) if cls.keyed else {}, values)
        for key in [k for k in values if k in cls.retired and k not in cls.__dataclass_fields__]:
            try:
                values = merged(cls.retired[key](values[key]), {k: v for k, v in values.items() if k != key})
            except Exception:  # noqa: BLE001 - a value no setting does now: left out, as keys no longer declared
                pass
        kwargs: dict[str, Any] = {}
        for f in cls.settings_fields():
            if f.name not in values:
                continue
            nested = _nested_class(f)
            value = values[f.name]
            kwargs[f.name] = nested.lenient(value) if nested is not None and isinstance(value, Mapping) else value
        return cls(**kwargs)

    def freeze(self) -> Settings:
        """Make these settings (and the nested ones) read-only: a run's settings never change
        after validation (:meth:`replace` makes a changed copy). Returns them."""
        for f in self.settings_fields():
            value = getattr(self, f.name)
            if isinstance(value, Settings):
                value.freeze()
        object.__setattr__(self, "_frozen", True)
        return self

    @property
    def frozen(self) -> bool:
        return bool(self.__dict__.get("_frozen"))

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise AttributeError(f"{type(self).__name__}.{name}: a run's settings are read-only once validated "
                                 f"(make a changed copy with .replace({name}=...))")
        object.__setattr__(self, name, value)

    def check_values(self, prefix: str) -> None:
        """Rules across this declaration's own keys (after each key passed its rule)."""

    def check(self, run: Any) -> None:
        """Rules across groups, with the whole run's settings (:class:`fedmm.config.RunSettings`)."""

    def replace(self, **changes: Any) -> Settings:
        """A validated copy with ``changes`` (a nested group's changes merge into its settings:
        ``replace(privacy={"clip_norm": 1.0})`` keeps the other privacy settings)."""
        values = self.to_dict()
        for key, value in changes.items():
            nested = isinstance(getattr(self, key, None), Settings) and isinstance(value, Mapping)
            values[key] = merged(values[key], value) if nested else value
        return type(self).from_dict(values)

    # ------------------------------------------------------------------ records
    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values (``name`` first where the group has one): what the
        config record, ``config.yaml`` and ``summary.json`` hold."""
        out: dict[str, Any] = {"name": self.option} if self.keyed and self.option else {}
        for f in self.settings_fields():
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, Settings) else copy.deepcopy(value)
        return out

    @classmethod
    def hydra_node(cls) -> dict[str, Any]:
        """The defaults as hydra sees them (``node=`` interpolations in place of their value)."""
        defaults = cls.defaults()
        node = defaults.to_dict()
        for f in cls.settings_fields():
            if f.metadata.get("node", MISSING) is not MISSING:
                node[f.name] = f.metadata["node"]
            nested = _nested_class(f)
            if nested is not None:  # its own node, with the values this declaration's default changes
                own, theirs = getattr(defaults, f.name).to_dict(), nested.defaults().to_dict()
                node[f.name] = {**nested.hydra_node(), **{k: v for k, v in own.items() if v != theirs.get(k)}}
        return node

    def differences(self) -> dict[str, Any]:
        """The settings whose value differs from the declared default (nested: dotted keys)."""
        default = self.defaults()
        out: dict[str, Any] = {}
        for f in self.settings_fields():
            mine, theirs = getattr(self, f.name), getattr(default, f.name)
            if isinstance(mine, Settings):
                out.update({f"{f.name}.{k}": v for k, v in mine.differences().items()})
            elif mine != theirs:
                out[f.name] = mine
        return out

    def label_parts(self) -> list[str]:
        """How a report names what differs from the defaults: each differing setting with a
        ``label`` format, in declaration order (nested settings: their own parts)."""
        default = self.defaults()
        parts: list[str] = []
        for f in self.settings_fields():
            mine = getattr(self, f.name)
            if isinstance(mine, Settings):
                parts.extend(mine.label_parts())
            elif f.metadata.get("label") and mine != getattr(default, f.name):
                parts.append(f.metadata["label"].format(" + ".join(map(str, mine)) if isinstance(mine, (list, tuple)) else mine))
        return parts

    @property
    def display(self) -> str:
        """How papers name this option with these settings (``title``; a declaration may name
        variants: FedMR with partition_ratio 1.0 is "Indep")."""
        return self.title or self.option or type(self).__name__

    # ------------------------------------------------------------------ read access
    @property
    def name(self) -> str:
        return self.option

    def __getitem__(self, key: str) -> Any:
        if key == "name" and self.keyed:
            return self.option
        if key in self.__dataclass_fields__:
            return getattr(self, key)
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return (key == "name" and self.keyed) or key in self.__dataclass_fields__

    def keys(self) -> list[str]:
        return list(self.to_dict())

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def items(self) -> list[tuple[str, Any]]:
        return [(k, self[k]) for k in self.keys()]


Mapping.register(Settings)


def plain(value: Any) -> Any:
    """``value`` with every settings object (at any depth of mappings) as its plain dict."""
    if isinstance(value, Settings):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value


def _nested_class(f: dataclasses.Field) -> type[Settings] | None:
    """The settings class of a nested field (``secure`` of FedMR), or None."""
    if f.default_factory is not MISSING:  # type: ignore[misc]
        try:
            value = f.default_factory()  # type: ignore[misc]
        except TypeError:
            return None
        if isinstance(value, Settings):
            return type(value)
    return None


@dataclass
class OtherSettings(Settings):
    """The settings of a group whose declarations this process does not load (a ClientApp
    reads the ``strategy`` group without importing server code): the values as sent, read-only."""

    values: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.values.get("name", ""))

    @property
    def display(self) -> str:
        return self.name

    def __getattr__(self, key: str) -> Any:
        values = self.__dict__.get("values", {})
        if key in values:
            return values[key]
        raise AttributeError(key)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __contains__(self, key: object) -> bool:
        return key in self.values

    def keys(self) -> list[str]:
        return list(self.values)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.values)


# =============================================================================== discovery
#: Where this project's own declarations of each group live (packages are scanned module by
#: module). Other packages add theirs through ``fedmm.<group>`` entry points.
OWN_PACKAGES: dict[str, tuple[str, ...]] = {
    "strategy": ("strategies",),
    "selection": ("strategies",),
    "server_optimizer": ("strategies",),
    "objective": ("objectives",),
    "dataset": ("fedmm.data",),
    "partition": ("fedmm.data",),
    "model": ("fedmm.models",),
}
ENTRY_POINT_PREFIX = "fedmm."
_IMPORTED: set[str] = set()


def _import_tree(name: str) -> None:
    """Import a module, or a package and every module below it."""
    if name in _IMPORTED:
        return
    module = importlib.import_module(name)
    _IMPORTED.add(name)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []) or [], prefix=f"{name}."):
        if info.name not in _IMPORTED:
            importlib.import_module(info.name)
            _IMPORTED.add(info.name)


def entry_point_targets(group: str) -> list[str]:
    """The modules or packages that installed distributions declare for ``fedmm.<group>``."""
    return sorted({ep.value.split(":", 1)[0] for ep in metadata.entry_points(group=ENTRY_POINT_PREFIX + group)})


#: Groups whose modules this process has imported (the installed distributions do not change
#: while it runs: a ClientApp discovers its objectives once, not per message).
_DISCOVERED: set[str] = set()


def discover(group: str) -> dict[str, type[Settings]]:
    """option -> settings class of ``group``: this project's packages and every entry point's."""
    if group not in _DISCOVERED:
        for name in OWN_PACKAGES.get(group, ()) + tuple(entry_point_targets(group)):
            _import_tree(name)
        _DISCOVERED.add(group)
    return {option: cls for (g, option), cls in sorted(_DECLARED.items()) if g == group}


def paired_objectives(strategy: str) -> list[str]:
    """The objectives whose clients need the server method ``strategy`` (their declared ``server``):
    ``strategy=<it>`` selects the first, and takes no other."""
    return sorted(name for name, cls in discover("objective").items() if getattr(cls, "server", "") == strategy)


def declared(group: str) -> dict[str, type[Settings]]:
    """option -> settings class of ``group`` among the modules already imported (no import)."""
    return {option: cls for (g, option), cls in sorted(_DECLARED.items()) if g == group}
