"""The import graph of the installed library: no cycles, and imports only run down the layers.

Read from the AST of every module of the installed ``quantkit`` (the wheel in CI), imports inside
functions included (they must not be a way around a cycle). The layers, top to bottom::

    __main__
    cli                              (may use the façade, like any user)
    quantkit (the public façade), debug, metrics
    sequential                       block-by-block quantization: uses pipeline, accuracy, export
    accuracy | export | generation   peers: none imports another
    lowering
    pipeline
    quantizers
    observers
    kernels
    core: _qmath, _graph, _qdq, _errors, _text, _fsutil, _quiet, _sizing, _hf

A module may import its own layer and the layers below, never above; so nothing below the façade
imports the ``quantkit`` package itself (that would import every layer).
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import quantkit

LAYERS = {
    "__main__": 10,
    "cli": 9,
    "<facade>": 8, "debug": 8, "metrics": 8,
    "sequential": 7,
    "accuracy": 6, "export": 6, "generation": 6,
    "lowering": 5,
    "pipeline": 4,
    "quantizers": 3,
    "observers": 2,
    "kernels": 1,
    "_qmath": 0, "_graph": 0, "_qdq": 0, "_errors": 0, "_text": 0, "_fsutil": 0, "_quiet": 0, "_sizing": 0,
    "_hf": 0, "calibration_data": 0,
}
PEERS_APART = {frozenset({"accuracy", "export"}), frozenset({"generation", "accuracy"}),
               frozenset({"generation", "export"})}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the installed package: walked from each package's folder (an editable install
    maps some subpackages from other folders, so the packages already imported seed the walk)."""
    import sys

    found: dict[str, tuple[Path, bool]] = {}
    todo = sorted({"quantkit"} | {m for m in sys.modules if m.startswith("quantkit.")})
    while todo:
        name = todo.pop()
        if name in found:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        is_pkg = spec.submodule_search_locations is not None
        found[name] = (Path(spec.origin), is_pkg)
        if is_pkg:
            todo.extend(f"{name}.{info.name}" for info in pkgutil.iter_modules(spec.submodule_search_locations))
    return found


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<facade>"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name.rsplit(".", 1)[0]) is not None
    except ImportError:
        return False


def _edges(mods: dict) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, (path, is_pkg) in list(mods.items()):
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        out = edges.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            else:
                continue
            for t in targets:
                if t.startswith("quantkit.") and t not in mods:  # a package the walk did not reach
                    spec = importlib.util.find_spec(t) if _importable(t) else None
                    if spec is not None and spec.origin and spec.origin.endswith(".py"):
                        mods[t] = (Path(spec.origin), spec.submodule_search_locations is not None)
                while t and t not in mods and "." in t:  # import a.b.c of a module a.b
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != name:
                    out.add(t)
    return edges


@pytest.fixture(scope="module")
def graph():
    mods = _modules()
    assert len(mods) > 80, f"only {len(mods)} modules found under {quantkit.__path__}"
    return mods, _edges(mods)


def test_every_module_has_a_layer(graph):
    mods, _ = graph
    unknown = sorted({_part(m) for m in mods} - set(LAYERS))
    assert not unknown, f"modules outside every layer: {unknown}; add them to LAYERS"


def test_imports_only_run_down(graph):
    _, edges = graph
    bad = []
    for a, targets in edges.items():
        for b in targets:
            pa, pb = _part(a), _part(b)
            if LAYERS.get(pb, -1) > LAYERS.get(pa, -1) or frozenset({pa, pb}) in PEERS_APART:
                bad.append(f"{a} -> {b} ({pa.strip('<>')} may not import {pb.strip('<>')})")
    assert not bad, "imports against the layers:\n" + "\n".join(sorted(bad))


def test_no_import_cycles(graph):
    _, edges = graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_a_cycle_and_an_upward_import():
    """The rules above can fail: a made-up graph with both faults is caught."""
    mods = {"quantkit.pipeline._a": None, "quantkit.pipeline._b": None, "quantkit.observers._c": None}
    edges = {"quantkit.pipeline._a": {"quantkit.pipeline._b"}, "quantkit.pipeline._b": {"quantkit.pipeline._a"},
             "quantkit.observers._c": {"quantkit.pipeline._a"}}
    with pytest.raises(AssertionError, match="observers may not import pipeline"):
        test_imports_only_run_down((mods, edges))
    with pytest.raises(AssertionError, match="quantkit.pipeline._a <-> quantkit.pipeline._b"):
        test_no_import_cycles((mods, edges))
