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
    assert "strategies.method.Method" in modules["strategies.fedavg"]


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
    bad = literals_outside(wire, PACKAGES, REPO / "fedmm" / "protocol.py")
    assert not bad, bad


def literals_outside(values: set, packages: tuple[str, ...] | list[str], owner: Path) -> list[str]:
    """Where a string literal of ``values`` is written in the ``packages``' files other than ``owner``."""
    bad = []
    for package in packages:
        for path in (REPO / package).rglob("*.py"):
            if path == owner:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and node.value in values:
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    return bad


# ============================================================================ no list names a method
def test_the_strategies_package_lists_no_method_and_finds_each_by_its_name() -> None:
    """strategies/__init__.py names no method: a method class is found by its name among the
    declared methods (discovery), imports as ``from strategies import <Name>`` in a fresh
    interpreter, and is in ``__all__``; so a method is its own file, no list edited."""
    import strategies
    from fedmm.config import discover

    declared = sorted({cls.strategy_class.__name__ for cls in discover("strategy").values()})
    assert {"FedAvg", "FedMR", "FedCross", "FedMut", "FedBuff", "FedNova"} <= set(declared)  # discovery works
    source = (REPO / "strategies" / "__init__.py").read_text(encoding="utf-8")
    named = [name for name in declared if name in source]
    assert named == ["FedAvg", "FedCross", "FedMR", "FedMut"], named  # the docstring's example import only
    tree = ast.parse(source)
    code_names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not code_names & set(declared), code_names & set(declared)
    assert set(declared) <= set(strategies.__all__)
    code = ("import strategies\n"
            f"for name in {declared!r}:\n"
            "    exec(f'from strategies import {name}')\n"
            "    assert issubclass(getattr(strategies, name), strategies.Method), name\n"
            "print('imported', len(strategies.__all__))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and f"imported {len(strategies.__all__)}" in out.stdout, out.stderr[-2000:]
    with pytest.raises(ImportError):
        exec("from strategies import FedNothing")  # noqa: S102 - a name no method declares


# ============================================================================ safe loading
def python_files() -> list[Path]:
    """Every .py file of the repository (not the virtual environment's, not git's)."""
    skip = {".venv", ".git", "__pycache__", "node_modules"}
    return [p for p in sorted(REPO.rglob("*.py")) if not skip & set(p.relative_to(REPO).parts)]


def unsafe_loads(tree: ast.AST) -> list[int]:
    """Lines of calls that pass ``weights_only`` anything but the literal True (a pickle of
    arbitrary objects: loading it runs whatever code it names)."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            for kw in node.keywords if kw.arg == "weights_only" and not (isinstance(kw.value, ast.Constant) and kw.value.value is True)]


def test_no_file_of_the_repository_loads_a_pickle_with_weights_only_off() -> None:
    assert unsafe_loads(ast.parse("torch.load(path, weights_only=False)")) == [1]  # the check sees one
    bad = [f"{path.relative_to(REPO)}:{line}" for path in python_files()
           for line in unsafe_loads(ast.parse(path.read_text(encoding="utf-8")))]
    assert not bad, bad


# ============================================================================ the bench's API
PRODUCT = ("fedmm", "client_app", "server_app", "strategies", "objectives", "launch")


def private_product_names() -> set[str]:
    """Names with one leading underscore that the product defines: functions, classes,
    module and class attributes, ``self._x`` attributes."""
    names: set[str] = set()
    for package in PRODUCT:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        for sub in ast.walk(target):
                            if isinstance(sub, ast.Name):
                                names.add(sub.id)
                            elif isinstance(sub, ast.Attribute):
                                names.add(sub.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__") and n != "_"}


def private_uses(tree: ast.AST, private: set[str]) -> list[str]:
    """Where ``tree`` reaches a private product name: ``x._name`` (``self``/``cls`` aside: a bench
    class's own), ``from product import _name`` and a string ``"_name"`` (``getattr``, patches)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PRODUCT:
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names if a.name in private]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private:
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_the_bench_uses_no_private_name_of_the_product() -> None:
    """bench/ measures the product through its public API: a benchmark that patches a private
    function breaks silently when the product renames it (or times the wrong thing)."""
    private = private_product_names()
    assert {"_pending", "_classifier", "_encoded"} <= private  # the collector sees defs and self attributes
    planted = ast.parse("from strategies.base import _x\nstrategy._updates\naround(runner, '_encoded')")
    assert len(private_uses(planted, private | {"_x"})) == 3
    bad = [f"{path.relative_to(REPO)}:{use}" for path in sorted((REPO / "bench").glob("*.py"))
           for use in private_uses(ast.parse(path.read_text(encoding="utf-8")), private)]
    assert not bad, bad


# ============================================================================ secure names
def test_the_secure_recombination_names_live_beside_the_secure_code() -> None:
    """fedmm/protocol.py holds the names every method shares; the secure-recombination names are
    in fedmm/secure_protocol.py (and nowhere else as a distinctive string literal)."""
    from fedmm import protocol, secure_protocol

    def constants(path: Path) -> dict[str, object]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant) for t in node.targets if isinstance(t, ast.Name)}

    generic = constants(REPO / "fedmm" / "protocol.py")
    secure = constants(REPO / "fedmm" / "secure_protocol.py")
    assert len(secure) == 25 and all(name.startswith("SECURE") for name in secure)
    assert not [name for name in generic if name.startswith("SECURE")], sorted(generic)
    assert not [name for name in vars(protocol) if name.startswith("SECURE")]
    assert not set(secure.values()) & {v for v in generic.values() if isinstance(v, str) and "secure" in v}
    assert {name: getattr(secure_protocol, name) for name in secure} == secure
    # ("secure" alone is also the name of FedMR's settings group: not distinctive)
    distinctive = {v for v in secure.values() if "secure" in str(v) and v != "secure"}
    assert len(distinctive) == 7  # the four actions, secure-in, secure-out, secure-bytes-sealed
    bad = literals_outside(distinctive, (*PACKAGES, "objectives"), REPO / "fedmm" / "secure_protocol.py")
    assert not bad, bad


