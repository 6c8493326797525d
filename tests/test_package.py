"""The package's shape: no import cycles (lazy imports inside functions included), few top-level modules,
and the public API importable from ``kvlab`` as listed in one place (``kvlab._EXPORTS``)."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import kvlab

ROOT = Path(kvlab.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """Module -> the kvlab modules importing it runs: every ``import`` / ``from … import`` anywhere in the
    file (inside functions too), each target's package ``__init__`` files that the importer is not
    already inside, and ``from pkg import mod`` as an import of ``pkg.mod``."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        own = set(_ancestors(mod)) | ({mod} if is_pkg else set())
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    targets.append(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
            for t in targets:
                if not t.startswith("kvlab"):
                    continue
                for m in [*_ancestors(t), t]:
                    if m in mods and m not in own and m != mod:
                        graph[mod].add(m)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
    g = import_graph()
    assert "kvlab.decode" in g["kvlab.studies.experiment"]          # a real edge is seen
    g = {k: set(v) for k, v in g.items()}
    g["kvlab.cache.kvcache"].add("kvlab.studies.experiment")        # experiment -> decode -> cache -> experiment
    cycle = find_cycle(g)
    assert cycle is not None and cycle[0] == cycle[-1]


def test_few_top_level_modules():
    top = sorted(p.stem for p in ROOT.glob("*.py"))
    assert len(top) <= 8, f"kvlab/ has {len(top)} top-level modules ({', '.join(top)}): put new ones in a subpackage"


@pytest.mark.parametrize("name", sorted(kvlab.__all__))
def test_public_api_is_importable_from_kvlab(name):
    value = getattr(kvlab, name)
    assert value is not None
    module = kvlab._EXPORTS.get(name) or kvlab._MODULES[name]
    importlib.import_module(f"kvlab.{module}")


def test_results_load_is_public():
    from kvlab import results

    assert callable(results.load)
