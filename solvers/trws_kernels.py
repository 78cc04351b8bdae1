"""TRW-S's compiled loops (numba), over the arrays of :class:`solvers.trws_compiled.RaggedEdges`.

Imported only when the compiled kernel is used (numba's import is slow). With numba each
function is compiled on first use and cached next to this file; without it they stay plain
Python (``prange`` is ``range``), which the tests run on small problems.

A sweep goes level by level. A level's edges are independent (no two variables of a level are
adjacent, and every edge of a forward level writes into a later level), so their min-plus products
(nearly all of a sweep's time) can run on several threads: a level with enough entries is cut into
work items (rows of an edge's class block), dealt to the threads beforehand
(:func:`solvers.trws_compiled.sweep_plan`). Each item writes its own rows of the products; the
messages are then updated from them in the serial order, so the threads change nothing in the
result, bit for bit (min is exact, and each row's sums are the same sums).
"""

from __future__ import annotations

from typing import Any

import numpy as np

prange: Any
try:
    import numba

    def _jit(parallel: bool = False):
        return numba.njit(cache=True, nogil=True, parallel=parallel)

    prange = numba.prange
except ImportError:  # pragma: no cover - numba is a dependency; the fallback keeps the loops runnable

    def _jit(parallel: bool = False):
        return lambda fn: fn

    prange = range


@_jit()
def minplus_rows(forward, e, d0, d1, eu, ev, uptr, vptr, lu, lv, mu, mv, bptr, blk, blk_t, gamma, offsets,
                 n_states, unary, lo, hi, msg_f, msg_b, hm, prod, prod_ptr):  # pragma: no cover
    """Rows ``d0:d1`` (destination classes) of edge ``e``'s min-plus product in the sweep's direction:
    ``prod[prod_ptr[e] + d] = min over source classes c of hm[c] + cost(c, d)``, where ``hm[c]`` is the
    smallest reparametrised source state of class ``c`` (computed here into the scratch ``hm``)."""
    if forward:  # the transposed block: one contiguous row per destination class
        src, ps, lsrc, cs, back, rows = eu[e], uptr[e], lu, mu[e], msg_b, blk_t
    else:
        src, ps, lsrc, cs, back, rows = ev[e], vptr[e], lv, mv[e], msg_f, blk
    os, pb, g = offsets[src], bptr[e], gamma[src]
    for c in range(cs):
        hm[c] = np.inf
    for s in range(n_states[src]):
        i = os + s
        h = g * (unary[i] + lo[i] + hi[i]) - back[ps + s]
        c = lsrc[ps + s]
        if h < hm[c]:
            hm[c] = h
    # four running minima (independent chains, so the loop is not bound by one chain of min latencies);
    # a row as a slice with range indices: numba then drops the negative-index checks
    n4 = cs - cs % 4
    at = prod_ptr[e]
    for d in range(d0, d1):
        r = rows[pb + d * cs : pb + (d + 1) * cs]
        b0 = b1 = b2 = b3 = np.inf
        for c in range(0, n4, 4):
            b0 = min(b0, hm[c] + r[c])
            b1 = min(b1, hm[c + 1] + r[c + 1])
            b2 = min(b2, hm[c + 2] + r[c + 2])
            b3 = min(b3, hm[c + 3] + r[c + 3])
        for c in range(n4, cs):
            b0 = min(b0, hm[c] + r[c])
        prod[at + d] = min(min(b0, b1), min(b2, b3))


@_jit(parallel=True)
def minplus_level(forward, first, last, item_e, item_d0, item_d1, eu, ev, uptr, vptr, lu, lv, mu, mv, bptr, blk,
                  blk_t, gamma, offsets, n_states, unary, lo, hi, msg_f, msg_b, hm_size, prod,
                  prod_ptr):  # pragma: no cover
    """The work items of one level on the threads: thread ``t`` runs items ``first[t]:last[t]``."""
    for t in prange(len(first)):
        hm = np.empty(hm_size)
        for it in range(first[t], last[t]):
            minplus_rows(forward, item_e[it], item_d0[it], item_d1[it], eu, ev, uptr, vptr, lu, lv, mu, mv, bptr,
                         blk, blk_t, gamma, offsets, n_states, unary, lo, hi, msg_f, msg_b, hm, prod, prod_ptr)