# ============================================================================ methods apart from their drivers
#: The limits of every class in strategies/ (issue 55: methods apart from the loops that drive them).
CLASS_LIMITS = {"lines": 250, "public_methods": 15}


def class_measures(source: str) -> list[tuple[str, int, int, int]]:
    """(name, lines, public methods its body defines, bases) of every top-level class of ``source``."""
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            public = [f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and not f.name.startswith("_")]
            out.append((node.name, node.end_lineno - node.lineno + 1, len(public), len(node.bases)))
    return out


def test_every_class_of_the_strategies_is_small_and_has_one_base() -> None:
    """No class in strategies/ is longer than 250 lines or defines more than 15 public methods,
    and none has more than one base (a method is one line of inheritance; a driver is composed)."""
    planted = "class A(B, C):\n    def a(self):\n        pass\n    def _b(self):\n        pass\n"
    assert class_measures(planted) == [("A", 5, 1, 2)]
    rows = [(path.name, *row) for path in sorted((REPO / "strategies").glob("*.py"))
            for row in class_measures(path.read_text(encoding="utf-8"))]
    big = [r for r in rows if r[2] > CLASS_LIMITS["lines"] or r[3] > CLASS_LIMITS["public_methods"]]
    assert not big, big
    several = [r for r in rows if r[4] > 1]
    assert not several, several


#: What a method file must not call: the defence stage and the robust means (the round's end and
#: the Mean a method is handed do).
DEFENCE_CALLS = {"defend", "Defence", "screen_and_bound", "byzfl_chain", "apply_chain", "refuse", "refused_settings",
                 "check_model", "krum_scores"}


def method_files() -> list[Path]:
    """The modules of strategies/ that declare a method (a ``Settings`` assigned in a class body)."""
    out = []
    for path in sorted((REPO / "strategies").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Assign) and any(getattr(t, "id", "") == "Settings"
                                                                                           for t in b.targets) for b in node.body)
               for node in tree.body):
            out.append(path)
    return out


def defence_calls(tree: ast.AST) -> list[str]:
    return [f"{n.lineno}: {ast.unparse(n.func)}" for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) in DEFENCE_CALLS or getattr(n.func, "attr", None) in DEFENCE_CALLS)]


