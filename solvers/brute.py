"""Exhaustive search over all allowed assignments: exact, for tiny problems and tests."""

from __future__ import annotations

import numpy as np

from .problem import PairwiseProblem
from .solution import BackendResult, Infeasible

MAX_COMBINATIONS = 1_000_000  # refuse beyond this many assignments (about a second of numpy work)
CHUNK = 65_536  # assignments evaluated per numpy batch


def solve_brute(problem: PairwiseProblem, time_limit: float | None = None, *,
                max_combinations: int = MAX_COMBINATIONS) -> BackendResult:
    """Enumerate every assignment of finite-unary states; ``time_limit`` is ignored."""
    p = problem
    domains = [np.flatnonzero(np.isfinite(u)) for u in p.unary]
    sizes = np.array([len(d) for d in domains], dtype=np.int64)
    if (sizes == 0).any():
        v = int(np.flatnonzero(sizes == 0)[0])
        raise Infeasible(f"variable {p.var_name(v)} has every state forbidden", variables=(p.var_name(v),))
    total = 1
    for s in sizes:
        total *= int(s)
        if total > max_combinations:
            raise ValueError(f"brute force refuses this problem: more than {max_combinations} assignments "
                             f"({p.n_vars} variables); use another backend")
    mat = p.constraint_matrix.toarray() if p.constraints else None
    lo, hi = p.constraint_bounds
    best_e, best_x = np.inf, None
    for start in range(0, total, CHUNK):
        codes = np.arange(start, min(total, start + CHUNK), dtype=np.int64)
        idx = np.stack(np.unravel_index(codes, tuple(sizes)), axis=1) if p.n_vars else np.zeros((len(codes), 0), np.int64)
        xs = np.empty_like(idx)
        for v, d in enumerate(domains):
            xs[:, v] = d[idx[:, v]]
        e = p.unary_flat[p.offsets[:-1] + xs].sum(axis=1)
        for g in p.groups:
            e = e + g.costs[np.arange(len(g))[None, :], xs[:, g.u], xs[:, g.v]].sum(axis=1)
        if mat is not None:
            lhs = mat[:, p.offsets[:-1] + xs].sum(axis=2)  # (m, batch)
            tol = 1e-9 * np.maximum(1.0, np.abs(np.where(np.isfinite(hi), hi, lo)))[:, None]
            ok = ((lhs >= lo[:, None] - tol) & (lhs <= hi[:, None] + tol)).all(axis=0)
            e = np.where(ok, e, np.inf)
        k = int(np.argmin(e))
        if e[k] < best_e:
            best_e, best_x = float(e[k]), xs[k].copy()
    if best_x is None:
        raise Infeasible(f"no assignment of the {p.n_vars} variables has finite energy and satisfies the constraints "
                         f"{[c.name for c in p.constraints]} (exhaustive search)",
                         variables=tuple(p.var_name(v) for v in range(p.n_vars)),
                         constraints=tuple(c.name for c in p.constraints))
    return BackendResult(best_x, lower_bound=best_e, status="optimal", info={"combinations": total})