@_jit()
def sweep(forward, level_ptr, order, vlevel_ptr, vorder, eu, ev, uptr, vptr, lu, lv, mu, mv, bptr, blk, blk_t,
          gamma, offsets, n_states, unary, lo, hi, msg_f, msg_b, decode, x, cond, hm, prod, prod_ptr, lows,
          threaded, item_ptr, item_e, item_d0, item_d1):  # pragma: no cover
    """One sweep, level by level. Forward: messages from every edge's earlier endpoint into its later
    one, ``lo`` (messages from earlier neighbours) kept in step; with ``decode``, before a level's
    edges its variables take the state minimising unary + messages from later neighbours + the
    costs to their already decoded earlier neighbours (``cond``). Backward: from the later endpoint
    into the earlier one, ``hi`` kept in step. ``hm``: scratch of the largest class count; ``prod``:
    the products, edge ``e``'s from ``prod_ptr[e]``. ``lows``: per edge, the forward message's
    normalising constant (written by the forward sweep). Levels with ``threaded[L]`` run their
    products on threads, thread ``t``'s items at ``item_ptr[L * n + t] : item_ptr[L * n + t + 1]``
    (``n`` threads)."""
    n_threads = (len(item_ptr) - 1) // max(1, len(level_ptr) - 1)
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
        if threaded[L]:
            at = L * n_threads
            minplus_level(forward, item_ptr[at : at + n_threads], item_ptr[at + 1 : at + n_threads + 1], item_e,
                          item_d0, item_d1, eu, ev, uptr, vptr, lu, lv, mu, mv, bptr, blk, blk_t, gamma, offsets,
                          n_states, unary, lo, hi, msg_f, msg_b, len(hm), prod, prod_ptr)
        else:
            for k in range(level_ptr[L], level_ptr[L + 1]):
                e = order[k]
                minplus_rows(forward, e, 0, mv[e] if forward else mu[e], eu, ev, uptr, vptr, lu, lv, mu, mv, bptr,
                             blk, blk_t, gamma, offsets, n_states, unary, lo, hi, msg_f, msg_b, hm, prod, prod_ptr)
        for k in range(level_ptr[L], level_ptr[L + 1]):
            e = order[k]
            if forward:  # block entry (class of src, class of dst) at src * stride_src + dst * stride_dst
                src, dst, ps, pd, lsrc, ldst, cd = eu[e], ev[e], uptr[e], vptr[e], lu, lv, mv[e]
                stride_src, stride_dst, into, acc = mv[e], 1, msg_f, lo
            else:
                src, dst, ps, pd, lsrc, ldst, cd = ev[e], eu[e], vptr[e], uptr[e], lv, lu, mu[e]
                stride_src, stride_dst, into, acc = 1, mv[e], msg_b, hi
            at = prod_ptr[e]
            low = np.inf
            for d in range(cd):
                low = min(low, prod[at + d])
            if forward:
                lows[e] = low
            od = offsets[dst]
            for t in range(n_states[dst]):
                new = prod[at + ldst[pd + t]] - low
                acc[od + t] += new - into[pd + t]
                into[pd + t] = new
            if decode:
                row = bptr[e] + lsrc[ps + x[src]] * stride_src
                for t in range(n_states[dst]):
                    cond[od + t] += blk[row + ldst[pd + t] * stride_dst]


@_jit()
def edge_bound(eu, ev, uptr, vptr, lu, lv, mu, mv, bptr, blk, gamma, offsets, n_states, theta, msg_f,
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
        b0 = b1 = b2 = b3 = np.inf  # four running minima: independent chains (see minplus_rows)
        n4 = cv - cv % 4
        for c in range(cu):
            r, h = blk[pb + c * cv : pb + (c + 1) * cv], hu[c]
            for d in range(0, n4, 4):
                b0 = min(b0, r[d] + h + hv[d])
                b1 = min(b1, r[d + 1] + h + hv[d + 1])
                b2 = min(b2, r[d + 2] + h + hv[d + 2])
                b3 = min(b3, r[d + 3] + h + hv[d + 3])
            for d in range(n4, cv):
                b0 = min(b0, r[d] + h + hv[d])
        total += min(min(b0, b1), min(b2, b3))
    return total


@_jit()
def energy(eu, ev, uptr, vptr, lu, lv, mv, bptr, blk, offsets, unary, x, big):  # pragma: no cover
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
