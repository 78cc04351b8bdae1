"""Approximate MAP backend through pgmpy's MPLP (``Mplp`` on a ``DiscreteMarkovNetwork``).

MPLP maximises a sum of non-negative log-potentials, so each cost table ``c`` becomes
``max(c) - c`` with ``+inf`` first replaced by a large finite penalty; every variable gets a unary
factor (MPLP needs one).  The result is approximate and has no bound.  Variables MPLP leaves out
are completed greedily given their assigned neighbours (logged); an assignment with a forbidden
state or pair raises :class:`~solvers.Infeasible` (not proven).  Side constraints are unsupported.

``time_limit``: pgmpy's ``Mplp.map_query`` only takes iteration counts, no clock and no callback.
It does consult ``Mplp._is_converged`` after every message-passing sweep and before every
triplet-tightening round, so :class:`_DeadlineMplp` overrides that (private) hook to report
convergence once the deadline has passed; ``map_query`` then returns the best decoded assignment
so far, with status ``"time_limit"``.  This was chosen over re-calling ``map_query`` in short
chunks, which cannot tell convergence from exhaustion and so would keep iterating to the limit.
Limits: pgmpy always runs at least 17 sweeps of its first pass before it honours convergence, and
building the network and ``Mplp(...)`` itself cannot be interrupted, so a run can overshoot the
limit by that much.  Should a pgmpy release drop the hook, the limit cannot be honoured; that is
logged as a warning and MPLP runs to its iteration counts.
"""

from __future__ import annotations

import logging
import time

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


def _deadline_mplp(mplp_cls: type, deadline: float) -> type | None:
    """A subclass of pgmpy's ``Mplp`` whose convergence test also says yes after ``deadline``.

    None when this pgmpy has no ``_is_converged`` hook (then the limit cannot be honoured)."""
    if not callable(getattr(mplp_cls, "_is_converged", None)):
        return None

    class _DeadlineMplp(mplp_cls):
        timed_out = False

        def _is_converged(self, *args, **kwargs):  # called after each sweep / tightening round
            if time.perf_counter() >= deadline:
                self.timed_out = True
                return True
            return super()._is_converged(*args, **kwargs)

    return _DeadlineMplp


def solve_pgmpy(problem: PairwiseProblem, time_limit: float | None = None, *, init_iter: int = 1000,
                later_iter: int = 20, tighten_triplet: bool = False) -> BackendResult:
    """MAP by MPLP; ``time_limit`` stops message passing when it has passed (see the module docstring)."""
    t0 = time.perf_counter()
    p = problem
    if p.constraints:
        raise Unsupported(f"pgmpy backend does not support linear side constraints "
                          f"({[c.name for c in p.constraints]}); use 'highs', 'cvxpy' or 'trws'")
    from pgmpy.factors.discrete import DiscreteFactor
    from pgmpy.inference import Mplp
    from pgmpy.models import DiscreteMarkovNetwork

    mplp_cls = Mplp
    if time_limit is not None:
        mplp_cls = _deadline_mplp(Mplp, t0 + float(time_limit)) or Mplp
        if mplp_cls is Mplp:
            log.warning("pgmpy backend cannot honour time_limit=%s: this pgmpy's Mplp has no _is_converged hook; "
                        "MPLP runs to its iteration counts", time_limit)
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
    for i, costs in enumerate(p.unary):
        factors.append(DiscreteFactor([names[i]], [len(costs)], _potential(costs, penalty)))
    for u, v, c in p.edges:
        model.add_edge(names[u], names[v])
        factors.append(DiscreteFactor([names[u], names[v]], list(c.shape), _potential(c, penalty).ravel()))
    model.add_factors(*factors)
    mplp = mplp_cls(model)
    result = mplp.map_query(init_iter=init_iter, later_iter=later_iter, tighten_triplet=tighten_triplet)
    timed_out = bool(getattr(mplp, "timed_out", False))
    if timed_out:
        log.info("pgmpy/MPLP stopped at time_limit=%ss after %.2fs", time_limit, time.perf_counter() - t0)
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
    return BackendResult(x, None, "time_limit" if timed_out else "feasible",
                         {"unassigned_by_mplp": int(len(missing)), "timed_out": timed_out})


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
