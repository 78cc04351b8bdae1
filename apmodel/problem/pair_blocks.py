r"""The placement model's pairwise terms, factored for the solvers.

Every graph edge between two node groups contributes a redistribution matrix, given factored as
``(block, rows, cols)`` (the matrix is ``block[np.ix_(rows, cols)]``: the distinct placements priced
once). A group pair's terms are summed by row and column classes (:class:`PairSum`), equal blocks
are kept once (:func:`distinct_blocks`), and the pairs are stacked per block size
(:func:`factored_stacks`) into :class:`solvers.FactoredStack`\ s, which the solvers read without
spreading the dense matrices (on a 4-D mesh those run to gigabytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

import solvers

#: a redistribution matrix ``block[np.ix_(rows, cols)]`` as ``(block, rows, cols)`` (:meth:`CostContext.redistribution_factors`)
Factors = tuple[np.ndarray, np.ndarray, np.ndarray]


def joint_classes(labels: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Indices grouped by their labels in every vector of ``labels`` at once: each index's class and
    one index of every class (the first). Two indices share a class iff every vector labels them
    alike, so a sum of matrices indexed by these vectors is a function of the classes."""
    key = np.zeros(len(labels[0]), dtype=np.int64)
    for lab in labels:  # kept below n * (largest label + 1): compacted after every vector
        key = key * (int(lab.max(initial=0)) + 1) + lab
        _, key = np.unique(key, return_inverse=True)
    _, first, classes = np.unique(key, return_index=True, return_inverse=True)
    return classes.astype(np.int64, copy=False), first.astype(np.int64, copy=False)


def rounded_up(n: int) -> int:
    """``n`` rounded up to three significant bits (8, 9, ..., 16, 18, ..., 32, 36, ...): stacking
    blocks padded to these sizes wastes at most a quarter of each side."""
    if n <= 8:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


@dataclass
class PairSum:
    """The sum of one group pair's terms (factored matrices, some transposed), by classes: its
    block is ``(len(row_first), len(col_first))``, written by :meth:`write`, and the sum is
    ``block[np.ix_(row_class, col_class)]``.

    The classes are :func:`joint_classes` of the terms' row and column indices (entries of one
    class pair are sums of the same numbers); on the 4-D mesh of LLaMA-3 8B the pairs' blocks hold
    126 M entries where their matrices hold 242 M (43 M once equal blocks are shared:
    :func:`distinct_blocks`). A term that appears several times (the same
    object: the edge between two groups of layer copies, repeated for every layer) enters once,
    multiplied by its count, in the order of its first appearance. Each entry is the same
    floating-point sum as adding the dense matrices in that order (a running sum of k copies
    would round k - 1 times, a product rounds once)."""

    terms: list[tuple[Factors, int]]  # distinct terms as they enter, with their counts
    row_class: np.ndarray
    row_first: np.ndarray
    col_class: np.ndarray
    col_first: np.ndarray

    @staticmethod
    def key(terms: list[tuple[Factors, bool]]) -> tuple:
        """What the sum depends on: the terms' identities and orientations in order (two pairs with
        equal keys have equal classes and bit-for-bit equal blocks; the factors outlive the key)."""
        return tuple((id(factors), transposed) for factors, transposed in terms)

    @classmethod
    def of(cls, terms: list[tuple[Factors, bool]]) -> PairSum:
        distinct: dict[tuple[int, bool], list] = {}  # (id, transposed) -> [factors as they enter, count]
        for factors, transposed in terms:
            entry = distinct.get((id(factors), transposed))
            if entry is None:
                block, rows, cols = factors
                distinct[(id(factors), transposed)] = [(block.T, cols, rows) if transposed else factors, 1]
            else:
                entry[1] += 1
        row_class, row_first = joint_classes([f[1] for f, _ in distinct.values()])
        col_class, col_first = joint_classes([f[2] for f, _ in distinct.values()])
        return cls([(f, n) for f, n in distinct.values()], row_class, row_first, col_class, col_first)

    @property
    def block_shape(self) -> tuple[int, int]:
        return (len(self.row_first), len(self.col_first))

    def write(self, out: np.ndarray) -> None:
        """The block into ``out`` (of :attr:`block_shape`; a view into a stack: nothing else is allocated)."""
        for i, ((block, rows, cols), count) in enumerate(self.terms):
            mat = block[rows[self.row_first]][:, cols[self.col_first]]  # rows, then columns: 2x np.ix_'s speed
            if i == 0:
                np.multiply(mat, count, out=out)
            elif count == 1:
                out += mat
            else:
                out += mat * count


