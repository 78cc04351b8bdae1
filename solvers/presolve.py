"""Cheap feasibility checks and domain reductions shared by every backend.

1. constraints that touch a single variable become domain restrictions (e.g. fixed states
   ``x[v, s] == 1``) and are removed from the row list;
2. arc consistency over the edges: a state with no finite partner on some edge is removed
   (bounded number of rounds; incomplete by design, it is a presolve);
3. every remaining row is checked against its min / max achievable left-hand side.

Anything proven impossible raises :class:`~solvers.solution.Infeasible` naming the variables,
edges and constraints involved.  Reductions never remove a state that a feasible assignment uses,
so energies on the reduced problem equal energies on the original.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .problem import EdgeGroup, LinearConstraint, PairwiseProblem
from .solution import Infeasible

log = logging.getLogger(__name__)

MAX_AC_ROUNDS = 64  # arc-consistency sweeps; each is one vectorised pass over all edges


def _tol(rhs: float) -> float:
    return 1e-9 * max(1.0, abs(rhs))


@dataclass
class PresolveResult:
    problem: PairwiseProblem  # reduced problem (forbidden states set to +inf, 1-variable rows dropped)
    removed_states: int
    absorbed_constraints: tuple[str, ...]


def _supports(g: EdgeGroup, finite: np.ndarray, other: np.ndarray, towards_u: bool) -> np.ndarray:
    """Per edge of ``g``, which states of one end (u when ``towards_u``, else v) have a finite pair
    with a state ``other`` allows at the other end. ``finite``: ``g``'s finite-entry mask, of its
    class blocks when it is factored (then computed per class and read back per state)."""
    f = g.factors
    if f is None:
        return (finite & other[:, None, :]).any(axis=2) if towards_u else (finite & other[:, :, None]).any(axis=1)
    mine, theirs = (f.row_class, f.col_class) if towards_u else (f.col_class, f.row_class)
    if not towards_u:
        finite = finite.transpose(0, 2, 1)
    present = np.zeros((len(g), finite.shape[2]), dtype=bool)  # classes of the other end holding an allowed state
    k, j = np.nonzero(other)
    present[k, theirs[k, j]] = True
    return np.take_along_axis((finite & present[:, None, :]).any(axis=2), mine, axis=1)


def presolve(problem: PairwiseProblem) -> PresolveResult:
    p = problem
    allowed = np.isfinite(p.unary_flat).copy()
    reasons: dict[int, list[str]] = {}  # variable -> what removed its states, for the messages
    kept, absorbed = _absorb_single_variable_rows(p, allowed, reasons)
    _check_vars(p, allowed, reasons, "unary costs and single-variable constraints")
    _arc_consistency(p, allowed, reasons)
    _check_vars(p, allowed, reasons, "after propagating forbidden pairs along edges")
    if kept:
        _check_rows(p, allowed, kept)

    removed = int(np.isfinite(p.unary_flat).sum() - allowed.sum())
    if removed == 0 and not absorbed:
        return PresolveResult(p, 0, ())
    unary = np.where(allowed, p.unary_flat, np.inf)
    reduced = PairwiseProblem._from_parts(p, unary, kept)
    log.debug("presolve removed %d states, absorbed %d single-variable constraints", removed, len(absorbed))
    return PresolveResult(reduced, removed, tuple(absorbed))


def _absorb_single_variable_rows(p: PairwiseProblem, allowed: np.ndarray, reasons: dict[int, list[str]],
                                 ) -> tuple[list[LinearConstraint], list[str]]:
    """1. Single-variable rows become domain restrictions (in ``allowed``): the rows kept (over
    several variables) and the names of those absorbed."""
    kept: list[LinearConstraint] = []
    absorbed: list[str] = []
    lo_all, hi_all = p.constraint_bounds
    for i, c in enumerate(p.constraints):
        vars_in = {t[0] for t in c.terms}
        if len(vars_in) > 1:
            kept.append(c)
            continue
        lo, hi = lo_all[i], hi_all[i]
        if not vars_in:
            if not (lo - _tol(c.rhs) <= 0.0 <= hi + _tol(c.rhs)):
                raise Infeasible(f"constraint {c.name!r} has no terms and 0 {c.sense} {c.rhs} is false",
                                 constraints=(c.name,))
            absorbed.append(c.name)
            continue
        (v,) = vars_in
        contrib = np.zeros(int(p.n_states[v]))
        for _, s, coef in c.terms:
            contrib[s] += coef
        ok = (contrib >= lo - _tol(c.rhs)) & (contrib <= hi + _tol(c.rhs))
        sl = slice(int(p.offsets[v]), int(p.offsets[v + 1]))
        newly = allowed[sl] & ~ok
        if newly.any():
            reasons.setdefault(v, []).append(f"constraint {c.name!r}")
        allowed[sl] &= ok
        absorbed.append(c.name)
    return kept, absorbed


def _check_vars(p: PairwiseProblem, allowed: np.ndarray, reasons: dict[int, list[str]], where: str) -> None:
    """Infeasible, naming what removed them, when a variable has no allowed state left."""
    counts = np.add.reduceat(allowed.astype(np.int64), p.offsets[:-1]) if p.n_vars else np.zeros(0)
    empty = np.flatnonzero(counts == 0)
    if len(empty):
        names = tuple(p.var_name(v) for v in empty[:10])
        detail = "; ".join(
            f"{p.var_name(v)}: states removed by " + (", ".join(reasons.get(int(v), [])) or "its unary cost (all +inf)")
            for v in empty[:10]
        )
        cons = tuple(sorted({r.split("'")[1] for v in empty for r in reasons.get(int(v), []) if r.startswith("constraint")}))
        raise Infeasible(f"no feasible state for variable(s) {', '.join(names)} ({where}): {detail}",
                         variables=names, constraints=cons)


def _arc_consistency(p: PairwiseProblem, allowed: np.ndarray, reasons: dict[int, list[str]]) -> None:
    """2. Arc consistency: a state no allowed state of a neighbour can pair with (finitely) goes."""
    finite = [np.isfinite(g.costs) if g.factors is None else np.isfinite(g.factors.blocks)[g.factors.block_of]
              for g in p.groups]
    idx_u = [p.offsets[g.u][:, None] + np.arange(g.shape[0]) for g in p.groups]
    idx_v = [p.offsets[g.v][:, None] + np.arange(g.shape[1]) for g in p.groups]
    # a group is checked again only when a state of one of its variables was removed since its last
    # check (by any group): otherwise it would find what it found then (the 4-D LLaMA-3 problem takes
    # 12 rounds, most of them around a few variables)
    touched = np.ones(p.n_vars, dtype=bool)
    for _round in range(MAX_AC_ROUNDS):
        changed = False
        touched_now = np.zeros(p.n_vars, dtype=bool)
        for g, fin, iu, iv in zip(p.groups, finite, idx_u, idx_v, strict=True):
            if not (touched[g.u].any() or touched[g.v].any()):
                continue
            au = allowed[iu]
            av = allowed[iv]
            sup_u = _supports(g, fin, av, towards_u=True) & au  # (k, a)
            dead = ~sup_u.any(axis=1)
            if dead.any():
                k = int(np.flatnonzero(dead)[0])
                u, v = int(g.u[k]), int(g.v[k])
                raise Infeasible(
                    f"edge ({p.var_name(u)}, {p.var_name(v)}) forbids every pair of the states still allowed "
                    f"for {p.var_name(u)} {np.flatnonzero(au[k]).tolist()} and {p.var_name(v)} "
                    f"{np.flatnonzero(av[k]).tolist()}",
                    variables=(p.var_name(u), p.var_name(v)),
                )
            sup_v = _supports(g, fin, sup_u, towards_u=False) & av  # (k, b)
            rm_u = au & ~sup_u
            rm_v = av & ~sup_v
            if rm_u.any() or rm_v.any():
                changed = True
                for rm, idx, ends, others in ((rm_u, iu, g.u, g.v), (rm_v, iv, g.v, g.u)):
                    ks = np.flatnonzero(rm.any(axis=1))
                    touched_now[ends[ks]] = True
                    for k in ks[:50]:  # keep reasons for messages, bounded
                        reasons.setdefault(int(ends[k]), []).append(
                            f"edge ({p.var_name(min(ends[k], others[k]))}, {p.var_name(max(ends[k], others[k]))})")
                    allowed[idx[rm]] = False
        if not changed:
            break
        touched = touched_now


def _check_rows(p: PairwiseProblem, allowed: np.ndarray, kept: list[LinearConstraint]) -> None:
    """3. Rows: Infeasible when the min / max achievable left-hand side over the allowed states
    cannot meet the right-hand side."""
    base = PairwiseProblem._from_parts(p, p.unary_flat, kept)
    mat = base.constraint_matrix
    lo_k, hi_k = base.constraint_bounds
    for i, c in enumerate(kept):
        row = mat.getrow(i).toarray().ravel()
        mins = np.minimum.reduceat(np.where(allowed, row, np.inf), p.offsets[:-1])
        maxs = np.maximum.reduceat(np.where(allowed, row, -np.inf), p.offsets[:-1])
        mn, mx = float(mins.sum()), float(maxs.sum())
        if mn > hi_k[i] + _tol(c.rhs):
            raise Infeasible(
                f"constraint {c.name!r}: the smallest achievable left-hand side is {mn:g} > rhs {c.rhs:g}",
                constraints=(c.name,))
        if mx < lo_k[i] - _tol(c.rhs):
            raise Infeasible(
                f"constraint {c.name!r}: the largest achievable left-hand side is {mx:g} < rhs {c.rhs:g}",
                constraints=(c.name,))
