"""The import graph of the three packages (``apmodel``, ``costmodels``, ``solvers``): no cycles
(counting imports inside functions, relative ones resolved), the CLI and the API on top, lowering
the last stage (it imports no orchestration and no reference model)."""

from __future__ import annotations

import ast
from pathlib import Path

import apmodel

PACKAGES = ("apmodel", "costmodels", "solvers")
ROOT = Path(apmodel.__file__).parent.parent


def _modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.with_suffix("").relative_to(ROOT).parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name of ``from {'.' * level}{module} import ...`` in ``module``'s file."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        package = package.rsplit(".", 1)[0]
    return f"{package}.{node.module}" if node.module else package


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source (TYPE_CHECKING included)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.level or node.module):
                base = _absolute(name, path, node) if node.level else node.module
                assert base is not None
                # "from package import submodule" names the submodule
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != name and t not in PACKAGES:
                    found.add(t)
        graph[name] = found
    for package in PACKAGES:  # a package's __init__ only maps public names to modules
        graph[package] = set()
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def visit(u: str, stack: list[str]) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u, [])
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 60 and {m.split(".")[0] for m in graph} == set(PACKAGES)
    assert _cycles(graph) == []


def test_a_cycle_would_be_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_orchestration_is_on_top_and_lowering_is_last():
    graph = import_graph()
    def in_cli(m: str) -> bool:  # the CLI package: its commands, error boundary and output
        return m == "apmodel.cli" or m.startswith("apmodel.cli.")

    importers = {m for m, deps in graph.items() if not in_cli(m) and any(in_cli(d) for d in deps)}
    assert importers == set(), importers
    # the API's callers: the CLI, and the adapters for other frameworks' entry points beside the API
    adapters = {"apmodel.entry.torchtitan"}
    assert {m for m, deps in graph.items() if "apmodel.entry.api" in deps} <= {m for m in graph if in_cli(m)} | adapters
    assert not any(adapters & deps for m, deps in graph.items() if m not in adapters), "nothing imports an adapter"
    assert "apmodel.entry.api" in graph["apmodel.cli"]
    lowering = {m: deps for m, deps in graph.items() if m.startswith("apmodel.lowering")}
    assert len(lowering) >= 5
    forbidden = {"apmodel.entry.api", "apmodel.cli", "apmodel.solve.search", "apmodel.reading.recipes", "apmodel.reading.report",
                 "apmodel.reading.report_data", "apmodel.reading.report_figures"}
    for module, deps in lowering.items():
        assert not deps & forbidden, (module, deps & forbidden)
        assert not any(d.startswith("apmodel.models") for d in deps), (module, deps)


#: apmodel's stage packages, bottom to top (docs/design.md, *The pipeline*): each imports only the
#: packages before it (the torch boundary module counts as one, after ``core``).
PACKAGE_ORDER = ("core", "_torch_private", "graph", "candidates", "problem", "result", "models", "frontend", "solve",
                 "reading", "lowering", "entry", "cli")


def _package(module: str) -> str:
    return module.split(".")[1]


def test_stage_packages_import_only_the_stages_below():
    graph = import_graph()
    up = [f"{m} -> {d}" for m, deps in sorted(graph.items()) if m.startswith("apmodel.")
          for d in sorted(deps) if d.startswith("apmodel.")
          and PACKAGE_ORDER.index(_package(d)) > PACKAGE_ORDER.index(_package(m))]
    assert up == [], "imports of a stage above (move the code down, or the import into the stage that needs it):\n" + "\n".join(up)


def test_every_package_has_its_place_in_the_order():
    packages = {_package(m) for m in import_graph() if m.startswith("apmodel.")}
    assert packages == set(PACKAGE_ORDER), packages ^ set(PACKAGE_ORDER)