#: entries of a block compared first when looking for an equal one (a full comparison follows a match)
_BLOCK_SAMPLE = 64


def distinct_blocks(pairs: Sequence[PairSum], ca: int, cb: int) -> tuple[np.ndarray, np.ndarray]:
    """The pairs' blocks in one stack ``(n, ca, cb)`` (zero padding), each distinct block once, and
    the block of every pair. Pairs of different terms can sum to equal blocks (a layer's ops of
    equal shapes and placements); sharing them, with the pairs of equal terms, cuts what the solvers
    copy and hold to a third on a 4-D mesh. A block is written into the next free slot, then
    compared with the earlier ones that agree on a fixed sample of entries; an equal one takes its
    place (the slot is cleared for the next pair). The slots never written are never touched
    (``np.zeros`` pages stay unmapped)."""
    blocks = np.zeros((len(pairs), ca, cb))
    sample = np.linspace(0, ca * cb - 1, min(_BLOCK_SAMPLE, ca * cb)).astype(np.int64)
    by_sample: dict[bytes, list[int]] = {}
    block_of_pair = np.empty(len(pairs), dtype=np.int64)
    n = 0  # blocks kept
    for k, pair in enumerate(pairs):  # summed in place: no block is made twice
        slot = blocks[n]
        pair.write(slot[: pair.block_shape[0], : pair.block_shape[1]])
        seen = by_sample.setdefault(slot.reshape(-1)[sample].tobytes(), [])
        equal = next((m for m in seen if np.array_equal(blocks[m], slot)), None)
        if equal is None:
            seen.append(n)
            block_of_pair[k] = n
            n += 1
        else:
            block_of_pair[k] = equal
            slot.fill(0.0)
    return blocks[:n], block_of_pair


def factored_stacks(terms: dict[tuple[int, int], list[tuple[Factors, bool]]],
                    group_sizes: Sequence[int]) -> list[solvers.FactoredStack]:
    """The group pairs' summed terms (per pair ``(gu, gv)``, ``gu < gv``: its factored matrices in
    order, each flagged if transposed) as factored stacks, one per shape (the groups' state counts)
    and block size (rounded up: a stack's blocks are padded to its largest).

    Pairs with the same terms in the same order (a layer's two projections of one shape, each group
    pair of a repeated block) have the same sum: it is made once and the pairs share it."""
    by_size: dict[tuple[int, ...], tuple[list[tuple[int, int, int]], list[PairSum]]] = {}
    made: dict[tuple, tuple[tuple[int, ...], int]] = {}  # terms' key -> (stack key, block index)
    for (gu, gv), pair_terms in terms.items():
        terms_key = PairSum.key(pair_terms)
        slot = made.get(terms_key)
        if slot is None:
            pair = PairSum.of(pair_terms)
            ca, cb = pair.block_shape
            size = (group_sizes[gu], group_sizes[gv], rounded_up(ca), rounded_up(cb))
            pairs = by_size.setdefault(size, ([], []))[1]
            slot = made[terms_key] = (size, len(pairs))
            pairs.append(pair)
        by_size[slot[0]][0].append((gu, gv, slot[1]))
    stacks = []
    for (_, _, ca, cb), (edges, pairs) in by_size.items():
        blocks, block_of_pair = distinct_blocks(pairs, ca, cb)
        stacks.append(solvers.FactoredStack([gu for gu, _, _ in edges], [gv for _, gv, _ in edges],
                                            np.stack([pairs[k].row_class for _, _, k in edges]),
                                            np.stack([pairs[k].col_class for _, _, k in edges]), blocks,
                                            block_of=block_of_pair[[k for _, _, k in edges]]))
    return stacks
