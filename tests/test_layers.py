"""The package's imports point one way (DESIGN.md's layers) and form no cycle, lazy imports included."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "metronome"

DOTTED = re.compile(r"(metronome|bench|tests)(\.[A-Za-z_]\w*)+")
# layer → the layers of ours it must never import
FORBIDDEN = {
    "attention": {"engine", "models", "audio", "serving", "experiments", "cli", "monitor"},
    "models": {"engine", "audio", "serving", "experiments", "cli"},
    "engine": {"audio", "serving", "experiments", "cli"},
    "audio": {"serving", "experiments", "cli"},
    "monitor": {"engine", "models", "audio", "serving", "experiments", "cli"},
    "serving": {"experiments", "cli"},
    "experiments": {"cli"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module of ours that ``path`` imports, at the top or inside a function, or names in a string (the
    tables that ``importlib.import_module`` reads: a dynamic import is an import all the same)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.fullmatch(node.value):
            found.add(node.value)
    return {name for name in found if name.split(".")[0] in ("metronome", "bench", "tests")}


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in files.items():
        targets = set()
        for imported in imports_of(path):
            while imported and imported not in files:      # `from pkg import name` names a module or an attribute
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        edges[name] = targets
    return edges


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_nothing_in_the_package_imports_bench_or_tests():
    offenders = {p.name: sorted(i for i in imports_of(p) if i.split(".")[0] in ("bench", "tests"))
                 for p in PACKAGE.rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}


@pytest.mark.parametrize("source", sorted(FORBIDDEN))
def test_layers_import_one_way(source):
    wrong = {m: sorted(t for t in targets if layer(t) in FORBIDDEN[source])
             for m, targets in graph().items() if layer(m) == source}
    assert not {m: t for m, t in wrong.items() if t}


def test_no_import_cycles():
    edges = graph()
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    # A package's __init__ re-exporting its modules is not a cycle of logic; only cycles between modules count.
    real = [c for c in cycles if not any(n == c[0].rpartition(".")[0] for n in c)]
    assert not real, real
