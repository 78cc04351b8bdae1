"""Approximate MAP backend through pgmpy's MPLP (``Mplp`` on a ``DiscreteMarkovNetwork``).

MPLP maximises a sum of non-negative log-potentials, so each cost table ``c`` becomes
``max(c) - c`` with ``+inf`` first replaced by a large finite penalty; every variable gets a unary
factor (MPLP needs one).  The result is approximate and has no bound.  Variables MPLP leaves out
are completed greedily given their assigned neighbours (logged); an assignment with a forbidden
state or pair raises :class:`~solvers.Infeasible` (not proven).  Side constraints are unsupported.
"""

from __future__ import annotations

import logging

import numpy as np

from .problem import PairwiseProblem
from .solution import BackendResult, Infeasible, Unsupported

log = logging.getLogger(__name__)

PENALTY_FACTOR = 10.0  # forbidden entry = max finite cost + PENALTY_FACTOR * (total cost range + 1)


def _potential(c: np.ndarray, penalty: float) -> np.ndarray:
    fin = np.isfinite(c)
    cmax = float(c[fin].max()) if fin.any() else 0.0
    c = np.where(fin, c, cmax + penalty)
    return c.max() - c


def solve_pgmpy(problem: PairwiseProblem, time_limit: float | None = None, *, init_iter: int = 1000,
                later_iter: int = 20, tighten_triplet: bool = False) -> BackendResult:
    """MAP by MPLP.  ``time_limit`` is not supported by pgmpy and is ignored (logged)."""
    p = problem
    if p.constraints:
        raise Unsupported(f"pgmpy backend does not support linear side constraints "
                          f"({[c.name for c in p.constraints]}); use 'highs', 'cvxpy' or 'trws'")
    from pgmpy.factors.discrete import DiscreteFactor
    from pgmpy.inference import Mplp
    from pgmpy.models import DiscreteMarkovNetwork

    if time_limit is not None:
        log.info("pgmpy backend ignores time_limit=%s", time_limit)
    rng_total = float(np.ptp(p.unary_flat[np.isfinite(p.unary_flat)])) if np.isfinite(p.unary_flat).any() else 0.0
    for g in p.groups:
        fin = np.isfinite(g.costs)
        if fin.any():
            rng_total += float(np.ptp(g.costs[fin])) * len(g)
    penalty = PENALTY_FACTOR * (rng_total + 1.0)
    names = [f"v{i}" for i in range(p.n_vars)]
    model = DiscreteMarkovNetwork()
    model.add_nodes_from(names)
    factors = []
    for i, u in enumerate(p.unary):
        factors.append(DiscreteFactor([names[i]], [len(u)], _potential(u, penalty)))
    for u, v, c in p.edges:
        model.add_edge(names[u], names[v])
        factors.append(DiscreteFactor([names[u], names[v]], list(c.shape), _potential(c, penalty).ravel()))
    model.add_factors(*factors)
    result = Mplp(model).map_query(init_iter=init_iter, later_iter=later_iter, tighten_triplet=tighten_triplet)
    x = np.full(p.n_vars, -1, dtype=np.int64)
    for name, state in result.items():
        x[int(name[1:])] = int(state)
    missing = np.flatnonzero(x < 0)
    if len(missing):
        log.info("pgmpy/MPLP left %d of %d variables unassigned; completing them greedily", len(missing), p.n_vars)
        _complete_greedily(p, x, missing)
    if not np.isfinite(p.energy(x)):
        raise Infeasible("pgmpy/MPLP returned an assignment using a forbidden state or pair (not proven infeasible)",
                         proven=False)
    return BackendResult(x, None, "feasible", {"unassigned_by_mplp": int(len(missing))})


def _complete_greedily(p: PairwiseProblem, x: np.ndarray, missing: np.ndarray) -> None:
    """Give each missing variable its best state given the neighbours assigned so far."""
    edges = p.edges
    by_var: dict[int, list[tuple[int, np.ndarray, bool]]] = {}
    for u, v, c in edges:
        by_var.setdefault(u, []).append((v, c, True))
        by_var.setdefault(v, []).append((u, c, False))
    for v in missing:
        score = p.unary[v].copy()
        for w, c, v_is_u in by_var.get(int(v), []):
            if x[w] >= 0:
                score = score + (c[:, x[w]] if v_is_u else c[x[w], :])
        x[v] = int(np.argmin(score))
