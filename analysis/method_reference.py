"""Write the docs' lists of methods from their declarations (nothing in them is written by hand).

    python -m analysis.method_reference            # rewrite the generated blocks of the pages below
    python -m analysis.method_reference --check    # exit 1 when a committed block is stale

Three pages carry a block this writes between its markers:

- ``docs/methods.md``: every method, objective, selector and server optimizer found by discovery
  (:func:`fedmm.config.options`), with its module, what its module docstring says it is, and for
  a method what it holds, what it releases under differential privacy and the drivers it runs
  under (its declarations: :mod:`strategies.method`);
- ``docs/usage.md``: the options and presets of those config groups;
- ``docs/privacy.md``: what each stage of the round's end refuses for each method
  (:func:`strategies.stages.refusal_table`), and why.

``tests/test_discovery.py`` fails when a committed block differs from what this writes, naming
this command: a new method's rows appear with its files.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

from analysis.settings_reference import _presets
from fedmm.config import options

DOCS = Path(__file__).resolve().parent.parent / "docs"
COMMAND = "python -m analysis.method_reference"
#: The config groups whose options are methods, in the order the pages list them.
GROUPS = ("strategy", "objective", "selection", "server_optimizer")


def _class_of(group: str, settings: type) -> type | None:
    """The class a declaration builds (a method, an objective, a selector's settings, an optimizer)."""
    attribute = {"strategy": "strategy_class", "objective": "objective_class", "server_optimizer": "optimizer_class"}.get(group)
    return getattr(settings, attribute, None) if attribute else settings


def _summary(group: str, settings: type) -> str:
    """What an option is, on one line: the first paragraph of the docstring of the module that
    declares it (of its declaration, where a module declares several options of the group)."""
    module = sys.modules[settings.__module__]
    alone = sum(s.__module__ == settings.__module__ for s in options(group).values()) == 1
    doc = inspect.getdoc(module) if alone else inspect.getdoc(settings)
    first = (doc or "").split("\n\n")[0]
    return _cell(re.sub(r"\s+", " ", first).strip())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _file(cls: type | None) -> str:
    """The file that declares ``cls`` (a package's ``__init__.py`` for a class declared there)."""
    if cls is None:
        return ""
    path = Path(inspect.getfile(cls)).resolve()
    return f"`{path.relative_to(DOCS.parent).as_posix()}`" if path.is_relative_to(DOCS.parent) else f"`{cls.__module__}`"


def _name(settings: type) -> str:
    return settings.title or settings.option


def methods_block() -> str:
    """The tables of docs/methods.md."""
    from strategies.contract import Refused, release_of

    out = []
    for group in GROUPS:
        declared = options(group)
        if group == "strategy":
            out += ["| method | `strategy=` | holds | under DP releases | drivers | where | what it is |", "|---|---|---|---|---|---|---|"]
            for option, settings in declared.items():
                cls = _class_of(group, settings)
                release = release_of(cls)
                dp = "refused" if isinstance(release, Refused) or release is None else f"its {release}"
                paired = [name for name, s in options("objective").items() if getattr(s, "server", "") == option]
                where = ", ".join([_file(cls), *(_file(_class_of("objective", options("objective")[p])) for p in paired)])
                out.append(f"| {_name(settings)} | `{option}` | {cls.holds} | {dp} | {', '.join(cls.drivers)} | {where} | "
                           f"{_summary(group, settings)} |")
        else:
            out += ["", f"| {group.replace('_', ' ')} | `{group}=` | where | what it is |", "|---|---|---|---|"]
            for option, settings in declared.items():
                out.append(f"| {_name(settings)} | `{option}` | {_file(settings)} | {_summary(group, settings)} |")
    return "\n".join(out)


def usage_block() -> str:
    """The option table of docs/usage.md."""
    out = ["| group | options (declared in code) | presets (`conf/<group>/`) |", "|---|---|---|"]
    for group in GROUPS:
        declared = options(group)
        names = []
        for option, settings in declared.items():
            server = getattr(settings, "server", "")
            names.append(f"`{option}`" + (f" (with `strategy={server}` only)" if server else ""))
        presets = [f"`{p}` ({base})" for p, base in _presets(group).items()]
        out.append(f"| `{group}` | {', '.join(names)} | {', '.join(presets) or '—'} |")
    return "\n".join(out)


def privacy_block() -> str:
    """The refusal table of docs/privacy.md."""
    from strategies.stages import refusal_table

    from strategies.privacy import REFUSED_WITH

    methods = {option: _class_of("strategy", settings) for option, settings in options("strategy").items()}
    rows = [(option, stage, key, why) for option, stage, key, why in refusal_table(methods) if key.startswith("strategy.privacy")]
    out = ["| method | stage | refused | why |", "|---|---|---|---|"]
    out += [f"| `strategy={option}` | {stage} | `{key}` | {_cell(why)} |" for option, stage, key, why in rows]
    out += [f"| any, with {setting} | dp_clip | `strategy.privacy.clip_norm` | {_cell(why)} |" for setting, why in REFUSED_WITH]
    return "\n".join(out)


#: page -> (block name, what writes it)
BLOCKS = {"methods.md": ("methods", methods_block), "usage.md": ("groups", usage_block), "privacy.md": ("refusals", privacy_block)}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}: generated by {COMMAND}; do not edit -->", f"<!-- /{name} -->"


def rendered(page: str, text: str) -> str:
    """``text`` (a page) with its block as the declarations write it."""
    name, write = BLOCKS[page]
    begin, end = _markers(name)
    if begin not in text or end not in text:
        raise ValueError(f"docs/{page} has no {begin} ... {end} block")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{write()}\n{end}{tail}"


def stale(docs: Path = DOCS) -> list[str]:
    """The pages whose committed block differs from what the declarations write."""
    return [page for page in BLOCKS if (docs / page).read_text(encoding="utf-8") != rendered(page, (docs / page).read_text(encoding="utf-8"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when a committed block is stale (write nothing)")
    parser.add_argument("--docs", default=str(DOCS), help="the folder of the pages (default: docs/)")
    args = parser.parse_args(argv)
    docs = Path(args.docs)
    if args.check:
        pages = stale(docs)
        for page in pages:
            print(f"docs/{page} is stale: run {COMMAND}", file=sys.stderr)
        return 1 if pages else 0
    for page in BLOCKS:
        path = docs / page
        path.write_text(rendered(page, path.read_text(encoding="utf-8")), encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
