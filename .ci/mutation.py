"""A small mutation tester: operator and constant mutations of one module, each run against chosen tests.

    .venv/bin/python .ci/mutation.py strategies/privacy.py --tests tests/test_privacy_groups.py tests/test_privacy.py
        [--deselect NAME ...] [--only FUNC ...] [--limit N] [--timeout 120] [--out result.json] [--list]

Each mutant changes one thing in the module's syntax tree: an arithmetic operator (+ −, × ÷, // /,
% //, ** ×), a comparison (< ≤, > ≥, == ≠, is / is not, in / not in), ``and`` / ``or``, a ``not``
or unary minus dropped, ``min`` / ``max`` swapped, an integer or float constant plus one, ``True``
/ ``False`` swapped. Strings, f-strings, docstrings, annotations, the arguments of ``setting(...)``
(declared defaults: the settings reference test pins them) and of log and error calls are left
alone. The mutated module is written in place of the file (``ast.unparse``: comments dropped, the
behaviour the same; the original is restored after every mutant), and the tests run in a process
forked from one that has already imported the heavy third-party packages, with ``-x``: a mutant is
*killed* when a test fails or the run times out, *survived* when every test passes. A baseline run
of the unparsed, unmutated module must pass first.

mutmut 3 and cosmic-ray both need a configuration of the whole project and a clean run of its whole
test suite; this runs one module against the handful of test files that concern it, in minutes.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import sys
import time
from pathlib import Path

BINOPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
          ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult}
COMPARE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
           ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
#: Imported once by the parent: third-party packages the tests load (never the project's own).
PREIMPORT = ("numpy", "scipy.stats", "flwr.app", "flwr.serverapp", "flwr.clientapp", "flwr.supercore", "hydra",
             "omegaconf", "dp_accounting", "dp_accounting.rdp.rdp_privacy_accountant", "pytest")
#: Calls whose arguments are messages or declarations, not behaviour.
LEFT_ALONE = {"log", "ConfigError", "ValueError", "RuntimeError", "TypeError", "setting", "print", "Nullable", "Number",
              "Int", "Choice"}


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _skipped(tree: ast.Module) -> set[int]:
    """ids of the nodes no mutant touches (module docstring above)."""
    skip: set[int] = set()

    def under(node: ast.AST) -> None:
        skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.JoinedStr, ast.arg)) or (isinstance(node, ast.Call) and _call_name(node) in LEFT_ALONE):
            under(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.returns is not None:
                under(node.returns)
            for d in node.decorator_list:
                under(d)
        elif isinstance(node, ast.AnnAssign):
            under(node.annotation)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            under(node)  # docstrings
    return skip


def _owner(tree: ast.Module) -> dict[int, str]:
    """id of every node -> the name of the function (Class.method) it is in ("" at module level)."""
    owner: dict[int, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = name
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{name}.{child.name}" if name else child.name
            owner[id(child)] = inner
            visit(child, inner)

    visit(tree, "")
    return owner


def mutants(source: str, only: list[str] | None = None) -> list[tuple[str, int, str, str]]:
    """(description, line, function, mutated source) of every mutant of ``source``."""
    tree = ast.parse(source)
    skip, owner = _skipped(tree), _owner(tree)
    sites = [n for n in ast.walk(tree) if id(n) not in skip]
    out = []
    for index, node in enumerate(sites):
        where = owner.get(id(node), "")
        if only and not any(where == o or where.startswith(o + ".") for o in only):
            continue
        changes = []
        if isinstance(node, ast.BinOp) and type(node.op) in BINOPS:
            changes.append(("op", BINOPS[type(node.op)], f"{type(node.op).__name__} -> {BINOPS[type(node.op)].__name__}"))
        elif isinstance(node, ast.AugAssign) and type(node.op) in BINOPS:
            changes.append(("op", BINOPS[type(node.op)], f"{type(node.op).__name__}= -> {BINOPS[type(node.op)].__name__}="))
        elif isinstance(node, ast.Compare):
            for k, op in enumerate(node.ops):
                if type(op) in COMPARE:
                    changes.append((("cmp", k), COMPARE[type(op)], f"{type(op).__name__} -> {COMPARE[type(op)].__name__}"))
        elif isinstance(node, ast.BoolOp):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            changes.append(("op", new, f"{type(node.op).__name__} -> {new.__name__}"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            changes.append(("drop", None, f"{type(node.op).__name__} dropped"))
        elif isinstance(node, ast.Name) and node.id in ("min", "max") and isinstance(node.ctx, ast.Load):
            changes.append(("name", "max" if node.id == "min" else "min", f"{node.id} -> {'max' if node.id == 'min' else 'min'}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            changes.append(("value", not node.value, f"{node.value} -> {not node.value}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            changes.append(("value", node.value + 1, f"{node.value!r} -> {node.value + 1!r}"))
        for kind, new, text in changes:
            mutated = copy.deepcopy(tree)
            target = _nth(mutated, index, tree, skip)
            if kind == "op":
                target.op = new()
            elif isinstance(kind, tuple):
                target.ops[kind[1]] = new()
            elif kind == "drop":
                _replace(mutated, target, target.operand)
            elif kind == "name":
                target.id = new
            else:
                target.value = new
            out.append((text, getattr(node, "lineno", 0), where, ast.unparse(mutated)))
    return out


def _nth(mutated: ast.Module, index: int, original: ast.Module, skip: set[int]) -> ast.AST:
    """The node of ``mutated`` at the place of the ``index``-th mutable node of ``original``."""
    pairs = zip(ast.walk(original), ast.walk(mutated))
    mutable = [m for o, m in pairs if id(o) not in skip]
    return mutable[index]


def _replace(tree: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list) and any(v is old for v in value):
                value[[i for i, v in enumerate(value) if v is old][0]] = new
                return


def run_tests(path: Path, source: str, stamp: float, tests: list[str], timeout: float) -> str:
    """"killed", "survived" or "timeout" for ``source`` written at ``path``, in a forked process."""
    import pytest

    path.write_text(source, encoding="utf-8")
    os.utime(path, (stamp, stamp))  # a fresh mtime: no cached bytecode of another version is used
    pid = os.fork()
    if pid == 0:  # the child: the tests, quietly
        sys.dont_write_bytecode = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        code = pytest.main(["-x", "-q", "-o", "addopts=", "-p", "no:warnings", "-p", "no:cacheprovider", *tests])
        os._exit(int(code))
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "survived" if os.waitstatus_to_exitcode(status) == 0 else "killed"
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("--tests", nargs="+", required=True)
    parser.add_argument("--deselect", nargs="*", default=[], help="test ids left out (slow or flaky)")
    parser.add_argument("--only", nargs="*", default=None, help="mutate only these functions (name or Class.method)")
    parser.add_argument("--limit", type=int, default=None, help="the first N mutants only")
    parser.add_argument("--sample", type=int, default=None, help="N mutants drawn at random (--seed) instead of all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    args = parser.parse_args()
    path = Path(args.target)
    original = path.read_text(encoding="utf-8")
    stat = path.stat()
    found = mutants(original, args.only)[: args.limit]
    if args.sample is not None and args.sample < len(found):
        import random

        found = sorted(random.Random(args.seed).sample(found, args.sample), key=lambda m: m[1])
    import signal

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # kill -TERM restores the file (finally)
    if args.list:
        for text, line, where, _ in found:
            print(f"{path}:{line} {where}: {text}")
        print(len(found), "mutants")
        return
    import importlib

    for name in PREIMPORT:  # the heavy third-party imports, once, before the forks
        try:
            importlib.import_module(name)
        except ImportError:
            pass

    tests = [*args.tests, *(f"--deselect={d}" for d in args.deselect)]
    rows = []
    t0 = time.time()
    try:
        baseline = run_tests(path, ast.unparse(ast.parse(original)), stat.st_mtime + 1, tests, args.timeout * 3)
        if baseline != "survived":
            raise SystemExit(f"the tests fail on the unmutated (unparsed) {path}: {baseline}")
        for n, (text, line, where, source) in enumerate(found):
            started = time.time()
            outcome = run_tests(path, source, stat.st_mtime + 2 + n, tests, args.timeout)
            rows.append({"line": line, "function": where, "mutation": text, "outcome": outcome,
                         "seconds": round(time.time() - started, 1)})
            print(f"[{n + 1}/{len(found)}] {outcome:8s} {path}:{line} {where}: {text}", flush=True)
    finally:
        path.write_text(original, encoding="utf-8")
        os.utime(path, (stat.st_atime, stat.st_mtime))
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("killed", "timeout", "survived")}
    print(path, counts, f"{time.time() - t0:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"target": str(path), "tests": tests, "counts": counts, "rows": rows},
                                             indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
