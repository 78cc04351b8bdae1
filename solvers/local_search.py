"""Local search on a complete assignment: ICM (coordinate descent) and star-block moves.

ICM updates every variable of a colour class at once (no two are adjacent, so their moves do
not interact): each takes its best state given its neighbours.  A star-block move takes a
high-degree *hub*, tries each of its states and lets its neighbours best-respond (two rounds),
and keeps the best result if it lowers the energy.  With a budget row ``w . x <= rhs`` moves
keep the assignment feasible, and :meth:`LocalSearch.repair` makes an infeasible one feasible.
Costs are the backend's internal finite ones (forbidden = a large finite value).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np

from .problem import PairwiseProblem

MAX_ROUNDS = 30  # ICM sweeps over all colour classes
STAR_ROUNDS = 3  # alternations of star-block and ICM
REL_EPS = 1e-12  # an improvement must exceed this fraction of the energy scale


@dataclass
class _Subset:
    vars: np.ndarray
    unary_pad: np.ndarray  # (n, w), +inf padding
    sides: list  # (group index, u side, v side) for the groups with an edge touching the subset; a side is
    # (edge ids, row positions) of the edges whose u (v) is in the subset
    touching: list | None = None  # stars only: (group index, edge ids) of every edge with an end in the star


def _greedy_colouring(n: int, adj_ptr: np.ndarray, adj: np.ndarray) -> np.ndarray:
    colour = [-1] * n
    ptr, nb = adj_ptr.tolist(), adj.tolist()
    deg_order = np.argsort(-(adj_ptr[1:] - adj_ptr[:-1]), kind="stable").tolist()
    for v in deg_order:
        used = {colour[w] for w in nb[ptr[v] : ptr[v + 1]]}
        c = 0
        while c in used:
            c += 1
        colour[v] = c
    return np.array(colour, dtype=np.int64)


class LocalSearch:
    def __init__(self, problem: PairwiseProblem, unary: np.ndarray, big: float,
                 budget: tuple[np.ndarray, float] | None = None, star_hubs: int = 16) -> None:
        p = self.p = problem
        self.unary = unary
        self.big = big
        self.budget = budget
        self.eps = REL_EPS * (float(np.abs(unary[unary < big]).sum()) + 1.0)
        V = p.n_vars
        eu = np.concatenate([g.u for g in p.groups]) if p.groups else np.zeros(0, np.int64)
        ev = np.concatenate([g.v for g in p.groups]) if p.groups else np.zeros(0, np.int64)
        keys = np.concatenate([eu, ev])
        vals = np.concatenate([ev, eu])
        order = np.argsort(keys, kind="stable")
        self.adj_ptr = np.concatenate([[0], np.cumsum(np.bincount(keys, minlength=V))]).astype(np.int64)
        self.adj = vals[order]
        colour = _greedy_colouring(V, self.adj_ptr, self.adj)
        self.classes = [self._subset(np.flatnonzero(colour == c)) for c in range(int(colour.max(initial=-1)) + 1)]
        deg = self.adj_ptr[1:] - self.adj_ptr[:-1]
        hubs = np.argsort(-deg, kind="stable")[:star_hubs]
        self.hubs = [int(h) for h in hubs if deg[h] >= 3]
        self._stars: dict[int, _Subset] = {}

    @functools.cached_property
    def costs(self) -> list[np.ndarray]:
        """Each group's edge costs with forbidden pairs at ``big``; made on first use (a copy of every
        matrix: a solve that TRW-S proves optimal never searches)."""
        return [g.dense(cap=self.big) for g in self.p.groups]

    def _subset(self, vars_: np.ndarray) -> _Subset:
        p = self.p
        pos = np.full(p.n_vars, -1, dtype=np.int64)
        pos[vars_] = np.arange(len(vars_))
        n = p.n_states[vars_]
        w = int(n.max(initial=1))
        idx = p.offsets[vars_][:, None] + np.arange(w)[None, :]
        valid = np.arange(w)[None, :] < n[:, None]
        upad = np.where(valid, self.unary[np.where(valid, idx, 0)], np.inf)
        sides = []
        for gi, g in enumerate(p.groups):
            eu = np.flatnonzero(pos[g.u] >= 0)
            ev = np.flatnonzero(pos[g.v] >= 0)
            if len(eu) or len(ev):
                sides.append((gi, (eu, pos[g.u[eu]]), (ev, pos[g.v[ev]])))
        return _Subset(vars_, upad, sides)

    def scores(self, x: np.ndarray, s: _Subset) -> np.ndarray:
        """(n, w) cost of each state of each subset variable given the others' states in x."""
        sc = s.unary_pad.copy()
        groups, costs = self.p.groups, self.costs
        for gi, (eu, ru), (ev, rv) in s.sides:
            g, c = groups[gi], costs[gi]
            a, b = g.shape
            if len(eu):
                np.add.at(sc, (ru[:, None], np.arange(a)[None, :]), c[eu, :, x[g.v[eu]]])
            if len(ev):
                np.add.at(sc, (rv[:, None], np.arange(b)[None, :]), c[ev, x[g.u[ev]], :])
        return sc

    def _star(self, h: int) -> _Subset:
        s = self._stars.get(h)
        if s is None:
            s = self._subset(self.adj[self.adj_ptr[h] : self.adj_ptr[h + 1]])
            inside = np.zeros(self.p.n_vars, dtype=bool)
            inside[s.vars] = True
            inside[h] = True
            s.touching = [(gi, e) for gi, g in enumerate(self.p.groups)
                          if len(e := np.flatnonzero(inside[g.u] | inside[g.v]))]
            self._stars[h] = s
        return s

    def _star_energy(self, y: np.ndarray, h: int, s: _Subset) -> float:
        """The terms of the energy that touch the star of ``h`` (the rest does not change in a star move)."""
        offs = self.p.offsets
        e = float(self.unary[offs[s.vars] + y[s.vars]].sum()) + float(self.unary[offs[h] + y[h]])
        groups, costs = self.p.groups, self.costs
        assert s.touching is not None  # a star (_star sets it)
        for gi, idx in s.touching:
            g = groups[gi]
            e += float(costs[gi][idx, y[g.u[idx]], y[g.v[idx]]].sum())
        return e

    def energy(self, x: np.ndarray) -> float:
        e = float(self.unary[self.p.offsets[:-1] + x].sum())
        for g, c in zip(self.p.groups, self.costs, strict=True):
            e += float(c[np.arange(len(g)), x[g.u], x[g.v]].sum())
        return e

    def _lhs(self, x: np.ndarray) -> float:
        assert self.budget is not None  # called only with a budget row
        w, _ = self.budget
        return float(w[self.p.offsets[:-1] + x].sum())

    def icm(self, x: np.ndarray, deadline: float | None) -> bool:
        changed_any = False
        offs = self.p.offsets
        for _ in range(MAX_ROUNDS):
            changed = False
            for s in self.classes:
                sc = self.scores(x, s)
                rows = np.arange(len(s.vars))
                cur = x[s.vars]
                new = sc.argmin(axis=1)
                gain = sc[rows, cur] - sc[rows, new]
                acc = gain > self.eps
                if self.budget is not None and acc.any():
                    w, rhs = self.budget
                    dl = w[offs[s.vars] + new] - w[offs[s.vars] + cur]
                    slack = rhs - self._lhs(x)
                    free = acc & (dl <= 0)
                    slack -= float(dl[free].sum())
                    cand = np.flatnonzero(acc & (dl > 0))
                    cand = cand[np.argsort(-gain[cand], kind="stable")]
                    ok = np.cumsum(dl[cand]) <= slack + 1e-9 * max(1.0, abs(rhs))
                    acc = free.copy()
                    acc[cand[ok]] = True
                if acc.any():
                    x[s.vars[acc]] = new[acc]
                    changed = changed_any = True
            if not changed or (deadline is not None and time.perf_counter() > deadline):
                break
        return changed_any

    def star(self, x: np.ndarray, deadline: float | None) -> bool:
        p = self.p
        improved = False
        for h in self.hubs:
            if deadline is not None and time.perf_counter() > deadline:
                break
            s = self._star(h)
            best_e, best_x = self._star_energy(x, h, s), None
            hu = self.unary[p.offsets[h] : p.offsets[h + 1]]
            for st in np.flatnonzero(hu < self.big):  # every allowed state
                if st == x[h]:
                    continue
                y = x.copy()
                y[h] = st
                for _ in range(2):
                    y[s.vars] = self.scores(y, s).argmin(axis=1)
                if self.budget is not None and self._lhs(y) > self.budget[1] + 1e-9 * max(1.0, abs(self.budget[1])):
                    continue
                e = self._star_energy(y, h, s)
                if e < best_e - self.eps:
                    best_e, best_x = e, y
            if best_x is not None:
                x[:] = best_x
                improved = True
        return improved

    def improve(self, x: np.ndarray, deadline: float | None = None) -> np.ndarray:
        """ICM, then alternate star-block moves and ICM while they help."""
        x = x.copy()
        self.icm(x, deadline)
        for _ in range(STAR_ROUNDS):
            if not self.hubs or not self.star(x, deadline):
                break
            self.icm(x, deadline)
        return x

    def repair(self, x: np.ndarray, deadline: float | None = None) -> np.ndarray:
        """Make ``w . x <= rhs`` hold by cheapest-per-unit moves (best effort), then improve."""
        assert self.budget is not None, "repair needs a budget row"
        w, rhs = self.budget
        offs = self.p.offsets
        x = x.copy()
        for _ in range(50):
            deficit = self._lhs(x) - rhs
            if deficit <= 1e-9 * max(1.0, abs(rhs)):
                return self.improve(x, deadline)
            for s in self.classes:
                deficit = self._lhs(x) - rhs
                if deficit <= 1e-9 * max(1.0, abs(rhs)):
                    break
                sc = self.scores(x, s)
                rows = np.arange(len(s.vars))
                cur = x[s.vars]
                n = sc.shape[1]
                widx = np.minimum(offs[s.vars][:, None] + np.arange(n)[None, :], len(w) - 1)
                wv = np.where(np.isfinite(sc), w[widx], np.inf)
                red = wv[rows, cur][:, None] - wv  # reduction of lhs per state
                cost = sc - sc[rows, cur][:, None]
                ratio = np.where(red > 0, cost / np.where(red > 0, red, 1.0), np.inf)
                best = ratio.argmin(axis=1)
                cand = np.flatnonzero(np.isfinite(ratio[rows, best]))
                if not len(cand):
                    continue
                cand = cand[np.argsort(ratio[cand, best[cand]], kind="stable")]
                csum = np.cumsum(red[cand, best[cand]])
                k = int(np.searchsorted(csum, deficit)) + 1
                take = cand[:k]
                x[s.vars[take]] = best[take]
        return x  # may still be infeasible; the caller checks
