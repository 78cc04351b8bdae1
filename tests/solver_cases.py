"""Random problem generators shared by the solver tests (no solver code here)."""

from __future__ import annotations

import numpy as np

import solvers


def random_problem(seed: int, max_vars: int = 8, max_states: int = 4, p_edge: float = 0.4,
                   p_inf: float = 0.1, graph: str = "random") -> solvers.PairwiseProblem:
    """Small random problem: ``graph`` is "random", "chain" or "tree"."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, max_vars + 1))
    ns = rng.integers(1, max_states + 1, size=n)
    unary = []
    for k in ns:
        u = rng.normal(size=k).round(3)
        u[rng.random(k) < p_inf] = np.inf
        unary.append(u)
    if graph == "chain":
        pairs = [(i, i + 1) for i in range(n - 1)]
    elif graph == "tree":
        pairs = [(int(rng.integers(0, i)), i) for i in range(1, n)]
    else:
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n) if rng.random() < p_edge]
    edges = []
    for i, j in pairs:
        m = rng.normal(scale=1.5, size=(ns[i], ns[j])).round(3)
        m[rng.random(m.shape) < p_inf] = np.inf
        if rng.random() < 0.5:
            edges.append((j, i, m.T))  # reversed orientation on purpose
        else:
            edges.append((i, j, m))
    return solvers.PairwiseProblem(unary, edges)


def with_budget(problem: solvers.PairwiseProblem, seed: int, tight: float = 0.5) -> solvers.PairwiseProblem:
    """Add one "<=" budget row with random non-negative weights, rhs between min and max weight sum."""
    rng = np.random.default_rng(seed + 7919)
    w = rng.integers(0, 5, size=problem.n_indicators).astype(float)
    mins = np.minimum.reduceat(np.where(np.isfinite(problem.unary_flat), w, np.inf), problem.offsets[:-1])
    maxs = np.maximum.reduceat(np.where(np.isfinite(problem.unary_flat), w, -np.inf), problem.offsets[:-1])
    lo, hi = np.nansum(np.where(np.isfinite(mins), mins, 0)), np.nansum(np.where(np.isfinite(maxs), maxs, 0))
    rhs = float(np.floor(lo + tight * (hi - lo)))
    terms = [(v, s, w[problem.offsets[v] + s]) for v in range(problem.n_vars) for s in range(problem.n_states[v])
             if w[problem.offsets[v] + s] != 0]
    return solvers.PairwiseProblem(problem.unary, problem.edges, [solvers.LinearConstraint("budget", terms, "<=", rhs)])


def brute_or_none(problem: solvers.PairwiseProblem):
    """Brute-force solution, or None when infeasible."""
    try:
        return solvers.solve(problem, "brute")
    except solvers.Infeasible:
        return None
