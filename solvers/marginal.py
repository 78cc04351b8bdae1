"""The marginal-polytope MILP of a pairwise problem, as numpy / scipy sparse arrays.

Columns: binary ``x[v, s]`` for every indicator (forbidden ones get upper bound 0), then continuous
``y[e, I, J] >= 0`` for every finite block of every edge.  Rows: one-hot ``sum_s x[v, s] = 1``;
marginalisation ``sum_J y[e, I, J] = sum_{i in I} x[u, i]`` and ``sum_I y[e, I, J] = sum_{j in J} x[v, j]``;
then the problem's side constraints.

Compression (exact): states of ``u`` whose rows of the edge matrix are identical form one class
``I`` (likewise columns for ``v``); the edge cost depends only on the class pair, and for integral
``x`` (and for the LP relaxation too: split ``y`` proportionally to ``x``) the aggregated polytope
is equivalent to the full one.  Placement costs have few distinct rows (states with the same
layout), so this shrinks the ``y`` block by 10x or more.  Without repeated rows every class is a
single state and this is the textbook formulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from .problem import PairwiseProblem

_HASH_SEED = 12345  # fixed seed for the row-hash vectors (deterministic models)


def row_classes(costs: np.ndarray, axis: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per edge, label identical rows (axis=1) or columns (axis=2) of ``costs`` (k, a, b).

    Returns labels (k, n) in 0..count-1 (labels ordered by first occurrence is not required) and
    counts (k,).  Rows are compared by a random projection (a forbidden +inf entry projected as a
    random stand-in value) and verified exactly against their class's first row; an edge whose
    verification fails gets singleton classes.
    """
    c = costs if axis == 1 else costs.transpose(0, 2, 1)
    k, n, m = c.shape
    r1 = rng.standard_normal(m)
    r2 = np.asarray(rng.standard_normal(m))  # drawn as before this stand-in replaced a second projection
    stand_in = 1e3 * (1.0 + abs(float(r2[0]))) if m else 0.0
    h = (np.where(c < np.inf, c, stand_in) * r1).sum(axis=2)  # (k, n); costs hold no NaN. Not a matmul:
    # BLAS may sum rows in different orders, so that identical rows hash apart
    order = np.argsort(h, axis=1, kind="stable")
    hs = np.take_along_axis(h, order, axis=1)
    new = np.ones((k, n), dtype=bool)
    new[:, 1:] = hs[:, 1:] != hs[:, :-1]
    lab_sorted = np.cumsum(new, axis=1) - 1
    labels = np.empty_like(lab_sorted)
    np.put_along_axis(labels, order, lab_sorted, axis=1)
    counts = lab_sorted[:, -1] + 1 if n else np.zeros(k, np.int64)
    # verify: every row that is not its class's first equals that first row (an edge whose rows are all
    # distinct has nothing to verify)
    first_pos = np.where(new, np.arange(n)[None, :], 0)
    first_pos = np.maximum.accumulate(first_pos, axis=1)  # position (in sorted order) of class start
    rep_sorted = np.take_along_axis(order, first_pos, axis=1)
    edge, pos = np.nonzero(~new)
    if len(edge):
        same = c[edge, order[edge, pos]] == c[edge, rep_sorted[edge, pos]]  # (rows, m); inf == inf holds
        bad = np.zeros(k, dtype=bool)
        bad[edge[~same.all(axis=1)]] = True
        if bad.any():
            labels[bad] = np.arange(n)[None, :]
            counts[bad] = n
    return labels.astype(np.int64), counts.astype(np.int64)


