"""The layers and their rules (docs/architecture.md), checked by parsing every import."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("fedmm", "client_app", "server_app", "strategies")
#: The composition root: may import both apps; nothing imports it.
ROOT = {"launch.cli", "fedmm.__main__"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module an import statement of ``path`` names (absolute names; relative ones resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = module_name(path).split(".")
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here[: len(here) - node.level + (1 if path.name == "__init__.py" else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def all_modules() -> dict[str, set[str]]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            out[module_name(path)] = imports_of(path)
    return out


def top(name: str) -> str:
    return name.split(".", 1)[0]


def test_the_parser_sees_imports() -> None:
    modules = all_modules()
    assert "fedmm.protocol" in modules["client_app.client_app"]
    assert "strategies.base" in modules["strategies.fedavg"] or "strategies.base.RoundLoopStrategy" in modules["strategies.fedavg"]


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        # the ground: the shared library knows no method, no app, no tool
        ("fedmm", {"objectives", "strategies", "client_app", "server_app", "analysis", "launch"}),
        ("objectives", {"strategies", "client_app", "server_app", "analysis", "launch"}),  # the client's half of a method
        ("strategies", {"client_app", "server_app", "analysis", "launch"}),  # the server's half (may name its objective's records)
        ("client_app", {"strategies", "server_app", "analysis", "launch"}),  # a ClientApp never loads server code
        ("server_app", {"client_app", "analysis", "launch"}),  # the ServerApp loads no client code
        ("analysis", {"launch", "client_app", "server_app"}),  # reports read run directories and declarations
    ],
)
def test_layers_point_one_way(layer: str, forbidden: set[str]) -> None:
    bad = [
        f"{module} imports {name}"
        for module, names in all_modules().items()
        if top(module) == layer and module not in ROOT
        for name in names
        if top(name) in forbidden
    ]
    assert not bad, bad


def resolved_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (``from pkg import submodule`` is an arrow to the
    submodule; a module's own enclosing packages, which Python imports first anyway, are no arrow)."""
    modules = all_modules()
    names = set(modules)

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            candidate = ".".join(parts[:i])
            if candidate in names:
                return candidate
        return None

    graph = {}
    for module, imported in modules.items():
        targets = {resolve(n) for n in imported} - {None, module}
        targets = {t for t in targets if not module.startswith(t + ".")}
        # `from pkg import sub` names both pkg and pkg.sub: the arrow is to the submodule
        targets = {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle() -> None:
    """Every import, top-level or inside a function, points one way: no module reaches itself."""
    assert cycles(resolved_graph()) == []


def test_the_circle_check_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_imports_the_composition_root() -> None:
    bad = [
        f"{module} imports {name}"
        for module, names in all_modules().items()
        if module not in ROOT
        for name in names
        if name in ROOT or any(name.startswith(r + ".") for r in ROOT)
    ]
    assert not bad, bad


def test_importing_the_client_app_loads_no_server_code() -> None:
    """A ClientApp process loads neither our strategies nor our ServerApp, and no part of
    ``flwr.serverapp`` beyond what ``import flwr.clientapp`` itself loads (Flower 1.41's and 1.42's own
    compat layer imports some of it)."""
    code = (
        "import sys, json\n"
        "import flwr.clientapp\n"
        "base = {m for m in sys.modules if m.startswith('flwr.serverapp')}\n"
        "import client_app.client_app\n"
        "ours = sorted(m for m in sys.modules if m.split('.')[0] in ('strategies', 'server_app'))\n"
        "extra = sorted(m for m in sys.modules if m.startswith('flwr.serverapp') and m not in base)\n"
        "print(json.dumps({'ours': ours, 'extra': extra}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == {"ours": [], "extra": []}


def test_wire_keys_are_defined_only_in_the_protocol_module() -> None:
    """The wire names appear as string literals only in fedmm/protocol.py."""
    from fedmm import protocol

    wire = {protocol.SERVER_ROUND, protocol.MODEL_INDEX, protocol.RUN_CONFIG, protocol.NUM_EXAMPLES,
            protocol.ROSTER_QUERY, protocol.NODE_KEY}
    bad = []
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if path == REPO / "fedmm" / "protocol.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and node.value in wire:
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    assert not bad, bad
