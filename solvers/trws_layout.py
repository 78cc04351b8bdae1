"""TRW-S's data layout: the variables' levels, the edges of one shape group in one direction
(:class:`Directed`), class blocks, and every class-compressed edge of one direction in flat ragged
arrays (:class:`Unified`), as :class:`solvers.trws.TRWS` builds and sweeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .problem import PairwiseProblem


def levels(n: int, lo_nbr_ptr: np.ndarray, lo_nbr: np.ndarray) -> np.ndarray:
    """Longest-path level of every variable given, per variable, its earlier neighbours (CSR)."""
    lev = [0] * n
    ptr = lo_nbr_ptr.tolist()
    nb = lo_nbr.tolist()
    for v in range(n):
        best = -1
        for w in nb[ptr[v] : ptr[v + 1]]:
            if lev[w] > best:
                best = lev[w]
        lev[v] = best + 1
    return np.array(lev, dtype=np.int64)


def csr(n: int, keys: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(keys, kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.add.at(ptr, keys + 1, 1)
    return np.cumsum(ptr), vals[order]


@dataclass
class Directed:
    """One shape group in one direction, sorted by the level of its source."""

    src: np.ndarray
    dst: np.ndarray
    costs: np.ndarray  # (k, n_src, n_dst), finite
    src_idx: np.ndarray  # (k, n_src) flat indicator indices
    dst_idx: np.ndarray  # (k, n_dst)
    msg: np.ndarray  # (k, n_dst) message into dst
    rev: np.ndarray  # position of the same edge in the other direction's arrays
    level_ptr: np.ndarray | None  # edges with source level L are [level_ptr[L], level_ptr[L+1])
    pair: int = -1  # index of the same edges' arrays in the other direction's list
    raw: np.ndarray | None = None  # forward only: original-order costs (+inf allowed), for decoding
    eid: np.ndarray = field(kw_only=True)  # position of each sorted edge in ``raw``
    cid: np.ndarray = field(kw_only=True)  # the same edge's index in :class:`~solvers.trws_compiled.RaggedEdges`


def class_block(raw: np.ndarray, lu, cu, lv, cv) -> np.ndarray:
    """(k, mu, mv) cost of each class pair (raw values, +inf allowed); padding marked by NaN."""
    k, a, b = raw.shape
    mu, mv = int(cu.max()), int(cv.max())
    rep_u = np.zeros((k, mu), dtype=np.int64)
    rep_u[np.arange(k)[:, None], lu] = np.arange(a)[None, :]
    rep_v = np.zeros((k, mv), dtype=np.int64)
    rep_v[np.arange(k)[:, None], lv] = np.arange(b)[None, :]
    cc = raw[np.arange(k)[:, None, None], rep_u[:, :, None], rep_v[:, None, :]]
    valid = (np.arange(mu)[None, :, None] < cu[:, None, None]) & (np.arange(mv)[None, None, :] < cv[:, None, None])
    return np.where(valid, cc, np.nan)


def class_dense(lu: np.ndarray, lv: np.ndarray, block: np.ndarray) -> np.ndarray:
    """The (k, a, b) matrices of class labels and a class block (the inverse of :func:`class_block`)."""
    return block[np.arange(len(block))[:, None, None], lu[:, :, None], lv[:, None, :]]


class RaggedClassMin:
    """Class-wise minimum of ragged per-edge vectors (all edges of one direction, flat)."""

    def __init__(self, labels: np.ndarray, ptr: np.ndarray, m: int) -> None:
        counts = np.diff(ptr)
        key = np.repeat(np.arange(len(counts)), counts) * m + labels
        self.perm = np.argsort(key, kind="stable")
        ks = key[self.perm]
        new = np.ones(len(ks), dtype=bool)
        new[1:] = ks[1:] != ks[:-1]
        self.starts = np.flatnonzero(new)
        self.dest = ks[self.starts]
        self.seg_ptr = np.searchsorted(self.starts, ptr)
        self.ptr = ptr
        self.m = m

    def __call__(self, vals: np.ndarray, e0: int, e1: int) -> np.ndarray:
        f0, f1 = self.ptr[e0], self.ptr[e1]
        s0, s1 = self.seg_ptr[e0], self.seg_ptr[e1]
        out = np.full((e1 - e0) * self.m, np.inf)
        out[self.dest[s0:s1] - e0 * self.m] = np.minimum.reduceat(vals[self.perm[f0:f1] - f0], self.starts[s0:s1] - f0)
        return out.reshape(e1 - e0, self.m)


def ragged_take(flat: np.ndarray, ptr: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reorder a ragged array (segments ``flat[ptr[i]:ptr[i+1]]``) by ``order``."""
    counts = np.diff(ptr)[order]
    new_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    idx = np.repeat(ptr[:-1][order] - new_ptr[:-1], counts) + np.arange(new_ptr[-1])
    return flat[idx], new_ptr


class Unified:
    """All class-compressed edges of one direction in flat ragged arrays, sorted by source level.

    One numpy call per step handles every edge of a level, whatever the state counts; costs live in
    one padded block array ``blk`` (E, m_src, m_dst) of class-pair costs.
    """

    def __init__(self, p: PairwiseProblem, src, dst, lsrc, ptr_s, ldst, ptr_d, blk, order, lev, n_levels, gamma):
        self.order = order
        self.src, self.dst = src[order], dst[order]
        self.lsrc, self.sptr = ragged_take(lsrc, ptr_s, order)
        self.ldst, self.dptr = ragged_take(ldst, ptr_d, order)
        ns, nd = np.diff(self.sptr), np.diff(self.dptr)
        self.ns = ns
        self.sidx = np.repeat(p.offsets[self.src] - self.sptr[:-1], ns) + np.arange(self.sptr[-1])
        self.didx = np.repeat(p.offsets[self.dst] - self.dptr[:-1], nd) + np.arange(self.dptr[-1])
        self.gamma_rep = np.repeat(gamma[self.src], ns)
        self.blk = np.ascontiguousarray(blk[order])
        self.ms, self.md = blk.shape[1], blk.shape[2]
        self.erep_d = np.repeat(np.arange(len(self.src)), nd)
        self.dst_flat = self.erep_d * self.md + self.ldst
        self.src_min = RaggedClassMin(self.lsrc, self.sptr, self.ms)
        self.dst_min = RaggedClassMin(self.ldst, self.dptr, self.md)
        self.msg = np.zeros(self.dptr[-1])
        self.rev: np.ndarray | None = None  # positions of the reverse messages (into src) in the other direction's msg
        self.level_ptr = np.searchsorted(lev[self.src], np.arange(n_levels + 1), side="left")
