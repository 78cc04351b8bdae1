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

The loops themselves are in :mod:`solvers.trws_kernels`, which :func:`kernels` imports on first use
(numba compiles them once, a few seconds, then reads them from its cache next to that file).
Without numba installed, :func:`available` is False and TRW-S runs the numpy kernel.

The min-plus products of a level with enough entries run on numba's threads
(:func:`sweep_plan`); the result is the same, bit for bit, on any number of threads.
``NUMBA_NUM_THREADS=1`` keeps every sweep on one thread.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: entries of a class block compared first when looking for an equal one (all are compared on a match)
_CORNER_SAMPLE = 64
#: a level's products go to the threads from this many class-block entries: a launch costs ~1-10 µs,
#: a level of this size ~30 µs on one thread (0.3 ns an entry, the 2-core machine of the benchmarks)
THREADED_LEVEL_ENTRIES = 100_000
#: entries of one work item (rows of one edge's block); each item also rebuilds its edge's source
#: minima (one pass over the source's states), so items much smaller than this waste that pass
ITEM_ENTRIES = 65_536


def available() -> bool:
    """Whether numba is installed (nothing is imported or compiled)."""
    return importlib.util.find_spec("numba") is not None


@dataclass(frozen=True)
class Kernels:
    """The compiled functions (see :mod:`solvers.trws_kernels` for the arrays they take), how many
    threads a sweep may use, and what keeps those threads safe (:class:`ThreadGate`)."""

    sweep: Any
    edge_bound: Any
    energy: Any
    threads: int = 1
    gate: "ThreadGate" = field(default_factory=lambda: ThreadGate())


