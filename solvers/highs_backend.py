"""Exact MILP backend through highspy (marginal-polytope form, see :mod:`solvers.marginal`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .marginal import build_marginal_model
from .problem import PairwiseProblem
from .solution import BackendResult, Infeasible, SolverError, TimeLimitReached

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


def _pass(h, highspy, model, integral: bool) -> None:
    a = model.matrix
    integrality = model.is_integer if integral else np.zeros(model.n_cols, dtype=bool)
    status = h.passModel(
        int(model.n_cols), int(a.shape[0]), int(a.nnz), int(highspy.MatrixFormat.kColwise),
        int(highspy.ObjSense.kMinimize), 0.0,
        model.cost, model.col_lower, model.col_upper, model.row_lower, model.row_upper,
        a.indptr.astype(np.int32), a.indices.astype(np.int32), a.data.astype(np.float64),
        integrality.astype(np.int32),
    )
    if status == highspy.HighsStatus.kError:
        raise SolverError("HiGHS rejected the model (passModel returned an error)")


def _configure(h, time_limit: float | None, threads: int | None, options: dict | None) -> None:
    if time_limit is not None:
        h.setOptionValue("time_limit", max(1e-3, float(time_limit)))
    if threads is not None:
        h.setOptionValue("threads", int(threads))
    for k, v in (options or {}).items():
        h.setOptionValue(k, v)


def _lp_first(problem: PairwiseProblem, model, highspy, time_limit, threads):
    """Solve the LP relaxation (dual simplex, no presolve); return (x, bound) when its rounding is optimal.

    The marginal-polytope relaxation is often tight on placement problems: when the rounded LP
    solution (argmax per variable) is feasible and its energy equals the LP optimum (relative
    ``LP_CERTIFY_GAP``), it is a certified optimum and the MIP is skipped.  Returns
    ``(x_or_None, certified_bound_or_None, lp_optimum_or_None, seconds)``; ``x`` is also returned
    (with certified bound None) as a finite-energy warm start when the rounding is feasible but not
    certified; the LP optimum (when the LP was solved) is a lower bound on the optimum either way.
    """
    t0 = time.perf_counter()
    h = _new_highs(highspy)
    _configure(h, time_limit, threads, {"presolve": "off", "solver": "simplex"})
    _pass(h, highspy, model, integral=False)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None, None, None, time.perf_counter() - t0
    lp = float(h.getInfo().objective_function_value)
    x = model.assignment_from_columns(problem, np.asarray(h.getSolution().col_value))
    e = problem.energy(x)
    if not np.isfinite(e) or problem.violated_constraints(x, tol=1e-9):
        return None, None, lp, time.perf_counter() - t0
    if e - lp <= LP_CERTIFY_GAP * max(1.0, abs(e)):
        return x, min(lp, e), lp, time.perf_counter() - t0
    return x, None, lp, time.perf_counter() - t0


LP_TIME_SHARE = 0.5  # at most this share of a time limit goes to the LP relaxation stage
LP_CERTIFY_GAP = 1e-9  # relative gap between a rounded LP solution's energy and the LP optimum that certifies it
FALLBACK_TIME_SHARE = 0.5  # with a time limit: at most this share of what the LP stage left goes to TRW-S
MIP_MIN_S = 0.01  # with a time limit: skip the MIP when less than this is left and a plan is known


#: ``(problem, seconds) -> result or None``: a plan and a bound found quickly, for a time-limited MIP
Fallback = Callable[[PairwiseProblem, float], "BackendResult | None"]


def solve_highs(problem: PairwiseProblem, time_limit: float | None = None, *, mip_rel_gap: float | None = None,
                warm_start=None, compress: bool = True, threads: int | None = None,
                options: dict | None = None, lp_first: bool = True, fallback: Fallback | None = None) -> BackendResult:
    """Solve exactly with HiGHS.

    ``lp_first``: first solve the LP relaxation by dual simplex without presolve (fast on these
    models); when its rounding is certified optimal (see :func:`_lp_first`) the MIP is skipped,
    otherwise the rounding warm-starts the MIP.  ``mip_rel_gap``: relative gap at which HiGHS
    stops (HiGHS default 1e-4 when None).  ``warm_start``: a complete assignment passed to HiGHS
    as a starting solution.  ``options``: further raw HiGHS options (MIP stage).  Returns HiGHS'
    dual bound as ``lower_bound`` (or a larger proven one: the LP optimum, TRW-S' bound).

    ``fallback``: with a time limit, when the LP stage does not certify an optimum, it runs on at
    most ``FALLBACK_TIME_SHARE`` of the time left before the MIP; its plan warm-starts the MIP (when
    better than ``warm_start`` / the LP rounding) and its bound counts (the composition ``highs``
    hands in TRW-S, :mod:`solvers.compositions`).
    The result is the best plan known, with status ``"time_limit"`` when the MIP stopped there:
    a time limit never raises while any feasible plan is known (the warm start, the LP rounding,
    TRW-S's).  :class:`TimeLimitReached` is raised only when none is.
    """
    import highspy

    t0 = time.perf_counter()
    model = build_marginal_model(problem, compress=compress)
    build_s = time.perf_counter() - t0
    a = model.matrix
    stats: dict[str, Any] = {"build_s": build_s, "cols": model.n_cols, "rows": int(a.shape[0]), "nnz": int(a.nnz)}
    bounds: list[float] = []  # proven lower bounds from every stage
    candidates: list[tuple[np.ndarray, str]] = []  # feasible plans known besides the MIP's
    if warm_start is not None:
        warm_start = problem.check_assignment(warm_start)
        candidates.append((warm_start, "warm start"))
    if lp_first:
        lp_limit = None if time_limit is None else LP_TIME_SHARE * time_limit
        x_lp, lp_bound, lp_opt, lp_s = _lp_first(problem, model, highspy, lp_limit, threads)
        stats["lp_s"] = lp_s
        if lp_bound is not None:
            stats.update(model_status="Optimal (LP relaxation integral)", mip_nodes=0)
            log.info("highs: %d cols %d rows, LP relaxation certified optimal, %.3fs total", model.n_cols,
                     a.shape[0], time.perf_counter() - t0)
            return BackendResult(x_lp, lower_bound=lp_bound, status="optimal", info=stats)
        if lp_opt is not None and np.isfinite(lp_opt):
            bounds.append(lp_opt)
        if x_lp is not None:
            candidates.append((x_lp, "LP rounding"))
            if warm_start is None:
                warm_start = x_lp
    if fallback is not None and time_limit is not None:
        left = time_limit - (time.perf_counter() - t0)
        warm_start = _fallback_stage(problem, fallback, left, stats, candidates, bounds, warm_start)
    if time_limit is not None:
        time_limit = time_limit - (time.perf_counter() - t0)
        if time_limit <= MIP_MIN_S and candidates:  # no time left for the MIP: the best plan known
            x, source = min(((c, n) for c, n in candidates if not problem.violated_constraints(c, tol=1e-9)),
                            key=lambda t: problem.energy(t[0]), default=(None, None))
            if x is not None:
                stats.update(model_status="Time limit reached (before the MIP)", mip_nodes=0, plan_from=source)
                return BackendResult(x, lower_bound=max(bounds) if bounds else None, status="time_limit",
                                     info=stats)
    h = _run_mip(problem, model, highspy, time_limit, threads, options, mip_rel_gap, warm_start)
    ms = h.getModelStatus()
    info = h.getInfo()
    M = highspy.HighsModelStatus
    stats.update(model_status=h.modelStatusToString(ms), mip_nodes=int(getattr(info, "mip_node_count", 0)))
    log.info("highs: %d cols %d rows %d nnz, build %.3fs, status %s, %.3fs total", model.n_cols, a.shape[0],
             a.nnz, build_s, stats["model_status"], time.perf_counter() - t0)
    if ms == M.kInfeasible:
        names = tuple(c.name for c in problem.constraints)
        raise Infeasible(f"HiGHS proved that no assignment has finite energy and satisfies the constraints {list(names)}",
                         constraints=names)
    if ms == M.kOptimal:
        st = "optimal"
    elif ms in (M.kTimeLimit, M.kInterrupt, M.kIterationLimit, M.kSolutionLimit):
        st = "time_limit"
    else:
        st = "feasible"
    x, source = None, "HiGHS"
    if info.primal_solution_status == 2:  # kSolutionStatusFeasible
        x = model.assignment_from_columns(problem, np.asarray(h.getSolution().col_value))
        dual = float(info.mip_dual_bound)
        if np.isfinite(dual):
            bounds.append(dual)
    best_e = np.inf if x is None else problem.energy(x)
    for cand, name in candidates:  # the best plan known (the MIP may not have used the warm start)
        e = problem.energy(cand)
        if e < best_e and not problem.violated_constraints(cand, tol=1e-9):
            x, best_e, source = cand, e, name
    if x is None:
        error = TimeLimitReached if ms == M.kTimeLimit else SolverError
        raise error(f"HiGHS stopped with status {stats['model_status']!r} and no feasible assignment")
    if source != "HiGHS":
        stats["plan_from"] = source
        log.info("highs: the %s plan (energy %.6g) is the best known (MIP status %s)", source, best_e,
                 stats["model_status"])
    bound = max(bounds) if bounds else None
    return BackendResult(x, lower_bound=bound, status=st, info=stats)


def _fallback_stage(problem: PairwiseProblem, fallback: Fallback, left: float, stats: dict[str, Any],
                    candidates: list[tuple[np.ndarray, str]], bounds: list[float], warm_start: Any) -> Any:
    """Run ``fallback`` on its share of the ``left`` seconds: its plan joins ``candidates``, its
    bound ``bounds``; the MIP's warm start (returned) is its plan when that is better."""
    t1 = time.perf_counter()
    fb = fallback(problem, max(1e-3, FALLBACK_TIME_SHARE * left))
    stats["fallback_s"] = time.perf_counter() - t1
    if fb is not None:
        candidates.append((fb.assignment, "TRW-S"))
        if fb.lower_bound is not None:
            bounds.append(float(fb.lower_bound))
        stats["fallback_energy"] = problem.energy(fb.assignment)
        if warm_start is None or stats["fallback_energy"] < problem.energy(warm_start):
            warm_start = fb.assignment
    return warm_start


def _run_mip(problem: PairwiseProblem, model: Any, highspy: Any, time_limit: float | None, threads: int | None,
             options: dict | None, mip_rel_gap: float | None, warm_start: Any) -> Any:
    """The MIP of ``model`` solved by HiGHS from ``warm_start`` (if any); the Highs object after its run."""
    h = _new_highs(highspy)
    if mip_rel_gap is not None:
        h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    _configure(h, time_limit, threads, options)
    _pass(h, highspy, model, integral=True)
    if warm_start is not None:
        x0 = problem.check_assignment(warm_start)
        sol = highspy.HighsSolution()
        sol.col_value = model.columns_from_assignment(problem, x0).tolist()
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    return h
