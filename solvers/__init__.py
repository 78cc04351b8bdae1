"""Generic pairwise discrete optimisation (torch-free).

``solve(PairwiseProblem(...), backend="trws")`` with interchangeable backends: ``trws`` (TRW-S
message passing + local search, approximate with a lower bound), ``highs`` (exact MILP),
``cvxpy`` (exact MILP through cvxpy), ``pgmpy`` (MPLP, approximate), ``brute`` (exhaustive, tiny
problems only), plus user backends added with :func:`register`.  What each backend can do is
declared as data (:class:`Capabilities`, :mod:`solvers.backends`); :func:`capabilities` reads it
and :func:`solve` refuses up front a problem the backend cannot take.

Before any backend runs, :func:`solve` applies a presolve (:mod:`solvers.presolve`) and exact
reductions (:mod:`solvers.reduce`: forbidden / dominated states, fixed, leaf and degree-2
variables); the returned :class:`Solution` always refers to the original problem.

The names below are loaded on first use, so ``import solvers.backends`` (help texts) does not load
numpy or scipy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .backends import BUILTIN_BACKENDS, UNDECLARED, BackendSpec, Capabilities

if TYPE_CHECKING:  # the lazily loaded names, for type checkers
    from .problem import EdgeGroup, EdgeStack, FactoredStack, GroupFactors, LinearConstraint, PairwiseProblem
    from .registry import (
        SolverRegistry,
        all_capabilities,
        available,
        capabilities,
        check_capabilities,
        default_registry,
        register,
        solve,
    )
    from .solution import BackendResult, Infeasible, Solution, SolverError, TimeLimitReached, Unsupported
    from .trws import warm_up_in_background

_LAZY = {
    "EdgeGroup": "problem", "EdgeStack": "problem", "FactoredStack": "problem", "GroupFactors": "problem", "LinearConstraint": "problem", "PairwiseProblem": "problem",
    "SolverRegistry": "registry", "all_capabilities": "registry", "available": "registry",
    "capabilities": "registry", "check_capabilities": "registry", "default_registry": "registry",
    "register": "registry", "solve": "registry",
    "BackendResult": "solution", "Infeasible": "solution", "Solution": "solution", "SolverError": "solution",
    "TimeLimitReached": "solution", "Unsupported": "solution",
    "warm_up_in_background": "trws",
}

__all__ = ["BUILTIN_BACKENDS", "UNDECLARED", "BackendSpec", "Capabilities", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'solvers' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
