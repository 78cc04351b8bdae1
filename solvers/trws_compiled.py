"""Compiled TRW-S sweeps: the optional accelerator of :mod:`solvers.trws` (numba).

The numpy kernel of :mod:`solvers.trws` processes a *level* of variables per handful of numpy
calls; on the planner's problems (a few hundred variables, ~80 levels, deep chains of views) the
cost of a sweep is those calls' overhead, not arithmetic.  Here one sweep is one compiled loop over
the edges in level order: the same messages, in the same order (no two variables of a level are
adjacent, so the order inside a level does not matter), up to floating-point summation order.

Edges are stored once, in the forward orientation (``eu[e]`` earlier than ``ev[e]`` in the
processing order), as *ragged* class blocks: edge ``e`` has ``mu[e] x mv[e]`` class-pair costs
row-major at ``blk[bptr[e]:]`` (and transposed, ``mv[e] x mu[e]``, at ``blk_t[bptr[e]:]``: each
sweep direction reads a contiguous row per destination class), the class of each state of
``eu[e]`` at ``lu[uptr[e]:]`` and of ``ev[e]`` at ``lv[vptr[e]:]`` (an incompressible edge has one
class per state and its raw matrix as block).  ``msg_f[vptr[e]:]`` is the message into ``ev[e]``, ``msg_b[uptr[e]:]`` into ``eu[e]``.
No padding, so every edge, compressible or not, is one loop.

The functions here are plain Python over numpy arrays; :func:`kernels` compiles them with
``numba.njit(cache=True)`` on first use (a few seconds once, then read from numba's cache next to
this file).  Without numba installed, :func:`available` is False and TRW-S runs the numpy kernel.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: entries of a class block compared first when looking for an equal one (all are compared on a match)
_CORNER_SAMPLE = 64


def available() -> bool:
    """Whether numba is installed (nothing is imported or compiled)."""
    return importlib.util.find_spec("numba") is not None


@dataclass(frozen=True)
class Kernels:
    """The compiled functions (see the module docstring for the arrays they take)."""

    sweep: Any
    edge_bound: Any
    energy: Any


def warm() -> bool:
    """Whether this process has already run the compiled sweeps (so using them costs nothing more)."""
    return kernels.cache_info().currsize > 0 and bool(getattr(kernels().sweep, "signatures", True))


@functools.lru_cache(maxsize=1)
def kernels() -> Kernels:
    """Compile (or load from numba's on-disk cache) the kernels; raises ImportError without numba."""
    import numba

    jit = numba.njit(cache=True, nogil=True)
    return Kernels(jit(_sweep), jit(_edge_bound), jit(_energy))


class RaggedEdges:
    """Every edge of a problem as ragged class blocks in the forward orientation, with the messages
    of both directions and the level orders of both sweeps (see the module docstring).

    ``parts``: per group of edges ``(raw, u, v, lu, cu, lv, cv, block)`` as :class:`solvers.trws.TRWS`
    builds them: costs ``raw`` (k, n_u, n_v) with ``u`` earlier than ``v`` (None for edges given
    factored), class labels and counts of rows and columns, and the padded class block (NaN
    padding; :class:`solvers.marginal.ClassCorners` for edges given factored) or None (the edge's
    raw matrix is used, one class per state).  ``big``: the finite stand-in of a forbidden pair.
    """

    def __init__(self, parts, n_states: np.ndarray, offsets: np.ndarray, gamma: np.ndarray, big: float,
                 lev_f: np.ndarray, lev_b: np.ndarray) -> None:
        eu, ev, lu, lv, mu, mv = [], [], [], [], [], []
        for raw, u, v, lab_u, cu, lab_v, cv, block in parts:
            if block is None:  # one class per state: the raw matrix is the block
                k, a, b = raw.shape
                lab_u = np.broadcast_to(np.arange(a), (k, a))
                lab_v = np.broadcast_to(np.arange(b), (k, b))
                cu, cv = np.full(k, a), np.full(k, b)
            eu.append(u)
            ev.append(v)
            lu.append(np.asarray(lab_u, dtype=np.int64).reshape(-1))
            lv.append(np.asarray(lab_v, dtype=np.int64).reshape(-1))
            mu.append(np.asarray(cu, dtype=np.int64))
            mv.append(np.asarray(cv, dtype=np.int64))

        def cat(xs, dtype):
            return np.ascontiguousarray(np.concatenate(xs).astype(dtype, copy=False)) if xs else np.zeros(0, dtype)

        def ptr(sizes):
            return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

        self.eu, self.ev = cat(eu, np.int64), cat(ev, np.int64)
        self.lu, self.lv = cat(lu, np.int64), cat(lv, np.int64)
        self.mu, self.mv = cat(mu, np.int64), cat(mv, np.int64)
        # each edge's block row-major at bptr[e], and transposed at the same offset (the forward sweep reads
        # a row per destination class), forbidden pairs (+inf) capped at ``big``. The kernels only read
        # them, so edges given factored whose corners are equal share one copy: those made of the same
        # source block and class representatives (repeated pairs) without looking, the others when
        # their entries are (a fixed sample compared first, then all). On LLaMA-3 8B's 4-D mesh 87 M
        # entries come down to 25 M (blk and blk_t: 1.4 GB to 0.4 GB of fresh memory).
        self.bptr = np.zeros(len(self.eu) + 1, dtype=np.int64)
        wholes: list[tuple[int, np.ndarray, bool]] = []  # (offset, raw costs or NaN-padded blocks, padded)
        corners: list[tuple[int, np.ndarray]] = []  # (offset, capped corner) of every distinct corner
        at_identity: dict[tuple, int] = {}  # a corner's identity (ClassCorners.identity) -> its offset
        by_sample: dict[tuple, list[tuple[int, np.ndarray]]] = {}  # (shape, sampled entries) -> corners
        pos = e0 = 0
        for raw, _, _, _, cu, _, cv, block in parts:
            if block is None or isinstance(block, np.ndarray):  # a whole part, edge after edge
                sizes = np.full(len(raw), raw.shape[1] * raw.shape[2]) if block is None else cu * cv
                self.bptr[e0 : e0 + len(sizes)] = pos + np.cumsum(sizes) - sizes
                wholes.append((pos, raw if block is None else block, block is not None))
                pos += int(sizes.sum())
                e0 += len(sizes)
                continue
            for e in range(len(cu)):  # ClassCorners
                key = block.identity(e)
                at = at_identity.get(key)
                if at is None:
                    corner = np.minimum(block.corner(e), big)
                    flat = corner.reshape(-1)
                    sample = flat[np.linspace(0, flat.size - 1, min(_CORNER_SAMPLE, flat.size)).astype(np.int64)]
                    alike = by_sample.setdefault((corner.shape, sample.tobytes()), [])
                    at = next((m_at for m_at, m in alike if np.array_equal(m, corner)), None)
                    if at is None:
                        at = pos
                        alike.append((pos, corner))
                        corners.append((pos, corner))
                        pos += corner.size
                    at_identity[key] = at
                self.bptr[e0 + e] = at
            e0 += len(cu)
        del by_sample
        self.bptr[-1] = pos
        self.blk, self.blk_t = np.empty(pos), np.empty(pos)
        while corners:  # each corner freed once copied
            at, corner = corners.pop()
            a, b = corner.shape
            self.blk[at : at + a * b] = corner.reshape(-1)
            self.blk_t[at : at + a * b].reshape(b, a)[...] = corner.T
        for at, source, padded in wholes:
            if padded:  # each edge's valid (cu, cv) corner of the NaN-padded block
                valid = ~np.isnan(source)
                flat, flat_t = source[valid], source.transpose(0, 2, 1)[valid.transpose(0, 2, 1)]
            else:
                flat, flat_t = source.reshape(-1), source.transpose(0, 2, 1).reshape(-1)
            np.minimum(flat, big, out=self.blk[at : at + flat.size])
            np.minimum(flat_t, big, out=self.blk_t[at : at + flat.size])
        self.uptr, self.vptr = ptr(n_states[self.eu]), ptr(n_states[self.ev])
        self.msg_f = np.zeros(self.vptr[-1])
        self.msg_b = np.zeros(self.uptr[-1])
        self.lows = np.zeros(len(self.eu))
        # the flat state index each message entry is added to (ev's states for msg_f, eu's for msg_b)
        self.state_f = np.repeat(offsets[self.ev] - self.vptr[:-1], n_states[self.ev]) + np.arange(self.vptr[-1])
        self.state_b = np.repeat(offsets[self.eu] - self.uptr[:-1], n_states[self.eu]) + np.arange(self.uptr[-1])
        self.n_states = np.ascontiguousarray(n_states, dtype=np.int64)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        self.gamma = np.ascontiguousarray(gamma, dtype=np.float64)
        n_lev_f, n_lev_b = int(lev_f.max(initial=-1)) + 1, int(lev_b.max(initial=-1)) + 1
        self.order_f, self.level_ptr_f = _by_level(lev_f[self.eu], n_lev_f)
        self.order_b, self.level_ptr_b = _by_level(lev_b[self.ev], n_lev_b)
        self.vorder_f, self.vlevel_ptr_f = _by_level(lev_f, n_lev_f)
        m = 1 + int(max(self.mu.max(initial=0), self.mv.max(initial=0)))
        self._s1, self._s2 = np.empty(m), np.empty(m)

    def sweep(self, forward: bool, unary: np.ndarray, lo: np.ndarray, hi: np.ndarray,
              x: np.ndarray | None) -> None:
        """One sweep (forward: into ``lo``, decoding into ``x`` when given; backward: into ``hi``)."""
        decode = forward and x is not None
        xx = x if x is not None and forward else np.zeros(len(self.n_states), dtype=np.int64)
        cond = np.zeros(len(unary)) if decode else np.zeros(0)
        levels = (self.level_ptr_f, self.order_f) if forward else (self.level_ptr_b, self.order_b)
        kernels().sweep(forward, *levels, self.vlevel_ptr_f, self.vorder_f, self.eu, self.ev, self.uptr, self.vptr,
                        self.lu, self.lv, self.mu, self.mv, self.bptr, self.blk, self.blk_t, self.gamma, self.offsets,
                        self.n_states, unary, lo, hi, self.msg_f, self.msg_b, decode, xx, cond, self._s1, self._s2,
                        self.lows)

    def forward_constants(self) -> float:
        """The sum over edges of the last forward sweep's normalising constants: right after that sweep,
        each is its edge's part of :meth:`edge_bound` (the minimum over pairs of the reparametrised
        edge, exactly, up to the rounding of the messages)."""
        return float(self.lows.sum())

    def message_sums(self, lo: np.ndarray, hi: np.ndarray) -> None:
        """Write into ``lo`` (``hi``) every state's sum of the messages from earlier (later) neighbours."""
        lo[:] = np.bincount(self.state_f, weights=self.msg_f, minlength=len(lo))
        hi[:] = np.bincount(self.state_b, weights=self.msg_b, minlength=len(hi))

    def energy(self, unary: np.ndarray, x: np.ndarray, big: float) -> float:
        """Energy of ``x`` with the internal ``unary``; +inf when it takes a forbidden pair (cost ``big``)."""
        return float(kernels().energy(self.eu, self.ev, self.uptr, self.vptr, self.lu, self.lv, self.mv, self.bptr,
                                      self.blk, self.offsets, unary, x, big))

    def edge_bound(self, theta: np.ndarray) -> float:
        """The edges' part of the lower bound for the reparametrised unary ``theta``."""
        return float(kernels().edge_bound(self.eu, self.ev, self.uptr, self.vptr, self.lu, self.lv, self.mu,
                                          self.mv, self.bptr, self.blk, self.gamma, self.offsets, self.n_states,
                                          theta, self.msg_f, self.msg_b, self._s1, self._s2))


def _by_level(lev: np.ndarray, n_levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices sorted by level (stable) and the start of every level among them."""
    order = np.argsort(lev, kind="stable").astype(np.int64)
    return order, np.searchsorted(lev[order], np.arange(n_levels + 1)).astype(np.int64)


def _sweep(forward, level_ptr, order, vlevel_ptr, vorder, eu, ev, uptr, vptr, lu, lv, mu, mv, bptr, blk, blk_t,
           gamma, offsets, n_states, unary, lo, hi, msg_f, msg_b, decode, x, cond, hm, nc, lows):  # pragma: no cover
    """One sweep, level by level. Forward: messages from every edge's earlier endpoint into its later
    one, ``lo`` (messages from earlier neighbours) kept in step; with ``decode``, before a level's
    edges its variables take the state minimising unary + messages from later neighbours + the
    costs to their already decoded earlier neighbours (``cond``). Backward: from the later endpoint
    into the earlier one, ``hi`` kept in step. ``hm``, ``nc``: scratch of the largest class count.
    ``lows``: per edge, the forward message's normalising constant (written by the forward sweep)."""
    for L in range(len(level_ptr) - 1):
        if decode:
            for k in range(vlevel_ptr[L], vlevel_ptr[L + 1]):
                v = vorder[k]
                o = offsets[v]
                best, arg = np.inf, 0
                for s in range(n_states[v]):
                    t = unary[o + s] + hi[o + s] + cond[o + s]
                    if t < best:
                        best, arg = t, s
                x[v] = arg
        for k in range(level_ptr[L], level_ptr[L + 1]):
            e = order[k]
            if forward:  # block entry (class of src, class of dst) at src * stride_src + dst * stride_dst
                src, dst, ps, pd, lsrc, ldst, cs, cd = eu[e], ev[e], uptr[e], vptr[e], lu, lv, mu[e], mv[e]
                stride_src, stride_dst, into, back, acc, rows = mv[e], 1, msg_f, msg_b, lo, blk_t
            else:
                src, dst, ps, pd, lsrc, ldst, cs, cd = ev[e], eu[e], vptr[e], uptr[e], lv, lu, mv[e], mu[e]
                stride_src, stride_dst, into, back, acc, rows = 1, mv[e], msg_b, msg_f, hi, blk
            os, od, pb, g = offsets[src], offsets[dst], bptr[e], gamma[src]
            for c in range(cs):
                hm[c] = np.inf
            for s in range(n_states[src]):
                i = os + s
                h = g * (unary[i] + lo[i] + hi[i]) - back[ps + s]
                c = lsrc[ps + s]
                if h < hm[c]:
                    hm[c] = h
            # min-plus product: nc[d] = min over c of hm[c] + cost(c, d), reading one contiguous row
            # per destination class (forward: the transposed blocks), four running minima per row
            # (independent, so the loop is not bound by one chain of min latencies)
            low = np.inf
            for d in range(cd):
                row = pb + d * cs
                b0 = b1 = b2 = b3 = np.inf
                c = 0
                while c + 4 <= cs:
                    b0 = min(b0, hm[c] + rows[row + c])
                    b1 = min(b1, hm[c + 1] + rows[row + c + 1])
                    b2 = min(b2, hm[c + 2] + rows[row + c + 2])
                    b3 = min(b3, hm[c + 3] + rows[row + c + 3])
                    c += 4
                while c < cs:
                    b0 = min(b0, hm[c] + rows[row + c])
                    c += 1
                best = min(min(b0, b1), min(b2, b3))
                nc[d] = best
                low = min(low, best)
            if forward:
                lows[e] = low
            for t in range(n_states[dst]):
                new = nc[ldst[pd + t]] - low
                acc[od + t] += new - into[pd + t]
                into[pd + t] = new
            if decode:
                row = pb + lsrc[ps + x[src]] * stride_src
                for t in range(n_states[dst]):
                    cond[od + t] += blk[row + ldst[pd + t] * stride_dst]


def _edge_bound(eu, ev, uptr, vptr, lu, lv, mu, mv, bptr, blk, gamma, offsets, n_states, theta, msg_f,
                msg_b, hu, hv):  # pragma: no cover
    """Sum over edges of ``min_{i,j} blk[i, j] + gamma_u * theta_u[i] - msg_b[i] - msg_f[j]`` (the edge parts
    of :meth:`solvers.trws.TRWS.lower_bound`)."""
    total = 0.0
    for e in range(len(eu)):
        u, v = eu[e], ev[e]
        cu, cv, ou, pu, pv, pb = mu[e], mv[e], offsets[u], uptr[e], vptr[e], bptr[e]
        g = gamma[u]
        for c in range(cu):
            hu[c] = np.inf
        for d in range(cv):
            hv[d] = np.inf
        for s in range(n_states[u]):
            h = g * theta[ou + s] - msg_b[pu + s]
            c = lu[pu + s]
            if h < hu[c]:
                hu[c] = h
        for t in range(n_states[v]):
            h = -msg_f[pv + t]
            d = lv[pv + t]
            if h < hv[d]:
                hv[d] = h
        b0 = b1 = b2 = b3 = np.inf  # four running minima: independent chains (see _sweep)
        for c in range(cu):
            row, h = pb + c * cv, hu[c]
            d = 0
            while d + 4 <= cv:
                b0 = min(b0, blk[row + d] + h + hv[d])
                b1 = min(b1, blk[row + d + 1] + h + hv[d + 1])
                b2 = min(b2, blk[row + d + 2] + h + hv[d + 2])
                b3 = min(b3, blk[row + d + 3] + h + hv[d + 3])
                d += 4
            while d < cv:
                b0 = min(b0, blk[row + d] + h + hv[d])
                d += 1
        total += min(min(b0, b1), min(b2, b3))
    return total


def _energy(eu, ev, uptr, vptr, lu, lv, mv, bptr, blk, offsets, unary, x, big):  # pragma: no cover
    """Unary plus edge costs of assignment ``x``; +inf at the first forbidden pair (a cost ``>= big``)."""
    total = 0.0
    for v in range(len(x)):
        total += unary[offsets[v] + x[v]]
    for e in range(len(eu)):
        c = blk[bptr[e] + lu[uptr[e] + x[eu[e]]] * mv[e] + lv[vptr[e] + x[ev[e]]]]
        if c >= big:
            return np.inf
        total += c
    return total
