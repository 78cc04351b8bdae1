"""Generic pairwise discrete optimisation (torch-free).

``solve(PairwiseProblem(...), backend="trws")`` with interchangeable backends: ``trws`` (TRW-S
message passing + local search, approximate with a lower bound), ``highs`` (exact MILP),
``cvxpy`` (exact MILP through cvxpy), ``pgmpy`` (MPLP, approximate), ``brute`` (exhaustive, tiny
problems only), plus user backends added with :func:`register`.

Before any backend runs, :func:`solve` applies a presolve (:mod:`solvers.presolve`) and exact
reductions (:mod:`solvers.reduce`: forbidden / dominated states, fixed, leaf and degree-2
variables); the returned :class:`Solution` always refers to the original problem.
"""

from .problem import EdgeGroup, LinearConstraint, PairwiseProblem
from .registry import BUILTIN_BACKENDS, SolverRegistry, available, default_registry, register, solve
from .solution import BackendResult, Infeasible, Solution, SolverError, TimeLimitReached, Unsupported

__all__ = [
    "BUILTIN_BACKENDS", "BackendResult", "EdgeGroup", "Infeasible", "LinearConstraint", "PairwiseProblem",
    "Solution", "SolverError", "SolverRegistry", "TimeLimitReached", "Unsupported", "available", "default_registry", "register",
    "solve",
]
