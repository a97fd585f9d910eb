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
ROOT = {"fedmm.cli", "fedmm.__main__"}


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
        ("fedmm", {"client_app", "server_app", "strategies"}),  # the shared library knows no app
        ("client_app", {"strategies", "server_app"}),  # a ClientApp never loads server code
        ("strategies", {"client_app", "server_app"}),  # strategies never import an app
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
    ``flwr.serverapp`` beyond what ``import flwr.clientapp`` itself loads (Flower 1.41's own
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