def _per_edge_ranks(labels: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``labels`` (k, n) (values below ``width``), its values renumbered 0..count-1 in
    increasing order, and the counts (k,)."""
    k = len(labels)
    uniq, inv = np.unique(np.arange(k)[:, None] * width + labels, return_inverse=True)
    start = np.searchsorted(uniq, np.arange(k) * width)
    return (inv.reshape(labels.shape) - start[:, None]).astype(np.int64), np.diff(np.append(start, len(uniq)))


def finite_absmax_per_edge(c: np.ndarray) -> np.ndarray:
    """Per edge, the largest finite |cost| (0 when none is finite); +inf and NaN (padding) entries skipped."""
    a = np.abs(c)
    np.putmask(a, ~(a < np.inf), 0.0)  # NaN < inf is False
    return a.max(axis=(1, 2), initial=0.0)


class ClassCorners:
    """The class-pair costs of edges given factored, read from their blocks on demand: edge ``e``'s
    ``(cu[e], cv[e])`` corner is ``blocks[index[e]][np.ix_(rep_u[e, :cu[e]], rep_v[e, :cv[e]])]``
    (the block row and column of every class). Stands where a NaN-padded class block is expected
    (:meth:`padded` makes that one), so that TRW-S can copy each corner straight into its own
    layout instead of through a padded array as large."""

    def __init__(self, blocks: np.ndarray, rep_u: np.ndarray, rep_v: np.ndarray, cu: np.ndarray, cv: np.ndarray,
                 index: np.ndarray | None = None) -> None:
        self.blocks, self.rep_u, self.rep_v, self.cu, self.cv = blocks, rep_u, rep_v, cu, cv
        self.index = np.arange(len(cu)) if index is None else index  # edge e's block is blocks[index[e]]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.cu), self.rep_u.shape[1], self.rep_v.shape[1])

    def corner(self, e: int) -> np.ndarray:
        # rows, then columns: twice the speed of one np.ix_ gather
        return self.blocks[self.index[e]][self.rep_u[e, : self.cu[e]]][:, self.rep_v[e, : self.cv[e]]]

    def identity(self, e: int) -> tuple:
        """What :meth:`corner` ``e`` is made of (the blocks array, while it lives, the block and the
        classes' rows and columns in it): edges with equal identities have equal corners."""
        return (id(self.blocks), int(self.index[e]), self.rep_u[e, : self.cu[e]].tobytes(),
                self.rep_v[e, : self.cv[e]].tobytes())

    def padded(self) -> np.ndarray:
        """``(k, max cu, max cv)`` with every corner, NaN elsewhere."""
        out = np.full(self.shape, np.nan)
        for e in range(len(self.cu)):
            out[e, : self.cu[e], : self.cv[e]] = self.corner(e)
        return out

    def finite_absmax(self) -> np.ndarray:
        """Per edge, the largest finite |cost| of its corner (0 when none is finite); computed once per
        :meth:`identity` (edges of one block and classes share it)."""
        by_identity: dict[tuple, float] = {}
        out = np.empty(len(self.cu))
        for e in range(len(self.cu)):
            key = self.identity(e)
            if key not in by_identity:
                by_identity[key] = float(finite_absmax_per_edge(self.corner(e)[None])[0])
            out[e] = by_identity[key]
        return out


def factored_classes(rows: np.ndarray, cols: np.ndarray, blocks: np.ndarray, index: np.ndarray | None = None,
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, ClassCorners]:
    """Classes of both axes for edges given factored (edge ``k``'s matrix ``blocks[index[k]][np.ix_(rows[k],
    cols[k])]``, as in :class:`~solvers.FactoredStack`; ``index`` defaults to every block in turn), as
    :func:`row_classes` gives them for dense matrices, without making those: ``(lu, cu, lv, cv,
    corners)``, the class pairs' costs as :class:`ClassCorners`.

    The classes are the labels the edges come with, renumbered per edge to those some state uses.
    Two labels whose prices happen to be equal stay apart: merging them would save little on
    the planner's problems (87.7 M class pairs against 85.9 M on LLaMA-3 8B's 4-D mesh) for two
    hashing passes over the blocks."""
    k = len(rows)
    ks = np.arange(k)
    lu, cu = _per_edge_ranks(rows, blocks.shape[1])
    lv, cv = _per_edge_ranks(cols, blocks.shape[2])
    rep_u = np.zeros((k, int(cu.max(initial=1))), dtype=np.int64)  # the block row of every class
    rep_u[ks[:, None], lu] = rows
    rep_v = np.zeros((k, int(cv.max(initial=1))), dtype=np.int64)
    rep_v[ks[:, None], lv] = cols
    return lu, cu, lv, cv, ClassCorners(blocks, rep_u, rep_v, cu, cv, index)


@dataclass
class MarginalModel:
    """Arrays of the MILP (CSC constraint matrix) plus what is needed to map solutions back."""

    cost: np.ndarray
    col_lower: np.ndarray
    col_upper: np.ndarray
    is_integer: np.ndarray  # bool per column
    matrix: sp.csc_matrix
    row_lower: np.ndarray
    row_upper: np.ndarray
    n_x: int
    # per group: labels_u (k,a), labels_v (k,b), yidx (k, max_cu, max_cv) column of y or -1
    group_maps: list[tuple[np.ndarray, np.ndarray, np.ndarray]]

    @property
    def n_cols(self) -> int:
        return len(self.cost)

    def columns_from_assignment(self, problem: PairwiseProblem, x: np.ndarray) -> np.ndarray:
        """A full column vector (x one-hot, y products) for a complete assignment."""
        col = np.zeros(self.n_cols)
        col[problem.offsets[:-1] + x] = 1.0
        for g, (lu, lv, yidx) in zip(problem.groups, self.group_maps, strict=True):
            ks = np.arange(len(g))
            cols = yidx[ks, lu[ks, x[g.u]], lv[ks, x[g.v]]]
            col[cols[cols >= 0]] = 1.0
        return col

    def assignment_from_columns(self, problem: PairwiseProblem, col: np.ndarray) -> np.ndarray:
        xv = np.asarray(col[: self.n_x])
        seg_max = np.maximum.reduceat(xv, problem.offsets[:-1])
        out = np.empty(problem.n_vars, dtype=np.int64)
        # first state reaching the segment max
        hit = xv >= np.repeat(seg_max, problem.n_states) - 1e-9
        pos = np.flatnonzero(hit)
        var_of = np.repeat(np.arange(problem.n_vars), problem.n_states)[pos]
        first = np.unique(var_of, return_index=True)[1]
        out[var_of[first]] = pos[first] - problem.offsets[var_of[first]]
        return out


def build_marginal_model(problem: PairwiseProblem, compress: bool = True) -> MarginalModel:
    p = problem
    n_x = p.n_indicators
    rng = np.random.default_rng(_HASH_SEED)
    allowed = np.isfinite(p.unary_flat)
    cost_parts = [np.where(allowed, p.unary_flat, 0.0)]
    rows_parts, cols_parts, vals_parts = [], [], []
    # one-hot rows 0..V-1
    var_of = np.repeat(np.arange(p.n_vars, dtype=np.int64), p.n_states)
    rows_parts.append(var_of)
    cols_parts.append(np.arange(n_x, dtype=np.int64))
    vals_parts.append(np.ones(n_x))
    next_row = p.n_vars
    next_col = n_x
    group_maps = []
    for g in p.groups:
        k, (a, b) = len(g), g.shape
        block = None
        if compress and g.factors is not None:
            f = g.factors
            lu, cu, lv, cv, corners = factored_classes(f.row_class, f.col_class, f.blocks, f.block_of)
            block = corners.padded()
        elif compress:
            lu, cu = row_classes(g.costs, 1, rng)
            lv, cv = row_classes(g.costs, 2, rng)
        else:
            lu, cu = np.tile(np.arange(a), (k, 1)), np.full(k, a)
            lv, cv = np.tile(np.arange(b), (k, 1)), np.full(k, b)
        mu, mv = int(cu.max()), int(cv.max())
        if block is None:  # each class pair's cost read at a representative state of each class: any member
            rep_u = np.zeros((k, mu), dtype=np.int64)
            rep_u[np.arange(k)[:, None], lu] = np.arange(a)[None, :]  # last write wins
            rep_v = np.zeros((k, mv), dtype=np.int64)
            rep_v[np.arange(k)[:, None], lv] = np.arange(b)[None, :]
            block = g.costs[np.arange(k)[:, None, None], rep_u[:, :, None], rep_v[:, None, :]]  # (k, mu, mv)
        exists = np.isfinite(block) & (np.arange(mu)[None, :, None] < cu[:, None, None]) & (
            np.arange(mv)[None, None, :] < cv[:, None, None])
        e_idx, I, J = np.nonzero(exists)
        ny = len(e_idx)
        ycols = next_col + np.arange(ny, dtype=np.int64)
        yidx = np.full((k, mu, mv), -1, dtype=np.int64)
        yidx[e_idx, I, J] = ycols
        group_maps.append((lu, lv, yidx))
        cost_parts.append(block[e_idx, I, J])
        # row ids for (e, I) and (e, J), compacted
        start_u = next_row + np.concatenate([[0], np.cumsum(cu)[:-1]])
        next_row += int(cu.sum())
        start_v = next_row + np.concatenate([[0], np.cumsum(cv)[:-1]])
        next_row += int(cv.sum())
        # y entries
        rows_parts += [start_u[e_idx] + I, start_v[e_idx] + J]
        cols_parts += [ycols, ycols]
        vals_parts += [np.ones(ny), np.ones(ny)]
        # x entries (-1)
        rows_parts.append((start_u[:, None] + lu).ravel())
        cols_parts.append((p.offsets[g.u][:, None] + np.arange(a)[None, :]).ravel())
        vals_parts.append(-np.ones(k * a))
        rows_parts.append((start_v[:, None] + lv).ravel())
        cols_parts.append((p.offsets[g.v][:, None] + np.arange(b)[None, :]).ravel())
        vals_parts.append(-np.ones(k * b))
        next_col += ny
    n_marg_end = next_row
    # side constraints
    m = len(p.constraints)
    if m:
        coo = p.constraint_matrix.tocoo()
        rows_parts.append(coo.row.astype(np.int64) + next_row)
        cols_parts.append(coo.col.astype(np.int64))
        vals_parts.append(coo.data)
        next_row += m
    n_rows, n_cols = next_row, next_col
    mat = sp.csc_matrix(
        (np.concatenate(vals_parts), (np.concatenate(rows_parts), np.concatenate(cols_parts))), shape=(n_rows, n_cols))
    mat.sum_duplicates()
    row_lower = np.zeros(n_rows)
    row_upper = np.zeros(n_rows)
    row_lower[: p.n_vars] = row_upper[: p.n_vars] = 1.0
    lo, hi = p.constraint_bounds
    row_lower[n_marg_end:] = lo
    row_upper[n_marg_end:] = hi
    col_lower = np.zeros(n_cols)
    col_upper = np.ones(n_cols)
    col_upper[:n_x] = allowed.astype(np.float64)
    is_int = np.zeros(n_cols, dtype=bool)
    is_int[:n_x] = True
    return MarginalModel(np.concatenate(cost_parts), col_lower, col_upper, is_int, mat, row_lower, row_upper, n_x,
                         group_maps)
