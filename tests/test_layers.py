"""The architecture as a test: layers import downward only, no file imports itself back.

Every module of the shipped packages belongs to one layer (docs/ARCHITECTURE.md draws
them); a module may import its own layer and the ones below, at the top of the file or
inside a function alike. Readers of plans (the executor, validate, explain, the exports)
must not import the pricing, the search or the planning entry point, not even through
another module. The graph of imports between files has no cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "costmodels", "executor", "hardware_profiles")

#: Layers from the bottom up; a module is in the layer of its longest matching prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("planner.errors", "planner.kinds", "planner.humanize", "planner.records",
              "planner.userfiles", "hardware_profiles")),
    ("graph", ("planner.graph", "planner.reference", "planner.layers")),
    ("ops", ("planner.ops",)),
    ("import", ("planner.importer", "planner.zoo")),
    ("sharding", ("planner.sharding",)),
    ("cost", ("costmodels", "planner.cost")),
    ("search", ("planner.search",)),
    ("plan", ("planner.plans", "planner.api")),
    ("readers", ("planner.validate", "planner.explain", "planner.exports", "planner.report",
                 "planner.plots", "executor")),
    ("cli", ("planner.cli", "planner")),
]
RANK = {name: k for k, (name, _) in enumerate(LAYERS)}

#: What a reader of plans never needs (it reads what the builder derived).
NOT_FOR_READERS = ("planner.cost", "planner.search", "planner.api", "planner.plans.build",
                   "planner.plans.planning", "costmodels.compute", "costmodels.communication")
READERS = ("planner.validate", "planner.explain", "planner.exports", "executor")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def layer_of(module: str) -> str:
    best, length = "", -1
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > length:
                best, length = name, len(prefix)
    if not best:
        raise AssertionError(f"module {module} is in no layer: add it to LAYERS")
    return best


def _imports(modules: dict[str, Path]) -> nx.DiGraph:
    """module -> module it imports (any import statement, top level or in a function)."""
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph.add_edge(name, target)
    return graph


MODULES = _modules()
IMPORTS = _imports(MODULES)


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_layers_import_downward_only() -> None:
    upward = [f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)})"
              for a, b in IMPORTS.edges if RANK[layer_of(b)] > RANK[layer_of(a)]]
    assert not upward, "\n".join(upward)


def test_no_import_cycles_between_files() -> None:
    cycles = list(nx.simple_cycles(IMPORTS))
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles[:10])


def test_readers_import_no_pricing_search_or_api() -> None:
    direct = [f"{a} imports {b}" for a, b in IMPORTS.edges
              if a.startswith(READERS) and b.startswith(NOT_FOR_READERS)]
    assert not direct, "\n".join(direct)


@pytest.mark.parametrize("reader", ["planner.validate", "planner.explain", "executor.train",
                                    "planner.exports.mindspore", "planner.exports.dtensor"])
def test_readers_load_no_pricing_or_search_at_all(reader: str) -> None:
    """Not even through the modules they import (checked in a fresh interpreter)."""
    code = (f"import sys; import {reader}; print(' '.join(sorted(n for n in sys.modules "
            f"if n.startswith({NOT_FOR_READERS!r}))))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           cwd=ROOT, check=True).stdout.split()
    assert not found, f"{reader} loads {found}"
