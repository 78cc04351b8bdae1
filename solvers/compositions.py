"""Backends made of other backends, declared here and nowhere else.

The leaf backends (:mod:`solvers.trws`, :mod:`solvers.highs_backend`, ...) never import one
another and never call :func:`solvers.solve`: where one can use another (TRW-S finishing with an
exact polish, HiGHS warm-started from TRW-S), it takes a function argument, and this module wires
the leaves together. The built-in names ``"trws"`` and ``"highs"`` are these compositions (see
:data:`solvers.backends.BUILTIN_BACKENDS`, whose ``runs`` field says what runs); they call the
leaf functions directly, so a backend a user registers under ``"highs"`` is never picked up
inside TRW-S. Each result's ``info["runs"]`` names what ran, and reaches the plan's solver record.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .highs_backend import solve_highs
from .polish import polish
from .problem import PairwiseProblem
from .registry import solve_with
from .solution import BackendResult, Infeasible, Solution, SolverError, Unsupported
from .trws import POLISH_GAP, solve_trws

log = logging.getLogger(__name__)

#: What each composition runs (shown in ``apmodel`` help, capabilities and plan files).
TRWS_RUNS = ("TRW-S + local search; above a 0.1% certified gap, an exact HiGHS polish on the near-optimal states; "
             "HiGHS alone where TRW-S finds no assignment within a side constraint (not a proof that none exists)")
HIGHS_RUNS = "HiGHS (LP relaxation first, then MIP); with a time limit, a TRW-S plan and bound first"


def _highs_exact(problem: PairwiseProblem, time_limit: float | None, warm_start: np.ndarray) -> Solution:
    """One polish stage: HiGHS (no fallback) through the presolve and reductions."""
    return solve_with(problem, solve_highs, "highs (polish)", time_limit, warm_start=warm_start)


def _trws_fallback(problem: PairwiseProblem, seconds: float) -> BackendResult | None:
    """TRW-S without polish within ``seconds``, or None when it cannot take the problem or finds nothing."""
    try:
        return solve_trws(problem, time_limit=seconds)
    except (Unsupported, Infeasible, SolverError) as err:
        log.info("highs: no TRW-S fallback plan (%s)", err)
        return None


def trws(problem: PairwiseProblem, time_limit: float | None = None, *, polish: bool = True,
         polish_gap: float = POLISH_GAP, **options) -> BackendResult:
    """The ``trws`` backend: :func:`solvers.trws.solve_trws`, finished by :func:`solvers.polish.polish`
    with HiGHS when its certified gap is above ``polish_gap`` (``polish=False``: TRW-S alone)."""
    step = _polish_with_highs if polish else None
    t0 = time.perf_counter()
    try:
        result = solve_trws(problem, time_limit, polish_step=step, polish_gap=polish_gap, **options)
    except Infeasible as err:
        # TRW-S's Lagrangian search over a budget row can miss a feasible assignment that exists:
        # only a proof may reach the caller as "no plan" (the planner reports it as out of memory)
        if not polish or err.proven:
            raise
        log.info("trws: %s; solving exactly with HiGHS", err)
        left = None if time_limit is None else max(1e-3, time_limit - (time.perf_counter() - t0))
        result = solve_highs(problem, left)
        result.info["fallback"] = f"TRW-S: {err}; HiGHS alone"
    result.info["runs"] = TRWS_RUNS if polish else "TRW-S + local search"
    return result


def _polish_with_highs(problem: PairwiseProblem, x: np.ndarray, bound: float, margins: np.ndarray | None,
                       deadline: float | None, target_gap: float, info: dict) -> tuple[np.ndarray, float]:
    return polish(problem, x, bound, margins, deadline, target_gap, info, exact=_highs_exact)


def highs(problem: PairwiseProblem, time_limit: float | None = None, *, fallback: bool = True,
          **options) -> BackendResult:
    """The ``highs`` backend: :func:`solvers.highs_backend.solve_highs`, with TRW-S's plan and bound
    as a warm start under a time limit (``fallback=False``: HiGHS alone)."""
    result = solve_highs(problem, time_limit, fallback=_trws_fallback if fallback else None, **options)
    result.info["runs"] = HIGHS_RUNS if fallback else "HiGHS (LP relaxation first, then MIP)"
    return result
