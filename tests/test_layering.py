"""The layering of the three packages, checked on their source.

* ``solvers`` is pure optimisation: importing it does not import torch.
* ``costmodels`` prices hardware and knows nothing of the planner: it never imports ``apmodel``.
* Private torch API (a ``torch`` module path or attribute with a leading underscore, ``torch._C``
  and ``torch._ops`` included, and the private attributes of torch objects apmodel has needed) is
  named only in ``apmodel/_torch_private.py``, so a torch release that changes it breaks one module.

The scans read the abstract syntax tree (imports, attribute accesses, ``getattr`` with a constant
name, ``import_module`` with a constant path), not the text, so docstrings and comments may mention
private names.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BOUNDARY = ROOT / "apmodel" / "_torch_private.py"
SCANNED_PACKAGES = ("apmodel", "costmodels", "solvers")

#: private attributes of torch objects (operators, FX graphs, DTensor) that cannot be told from the
#: receiver's type in the syntax tree; each is one apmodel once read outside the boundary
TORCH_PRIVATE_ATTRIBUTES = frozenset({
    "_schema", "_overloadname", "_overloadpacket", "_op_dk", "_dispatch_cache", "_codegen",
    "_op_dispatcher", "_local_tensor", "_spec", "_modules", "_parameters", "_buffers",
})


def _private(component: str) -> bool:
    return component.startswith("_") and not (component.startswith("__") and component.endswith("__"))


def _private_path(dotted: str) -> bool:
    """True for a torch path with a private component, except ATen operator names: in
    ``torch.ops.aten._unsafe_view.default`` the underscore is the operator's name in the public
    ``torch.ops`` namespace, not a private Python module."""
    parts = dotted.split(".")
    if parts[0] != "torch":
        return False
    if parts[1:2] == ["ops"]:
        parts = parts[:3]  # torch.ops.<namespace>; what follows names an operator
    return any(_private(p) for p in parts[1:])


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every private torch name that ``source`` uses."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> the torch path it is bound to
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    if _private_path(a.name):
                        found.append((node.lineno, f"import {a.name}"))
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases["torch"] = "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "torch":
                continue
            for a in node.names:
                path = f"{node.module}.{a.name}"
                if _private_path(path):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
                aliases[a.asname or a.name] = path
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = [node.attr]
            root = node.value
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            base = aliases.get(root.id) if isinstance(root, ast.Name) else None
            if base is not None and _private(node.attr):
                path = ".".join([base, *reversed(chain)])
                if _private_path(path):
                    found.append((node.lineno, path))
            elif node.attr in TORCH_PRIVATE_ATTRIBUTES and not (isinstance(root, ast.Name) and root.id in ("self", "cls")):
                found.append((node.lineno, f"attribute .{node.attr}"))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.AST):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            args = node.args
            if fn == "getattr" and len(args) >= 2 and isinstance(args[1], ast.Constant) and args[1].value in TORCH_PRIVATE_ATTRIBUTES:
                found.append((node.lineno, f"getattr(..., {args[1].value!r})"))
            if fn in ("import_module", "__import__") and isinstance(args[0], ast.Constant) \
                    and isinstance(args[0].value, str) and _private_path(args[0].value):
                found.append((node.lineno, f"{fn}({args[0].value!r})"))
    return sorted(set(found))


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


# ----------------------------------------------------------------------------------------------
# the scanner itself


@pytest.mark.parametrize("source, expected", [
    ("from torch.utils._pytree import tree_flatten", "from torch.utils._pytree import tree_flatten"),
    ("from torch.utils import _pytree", "from torch.utils import _pytree"),
    ("import torch._dynamo", "import torch._dynamo"),
    ("import torch\nx = torch._ops.OpOverload", "torch._ops"),
    ("import torch\nx = torch._C.DispatchKey", "torch._C"),
    ("import torch.distributed as dist\ndist._functional_collectives", "torch.distributed._functional_collectives"),
    ("from torch import fx\ng = fx.graph._codegen", "torch.fx.graph._codegen"),
    ("def f(op):\n    return op._schema", "attribute ._schema"),
    ("def f(op):\n    return getattr(op, '_overloadname', None)", "getattr(..., '_overloadname')"),
    ("import importlib\nimportlib.import_module('torch._functorch.aot_autograd')",
     "import_module('torch._functorch.aot_autograd')"),
])
def test_scanner_flags_private_torch_names(source, expected):
    assert [what for _, what in private_torch_uses(source)] == [expected]


@pytest.mark.parametrize("source", [
    "import torch\nop = torch.ops.aten._unsafe_view.default",  # an ATen operator's name
    "import torch\nfrom torch import fx\nx = fx.graph.CodeGen(); torch.__version__",
    "from torch.distributed.tensor import DTensor\nDTensor.from_local",
    "class A:\n    def f(self):\n        return self._spec",  # apmodel's own attribute
    "import numpy as np\nnp._pytree = 1",  # not torch
    '"""torch._ops.OpOverload in a docstring"""',
])
def test_scanner_passes_public_names(source):
    assert private_torch_uses(source) == []


# ----------------------------------------------------------------------------------------------
# the packages


def test_private_torch_names_only_in_the_boundary_module():
    offenders = []
    for package in SCANNED_PACKAGES:
        for path in _sources(package):
            if path == BOUNDARY:
                continue
            offenders += [f"{path.relative_to(ROOT)}:{line}: {what}"
                          for line, what in private_torch_uses(path.read_text())]
    assert not offenders, "private torch API outside apmodel/_torch_private.py:\n" + "\n".join(offenders)


def test_the_boundary_module_is_where_the_private_names_are():
    # the scan would pass vacuously if it could not see the boundary's own uses
    found = {what for _, what in private_torch_uses(BOUNDARY.read_text())}
    assert "from torch._ops import OpOverload" in found
    assert "from torch.utils._pytree import tree_flatten" in found
    assert any(w.startswith("torch._C") for w in found)


def test_costmodels_never_imports_apmodel():
    offenders = []
    for path in _sources("costmodels"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level > 1:  # a relative import out of the package
                    names = ["." * node.level + (node.module or "")]
                elif node.level == 0 and node.module:
                    names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                          if n.split(".")[0] == "apmodel" or n.startswith("..")]
    assert not offenders, "costmodels imports the planner:\n" + "\n".join(offenders)


def test_importing_solvers_does_not_import_torch():
    script = ("import sys\nimport solvers\nimport solvers.registry\n"
              "print('torch' in sys.modules, sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("False"), f"importing solvers imported torch: {r.stdout.strip()}"