class ThreadGate:
    """Serialises threaded sweeps within a process and keeps a forked child off the threads.

    numba's thread pools do not all take launches from two Python threads at once (its
    ``workqueue`` layer aborts), and GNU OpenMP's (its ``omp`` layer here) cannot be used again in
    a child forked after it started: the child would abort at its first threaded sweep. So one
    threaded sweep at a time, and a process other than the one that first used the threads sweeps
    on one thread (the same result)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner_pid: int | None = None

    def usable(self) -> bool:
        """Whether this process may use the threads (and, from now on, owns them)."""
        pid = os.getpid()
        if self.owner_pid is None:
            self.owner_pid = pid
        return self.owner_pid == pid


def warm() -> bool:
    """Whether this process has already run the compiled sweeps (so using them costs nothing more)."""
    return kernels.cache_info().currsize > 0 and bool(getattr(kernels().sweep, "signatures", True))


@functools.lru_cache(maxsize=1)
def kernels() -> Kernels:
    """Compile (or load from numba's on-disk cache) the kernels; raises ImportError without numba."""
    import numba

    from . import trws_kernels

    return Kernels(trws_kernels.sweep, trws_kernels.edge_bound, trws_kernels.energy, threads=numba.get_num_threads())


@dataclass(frozen=True)
class SweepPlan:
    """Which levels of one sweep direction run their products on threads, and each thread's work
    items there: rows ``item_d0[i]:item_d1[i]`` of edge ``item_e[i]``'s product; thread ``t`` of
    level ``L`` has items ``item_ptr[L * threads + t] : item_ptr[L * threads + t + 1]``."""

    threaded: np.ndarray  # bool per level
    item_ptr: np.ndarray
    item_e: np.ndarray
    item_d0: np.ndarray
    item_d1: np.ndarray

    @property
    def any_threaded(self) -> bool:
        return bool(self.threaded.any())

    @classmethod
    def one_thread(cls, n_levels: int) -> SweepPlan:
        """Every level on the calling thread (no items)."""
        none = np.zeros(0, dtype=np.int64)
        return cls(np.zeros(n_levels, dtype=bool), np.zeros(n_levels + 1, dtype=np.int64), none, none, none)


def sweep_plan(level_ptr: np.ndarray, order: np.ndarray, src_classes: np.ndarray, dst_classes: np.ndarray,
               threads: int, *, min_entries: int = THREADED_LEVEL_ENTRIES,
               item_entries: int = ITEM_ENTRIES) -> SweepPlan:
    """Deal each level's min-plus products to ``threads`` threads: levels of at least ``min_entries``
    class-block entries are cut into items of about ``item_entries`` (whole rows of one edge's
    product), and the items, largest first, each go to the thread with the least work so far
    (longest-processing-time first: within 4/3 of the best split). Smaller levels, or one thread:
    not threaded."""
    n_levels = len(level_ptr) - 1
    threads = max(1, int(threads))
    threaded = np.zeros(n_levels, dtype=bool)
    item_ptr = np.zeros(n_levels * threads + 1, dtype=np.int64)
    items_e: list[int] = []
    items_d0: list[int] = []
    items_d1: list[int] = []
    entries = src_classes * dst_classes
    for L in range(n_levels):
        edges = order[level_ptr[L] : level_ptr[L + 1]]
        if threads > 1 and int(entries[edges].sum()) >= min_entries:
            threaded[L] = True
            items = []  # (entries, edge, first row, end row)
            for e in edges.tolist():
                rows, width = int(dst_classes[e]), int(src_classes[e])
                cuts = np.linspace(0, rows, max(1, min(rows, rows * width // item_entries)) + 1).astype(np.int64)
                items += [((b - a) * width, e, a, b) for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=False) if b > a]
            loads = np.zeros(threads)
            dealt: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]
            for size, e, a, b in sorted(items, key=lambda item: -item[0]):
                t = int(np.argmin(loads))
                loads[t] += size
                dealt[t].append((e, a, b))
            for t, mine in enumerate(dealt):
                for e, a, b in mine:
                    items_e.append(e)
                    items_d0.append(a)
                    items_d1.append(b)
                item_ptr[L * threads + t + 1] = len(items_e)
        else:
            item_ptr[L * threads + 1 : (L + 1) * threads + 1] = len(items_e)
    as_array = functools.partial(np.asarray, dtype=np.int64)
    return SweepPlan(threaded, item_ptr, as_array(items_e), as_array(items_d0), as_array(items_d1))


class RaggedEdges:
    """Every edge of a problem as ragged class blocks in the forward orientation, with the messages
    of both directions and the level orders of both sweeps (see the module docstring).

    ``parts``: per group of edges ``(raw, u, v, lu, cu, lv, cv, block)`` as :class:`solvers.trws.TRWS`
    builds them: costs ``raw`` (k, n_u, n_v) with ``u`` earlier than ``v`` (None for edges given
    factored), class labels and counts of rows and columns, and the padded class block (NaN
    padding; :class:`solvers.marginal.ClassCorners` for edges given factored) or None (the edge's
    raw matrix is used, one class per state).  ``big``: the finite stand-in of a forbidden pair.
    ``threads``: how many threads a sweep may use (default: numba's, :func:`kernels`).
    """

    def __init__(self, parts, n_states: np.ndarray, offsets: np.ndarray, gamma: np.ndarray, big: float,
                 lev_f: np.ndarray, lev_b: np.ndarray, threads: int | None = None) -> None:
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
        # each edge's min-plus product (its destination classes: mv forward, mu backward), and who computes what
        self.prod_ptr = ptr(np.maximum(self.mu, self.mv))
        self.prod = np.empty(self.prod_ptr[-1])
        threads = kernels().threads if threads is None else threads
        self.plan_f = sweep_plan(self.level_ptr_f, self.order_f, self.mu, self.mv, threads)
        self.plan_b = sweep_plan(self.level_ptr_b, self.order_b, self.mv, self.mu, threads)

    def sweep(self, forward: bool, unary: np.ndarray, lo: np.ndarray, hi: np.ndarray,
              x: np.ndarray | None) -> None:
        """One sweep (forward: into ``lo``, decoding into ``x`` when given; backward: into ``hi``)."""
        decode = forward and x is not None
        xx = x if x is not None and forward else np.zeros(len(self.n_states), dtype=np.int64)
        cond = np.zeros(len(unary)) if decode else np.zeros(0)
        levels = (self.level_ptr_f, self.order_f) if forward else (self.level_ptr_b, self.order_b)
        plan = self.plan_f if forward else self.plan_b
        k = kernels()

        def run(dealt: SweepPlan) -> None:
            k.sweep(forward, *levels, self.vlevel_ptr_f, self.vorder_f, self.eu, self.ev, self.uptr, self.vptr,
                    self.lu, self.lv, self.mu, self.mv, self.bptr, self.blk, self.blk_t, self.gamma, self.offsets,
                    self.n_states, unary, lo, hi, self.msg_f, self.msg_b, decode, xx, cond, self._s1, self.prod,
                    self.prod_ptr, self.lows, dealt.threaded, dealt.item_ptr, dealt.item_e, dealt.item_d0,
                    dealt.item_d1)

        if not plan.any_threaded:
            run(plan)
        elif k.gate.usable():
            with k.gate.lock:
                run(plan)
        else:  # a child forked from the process that started the threads
            run(SweepPlan.one_thread(len(levels[0]) - 1))

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
