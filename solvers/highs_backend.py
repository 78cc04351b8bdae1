"""Exact MILP backend through highspy (marginal-polytope form, see :mod:`solvers.marginal`)."""

from __future__ import annotations

import logging
import time

import numpy as np

from .marginal import build_marginal_model
from .problem import PairwiseProblem
from .solution import BackendResult, Infeasible, SolverError

log = logging.getLogger(__name__)


def _new_highs(highspy):
    """A silent HiGHS instance.

    highspy's Python ``Highs`` class prints a banner to stdout on construction (before any option
    can be set), which would corrupt machine-readable stdout (``apmodel plan --json``); its core
    base class does not, and has every method used here.  Fall back to ``Highs`` if that changes.
    """
    core = getattr(getattr(highspy, "_core", None), "_Highs", None)
    h = core() if core is not None else highspy.Highs()
    h.setOptionValue("output_flag", False)
    return h


def solve_highs(problem: PairwiseProblem, time_limit: float | None = None, *, mip_rel_gap: float | None = None,
                warm_start=None, compress: bool = True, threads: int | None = None,
                options: dict | None = None) -> BackendResult:
    """Solve exactly with HiGHS.

    ``mip_rel_gap``: relative gap at which HiGHS stops (HiGHS default 1e-4 when None).
    ``warm_start``: a complete assignment passed to HiGHS as a starting solution.
    ``options``: further raw HiGHS options.  Returns HiGHS' dual bound as ``lower_bound``.
    """
    import highspy

    t0 = time.perf_counter()
    model = build_marginal_model(problem, compress=compress)
    build_s = time.perf_counter() - t0
    h = _new_highs(highspy)
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    if mip_rel_gap is not None:
        h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    if threads is not None:
        h.setOptionValue("threads", int(threads))
    for k, v in (options or {}).items():
        h.setOptionValue(k, v)
    a = model.matrix
    status = h.passModel(
        int(model.n_cols), int(a.shape[0]), int(a.nnz), int(highspy.MatrixFormat.kColwise),
        int(highspy.ObjSense.kMinimize), 0.0,
        model.cost, model.col_lower, model.col_upper, model.row_lower, model.row_upper,
        a.indptr.astype(np.int32), a.indices.astype(np.int32), a.data.astype(np.float64),
        model.is_integer.astype(np.int32),
    )
    if status == highspy.HighsStatus.kError:
        raise SolverError("HiGHS rejected the model (passModel returned an error)")
    if warm_start is not None:
        x0 = problem.check_assignment(warm_start)
        sol = highspy.HighsSolution()
        sol.col_value = model.columns_from_assignment(problem, x0).tolist()
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    ms = h.getModelStatus()
    info = h.getInfo()
    M = highspy.HighsModelStatus
    stats = {"build_s": build_s, "cols": model.n_cols, "rows": int(a.shape[0]), "nnz": int(a.nnz),
             "model_status": h.modelStatusToString(ms), "mip_nodes": int(getattr(info, "mip_node_count", 0))}
    log.info("highs: %d cols %d rows %d nnz, build %.3fs, status %s, %.3fs total", model.n_cols, a.shape[0],
             a.nnz, build_s, stats["model_status"], time.perf_counter() - t0)
    if ms == M.kInfeasible:
        names = tuple(c.name for c in problem.constraints)
        raise Infeasible(f"HiGHS proved that no assignment has finite energy and satisfies the constraints {list(names)}",
                         constraints=names)
    has_sol = info.primal_solution_status == 2  # kSolutionStatusFeasible
    if not has_sol:
        raise SolverError(f"HiGHS stopped with status {stats['model_status']!r} and no feasible assignment")
    x = model.assignment_from_columns(problem, np.asarray(h.getSolution().col_value))
    bound = float(info.mip_dual_bound)
    if not np.isfinite(bound):
        bound = None
    if ms == M.kOptimal:
        st = "optimal"
    elif ms in (M.kTimeLimit, M.kInterrupt, M.kIterationLimit, M.kSolutionLimit):
        st = "time_limit"
    else:
        st = "feasible"
    return BackendResult(x, lower_bound=bound, status=st, info=stats)
