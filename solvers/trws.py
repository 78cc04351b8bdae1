"""Sequential tree-reweighted message passing (TRW-S, Kolmogorov 2006) plus local search.

Approximate: returns the best assignment decoded across sweeps, improved by local search
(:mod:`solvers.local_search`), and a proven lower bound (the reparametrised energy's sum of
minima, valid for any messages).

Vectorisation.  Monotonic chains come from the variable order (index order unless ``order`` is
given): edge ``(u, v)`` points from the earlier to the later variable.  Variable ``v`` can be
processed in the forward sweep once all its earlier neighbours are, so variables are grouped
into *levels* (longest path from a source); processing a level at once is exactly sequential
TRW-S in the given order (no two variables of a level are adjacent).

Compression.  States whose rows (columns) of an edge matrix are identical form a class (for
placement costs: states with the same layout).  A message is then a min over classes: take the
class-wise minimum of the incoming vector, add the small class-pair block, expand to states.
All edges whose class counts fit a common padding live in one set of flat ragged arrays sorted
by source level (:class:`~solvers.trws_layout.Unified`), so each level costs a fixed handful of numpy calls whatever
the mix of state counts; when the padded blocks of *all* edges stay small (``UNIFIED_ALL_ENTRIES``,
e.g. the planner's reduced problems) every edge joins them, otherwise the remaining
(incompressible, large) edges are handled per ``(n_u, n_v)`` shape group as contiguous slices of
stacked cost arrays.

Kernels.  The above is the numpy kernel; its cost is numpy's per-call overhead times the levels
(the planner's problems: ~80 levels for ~200 variables).  :mod:`solvers.trws_compiled` runs the
same sweeps as compiled loops (numba, optional: the ``fast`` extra), much faster per sweep, with
the same messages (the order inside a level does not matter).  ``kernel="auto"`` (the default)
starts on numpy and switches, messages carried over, once the run has lasted ``COMPILED_AFTER_S``.

Forbidden states and pairs use a large finite cost internally (``inf - inf`` would give NaN);
the returned assignment is checked to have finite true energy.

Side constraints: rows that touch one variable (fixed states) are absorbed by the presolve as
domain restrictions.  One remaining ``<=`` or ``>=`` row (a budget) is handled by Lagrangian
relaxation with bisection on the multiplier, returning a feasible assignment; anything else
raises :class:`~solvers.Unsupported`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import trws_compiled
from .local_search import LocalSearch
from .marginal import ClassCorners, factored_classes, finite_absmax_per_edge, row_classes
from .problem import PairwiseProblem
from .solution import BackendResult, Infeasible, Unsupported
from .trws_layout import Directed, Unified, class_block, class_dense, csr, levels

#: ``(problem, x, bound, margins, deadline, target_gap, info) -> (x, bound)``: improves a TRW-S result
PolishStep = Callable[[PairwiseProblem, np.ndarray, float, "np.ndarray | None", "float | None", float, dict],
                      tuple[np.ndarray, float]]

log = logging.getLogger(__name__)

# forbidden cost = BIG_FACTOR * (sum of the largest finite |cost| of every term + 1): above any finite energy,
# with room for the budget multiplier (_lagrangian's lam_cap), and small enough that a message carrying it
# keeps the bound's rounding under 1e-9 relative (at 1e6, bounds on the 4-D planner problem moved by ~1 µs)
BIG_FACTOR = 1e4
DEFAULT_MAX_ITER = 1000  # forward+backward sweeps
DEFAULT_TOL = 1e-5  # relative: stop at this gap, or when the bound improved less over PATIENCE sweeps
PATIENCE = 5
BOUND_EVERY = 2  # after the first PATIENCE sweeps, compute the bound every this many sweeps (or on a new best energy)
STALL_GAP = 1e-3  # relative: also stop when the gap is below this and the energy has not improved for
ENERGY_PATIENCE = 10  # this many sweeps
LAGRANGE_STEPS = 14  # bisection steps on the budget multiplier
POLISH_GAP = 1e-3  # relative: above this certified gap, polish exactly (solvers.polish) within the time limit
POLISH_MIN_S = 5.0  # without a time limit, the polish may take max(POLISH_MIN_S, POLISH_FACTOR * TRW-S seconds)
POLISH_FACTOR = 1.0
COMPRESS_RATIO = 0.9  # use class-compressed messages when they shrink the cost block at least this much (a sweep
# of the compiled kernel costs its block entries; the per-state class lookups are cheap beside them)
KERNELS = ("auto", "numba", "numpy")  # "auto": numpy, then compiled (numba installed) after COMPILED_AFTER_S
# numba's first use in a process costs ~0.6 s (import, typing context, cached code; measured on the 2-core
# CI machine), ~40x a planner problem's numpy sweep: "auto" switches only when the run lasts longer than this
COMPILED_AFTER_S = 0.25


def _compiled_kernel(kernel: str) -> bool:
    """Whether to run the compiled sweeps of :mod:`solvers.trws_compiled` for ``kernel`` (see ``KERNELS``)."""
    if kernel not in KERNELS:
        raise ValueError(f"trws kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "numpy" or (kernel == "auto" and not trws_compiled.available()):
        return False
    if not trws_compiled.available():
        raise ValueError("trws kernel 'numba' needs the numba package, which is not installed (pip install "
                         "numba, an apmodel dependency); kernels 'auto' and 'numpy' run without it")
    try:
        trws_compiled.kernels()
    except Exception as err:  # numba present but unusable (e.g. a numpy it does not support)
        if kernel == "numba":
            raise ValueError(f"trws kernel 'numba' is not usable here: {type(err).__name__}: {err}") from err
        log.warning("trws: the compiled kernel is not usable (%s: %s); using numpy", type(err).__name__, err)
        return False
    return True


UNIFIED_MAX_CLASSES = 32  # edges with at most this many row / column classes share one padded block array
UNIFIED_ALL_ENTRIES = 2_000_000  # padded class blocks up to this many entries in total: every edge is unified
UNIFIED_SMALL = 4  # without compressible edges, edges of at most this many classes are still unified


class TRWS:
    """Message-passing state for one problem (reusable across unary changes, e.g. Lagrangian)."""

    def __init__(self, problem: PairwiseProblem, order: np.ndarray | None = None, kernel: str = "auto") -> None:
        if kernel not in KERNELS:
            raise ValueError(f"trws kernel must be one of {KERNELS}, got {kernel!r}")
        self.t0 = time.perf_counter()
        p = problem
        self.p = p
        V = p.n_vars
        rank = np.arange(V) if order is None else np.argsort(np.asarray(order))
        self.rank = rank
        fin_u = np.isfinite(p.unary_flat)
        self.N = p.n_indicators
        # orientation by rank, levels
        us, vs = [], []
        for g in p.groups:
            flip = rank[g.u] > rank[g.v]
            us.append(np.where(flip, g.v, g.u))
            vs.append(np.where(flip, g.u, g.v))
        eu = np.concatenate(us) if us else np.zeros(0, np.int64)
        ev = np.concatenate(vs) if vs else np.zeros(0, np.int64)
        # process variables in rank order: relabel to rank space for the level computation
        lo_ptr, lo_nb = csr(V, rank[ev], rank[eu])
        hi_ptr, hi_nb = csr(V, V - 1 - rank[eu], V - 1 - rank[ev])
        self.lev_f = levels(V, lo_ptr, lo_nb)[rank]
        self.lev_b = levels(V, hi_ptr, hi_nb)[V - 1 - rank]
        n_in = np.bincount(ev, minlength=V)
        n_out = np.bincount(eu, minlength=V)
        self.gamma = 1.0 / np.maximum(1, np.maximum(n_in, n_out))
        self.n_out = n_out
        # phase 1: orient, find classes of identical rows / columns, bound the energy scale
        parts = []
        scale = float(np.abs(np.where(fin_u, p.unary_flat, 0.0)).max(initial=0.0)) * V
        rng = np.random.default_rng(0)
        for g, a_u in zip(p.groups, us, strict=True):
            flip = a_u != g.u  # edges whose later endpoint (by rank) is g.u
            for mask, transposed in ((~flip, False), (flip, True)):
                if not mask.any():
                    continue
                u, v = g.u[mask], g.v[mask]
                f = g.factors
                if f is not None:  # classes from the factors; the dense matrices are never made
                    rows, cols, blocks = f.row_class[mask], f.col_class[mask], f.blocks  # the blocks are not copied
                    if transposed:
                        rows, cols, blocks, u, v = cols, rows, blocks.transpose(0, 2, 1), v, u
                    raw: np.ndarray | None = None
                    lu, cu, lv, cv, corners = factored_classes(rows, cols, blocks, f.block_of[mask])
                    block: np.ndarray | ClassCorners | None = corners
                    absmax = corners.finite_absmax()
                else:
                    raw = g.costs if mask.all() else g.costs[mask]
                    if transposed:
                        raw, u, v = raw.transpose(0, 2, 1), v, u
                    lu, cu = row_classes(raw, 1, rng)
                    lv, cv = row_classes(raw, 2, rng)
                    a, b = raw.shape[1:]
                    block = None
                    if int(cu.max()) * int(cv.max()) <= COMPRESS_RATIO * a * b:
                        block = class_block(raw, lu, cu, lv, cv)
                    absmax = finite_absmax_per_edge(raw if block is None else block)
                scale += float(absmax.sum())
                parts.append((raw, u, v, lu, cu, lv, cv, block))
        self.scale = scale + 1.0
        self.big = BIG_FACTOR * self.scale
        self.unary = np.where(fin_u, p.unary_flat, self.big)
        self.n_lev_f = int(self.lev_f.max(initial=-1)) + 1
        self.n_lev_b = int(self.lev_b.max(initial=-1)) + 1
        self.msum_lo = np.zeros(self.N)  # messages into v from earlier neighbours
        self.msum_hi = np.zeros(self.N)  # from later neighbours
        # phase 2: the compiled kernel's ragged edges, or the numpy kernel's arrays sorted by source level
        self.fwd: list[Directed] = []
        self.bwd: list[Directed] = []
        self.ufwd: Unified | None = None
        self.ubwd: Unified | None = None
        self.edges: trws_compiled.RaggedEdges | None = None
        self._ucanon = np.zeros(0, np.int64)  # index in RaggedEdges of every edge of the unified block
        # kept to switch kernels mid-run ("auto")
        self._parts = parts if kernel == "auto" and trws_compiled.available() else None
        if kernel == "auto":  # a problem whose setup alone took that long goes compiled at once
            self.maybe_compile()
        elif _compiled_kernel(kernel):
            self.edges = self._ragged(parts)
        if self.edges is None:
            self._build_numpy(parts)

    def _ragged(self, parts) -> trws_compiled.RaggedEdges:
        return trws_compiled.RaggedEdges(parts, self.p.n_states, self.p.offsets, self.gamma, self.big, self.lev_f,
                                         self.lev_b)

    def maybe_compile(self) -> None:
        """Kernel "auto": once this object has run COMPILED_AFTER_S (at once when this process has run the
        compiled sweeps before), continue with the compiled sweeps, carrying every message over (the
        sweeps then go on exactly as the numpy kernel's would)."""
        if self._parts is None or (time.perf_counter() - self.t0 < COMPILED_AFTER_S and not trws_compiled.warm()):
            return
        parts, self._parts = self._parts, None
        if not _compiled_kernel("auto"):
            return
        e = self._ragged(parts)
        for d, into_v in ((self.ufwd, True), (self.ubwd, False)):  # messages of the numpy kernel, if built
            if d is not None:
                c = self._ucanon[d.order]
                ptr = e.vptr if into_v else e.uptr
                counts = np.diff(d.dptr)
                (e.msg_f if into_v else e.msg_b)[np.repeat(ptr[c] - d.dptr[:-1], counts) + np.arange(d.dptr[-1])] = d.msg
        for dset, into_v in ((self.fwd, True), (self.bwd, False)):
            for dr in dset:
                c = dr.cid[dr.eid]
                ptr = e.vptr if into_v else e.uptr
                (e.msg_f if into_v else e.msg_b)[ptr[c][:, None] + np.arange(dr.msg.shape[1])[None, :]] = dr.msg
        self.edges, self.ufwd, self.ubwd, self.fwd, self.bwd = e, None, None, [], []
        log.info("trws: compiled sweeps after %.2f s", time.perf_counter() - self.t0)

    def _build_numpy(self, parts) -> None:
        """The numpy kernel's arrays (see the module docstring: unified block and shape groups)."""
        # edges whose class counts fit the padding the compressible ones need anyway join them
        sizes = [max(t[7].shape[1:]) for t in parts if t[7] is not None and max(t[7].shape[1:]) <= UNIFIED_MAX_CLASSES]
        cap = max(sizes) if sizes else UNIFIED_SMALL
        # small problems: everything in one block (one padded array costs less than a numpy call per shape group)
        padded = sum(len(t[1]) for t in parts) * max((max(int(t[4].max()), int(t[6].max())) for t in parts), default=0) ** 2
        if padded <= UNIFIED_ALL_ENTRIES:
            cap = max(cap, max((max(int(t[4].max()), int(t[6].max())) for t in parts), default=0))
        uparts, ucanon, start = [], [], 0
        for raw, u, v, lu, cu, lv, cv, block in parts:
            cid = np.arange(start, start + len(u))
            start += len(u)
            if isinstance(block, ClassCorners):  # the numpy kernel takes padded blocks
                block = block.padded()
            if max(int(cu.max()), int(cv.max())) <= cap:
                if block is None:
                    block = class_block(raw, lu, cu, lv, cv)
                uparts.append((u, v, lu, lv, block))
                ucanon.append(cid)
            else:  # a factored part's dense matrices are made only here (the numpy kernel's wide edges)
                self._add_part(raw if raw is not None else class_dense(lu, lv, block), u, v, cid)
        if uparts:
            self._ucanon = np.concatenate(ucanon)
            self._build_unified(uparts)
        self.vars_f = self._vars_by_level(self.lev_f, self.n_lev_f)
        self.vars_b = self._vars_by_level(self.lev_b, self.n_lev_b)
        for dset, lev, nl in ((self.fwd, self.lev_f, self.n_lev_f), (self.bwd, self.lev_b, self.n_lev_b)):
            for d in dset:
                d.level_ptr = np.searchsorted(lev[d.src], np.arange(nl + 1), side="left")

    def _build_unified(self, uparts) -> None:
        p = self.p
        U = np.concatenate([t[0] for t in uparts])
        Vv = np.concatenate([t[1] for t in uparts])
        LU = np.concatenate([t[2].ravel() for t in uparts])
        LV = np.concatenate([t[3].ravel() for t in uparts])
        MU = max(t[4].shape[1] for t in uparts)
        MV = max(t[4].shape[2] for t in uparts)
        blk = np.full((len(U), MU, MV), np.inf)
        e0 = 0
        for t in uparts:
            b = t[4]
            b = np.where(np.isnan(b), np.inf, np.where(np.isfinite(b), b, self.big))
            blk[e0 : e0 + len(b), : b.shape[1], : b.shape[2]] = b
            e0 += len(b)
        ptr_u = np.concatenate([[0], np.cumsum(p.n_states[U])]).astype(np.int64)
        ptr_v = np.concatenate([[0], np.cumsum(p.n_states[Vv])]).astype(np.int64)
        of = np.argsort(self.lev_f[U], kind="stable")
        ob = np.argsort(self.lev_b[Vv], kind="stable")
        f = Unified(p, U, Vv, LU, ptr_u, LV, ptr_v, blk, of, self.lev_f, self.n_lev_f, self.gamma)
        b = Unified(p, Vv, U, LV, ptr_v, LU, ptr_u, blk.transpose(0, 2, 1), ob, self.lev_b, self.n_lev_b,
                     self.gamma)
        inv_f = np.empty_like(of)
        inv_f[of] = np.arange(len(of))
        inv_b = np.empty_like(ob)
        inv_b[ob] = np.arange(len(ob))
        f.rev = np.repeat(b.dptr[:-1][inv_b[of]] - f.sptr[:-1], f.ns) + np.arange(f.sptr[-1])
        b.rev = np.repeat(f.dptr[:-1][inv_f[ob]] - b.sptr[:-1], b.ns) + np.arange(b.sptr[-1])
        self.ufwd, self.ubwd = f, b

    def _add_part(self, raw, u, v, cid) -> None:
        """Uncompressed edges u (earlier) -> v (later), raw costs (k, n_u, n_v) (+inf allowed, maybe a view);
        ``cid``: their indices in :class:`~solvers.trws_compiled.RaggedEdges`."""
        p = self.p
        of = np.argsort(self.lev_f[u], kind="stable")
        ob = np.argsort(self.lev_b[v], kind="stable")
        inv_b = np.empty_like(ob)
        inv_b[ob] = np.arange(len(ob))
        inv_f = np.empty_like(of)
        inv_f[of] = np.arange(len(of))
        a, b = raw.shape[1], raw.shape[2]

        def idx(vars_, n):
            return p.offsets[vars_][:, None] + np.arange(n)[None, :]

        fin = np.where(np.isfinite(raw), raw, self.big)
        df = Directed(u[of], v[of], np.ascontiguousarray(fin[of]), idx(u[of], a), idx(v[of], b), np.zeros((len(u), b)),
                       inv_b[of], None, len(self.bwd), raw=raw, eid=of, cid=cid)
        db = Directed(v[ob], u[ob], np.ascontiguousarray(fin[ob].transpose(0, 2, 1)), idx(v[ob], b), idx(u[ob], a),
                       np.zeros((len(u), a)), inv_f[ob], None, len(self.fwd), raw=None, eid=ob, cid=cid)
        self.fwd.append(df)
        self.bwd.append(db)

    def _vars_by_level(self, lev, nl):
        order = np.argsort(lev, kind="stable")
        ptr = np.searchsorted(lev[order], np.arange(nl + 1))
        out = []
        p = self.p
        for L in range(nl):
            vs = order[ptr[L] : ptr[L + 1]]
            n = p.n_states[vs]
            w = int(n.max())
            pad = p.offsets[vs][:, None] + np.arange(w)[None, :]
            valid = np.arange(w)[None, :] < n[:, None]
            pad = np.where(valid, pad, 0)
            out.append((vs, pad, valid))
        return out

    # ------------------------------------------------------------------ sweeps
    def sweep(self, forward: bool, x: np.ndarray | None = None) -> None:
        """One sweep; when ``x`` is given (forward only), decode into it by sequential conditioning."""
        if self.edges is not None:
            self.edges.sweep(forward, self.unary, self.msum_lo, self.msum_hi, x)
            return
        dirs, other = (self.fwd, self.bwd) if forward else (self.bwd, self.fwd)
        levels = self.vars_f if forward else self.vars_b
        msum_dst = self.msum_lo if forward else self.msum_hi
        unary, lo, hi = self.unary, self.msum_lo, self.msum_hi
        cond = np.zeros(self.N) if x is not None else None
        uf, uo = (self.ufwd, self.ubwd) if forward else (self.ubwd, self.ufwd)
        for L, (vs, pad, valid) in enumerate(levels):
            if x is not None:
                assert cond is not None  # made with x
                dec = unary[pad] + hi[pad] + cond[pad]
                dec[~valid] = np.inf
                x[vs] = dec.argmin(axis=1)
            if uf is not None and uf.level_ptr[L] < uf.level_ptr[L + 1]:
                assert uo is not None and uf.rev is not None  # both directions are built together
                e0, e1 = uf.level_ptr[L], uf.level_ptr[L + 1]
                f0, f1, d0, d1 = uf.sptr[e0], uf.sptr[e1], uf.dptr[e0], uf.dptr[e1]
                si = uf.sidx[f0:f1]
                h = uf.gamma_rep[f0:f1] * (unary[si] + lo[si] + hi[si]) - uo.msg[uf.rev[f0:f1]]
                newc = (uf.src_min(h, e0, e1)[:, :, None] + uf.blk[e0:e1]).min(axis=1)
                newc -= newc.min(axis=1, keepdims=True)
                new = newc.ravel()[uf.dst_flat[d0:d1] - e0 * uf.md]
                delta = new - uf.msg[d0:d1]
                uf.msg[d0:d1] = new
                np.add.at(msum_dst, uf.didx[d0:d1], delta)
                if cond is not None:
                    assert x is not None  # cond is made with x
                    cls_src = uf.lsrc[uf.sptr[e0:e1] + x[uf.src[e0:e1]]]  # class of each source's state
                    er = uf.erep_d[d0:d1]
                    np.add.at(cond, uf.didx[d0:d1], uf.blk[er, cls_src[er - e0], uf.ldst[d0:d1]])
            for d in dirs:
                assert d.level_ptr is not None  # set once every part is added
                s0, s1 = d.level_ptr[L], d.level_ptr[L + 1]
                if s0 == s1:
                    continue
                si = d.src_idx[s0:s1]
                hat = unary[si] + lo[si] + hi[si]
                od = other[d.pair]
                h = self.gamma[d.src[s0:s1]][:, None] * hat - od.msg[d.rev[s0:s1]]
                new = (h[:, :, None] + d.costs[s0:s1]).min(axis=1)
                new -= new.min(axis=1, keepdims=True)
                delta = new - d.msg[s0:s1]
                d.msg[s0:s1] = new
                np.add.at(msum_dst, d.dst_idx[s0:s1].ravel(), delta.ravel())
                if cond is not None:
                    assert x is not None and d.raw is not None  # decoding: forward edges keep raw
                    rows = d.raw[d.eid[s0:s1], x[d.src[s0:s1]], :]  # +inf allowed: argmin only
                    np.add.at(cond, d.dst_idx[s0:s1].ravel(), rows.ravel())

    def lower_bound(self, after_forward: bool = False) -> float:
        """A proven lower bound on the (internal) energy, valid for any messages (unless ``after_forward``).

        ``after_forward`` (only right after a forward sweep): the compiled kernel's edges contribute
        the constants that sweep recorded (:meth:`~solvers.trws_compiled.RaggedEdges.forward_constants`)
        instead of a pass over every cost block: the same value up to the messages' rounding, good
        for deciding when to stop; the bound a run hands back is computed in full.

        Split the reparametrised energy: each forward edge (u earlier, v later) takes
        ``gamma_u * theta_u`` of its earlier endpoint, and variable v keeps
        ``(1 - out_v * gamma_v) * theta_v >= 0``; the bound is the sum of the minima of the parts.
        Right after a forward sweep each edge part's minimum is the message's normalising constant,
        and the bound equals the TRW-S chain bound (exact on chains and trees).
        """
        self._resum()
        theta = self.unary + self.msum_lo + self.msum_hi
        offs = self.p.offsets[:-1]
        rest = 1.0 - self.n_out * self.gamma
        total = float((rest * np.minimum.reduceat(theta, offs)).sum()) if self.p.n_vars else 0.0
        if self.edges is not None:
            total += self.edges.forward_constants() if after_forward else self.edges.edge_bound(theta)
        if self.ufwd is not None:
            uf = self.ufwd
            assert self.ubwd is not None and uf.rev is not None  # both directions are built together
            k = len(uf.src)
            g = uf.gamma_rep * theta[uf.sidx] - self.ubwd.msg[uf.rev]
            te = uf.blk + uf.src_min(g, 0, k)[:, :, None] + uf.dst_min(-uf.msg, 0, k)[:, None, :]
            total += float(te.min(axis=(1, 2)).sum())
        for df, db in zip(self.fwd, self.bwd, strict=True):
            g = self.gamma[df.src][:, None] * theta[df.src_idx] - db.msg[df.rev]
            te = df.costs - df.msg[:, None, :] + g[:, :, None]
            total += float(te.min(axis=(1, 2)).sum())
        return total

    def _resum(self) -> None:
        """Recompute the message sums from the messages themselves.

        The sweeps keep them up to date by adding each message's change; a message that once held a
        forbidden state's cost (``big``, BIG_FACTOR x the energy scale) leaves a rounding error of
        big's last bits behind (with BIG_FACTOR 1e6, ~1 µs per state over the 4-D planner problem's
        sweeps: enough to put the "proven" bound above a feasible energy)."""
        if self.edges is not None:
            self.edges.message_sums(self.msum_lo, self.msum_hi)
            return
        for msum, unified, dset in ((self.msum_lo, self.ufwd, self.fwd), (self.msum_hi, self.ubwd, self.bwd)):
            msum[:] = 0.0
            if unified is not None:
                msum += np.bincount(unified.didx, weights=unified.msg, minlength=self.N)
            for d in dset:
                msum += np.bincount(d.dst_idx.ravel(), weights=d.msg.ravel(), minlength=self.N)

    def margins(self) -> np.ndarray:
        """Per flat indicator: how far the state's reparametrised unary is above its variable's minimum.

        Small margins mark the states the dual considers (near-)optimal; :mod:`solvers.polish`
        restricts an exact solve to them."""
        theta = self.unary + self.msum_lo + self.msum_hi
        offs = self.p.offsets[:-1]
        if not self.p.n_vars:
            return theta
        vmin = np.minimum.reduceat(theta, offs)
        return theta - np.repeat(vmin, self.p.n_states)

    def internal_energy(self, x: np.ndarray) -> float:
        """Energy with the internal unary; forbidden pairs count +inf."""
        if self.edges is not None:
            return self.edges.energy(self.unary, x, self.big)
        e = float(self.unary[self.p.offsets[:-1] + x].sum())
        for g in self.p.groups:
            e += float(g.at(x[g.u], x[g.v]).sum())
        return e

    def set_unary(self, unary_flat: np.ndarray) -> None:
        fin = np.isfinite(unary_flat)
        self.unary = np.where(fin, unary_flat, self.big)

    def run(self, max_iter: int, tol: float, deadline: float | None, local: LocalSearch | None,
            x0: np.ndarray | None = None, stall_gap: float = STALL_GAP) -> tuple[np.ndarray, float, float, int]:
        """Sweeps until convergence; returns (best x, its internal energy, best bound, iterations)."""
        x = np.zeros(self.p.n_vars, dtype=np.int64)
        best_x, best_e = None, np.inf
        if x0 is not None:
            best_x, best_e = x0.copy(), self.internal_energy(x0)
        best_lb, proven_lb, hist = -np.inf, -np.inf, []
        it = last_improved = 0
        for it in range(1, max_iter + 1):
            self.maybe_compile()
            self.sweep(True, x)
            e = self.internal_energy(x)
            if e < best_e:
                best_e, best_x, last_improved = e, x.copy(), it
            fresh = it <= PATIENCE or it % BOUND_EVERY == 0 or it == last_improved
            if fresh:  # right after the forward sweep: the compiled kernel's bound is then the constants it recorded
                lb = self.lower_bound(after_forward=True)
                best_lb = max(best_lb, lb)
                if self.edges is None:  # the numpy kernel's is computed in full (before an "auto" switch)
                    proven_lb = max(proven_lb, lb)
                hist.append(best_lb)
            gap = (best_e - best_lb) / max(1.0, abs(best_e))
            stalled = fresh and len(hist) > PATIENCE and hist[-1] - hist[-1 - PATIENCE] <= tol * max(1.0, abs(hist[-1]))
            if (gap <= tol or (gap <= stall_gap and it - last_improved >= ENERGY_PATIENCE) or stalled
                    or it == max_iter or (deadline is not None and time.perf_counter() > deadline)):
                break  # before the backward sweep: the messages stay those of the forward sweep just run
            self.sweep(False)
        if self.edges is not None and it:  # the bound handed back, in full, on the last forward sweep's messages
            best_lb = max(proven_lb, self.lower_bound())
        if best_x is None:
            best_x = x.copy()
        return best_x, best_e, best_lb, it


def _budget_row(p: PairwiseProblem):
    if not p.constraints:
        return None
    if len(p.constraints) > 1:
        raise Unsupported(f"trws handles at most one multi-variable linear constraint (a budget); got "
                          f"{[c.name for c in p.constraints]}; use backend 'highs' or 'cvxpy'")
    c = p.constraints[0]
    if c.sense == "==":
        raise Unsupported(f"trws cannot honour the equality constraint {c.name!r} over several variables; "
                          "use backend 'highs' or 'cvxpy'")
    w = p.constraint_matrix.getrow(0).toarray().ravel()
    if c.sense == ">=":
        return c.name, -w, -c.rhs
    return c.name, w, c.rhs


def solve_trws(problem: PairwiseProblem, time_limit: float | None = None, *, max_iter: int = DEFAULT_MAX_ITER,
               tol: float = DEFAULT_TOL, stall_gap: float = STALL_GAP, order=None, local_search: bool = True,
               star_hubs: int = 16, polish_step: PolishStep | None = None,
               polish_gap: float = POLISH_GAP, kernel: str = "auto") -> BackendResult:
    """TRW-S + local search.

    Stops after ``max_iter`` forward+backward sweeps, at ``time_limit`` seconds, when the relative
    gap between the best energy and the bound is ``<= tol``, when the bound stalls, or when the gap
    is ``<= stall_gap`` and the best energy has not improved for ENERGY_PATIENCE sweeps.
    ``order``: variable processing order (default: index order; a topological order of the
    planner's graph gives long monotonic chains).  ``star_hubs``: how many highest-degree
    variables get a star-block search.  ``polish_step``: when the certified gap is above
    ``polish_gap``, ``polish_step(problem, x, bound, margins, deadline, polish_gap, info) -> (x,
    bound)`` improves the result with the final reparametrisation's margins, within the time limit
    (without one: ``max(POLISH_MIN_S, POLISH_FACTOR * TRW-S seconds)``); the composition
    ``trws`` hands in :func:`solvers.polish.polish` with HiGHS (:mod:`solvers.compositions`).
    ``kernel``: ``"numba"`` (the compiled sweeps of :mod:`solvers.trws_compiled`), ``"numpy"``, or
    ``"auto"`` (numpy, switching to the compiled sweeps, numba installed, once the run has taken
    ``COMPILED_AFTER_S``: numba's first use in a process costs more than a small problem's whole run).
    """
    t0 = time.perf_counter()
    deadline = None if time_limit is None else t0 + float(time_limit)
    p = problem
    budget = _budget_row(p)
    tr = TRWS(p, order, kernel)
    ls = LocalSearch(p, tr.unary, tr.big, budget=None if budget is None else (budget[1], budget[2]),
                     star_hubs=star_hubs) if local_search else None
    finite_cap = tr.scale  # any assignment of finite true energy has internal energy <= scale
    info: dict[str, Any] = {"levels_fwd": tr.n_lev_f, "levels_bwd": tr.n_lev_b}
    if budget is None:
        x, e, lb, it = tr.run(max_iter, tol, deadline, ls, stall_gap=stall_gap)
        info["iterations"] = it
        info["trws_energy"] = e
        if ls is not None and x is not None and e - lb > tol * max(1.0, abs(e)):  # not already proven optimal
            x = ls.improve(x, deadline)
        bound = lb
        margins = tr.margins()
    else:
        name, w, rhs = budget
        x, bound, it_total, margins = _lagrangian(tr, ls, w, rhs, max_iter, tol, deadline, info, stall_gap)
        info["iterations"] = it_total
        if x is None:
            raise Infeasible(f"trws found no assignment satisfying constraint {name!r} (not proven infeasible)",
                             constraints=(name,), proven=False)
    e_true = p.energy(x)
    if polish_step is not None and np.isfinite(e_true) and np.isfinite(bound) and \
            e_true - bound > polish_gap * max(1.0, abs(e_true)):
        info["trws_seconds"] = time.perf_counter() - t0
        pdl = deadline if deadline is not None else (
            time.perf_counter() + max(POLISH_MIN_S, POLISH_FACTOR * info["trws_seconds"]))
        x, bound = polish_step(p, x, bound, margins, pdl, polish_gap, info)
        e_true = p.energy(x)
    if not np.isfinite(e_true):
        if bound > finite_cap:
            raise Infeasible("no assignment has finite energy (TRW-S lower bound exceeds every finite energy)",
                             proven=True)
        raise Infeasible("trws found no assignment of finite energy (not proven infeasible; try backend 'highs')",
                         proven=False)
    status = "feasible"
    if deadline is not None and time.perf_counter() > deadline:
        status = "time_limit"
    info["seconds"] = time.perf_counter() - t0
    log.info("trws: %d vars %d edges, %d sweeps, energy %.6g bound %.6g, %.3fs", p.n_vars, p.n_edges,
             info["iterations"], e_true, bound, info["seconds"])
    return BackendResult(x, lower_bound=min(bound, e_true) if np.isfinite(bound) else None, status=status, info=info)


def _lagrangian(tr: TRWS, ls: LocalSearch | None, w: np.ndarray, rhs: float, max_iter: int, tol: float,
                deadline: float | None, info: dict, stall_gap: float):
    """min E(x) + lam * (w.x - rhs) over lam >= 0 by bisection: the best feasible x, the best dual bound,
    the sweeps run and the margins (:meth:`TRWS.margins`) of the run that gave the best x."""
    p = tr.p
    base = p.unary_flat.copy()
    offs = p.offsets[:-1]
    tol_c = 1e-9 * max(1.0, abs(rhs))
    best_x, best_e, best_bound, its, best_marg = None, np.inf, -np.inf, 0, None

    def evaluate(lam: float):
        nonlocal best_x, best_e, best_bound, its, best_marg
        tr.set_unary(base + lam * w)
        x, _, lb, it = tr.run(max_iter, tol, deadline, None, stall_gap=stall_gap)
        its += it
        best_bound = max(best_bound, lb - lam * rhs)
        lhs = float(w[offs + x].sum())
        raw_feasible = lhs <= rhs + tol_c and tr.internal_energy(x) < tr.big
        if ls is not None:  # polish (or repair) the Lagrangian solution; only feasible results are kept
            x = ls.improve(x, deadline) if raw_feasible else ls.repair(x, deadline)
            lhs = float(w[offs + x].sum())
        e = p.energy(x)
        if lhs <= rhs + tol_c and np.isfinite(e) and e < best_e:
            best_e, best_x, best_marg = e, x.copy(), tr.margins()
        return raw_feasible  # the bisection follows the relaxation's own solution

    if evaluate(0.0):
        info["lagrange_multiplier"] = 0.0
        return best_x, best_bound, its, best_marg
    wscale = float(np.abs(w).max(initial=0.0)) or 1.0
    lam_hi = tr.scale / wscale / max(1, p.n_vars) * 1e-2
    lam_lo = 0.0
    lam_cap = tr.big * 1e-3 / (wscale * max(1, p.n_vars))  # beyond this the multiplier swamps forbidden costs
    while lam_hi < lam_cap:
        if deadline is not None and time.perf_counter() > deadline:
            break
        if evaluate(lam_hi):
            break
        lam_lo, lam_hi = lam_hi, lam_hi * 4
    for _ in range(LAGRANGE_STEPS):
        if deadline is not None and time.perf_counter() > deadline:
            break
        mid = 0.5 * (lam_lo + lam_hi)
        if evaluate(mid):
            lam_hi = mid
        else:
            lam_lo = mid
    tr.set_unary(base)
    info["lagrange_multiplier"] = lam_hi
    return best_x, best_bound, its, best_marg


@functools.lru_cache(maxsize=1)
def warm_up_in_background() -> threading.Thread | None:
    """Load the compiled kernels (numba's import and cached code: see ``COMPILED_AFTER_S``) in a daemon thread, once
    per process, so that a solve starting later finds them warm and runs compiled from its first
    sweep; None without numba. A caller with other work first (the planner traces and builds for
    seconds before it solves) starts this, then goes on: numba's loading of machine code overlaps it."""
    if not trws_compiled.available():
        return None
    thread = threading.Thread(target=_run_tiny_problem, name="trws-numba-warm-up", daemon=True)
    thread.start()
    return thread


def _run_tiny_problem() -> None:
    """Every kernel called once on a two-variable problem: loads each one's cached machine code."""
    try:
        problem = PairwiseProblem(unary=[np.zeros(2), np.zeros(2)], edges=[(0, 1, np.eye(2))])
        solve_trws(problem, max_iter=2, local_search=False, kernel="numba")
    except Exception as e:  # a warm-up only: the solve itself reports real failures
        log.info("TRW-S warm-up failed (%s: %s); the first solve loads the kernels itself", type(e).__name__, e)
