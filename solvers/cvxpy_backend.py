"""Exact MILP backend through cvxpy (same marginal-polytope model as ``highs``, vectorised).

Default solver HiGHS; any installed cvxpy MILP solver can be chosen with ``solver=``.  Callers can
add their own constraints over the indicator vector ``x`` (a cvxpy Variable of length
``problem.n_indicators``; ``x[problem.offsets[v] + s]`` is 1 when variable ``v`` takes state ``s``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from .marginal import build_marginal_model
from .problem import PairwiseProblem
from .solution import BackendResult, Infeasible, SolverError, TimeLimitReached

log = logging.getLogger(__name__)


def solve_cvxpy(problem: PairwiseProblem, time_limit: float | None = None, *, solver: str = "HIGHS",
                extra_constraints: Callable | None = None, compress: bool = True,
                solver_options: dict | None = None) -> BackendResult:
    """Solve exactly with cvxpy.  ``extra_constraints(x) -> list[cvxpy.Constraint]``.

    ``time_limit`` is passed to HiGHS (``time_limit``); other solvers get it only through
    ``solver_options``.  cvxpy exposes no MIP dual bound, so ``lower_bound`` is None.
    """
    import cvxpy as cp

    t0 = time.perf_counter()
    m = build_marginal_model(problem, compress=compress)
    a = m.matrix.tocsc()
    n_x = m.n_x
    ax, ay = a[:, :n_x], a[:, n_x:]
    x = cp.Variable(n_x, boolean=True)
    y = cp.Variable(a.shape[1] - n_x, nonneg=True)
    lhs = ax @ x + ay @ y
    eq = m.row_lower == m.row_upper
    cons = []
    if eq.any():
        cons.append(lhs[np.flatnonzero(eq)] == m.row_lower[eq])
    up = ~eq & np.isfinite(m.row_upper)
    if up.any():
        cons.append(lhs[np.flatnonzero(up)] <= m.row_upper[up])
    lo = ~eq & np.isfinite(m.row_lower)
    if lo.any():
        cons.append(lhs[np.flatnonzero(lo)] >= m.row_lower[lo])
    forbidden = np.flatnonzero(m.col_upper[:n_x] == 0)
    if len(forbidden):
        cons.append(x[forbidden] == 0)
    if extra_constraints is not None:
        extra = extra_constraints(x)
        if extra is None:
            raise TypeError("extra_constraints(x) must return a list of cvxpy constraints, got None")
        cons += list(extra)
    obj = cp.Minimize(m.cost[:n_x] @ x + m.cost[n_x:] @ y)
    prob = cp.Problem(obj, cons)
    opts = dict(solver_options or {})
    if time_limit is not None and solver.upper() == "HIGHS":
        opts.setdefault("time_limit", float(time_limit))
    try:
        prob.solve(solver=solver, **opts)
    except cp.error.SolverError as err:
        raise SolverError(f"cvxpy solver {solver!r} failed: {err}") from err
    status = prob.status
    log.info("cvxpy(%s): status %s, %.3fs", solver, status, time.perf_counter() - t0)
    if status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
        names = tuple(c.name for c in problem.constraints)
        raise Infeasible(f"cvxpy/{solver} proved that no assignment satisfies the constraints {list(names)} "
                         "(and any extra constraints) with finite energy", constraints=names)
    if x.value is None:
        error = TimeLimitReached if status == cp.USER_LIMIT else SolverError
        raise error(f"cvxpy/{solver} returned status {status!r} without a solution")
    col = np.concatenate([x.value, np.zeros(a.shape[1] - n_x)])
    assignment = m.assignment_from_columns(problem, col)
    st = "optimal" if status == cp.OPTIMAL else ("time_limit" if status == cp.USER_LIMIT else "feasible")
    return BackendResult(assignment, None, st, {"cvxpy_status": status, "solver": solver})
