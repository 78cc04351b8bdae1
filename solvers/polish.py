"""Exact polish of an approximate assignment: HiGHS on the near-optimal states of a reparametrisation.

When TRW-S has (nearly) converged its dual but leaves a gap, the gap is usually a decoding
problem: the reparametrised unary ``theta`` of many variables has several states tied (or
within a hair of) its minimum, and the decoder broke the ties inconsistently across variables.
The optimum then lies within the near-minimal states: :func:`polish` restricts every variable to
the states whose *margin* (``theta_v(s) - min theta_v``) is at most a small fraction of the
absolute gap (plus the current state, so the current assignment stays feasible), solves that
restricted problem exactly (HiGHS through the presolve and reductions, which remove the many
variables left with one state; handed in by :mod:`solvers.compositions`), warm-started from the current assignment, and widens
the fraction while the gap stays above the target and time remains.  The last stage is the whole
problem, whose HiGHS dual bound is then a valid bound too (a restricted stage proves nothing
about the unrestricted optimum, so it never raises the bound).

Only improvements are kept: the result is never worse than the assignment given.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable

import numpy as np

from .problem import PairwiseProblem
from .solution import Infeasible, Solution, SolverError

log = logging.getLogger(__name__)

#: Margins admitted per stage, as fractions of the absolute gap (energy - bound); ``inf``: every state.
STAGES = (1e-3, 1e-2, 1e-1, 1.0, np.inf)


def highs_available() -> bool:
    return importlib.util.find_spec("highspy") is not None


def _gap(energy: float, bound: float) -> float:
    return max(0.0, (energy - bound) / max(1.0, abs(energy)))


#: ``(problem, time_limit, warm_start) -> Solution``: the exact solver of each stage
ExactSolve = Callable[[PairwiseProblem, "float | None", np.ndarray], Solution]


def polish(problem: PairwiseProblem, x: np.ndarray, bound: float, margins: np.ndarray | None,
           deadline: float | None, target_gap: float, info: dict | None = None, *,
           exact: ExactSolve) -> tuple[np.ndarray, float]:
    """Improve ``x`` (a feasible assignment of ``problem``) until ``(energy - bound) / max(1, |energy|)
    <= target_gap``, the stages run out, or ``deadline`` (``time.perf_counter()`` seconds) passes.

    ``bound``: a proven lower bound on the optimum; ``margins``: per flat indicator, the margin of
    the state in a reparametrisation (None: only the whole-problem stage runs).  Returns the best
    assignment and the best proven bound (``bound``, or HiGHS' on the whole problem when larger).
    ``info`` (optional) receives ``polish_stages``, ``polish_s`` and ``polish_energy_before``.
    ``exact`` solves each stage (HiGHS through the presolve and reductions: :mod:`solvers.compositions`).
    """
    t0 = time.perf_counter()
    p = problem
    x = p.check_assignment(x)
    e = p.energy(x)
    g0 = e - bound
    stages = []
    if info is not None:
        info["polish_energy_before"] = e
    if not highs_available():
        log.info("polish: highspy is not installed; the assignment is kept as it is")
        return x, bound
    offs = p.offsets[:-1]
    allowed = np.isfinite(p.unary_flat)
    prev_kept = -1
    for frac in STAGES if margins is not None else (np.inf,):
        if _gap(e, bound) <= target_gap:
            break
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 1e-3:
            break
        if np.isfinite(frac):
            assert margins is not None  # the finite stages run only with margins
            keep = allowed & (margins <= frac * g0)
            keep[offs + x] = True
            n_kept = int(keep.sum())
            if n_kept == prev_kept:  # the same restricted problem as the last stage
                continue
            if n_kept == int(allowed.sum()):
                frac = np.inf
        if not np.isfinite(frac):
            keep, n_kept, sub = allowed, int(allowed.sum()), p
        else:
            sub = PairwiseProblem._from_parts(p, np.where(keep, p.unary_flat, np.inf), p.constraints)
        prev_kept = n_kept
        t1 = time.perf_counter()
        try:
            sol = exact(sub, left, x)
        except (SolverError, Infeasible) as err:  # a time limit without a solution, or a failure
            stages.append({"margin": float(frac), "states": n_kept, "error": str(err)[:200],
                           "seconds": time.perf_counter() - t1})
            log.info("polish: stage with margin %.3g (%d states) gave no assignment: %s", frac, n_kept, err)
            continue
        stages.append({"margin": float(frac), "states": n_kept, "energy": sol.energy, "status": sol.status,
                       "seconds": time.perf_counter() - t1})
        if sol.energy < e:
            x, e = sol.assignment, sol.energy
        if not np.isfinite(frac) and sol.lower_bound is not None:
            bound = max(bound, float(sol.lower_bound))
        log.info("polish: margin %.3g, %d of %d states, energy %.6g (%s), gap %.3g%%, %.3fs", frac, n_kept,
                 int(allowed.sum()), e, sol.status, 100 * _gap(e, bound), time.perf_counter() - t1)
    if info is not None:
        info["polish_stages"] = stages
        info["polish_s"] = time.perf_counter() - t0
    return x, min(bound, e)
