"""The sizes and seams of the three packages (``apmodel``, ``costmodels``, ``solvers``), checked on
their source:

* no module over :data:`MAX_MODULE_LINES` lines (``apmodel/_torch_private.py`` excepted: it is the
  one place that names private torch API, by design);
* no function over :data:`MAX_FUNCTION_LINES` lines, from its ``def`` to its last line, docstring
  included (a nested function counts in its own right and in its parent's lines);
* no import of a module's underscore name from another module (``from apmodel.x import _y``,
  ``from .x import _y``, ``x._y`` on an imported package module; dunder names excepted): what
  another module uses is that module's API, so it is named as such. Importing a module is not
  importing a name from it (``from apmodel import _torch_private`` is the boundary's own way in).

Each message names the offender, so a failure says what to split or rename.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("apmodel", "costmodels", "solvers")
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 100
#: modules allowed over MAX_MODULE_LINES, with why
LONG_MODULES = {"apmodel/_torch_private.py": "the boundary: every private torch name lives there"}
#: functions allowed over MAX_FUNCTION_LINES ("path:qualified name" -> the most lines it may have):
#: none today. An entry is a debt, not a licence: the test fails if one grows, and when one shrinks
#: under the limit (so its entry goes)
LONG_FUNCTIONS: dict[str, int] = {}


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _module_names() -> dict[str, Path]:
    names = {}
    for path in _sources():
        parts = path.with_suffix("").relative_to(ROOT).parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def function_lengths(source: str) -> dict[str, tuple[int, int]]:
    """Qualified name (``Class.method``, ``outer.<locals>.inner``) -> (first line, length in lines)
    of every function and method in ``source``."""
    found: dict[str, tuple[int, int]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                assert child.end_lineno is not None
                found[name] = (child.lineno, child.end_lineno - child.lineno + 1)
                visit(child, name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def private_imports(module: str, is_package: bool, source: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, what) for every underscore name ``module`` takes from another package module:
    ``from m import _x`` (relative imports resolved) and ``m._x`` on a name bound to a package
    module by an import."""
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    module_aliases: dict[str, str] = {}  # local name -> the package module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source_module = f"{base}.{node.module}" if node.module else base
            else:
                source_module = node.module or ""
            if source_module.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:
                if f"{source_module}.{a.name}" in modules:  # a submodule, not a name inside one
                    module_aliases[a.asname or a.name] = f"{source_module}.{a.name}"
                elif _private(a.name) and source_module != module:
                    found.append((node.lineno, f"from {source_module} import {a.name}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules and a.name.split(".")[0] in PACKAGES and a.asname:
                    module_aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
            target = module_aliases.get(node.value.id)
            if target is not None and target != module:
                found.append((node.lineno, f"{target}.{node.attr}"))
    return sorted(set(found))


# ----------------------------------------------------------------------------------------------
# the scanners themselves


def test_function_lengths_count_from_def_to_the_last_line():
    source = "class A:\n    def f(self):\n        '''doc'''\n\n        return 1\n\n\ndef g():\n    def h():\n        pass\n    return h\n"
    assert function_lengths(source) == {"A.f": (2, 4), "g": (8, 4), "g.<locals>.h": (9, 2)}


@pytest.mark.parametrize("module, source, expected", [
    ("apmodel.a", "from apmodel.b import _x, y", ["from apmodel.b import _x"]),
    ("apmodel.lowering.a", "from .graph import _fmt", ["from apmodel.lowering.graph import _fmt"]),
    ("apmodel.lowering.a", "from ..result.plans import _bad", ["from apmodel.result.plans import _bad"]),
    ("costmodels.a", "from costmodels import compute as c\nc._tensors(1)", ["costmodels.compute._tensors"]),
    ("apmodel.a", "import apmodel.b as b\nb._y", ["apmodel.b._y"]),
])
def test_private_imports_are_found(module, source, expected):
    modules = {"apmodel.a", "apmodel.b", "apmodel.result.plans", "apmodel.lowering.a", "apmodel.lowering.graph",
               "costmodels.a", "costmodels.compute"}
    assert [what for _, what in private_imports(module, False, source, modules)] == expected


@pytest.mark.parametrize("source", [
    "from apmodel import _torch_private",  # a module
    "from apmodel._torch_private import OpOverload",  # a public name of the boundary module
    "from apmodel.b import __version__",  # dunder
    "from torch.utils._pytree import tree_flatten",  # not a package module (test_layering's business)
    "from apmodel.b import y\ny._z",  # an attribute of a name, not of a module
    "def f(self):\n    return self._x",
])
def test_public_imports_pass(source):
    modules = {"apmodel.a", "apmodel.b", "apmodel._torch_private"}
    assert private_imports("apmodel.a", False, source, modules) == []


# ----------------------------------------------------------------------------------------------
# the packages


def test_no_module_is_too_long():
    long = {_rel(p): n for p in _sources() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    offenders = [f"{path}: {n} lines" for path, n in sorted(long.items()) if path not in LONG_MODULES]
    assert not offenders, (f"modules over {MAX_MODULE_LINES} lines (move a cohesive part into a sibling module):\n"
                           + "\n".join(offenders))
    assert set(LONG_MODULES) <= set(long), f"no longer over the limit, drop from LONG_MODULES: {set(LONG_MODULES) - set(long)}"


def test_no_function_is_too_long():
    long: dict[str, tuple[int, int]] = {}
    for path in _sources():
        for name, (line, n) in function_lengths(path.read_text(encoding="utf-8")).items():
            if n > MAX_FUNCTION_LINES:
                long[f"{_rel(path)}:{name}"] = (line, n)
    offenders = [f"{key} (line {line}): {n} lines" for key, (line, n) in sorted(long.items())
                 if n > LONG_FUNCTIONS.get(key, MAX_FUNCTION_LINES)]
    assert not offenders, (f"functions over {MAX_FUNCTION_LINES} lines (make a phase a named function):\n"
                           + "\n".join(offenders))
    shrunk = sorted(set(LONG_FUNCTIONS) - set(long))
    assert not shrunk, f"no longer over the limit, drop from LONG_FUNCTIONS: {shrunk}"


def test_no_module_imports_another_modules_private_names():
    modules = _module_names()
    offenders = []
    for name, path in modules.items():
        for line, what in private_imports(name, path.name == "__init__.py", path.read_text(encoding="utf-8"), set(modules)):
            offenders.append(f"{_rel(path)}:{line}: {what}")
    assert not offenders, ("underscore names used across modules (make them public in their home module):\n"
                           + "\n".join(offenders))


def _design_packages() -> list[str]:
    """The stage packages docs/design.md lists (its "| `apmodel/NAME/` | ... |" rows)."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    return re.findall(r"^\| `apmodel/(\w+)/` \|", text, flags=re.M)


def test_the_tree_is_the_pipeline_docs_design_lists():
    from test_import_graph import PACKAGE_ORDER

    listed = _design_packages()
    packages = sorted(p.name for p in (ROOT / "apmodel").iterdir() if (p / "__init__.py").is_file())
    assert sorted(listed) == packages, (f"docs/design.md lists stage packages {sorted(listed)}; "
                                        f"apmodel/ has {packages}")
    assert listed == [p for p in PACKAGE_ORDER if p != "_torch_private"], "docs/design.md lists them in import order"
    loose = sorted(p.name for p in (ROOT / "apmodel").glob("*.py")
                   if p.name not in ("__init__.py", "_torch_private.py"))
    assert not loose, f"modules outside a stage package (move each into its stage's package): {loose}"