def test_no_method_file_calls_a_defence_or_a_robust_mean() -> None:
    """A method asks for a mean through the Mean it is handed and never sees an update before the
    defence stage: no method file calls the stage or a robust mean."""
    files = method_files()
    assert {"fedavg.py", "fedmr.py", "fedbuff.py", "fednova.py"} <= {p.name for p in files}
    assert defence_calls(ast.parse("x = apply_chain(pre, agg, v)\ndefend(a)")) == ["1: apply_chain", "2: defend"]
    bad = [f"{path.name}:{call}" for path in files for call in defence_calls(ast.parse(path.read_text(encoding="utf-8")))]
    assert not bad, bad


def product_patches(tree: ast.AST) -> list[str]:
    """Where ``tree`` writes an attribute of a name it imported from this project's packages
    (``Defence.screen_and_bound = ...``, ``setattr(work, "local_data", ...)``): a patch of the product."""
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in PRODUCT}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PRODUCT:
            imported |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        for target in targets:
            base = target
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(target, ast.Attribute) and isinstance(base, ast.Name) and base.id in imported:
                found.append(f"{node.lineno}: {ast.unparse(target)}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args \
                and isinstance(node.args[0], ast.Name) and node.args[0].id in imported:
            found.append(f"{node.lineno}: setattr({node.args[0].id}, ...)")
    return found


def test_the_bench_patches_nothing_of_the_product() -> None:
    """bench/ observes runs (fedmm/observers.py) and calls the product's public API; it writes no
    attribute of a product module or class."""
    planted = ast.parse("from strategies.defence import Defence\nfrom client_app import work\n"
                        "Defence.screen_and_bound = f\nsetattr(work, 'local_data', g)\nimport torch\ntorch.x = 1\n")
    assert product_patches(planted) == ["3: Defence.screen_and_bound", "4: setattr(work, ...)"]
    bad = [f"{path.name}:{patch}" for path in sorted((REPO / "bench").glob("*.py"))
           for patch in product_patches(ast.parse(path.read_text(encoding="utf-8")))]
    assert not bad, bad


def test_the_rounds_share_one_start_one_end_and_one_reply_check() -> None:
    """The synchronous, asynchronous and secure rounds start with ``rounds.begin`` and end with
    ``rounds.end`` (the end of a round written once), and check a train reply with the ledger's
    ``ReplyCheck``; the secure relay writes none of the strategy's state; no round module probes
    a declared field with getattr/hasattr and a literal name."""
    loop = ["base", "context", "rounds", "stages", "drivers", "ledger", "asynchronous", "secure_recombination", "heterogeneity",
            "evaluation", "loop_log"]
    trees = {name: ast.parse((REPO / "strategies" / f"{name}.py").read_text(encoding="utf-8")) for name in loop}

    def calls(tree: ast.AST, name: str) -> list[ast.Call]:
        return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and
                (getattr(n.func, "attr", None) == name or getattr(n.func, "id", None) == name)]

    assert [name for name, tree in trees.items() if calls(tree, "decode_train_reply")] == ["ledger"]
    assert [name for name, tree in trees.items() if calls(tree, "record_to_model")] == ["rounds"]
    assert {name for name, tree in trees.items() if calls(tree, "begin")} == {"rounds", "asynchronous", "secure_recombination"}
    assert {name for name, tree in trees.items() if calls(tree, "end")} == {"rounds", "asynchronous"}  # secure ends as the synchronous round
    assert [name for name, tree in trees.items() if calls(tree, "defend")] == ["stages"]
    writes = [ast.unparse(t) for n in ast.walk(trees["secure_recombination"]) if isinstance(n, (ast.Assign, ast.AugAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
              if isinstance(t, (ast.Attribute, ast.Subscript)) and ast.unparse(t).startswith(("s.", "strategy.", "self._strategy."))]
    assert not writes, writes
    probes = [f"{name}:{n.lineno}" for name, tree in trees.items() for n in calls(tree, "getattr") + calls(tree, "hasattr")
              if len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and (n.func.id == "hasattr" or len(n.args) == 3)]
    assert not probes, probes
