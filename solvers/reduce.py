"""Exact problem reductions shared by every backend (run by :func:`solvers.solve` after the presolve).

Every reduction keeps the optimum value (up to a constant ``offset``) and records how to map a
solution of the reduced problem back to the original one:

1. forbidden states (``+inf`` unary) are dropped from the variable and from its edge matrices;
2. dominated states are dropped: state ``t`` of ``v`` goes when another state ``s`` has a unary
   cost and every incident edge row no larger (``s`` is then at least as good in any assignment);
   identical states are the special case of mutual dominance (the lower index is kept);
3. a variable with one state is eliminated: its edge rows are folded into the neighbours' unaries;
4. a variable of degree 0 is fixed at its cheapest state, one of degree 1 (a leaf) is folded into
   its neighbour (``u_w[j] += min_i u_l[i] + M[i, j]``, the argmin is remembered);
5. a variable of degree 2 is eliminated by series reduction: its two edges ``(a, v)`` and
   ``(v, b)`` become one edge ``(a, b)`` with the min-plus product ``min_j M_av[i, j] + u_v[j] +
   M_vb[j, k]`` (the argmin table is remembered), summed with an existing ``(a, b)`` edge
   (parallel edges are summed).  Only when the product costs at most ``MAX_SERIES_WORK`` entries.

Variables that appear in a side constraint are never eliminated and never lose a finite state
(their rows are kept, re-indexed); their neighbours may still be eliminated.

:class:`Reduction` maps assignments both ways (:meth:`Reduction.expand`, :meth:`Reduction.restrict`)
and bounds: a lower bound ``b`` on the reduced problem gives ``b + offset`` on the original.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from .problem import FactoredStack, LinearConstraint, PairwiseProblem
from .solution import Infeasible

log = logging.getLogger(__name__)

MAX_SERIES_WORK = 4_000_000  # n_a * n_v * n_b entries of the min-plus product of one series reduction
MAX_ROUNDS = 4  # alternations of the dominance pass and the elimination fixpoint
MAX_DOMINANCE_WORK = 2_000_000  # n_v^2 * (row width) comparisons for the dominance test of one variable


@dataclass
class _Record:
    """How to recover an eliminated variable's original state.

    ``kind`` "fixed": ``value`` is the original state.  "leaf": ``table[pos_a[x_a]]`` is the local
    state, mapped to the original by ``states``.  "series": ``table[pos_a[x_a], pos_b[x_b]]``.
    """

    kind: str
    var: int
    value: int = -1
    states: np.ndarray | None = None
    a: int = -1
    b: int = -1
    pos_a: np.ndarray | None = None
    pos_b: np.ndarray | None = None
    table: np.ndarray | None = None


@dataclass
class Reduction:
    """A reduced problem plus what maps its solutions back to the original problem."""

    original: PairwiseProblem
    problem: PairwiseProblem  # the reduced problem (may have 0 variables)
    offset: float  # original optimum = reduced optimum + offset
    kept: np.ndarray  # original index of each reduced variable
    states: list[np.ndarray]  # per reduced variable: original state of each local state
    records: list[_Record] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    def expand(self, x_reduced) -> np.ndarray:
        """An original assignment from one of the reduced problem (same energy up to ``offset``)."""
        x = np.full(self.original.n_vars, -1, dtype=np.int64)
        xr = np.asarray(x_reduced, dtype=np.int64).reshape(-1)
        for i, v in enumerate(self.kept.tolist()):
            x[v] = self.states[i][xr[i]]
        for r in reversed(self.records):
            if r.kind == "fixed":
                x[r.var] = r.value
            elif r.kind == "leaf":
                assert r.states is not None and r.table is not None and r.pos_a is not None
                x[r.var] = r.states[r.table[r.pos_a[x[r.a]]]]
            else:
                assert r.states is not None and r.table is not None and r.pos_a is not None and r.pos_b is not None
                x[r.var] = r.states[r.table[r.pos_a[x[r.a]], r.pos_b[x[r.b]]]]
        return x

    def restrict(self, x_original) -> np.ndarray | None:
        """The reduced assignment of an original one, or None when it uses a removed state."""
        x = np.asarray(x_original, dtype=np.int64)
        out = np.empty(len(self.kept), dtype=np.int64)
        for i, v in enumerate(self.kept.tolist()):
            hit = np.flatnonzero(self.states[i] == x[v])
            if len(hit) == 0:
                return None
            out[i] = hit[0]
        return out


class _Factored:
    """One edge's matrix ``blocks[index][np.ix_(rows, cols)]`` (transposed when ``transposed``), from a
    :class:`~solvers.FactoredStack`, kept factored through what the reductions do to most edges:
    drop rows (states) and transpose. Arithmetic reads it as the dense matrix (``np.asarray``)."""

    __slots__ = ("blocks", "index", "transposed", "rows", "cols")

    def __init__(self, blocks: np.ndarray, index: int, rows: np.ndarray, cols: np.ndarray,
                 transposed: bool = False) -> None:
        self.blocks, self.index, self.rows, self.cols, self.transposed = blocks, index, rows, cols, transposed

    @property
    def block(self) -> np.ndarray:
        b = self.blocks[self.index]
        return b.T if self.transposed else b

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.rows), len(self.cols))

    @property
    def T(self) -> _Factored:
        return _Factored(self.blocks, self.index, self.cols, self.rows, not self.transposed)

    def __getitem__(self, rows: np.ndarray) -> _Factored:
        """The rows ``rows`` (a boolean mask or indices) selects, as ``m[rows]`` of the dense matrix."""
        return _Factored(self.blocks, self.index, self.rows[rows], self.cols, self.transposed)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        dense = self.block[np.ix_(self.rows, self.cols)]
        return dense if dtype is None else dense.astype(dtype, copy=False)


def _rows_with_a_finite_entry(m: np.ndarray | _Factored, finite_blocks: dict[tuple[int, int, bool], np.ndarray]) -> np.ndarray:
    """Which rows of ``m`` hold a finite entry; a factored ``m`` reads its block's finite mask from
    ``finite_blocks`` (made on first use: edges share blocks, and a variable's edges are read again
    after each change around it)."""
    if isinstance(m, _Factored):
        key = (id(m.blocks), m.index, m.transposed)
        finite = finite_blocks.get(key)
        if finite is None:
            finite = finite_blocks[key] = np.isfinite(m.block)
        # numpy's stubs type any(axis=...) as a scalar or an array; on a 2-D array it is an array
        return cast(np.ndarray, finite[:, np.unique(m.cols)].any(axis=1))[m.rows]
    return np.isfinite(m).any(axis=1)


def _factored_stacks(edges: list[tuple[int, int, _Factored]]) -> list[FactoredStack]:
    """Factored edges as :class:`~solvers.FactoredStack` s that share the blocks they came with
    (one per blocks array, orientation and matrix shape): rows dropped and transposes cost no copy."""
    by_source: dict[tuple, list] = {}
    for u, v, m in edges:
        by_source.setdefault((id(m.blocks), m.transposed, m.shape), []).append((u, v, m))
    stacks = []
    for (_, transposed, _), items in by_source.items():
        blocks = items[0][2].blocks
        stacks.append(FactoredStack([u for u, _, _ in items], [v for _, v, _ in items],
                                    np.stack([m.rows for _, _, m in items]), np.stack([m.cols for _, _, m in items]),
                                    blocks.transpose(0, 2, 1) if transposed else blocks,
                                    block_of=[m.index for _, _, m in items]))
    return stacks


def _positions(states: np.ndarray, n_orig: int) -> np.ndarray:
    pos = np.full(n_orig, -1, dtype=np.int64)
    pos[states] = np.arange(len(states))
    return pos


def reduce_problem(problem: PairwiseProblem, *, series: bool = True, dominance: bool = True) -> Reduction:
    """Apply the reductions of the module docstring until none applies; raise Infeasible when one proves it."""
    reducer = _Reducer(problem, series=series, dominance=dominance)
    reducer.run()
    return reducer.reduction()


class _Reducer:
    """The working state of :func:`reduce_problem`: per variable its unary, its surviving original
    states and its edges (``adj[v][w]``: rows are the states of ``v``), what is eliminated and how
    to undo it."""

    def __init__(self, problem: PairwiseProblem, *, series: bool, dominance: bool) -> None:
        p = self.p = problem
        self.series, self.dominance = series, dominance
        n = self.n = p.n_vars
        self.n_orig = p.n_states.tolist()
        self.unary = [np.array(u, dtype=np.float64) for u in p.unary]
        self.states = [np.arange(k, dtype=np.int64) for k in self.n_orig]
        self.adj: list[dict[int, np.ndarray | _Factored]] = [dict() for _ in range(n)]  # adj[v][w]: rows = states of v
        for g in p.groups:
            for k in range(len(g)):
                u, v = int(g.u[k]), int(g.v[k])
                # a read-only view (or factors): every rule below makes new matrices, never writes one
                f = g.factors
                m = g.costs[k] if f is None else _Factored(f.blocks, int(f.block_of[k]), f.row_class[k], f.col_class[k])
                self.adj[u][v] = m
                self.adj[v][u] = m.T
        self.frozen = np.zeros(n, dtype=bool)
        for c in p.constraints:
            for v, _, _ in c.terms:
                self.frozen[v] = True
        self.alive = np.ones(n, dtype=bool)
        self.records: list[_Record] = []
        self.offset = 0.0
        self.counts = {"fixed": 0, "leaf": 0, "series": 0, "states_removed": 0}
        self.finite_blocks: dict[tuple[int, int, bool], np.ndarray] = {}  # see _rows_with_a_finite_entry
        self.dirty = np.ones(n, dtype=bool)  # variables whose dominance test may find something new
        self.stale = np.ones(n, dtype=bool)  # variables whose unary or edges changed since their last prune

    def restrict_states(self, v: int, keep: np.ndarray) -> None:
        if keep.all():
            return
        if not keep.any():
            raise Infeasible(f"no feasible state for variable {self.p.var_name(v)} (found while eliminating its "
                             "neighbours: every state is forbidden)", variables=(self.p.var_name(v),))
        self.counts["states_removed"] += int((~keep).sum())
        adj = self.adj
        for w in adj[v]:
            self.dirty[w] = self.stale[w] = True  # w's rows lost entries: a state may now dominate another, or be forbidden
        self.unary[v] = self.unary[v][keep]
        self.states[v] = self.states[v][keep]
        for w, m in adj[v].items():
            m2 = m[keep]
            adj[v][w] = m2
            adj[w][v] = m2.T

    def prune(self, v: int, dominated: bool) -> None:
        """Drop forbidden states of v, then (when ``dominated``, unless frozen) dominated ones."""
        unary, adj = self.unary, self.adj
        self.stale[v] = False
        keep = np.isfinite(unary[v])
        for m in adj[v].values():
            keep &= _rows_with_a_finite_entry(m, self.finite_blocks)
        self.restrict_states(v, keep)
        k = len(unary[v])
        if not (self.dominance and dominated) or self.frozen[v] or k < 2:
            return
        width = 1 + sum(m.shape[1] for m in adj[v].values())
        if k * k * width > MAX_DOMINANCE_WORK:
            return
        sig = np.concatenate([unary[v][:, None]] + [np.asarray(m) for m in adj[v].values()], axis=1)  # (k, width)
        sig = sig[:, (sig != sig[:1]).any(axis=0)]  # columns equal for every state do not matter
        le = (sig[:, None, :] <= sig[None, :, :]).all(axis=2)  # le[s, t]: s is no worse than t anywhere
        idx = np.arange(k)
        # s beats t: no worse anywhere and better somewhere (not le[t, s]), or identical with a lower
        # index: a strict partial order, so a kept state dominates every removed one
        beats = le & (~le.T | (idx[:, None] < idx[None, :]))
        np.fill_diagonal(beats, False)
        self.restrict_states(v, ~cast(np.ndarray, beats.any(axis=0)))  # an array (see _rows_with_a_finite_entry)

    def drop_var(self, v: int) -> list[int]:
        adj = self.adj
        nbrs = list(adj[v])
        for w in nbrs:
            del adj[w][v]
        adj[v].clear()
        self.alive[v] = False
        return nbrs

    def eliminate(self, v: int) -> list[int] | None:
        """Eliminate v if a rule applies; return the neighbours to revisit, or None."""
        unary, states, adj = self.unary, self.states, self.adj
        k = len(unary[v])
        deg = len(adj[v])
        if k == 1:
            for w, m in adj[v].items():
                unary[w] = unary[w] + np.asarray(m)[0]
                self.dirty[w] = self.stale[w] = True
            self.offset += float(unary[v][0])
            self.records.append(_Record("fixed", v, value=int(states[v][0])))
            self.counts["fixed"] += 1
            return self.drop_var(v)
        if deg == 0:
            s = int(np.argmin(unary[v]))
            self.offset += float(unary[v][s])
            self.records.append(_Record("fixed", v, value=int(states[v][s])))
            self.counts["fixed"] += 1
            self.alive[v] = False
            return []
        if deg == 1:
            (w, m), = adj[v].items()
            tot = unary[v][:, None] + np.asarray(m)  # (k, n_w)
            arg = tot.argmin(axis=0)
            unary[w] = unary[w] + tot[arg, np.arange(tot.shape[1])]
            self.dirty[w] = self.stale[w] = True
            self.records.append(_Record("leaf", v, states=states[v], a=w, pos_a=_positions(states[w], self.n_orig[w]),
                                        table=arg))
            self.counts["leaf"] += 1
            return self.drop_var(v)
        if deg == 2 and self.series:
            return self._series(v)
        return None

    def _series(self, v: int) -> list[int] | None:
        """Series reduction of ``v``, of degree 2 (when the product is small enough)."""
        unary, states, adj, n_orig = self.unary, self.states, self.adj, self.n_orig
        k = len(unary[v])
        (a, ma), (b, mb) = adj[v].items()
        if ma.shape[1] * k * mb.shape[1] > MAX_SERIES_WORK:
            return None
        ma, mb = np.asarray(ma), np.asarray(mb)
        tot = ma.T[:, :, None] + unary[v][None, :, None] + mb[None, :, :]  # (n_a, k, n_b)
        arg = tot.argmin(axis=1)
        prod = np.take_along_axis(tot, arg[:, None, :], axis=1)[:, 0, :]
        self.records.append(_Record("series", v, states=states[v], a=a, b=b,
                                    pos_a=_positions(states[a], n_orig[a]), pos_b=_positions(states[b], n_orig[b]),
                                    table=arg))
        self.counts["series"] += 1
        self.drop_var(v)
        if b in adj[a]:
            prod = np.asarray(adj[a][b]) + prod  # parallel edges are summed
        adj[a][b] = prod
        self.dirty[a] = self.dirty[b] = self.stale[a] = self.stale[b] = True
        adj[b][a] = prod.T
        return [a, b]

    def run(self) -> None:
        """Rounds of (a) dominance, once per changed variable (the costly test), and (b) eliminations
        to a fixpoint, pruning only forbidden states on the way, until a round changes nothing."""
        n, alive, dirty, stale = self.n, self.alive, self.dirty, self.stale
        for _round in range(MAX_ROUNDS):
            before = dict(self.counts)
            for v in np.flatnonzero(alive & dirty).tolist():
                dirty[v] = False
                if alive[v]:
                    self.prune(v, True)
            queue = np.flatnonzero(alive).tolist()[::-1]
            queued = np.zeros(n, dtype=bool)
            queued[queue] = True
            while queue:
                v = queue.pop()
                queued[v] = False
                if not alive[v]:
                    continue
                if stale[v]:  # otherwise pruning finds nothing new
                    self.prune(v, False)
                revisit = None if self.frozen[v] else self.eliminate(v)
                for w in revisit or ():
                    if alive[w] and not queued[w]:
                        queued[w] = True
                        queue.append(w)
            if self.counts == before or not (alive & dirty).any():
                break

    def reduction(self) -> Reduction:
        """The reduced problem over the surviving variables, and how to map back."""
        p, n, states, counts = self.p, self.n, self.states, self.counts
        kept = np.flatnonzero(self.alive)
        new_index = np.full(n, -1, dtype=np.int64)
        new_index[kept] = np.arange(len(kept))
        edges: list = []
        factored: list = []
        for v in kept.tolist():
            for w, m in self.adj[v].items():
                if v < w:
                    (factored if isinstance(m, _Factored) else edges).append((int(new_index[v]), int(new_index[w]), m))
        edges += _factored_stacks(factored)
        cons = []
        for c in p.constraints:
            terms = []
            for v, s, coef in c.terms:
                j = np.flatnonzero(states[v] == s)
                if len(j):  # a removed state of a frozen variable is forbidden: its indicator is 0
                    terms.append((int(new_index[v]), int(j[0]), coef))
            cons.append(LinearConstraint(c.name, terms, c.sense, c.rhs))
        names = [p.names[v] for v in kept.tolist()] if p.names else None
        reduced = PairwiseProblem([self.unary[v] for v in kept.tolist()], edges, cons, names=names)
        stats = dict(counts, vars=len(kept), edges=reduced.n_edges, indicators=reduced.n_indicators)
        log.debug("reduce: %d -> %d variables, %d -> %d edges, %d -> %d states (%s)", n, len(kept), p.n_edges,
                  reduced.n_edges, p.n_indicators, reduced.n_indicators, counts)
        return Reduction(p, reduced, self.offset, kept, [states[v] for v in kept.tolist()], records=self.records, stats=stats)
