"""The public API, listed in one place (``docs/api.md``), and the check that nothing in it goes away silently.

    python -m analysis.public_api            # rewrite docs/api.md from the code
    python -m analysis.public_api --check    # exit 1 when a public name went away without a
                                             # deprecation, or the page is stale

What users import and type, read from the code: the strategies package (its foundations and
every method class, with their constructor arguments), the client objectives' base, the
ClientApp builder, every setting's name (``group.option.key``, nested groups dotted), the
commands, ``fedmm-search``'s options, and the files a run directory holds. A name that leaves the
code must be deprecated first: a constructor argument renamed in
``strategies.base.RENAMED_ARGUMENTS``, a class in ``strategies.DEPRECATED``, a setting in its
declaration's ``retired`` or ``renamed``. ``tests/test_public_api.py`` fails when one goes away
otherwise, naming it, and when the committed page differs from the code (naming this command).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"
COMMAND = "python -m analysis.public_api"


def _parameters(obj: object) -> list[str]:
    """The names of a callable's parameters (a class: its constructor's), ``**kwargs`` as ``**``."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    out = []
    for p in list(inspect.signature(target).parameters.values())[1 if inspect.isclass(obj) else 0:]:
        out.append("**" if p.kind is p.VAR_KEYWORD else "*" if p.kind is p.VAR_POSITIONAL else p.name)
    return out


def _settings_names() -> list[str]:
    from fedmm.config import GROUPS, options
    from fedmm.settings import Settings

    def keys(cls: type[Settings], prefix: str) -> list[str]:
        out = []
        defaults = cls()
        for f in cls.settings_fields():
            value = getattr(defaults, f.name)
            out += keys(type(value), f"{prefix}{f.name}.") if isinstance(value, Settings) else [f"{prefix}{f.name}"]
        return out

    names = []
    for group in GROUPS:
        for option, cls in options(group).items():
            names += keys(cls, f"{group}.{option}." if option != "default" else f"{group}.")
    return sorted(set(names))


def surface() -> dict[str, list[str]]:
    """The public API, by part: each a sorted list of names (``name(arg, ...)`` for a callable)."""
    import strategies
    from client_app import client_app
    from launch import search
    from objectives import base as objectives
    from server_app.checkpoint import CHECKPOINT_FILE
    from server_app.tracking import FINAL_FILES

    names = {name: getattr(strategies, name) for name in strategies.__getattr__("__all__")}
    classes = sorted(f"{name}({', '.join(_parameters(obj))})" if callable(obj) else name for name, obj in names.items())
    hooks = sorted(name for name, value in vars(objectives.LocalUpdate).items() if not name.startswith("_") and callable(value))
    import tomllib

    scripts = sorted(tomllib.loads((PAGE.parent.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"])
    return {
        "strategies": classes,
        "objectives.base.LocalUpdate": hooks,
        "client_app.client_app": [f"build_app({', '.join(_parameters(client_app.build_app))})", "app"],
        "settings": _settings_names(),
        "commands": scripts,
        "fedmm-search": sorted(a for action in search.build_parser()._actions for a in action.option_strings
                               if a not in ("-h", "--help")),
        "run directory": sorted({*FINAL_FILES, CHECKPOINT_FILE, "label_histograms.json", "federated_evaluation.json"}),
    }


def deprecated() -> set[str]:
    """Names that may leave the surface: their deprecation stands in for them."""
    import strategies
    from fedmm.config import GROUPS, options
    from strategies.base import RENAMED_ARGUMENTS

    out = set(RENAMED_ARGUMENTS) | set(strategies.DEPRECATED)
    for group in GROUPS:
        for option, cls in options(group).items():
            prefix = f"{group}.{option}." if option != "default" else f"{group}."
            for klass in cls.__mro__:
                out |= {prefix + key for key in vars(klass).get("retired", {})}
            out |= {f"{group}.{old}." for old in getattr(cls, "renamed", {})}
    return out


def render() -> str:
    lines = ["# The public API", "",
             "What fedmm promises to keep: a name listed here goes away only after a deprecation (its old",
             "form keeps working, with a `DeprecationWarning` naming the new one, for at least one minor",
             "release; [CHANGELOG.md](../CHANGELOG.md) says when). Generated from the code by",
             f"`{COMMAND}`; `tests/test_public_api.py` fails when a name leaves without a deprecation.", ""]
    for part, names in surface().items():
        lines += [f"## {part}", "", *(f"- `{name}`" for name in names), ""]
    return "\n".join(lines)


def read(text: str) -> dict[str, list[str]]:
    """The parts and names of a page :func:`render` wrote."""
    parts: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = parts.setdefault(line[3:], [])
        elif current is not None and line.startswith("- `"):
            current.append(line[3:-1])
    return parts


def _key(name: str) -> str:
    return name.split("(", 1)[0]


def removed(committed: dict[str, list[str]], now: dict[str, list[str]]) -> list[str]:
    """What the committed list has and the code no longer has, without a deprecation: whole names,
    and a callable's arguments (``FedMR(num_models)``)."""
    old_names = deprecated()
    out = []
    for part, names in committed.items():
        current = {_key(n): n for n in now.get(part, [])}
        for name in names:
            key = _key(name)
            if key not in current:
                if not any(key == d or key.startswith(d) for d in old_names):
                    out.append(f"{part}: {name}")
                continue
            if "(" in name:
                args = [a for a in name[len(key) + 1:-1].split(", ") if a]
                kept = current[key][len(key) + 1:-1].split(", ")
                out += [f"{part}: {key}({a})" for a in args if a not in kept and a not in old_names]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when a name left without a deprecation or the page is stale")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page (default: docs/api.md)")
    args = parser.parse_args(argv)
    if args.check:
        committed = args.page.read_text(encoding="utf-8")
        gone = removed(read(committed), surface())
        for name in gone:
            print(f"gone without a deprecation: {name}", file=sys.stderr)
        if committed != render():
            print(f"{args.page} is stale: run {COMMAND}", file=sys.stderr)
        return 1 if gone or committed != render() else 0
    args.page.write_text(render(), encoding="utf-8")
    print(f"wrote {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
