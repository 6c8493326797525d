"""The package's shape: layers that import only downward, no import cycles (lazy imports inside functions
included), no module over 500 lines, few top-level modules, and the public API importable from ``kvlab`` as
listed in one place (``kvlab._EXPORTS``). docs/design.md shows the same layer table."""
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
    assert "kvlab.decode" in g["kvlab.harness.experiment"]          # a real edge is seen
    g = {k: set(v) for k, v in g.items()}
    g["kvlab.cache.kvcache"].add("kvlab.harness.experiment")        # experiment -> decode -> cache -> experiment
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


# The layers, lowest first: a module may import from its own layer and the layers below it, never above.
# (docs/design.md, "The package", shows this table.)
LAYERS = (
    ("core", ("kvlab.core",)),                                    # models, pruning, metrics, registries, catalogue
    ("cache, store", ("kvlab.cache", "kvlab.store")),             # K/V tensors + mirror; the run store
    ("decode", ("kvlab.decode",)),                                # the loop and the protocols it owns
    ("policies", ("kvlab.eviction", "kvlab.refresh", "kvlab.uncertainty")),   # decide, never mutate
    ("train", ("kvlab.train",)),                                  # the students: training, loading, the pair
    ("harness", ("kvlab.harness",)),                              # RunSpec, scored/forced runs, statistics, tables
    ("studies", ("kvlab.studies",)),                              # one folder per study
    ("apps", ("kvlab.viz", "kvlab.sweep", "kvlab.playground", "kvlab.cli", "kvlab.__main__")),
)


def layer_of(module: str) -> int | None:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, targets in graph.items():
        lm = layer_of(mod)
        for t in targets:
            if t == "kvlab" or lm is None:
                continue
            lt = layer_of(t)
            if lt is not None and lt > lm:
                out.append(f"{mod} ({LAYERS[lm][0]}) imports {t} ({LAYERS[lt][0]})")
    return sorted(out)


def test_every_module_has_a_layer():
    loose = [m for m in import_graph() if m != "kvlab" and layer_of(m) is None]
    assert not loose, f"modules in no layer of LAYERS: {loose}"


def test_layers_import_only_downward():
    up = upward_imports(import_graph())
    assert not up, "imports that run upward:\n" + "\n".join(up)


def test_the_layering_check_finds_a_planted_upward_import():
    g = {k: set(v) for k, v in import_graph().items()}
    g["kvlab.cache.kvcache"].add("kvlab.studies.eviction.tables")
    assert upward_imports(g) == ["kvlab.cache.kvcache (cache, store) imports kvlab.studies.eviction.tables (studies)"]


@pytest.mark.parametrize("lower, forbidden", [
    (("kvlab.core", "kvlab.cache", "kvlab.store"),
     ("kvlab.studies", "kvlab.sweep", "kvlab.train", "kvlab.playground", "kvlab.viz", "kvlab.cli")),
    (("kvlab.eviction", "kvlab.refresh"),
     ("kvlab.studies", "kvlab.sweep", "kvlab.playground", "kvlab.viz", "kvlab.cli")),
])
def test_lower_packages_import_nothing_above(lower, forbidden):
    g = import_graph()
    bad = [f"{m} -> {t}" for m, ts in g.items() if m.startswith(lower) for t in ts if t.startswith(forbidden)]
    assert not bad, bad


def test_the_loop_is_a_package_owning_its_protocols():
    from kvlab.decode import protocols
    from kvlab.eviction.base import EvictView, Keep

    assert (ROOT / "decode" / "__init__.py").is_file()
    assert EvictView.__module__ == Keep.__module__ == "kvlab.decode.protocols" == protocols.__name__


def test_no_module_over_500_lines():
    big = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 500}
    assert not big, f"split these modules (over 500 lines): {big}"


def test_design_doc_shows_the_layer_table():
    """docs/design.md, "The package", shows LAYERS: one row per layer, lowest first, with the same packages."""
    text = (ROOT.parent / "docs" / "design.md").read_text()
    section = text[text.index("## The package"):text.index("\n## ", text.index("## The package") + 1)]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| layer |")]
    shown = [(r[0], tuple(p.strip(" `") for p in r[1].split(","))) for r in rows]
    assert shown == [(name, tuple(pkgs)) for name, pkgs in LAYERS], shown
