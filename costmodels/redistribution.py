"""Cost of moving a tensor from one placement tuple to another.

Placements are tuples of strings, one per mesh axis: ``"R"``, ``"S(d)"``, ``"P"`` (partial sum) or
``"P(avg)"`` (partial mean: reduced by the same collectives as a sum, at the same price).
The transition is decomposed into per-axis steps in the order DTensor's redistribute
uses (``torch.distributed.tensor._redistribute``):

1. if the source is sharded, mesh axes from last (innermost) to first: if the target is a shard whose tensor dim is
   sharded differently by the *earlier* axes in source and target (nested sharding that
   would be misaligned), go to Replicate first; then apply the (possibly replaced) step;
2. mesh axes from first to last: apply whatever is still different.

Per-axis steps: S->R all-gather, P->R all-reduce, P->S reduce-scatter, S(i)->S(j)
all-to-all, R->S a local slice (free), R->P and S->P forbidden (``inf``).

Each step sees the buffer of one group along its axis: the global shape split (ceil, in
mesh order) by the shards of all *other* axes at that moment. Uneven shards are padded, as
DTensor pads them for its collectives: a gather or scatter of dim ``d`` over ``n`` ranks
moves ``n * ceil(L_d / n)`` rows.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Sequence

import numpy as np

_SHARD = re.compile(r"^S\((\d+)\)$")

#: placement token kinds
_R, _P = "R", "P"
#: partial tokens -> their index (kinds differ: moving between two partials needs a reduction)
_PARTIALS = {"P": 0, "P(sum)": 0, "P(avg)": 1}


def _parse(p: str, ndim: int, what: str) -> tuple[str, int]:
    if p == _R:
        return (p, -1)
    if p in _PARTIALS:
        return (_P, _PARTIALS[p])
    m = _SHARD.match(p) if isinstance(p, str) else None
    if not m:
        raise ValueError(f"{what}: bad placement {p!r}; expected 'R', 'P', 'P(avg)' or 'S(d)'")
    d = int(m.group(1))
    if d >= ndim:
        raise ValueError(f"{what}: placement {p!r} shards dim {d} of a {ndim}-d tensor")
    return ("S", d)


def _group_shape(global_shape: tuple[int, ...], cur: list[tuple[str, int]],
                 mesh: tuple[int, ...], skip: int) -> list[int]:
    """Shape of the tensor one group along mesh axis ``skip`` holds collectively."""
    shape = list(global_shape)
    for m, (k, d) in enumerate(cur):
        if m != skip and k == "S":
            shape[d] = -(-shape[d] // mesh[m])
    return shape


def _step_nbytes(kind: str, L: list[int], d: int, n: int, itemsize: int) -> int:
    """Bytes (nccl-tests size) of one ``kind`` collective over ``n`` ranks of a group
    holding ``L`` (see :func:`_group_shape`); ``d`` is the gathered / scattered dim
    (all-gather, reduce-scatter), the source shard dim (all-to-all), unused for all-reduce."""
    if kind == "all_reduce":
        return math.prod(L) * itemsize
    if kind == "all_to_all":
        local = list(L)
        local[d] = -(-L[d] // n)
        return math.prod(local) * itemsize
    # all-gather / reduce-scatter: dim d padded to a multiple of n
    return n * -(-L[d] // n) * math.prod(L[:d] + L[d + 1:]) * itemsize


def _steps(comm: Any, global_shape: tuple[int, ...], itemsize: int,
           src: tuple[str, ...], dst: tuple[str, ...]) -> tuple[tuple[str, int, int, float], ...]:
    mesh = tuple(comm.mesh_shape)
    D = len(mesh)
    ndim = len(global_shape)
    if len(src) != D or len(dst) != D:
        raise ValueError(f"placements {src!r} -> {dst!r} need one entry per mesh axis "
                         f"of mesh {mesh}")
    cur = [_parse(p, ndim, f"source placement {src!r}") for p in src]
    tgt = [_parse(p, ndim, f"target placement {dst!r}") for p in dst]
    steps: list[tuple[str, int, int, float]] = []

    def apply(axis: int, new: tuple[str, int]) -> bool:
        old = cur[axis]
        n = mesh[axis]
        L = _group_shape(global_shape, cur, mesh, axis)
        kind = None
        if old == new:
            return True
        if new[0] == _P:
            steps.append(("forbidden", axis, 0, math.inf))
            cur[axis] = new
            return False
        if old[0] == _R:
            kind = None  # R -> S: local slice
        elif old[0] == "S" and new[0] == _R:
            kind, d = "all_gather", old[1]
        elif old[0] == _P and new[0] == _R:
            kind, d = "all_reduce", -1
        elif old[0] == _P and new[0] == "S":
            kind, d = "reduce_scatter", new[1]
        else:  # S(i) -> S(j)
            kind, d = "all_to_all", old[1]
        if kind is not None and n > 1:
            nbytes = _step_nbytes(kind, L, d, n, itemsize)
            steps.append((kind, axis, int(nbytes), float(comm.time_us(kind, nbytes, axis))))
        cur[axis] = new
        return True

    # pass 1 (only when the source is sharded at all, as in DTensor): innermost to
    # outermost, clearing misaligned nested sharding through Replicate
    src_sharded = math.prod(mesh[m] for m in range(D) if cur[m][0] == "S") > 1
    for axis in (reversed(range(D)) if src_sharded else ()):
        target = tgt[axis]
        if target[0] == "S":
            d = target[1]
            before_cur = [i for i in range(axis) if cur[i] == ("S", d)]
            before_tgt = [i for i in range(axis) if tgt[i] == ("S", d)]
            if before_cur != before_tgt:
                target = (_R, -1)
        if cur[axis] != target and not apply(axis, target):
            return tuple(steps)
    # pass 2: outermost to innermost, whatever is left
    for axis in range(D):
        if cur[axis] != tgt[axis] and not apply(axis, tgt[axis]):
            return tuple(steps)
    return tuple(steps)


def _cached_steps(comm: Any):
    """The per-comm-object cache (an lru_cache'd closure stored on the object)."""
    cache = getattr(comm, "redistribution_cache", None)
    if cache is None:
        cache = functools.lru_cache(maxsize=1 << 18)(functools.partial(_steps, comm))
        try:
            comm.redistribution_cache = cache
        except (AttributeError, TypeError):  # frozen / slotted user object: no cache
            pass
    return cache


def _key(global_shape: Any, itemsize_bytes: Any, src: Any, dst: Any):
    return (tuple(int(s) for s in global_shape), int(itemsize_bytes), tuple(src), tuple(dst))


def redistribution_steps(comm: Any, global_shape: tuple[int, ...], itemsize_bytes: int,
                         src: tuple[str, ...], dst: tuple[str, ...]) -> list[tuple[str, int, int, float]]:
    """The collectives of a redistribution, as ``(kind, axis, nbytes, µs)``; local slices
    are free and not listed; a forbidden transition shows as ``("forbidden", axis, 0, inf)``."""
    return list(_cached_steps(comm)(*_key(global_shape, itemsize_bytes, src, dst)))


def redistribution_us(comm: Any, global_shape: tuple[int, ...], itemsize_bytes: int,
                      src: tuple[str, ...], dst: tuple[str, ...]) -> float:
    """Time in µs to move a tensor of ``global_shape`` (elements of ``itemsize_bytes``)
    from placements ``src`` to ``dst`` over ``comm`` (a CommModel with ``mesh_shape``).
    0 when ``src == dst``; ``inf`` for R->P or S->P."""
    src_t, dst_t = tuple(src), tuple(dst)
    if src_t == dst_t:
        return 0.0
    return float(sum(s[3] for s in _cached_steps(comm)(*_key(global_shape, itemsize_bytes, src_t, dst_t))))


# ------------------------------------------------------------------------------------------
# Whole-edge pricing: every (src, dst) pair of one tensor at once.
#
# The step sequence of a pair depends on the two placement tuples and the mesh only; the
# shape enters through each step's buffer size. So for one list of sources and one list of
# destinations (a "block", shared by many graph edges) we run the two passes of ``_steps``
# once, vectorised over all pairs with numpy, and record every step as a shape-free token
# ``(kind, axis, dim, shard divisions by the other axes)``. Pricing an edge is then: price
# each distinct token for this shape (a handful of ``comm.time_us`` calls, memoised by
# ``(kind, axis, nbytes)``), and add the step prices of every pair in step order, so the
# sums are the same floating-point operations as ``redistribution_us``'s.

#: per-axis placement codes of the vectorised path: R, the partials (P, P(avg)), then S(d) as
#: ``_CODE_S0 + d``
_CODE_R, _CODE_P, _CODE_S0 = 0, 1, 1 + len(set(_PARTIALS.values()))
#: step kinds of the vectorised path (0: no collective in this slot)
_KIND_NAMES = (None, "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "forbidden")
_AG, _RS, _AR, _A2A, _FORBIDDEN = 1, 2, 3, 4, 5
#: bound on the pair count (sum over cached matrices) kept per comm object; past it that cache
#: starts afresh (a 4-axis mesh block can hold ~1.7 M pairs)
_MAX_CACHED_PAIRS = 1 << 25
#: bound on the bytes of cached step tables per comm object (likewise)
_MAX_CACHED_BLOCK_BYTES = 1 << 28
#: bound on the memoised collective prices per comm object
_MAX_CACHED_TIMES = 1 << 20


class _MatrixCache:
    """What :func:`redistribution_matrix` keeps on a comm object: parsed placement tuples,
    step tables per (sources, destinations) block, collective prices (µs) and finished
    matrices per (shape, itemsize, sources, destinations)."""

    def __init__(self) -> None:
        self.codes: dict[tuple[str, ...], tuple[tuple[int, ...], int]] = {}
        self.decoded: dict[tuple[int, int], tuple | None] = {}
        self.blocks: dict[tuple, "_Block"] = {}
        self.block_bytes = 0
        self.times: dict[tuple[str, int, int], float] = {}
        self.matrices: dict[tuple, np.ndarray] = {}
        self.matrix_pairs = 0


class _Block:
    """Steps of every pair of one (sources, destinations) block, shape-free.

    ``tokens[t]`` is ``(kind, axis, dim, divisions)`` (``None`` for "no step"), where
    ``divisions`` lists ``(tensor dim, axis size)`` for the other axes' shards in mesh order.
    ``slots`` holds, per step slot in the order ``_steps`` takes them, the token of each of the
    slot's distinct steps and each pair's index among those (pairs row-major over sources,
    destinations, in the narrowest integer type): a slot has a few hundred distinct steps, so a
    pair costs two bytes per slot and a matrix one gather per slot."""

    def __init__(self, tokens: list, slots: list[tuple[Any, Any]]) -> None:
        self.tokens = tokens
        self.slots = slots
        self.nbytes = sum(token_of.nbytes + local.nbytes for token_of, local in slots)


def _matrix_cache(comm: Any) -> _MatrixCache:
    cache = getattr(comm, "redistribution_matrix_cache", None)
    if cache is None:
        cache = _MatrixCache()
        try:
            comm.redistribution_matrix_cache = cache
        except (AttributeError, TypeError):  # frozen / slotted user object: no reuse
            pass
    return cache


def _placement_codes(cache: _MatrixCache, placements: tuple[str, ...], D: int,
                     what: str) -> tuple[tuple[int, ...], int]:
    """Per-axis codes of one placement tuple and the largest sharded dim (-1 if none)."""
    hit = cache.codes.get(placements)
    if hit is None:
        if len(placements) != D:
            raise ValueError(f"{what} {placements!r} needs one entry per mesh axis "
                             f"of a {D}-axis mesh")
        codes, top = [], -1
        for p in placements:
            kind, d = _parse(p, 1 << 30, f"{what} {placements!r}")
            codes.append(_CODE_R if kind == _R else _CODE_P + d if kind == _P else _CODE_S0 + d)
            top = max(top, d if kind == "S" else -1)
        hit = cache.codes[placements] = (tuple(codes), top)
    return hit


def _dense_unique(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` for non-negative integer keys of a small
    range (a table lookup instead of a sort)."""
    present = np.zeros(int(keys.max(initial=0)) + 1, dtype=bool)
    present[keys] = True
    uniq = np.flatnonzero(present)
    rank = np.cumsum(present) - 1
    return uniq, rank[keys]


def _decode_token(key: int, mesh: tuple[int, ...], radix: int) -> tuple | None:
    """The step token ``(kind, axis, dim, divisions)`` behind a key of :func:`_trace_keys`
    (``None`` for key 0, "no step")."""
    if key == 0:
        return None
    D = len(mesh)
    axis, key = key % D, key // D
    codes = []
    for _ in range(D):
        codes.append(key % radix)
        key //= radix
    codes.reverse()
    kind, dim = divmod(key, radix + 1)
    # the group's shape divisions, in mesh order as _group_shape does them
    divisions = tuple((c - _CODE_S0, mesh[m]) for m, c in enumerate(codes) if m != axis and c >= _CODE_S0)
    return (_KIND_NAMES[kind], axis, dim - 1, divisions)


def _trace_keys(mesh: tuple[int, ...], src_codes: Any, dst_codes: Any) -> tuple[list, int]:
    """The two passes of ``_steps`` for all pairs at once.

    ``src_codes`` (n_src x D) and ``dst_codes`` (n_dst x D) are placement codes. Returns, per
    slot (2D slots in the order ``_steps`` visits axes), every pair's step key (row-major over
    src, dst; 0: no step; :func:`_decode_token` reads the others), and the radix of the keys.
    Placement codes are kept one array per mesh axis, in the narrowest integer types that hold
    them (the pass is memory-bound)."""
    D = len(mesh)
    n_src, n_dst = len(src_codes), len(dst_codes)
    radix = int(max(src_codes.max(initial=0), dst_codes.max(initial=0))) + 1
    code_t = np.int8 if radix <= np.iinfo(np.int8).max else np.int64
    top = (_FORBIDDEN * (radix + 1) + radix) * radix ** D * D + D  # above every key
    key_t = np.int32 if top <= np.iinfo(np.int32).max else np.int64
    cur = [np.repeat(src_codes[:, m].astype(code_t), n_dst) for m in range(D)]
    tgt = [np.tile(dst_codes[:, m].astype(code_t), n_src) for m in range(D)]
    n = n_src * n_dst
    alive = np.ones(n, dtype=bool)  # not yet stopped by a forbidden step
    slots: list[Any] = []

    def apply(axis: int, new: Any, active: Any) -> None:
        """One call of ``_steps.apply`` on the ``active`` pairs; records the slot's keys."""
        old = cur[axis]
        new_p = (new >= _CODE_P) & (new < _CODE_S0)
        forbidden = active & new_p
        comm_step = active & ~new_p & (old != _CODE_R) if mesh[axis] > 1 else np.zeros(n, dtype=bool)
        old_s, new_s, new_r = old >= _CODE_S0, new >= _CODE_S0, new == _CODE_R
        old_p = (old >= _CODE_P) & ~old_s
        kind: Any = np.zeros(n, dtype=key_t)
        kind[comm_step & old_s & new_r] = _AG
        kind[comm_step & old_p & new_r] = _AR
        kind[comm_step & old_p & new_s] = _RS
        kind[comm_step & old_s & new_s] = _A2A
        # 1 + the dim the step gathers / scatters (all-to-all: the source's), 0 for all-reduce
        dim = np.where(kind == _RS, new, old).astype(key_t) - (_CODE_S0 - 1)
        dim[kind == _AR] = 0
        # key = ((kind, dim), codes of the other axes (they fix the group's shape), axis)
        key = kind * (radix + 1) + dim
        for m in range(D):
            key = key * radix + (cur[m] if m != axis else 0)
        key = key * D + axis
        key[kind == 0] = 0
        key[forbidden] = _FORBIDDEN * (radix + 1) * radix ** D * D + axis
        slots.append(key)
        cur[axis] = np.where(active, new, old)
        alive[forbidden] = False

    sharded = np.zeros(n, dtype=bool)  # the source shards over a mesh axis of more than one rank
    for m in range(D):
        if mesh[m] > 1:
            sharded |= cur[m] >= _CODE_S0
    for axis in reversed(range(D)):  # pass 1 (sharded sources only)
        target = tgt[axis].copy()
        mismatch = np.zeros(n, dtype=bool)
        for i in range(axis):
            mismatch |= (cur[i] == target) != (tgt[i] == target)
        target[(target >= _CODE_S0) & mismatch] = _CODE_R
        apply(axis, target, alive & sharded & (cur[axis] != target))
    for axis in range(D):  # pass 2
        apply(axis, tgt[axis].copy(), alive & (cur[axis] != tgt[axis]))
    return slots, radix


def _block(cache: _MatrixCache, mesh: tuple[int, ...], srcs: tuple, dsts: tuple,
           src_codes: list, dst_codes: list) -> _Block:
    """The (cached) step table of one (sources, destinations) block."""
    block = cache.blocks.get((srcs, dsts))
    if block is not None:
        return block
    slot_keys, radix = _trace_keys(mesh, np.array(src_codes, dtype=np.int64).reshape(len(srcs), len(mesh)),
                                   np.array(dst_codes, dtype=np.int64).reshape(len(dsts), len(mesh)))
    # per slot: its distinct keys and each pair's rank among them; slots where no pair has a
    # step are dropped
    per_slot = [(uniq, local) for uniq, local in map(_dense_unique, slot_keys) if uniq[-1] != 0]
    token_keys = np.unique(np.concatenate([np.zeros(1, dtype=np.int64)] + [uniq for uniq, _ in per_slot]))
    tokens = []
    for k in token_keys.tolist():  # token_keys[0] == 0: "no step"
        token = cache.decoded.get((radix, k), False)
        if token is False:
            token = cache.decoded[(radix, k)] = _decode_token(k, mesh, radix)
        tokens.append(token)
    slots = []
    for uniq, local in per_slot:
        narrow = np.int16 if len(uniq) <= np.iinfo(np.int16).max else np.int64
        slots.append((np.searchsorted(token_keys, uniq), local.astype(narrow)))
    block = _Block(tokens, slots)
    if cache.block_bytes + block.nbytes > _MAX_CACHED_BLOCK_BYTES:
        cache.blocks.clear()
        cache.block_bytes = 0
    cache.blocks[(srcs, dsts)] = block
    cache.block_bytes += block.nbytes
    return block


def _token_us(comm: Any, cache: _MatrixCache, mesh: tuple[int, ...], shape: tuple[int, ...],
              itemsize: int, token: tuple | None) -> float:
    """Price (µs) of one step token for a tensor of ``shape``: 0 for "no step", inf for a
    forbidden one, else the memoised ``comm.time_us`` of its collective."""
    if token is None:
        return 0.0
    kind, axis, dim, divisions = token
    if kind == "forbidden":
        return math.inf
    group_shape = list(shape)  # as _group_shape: ceil-divided by the other axes' shards
    for d, n in divisions:
        group_shape[d] = -(-group_shape[d] // n)
    nbytes = _step_nbytes(kind, group_shape, dim, mesh[axis], itemsize)
    key = (kind, axis, nbytes)
    us = cache.times.get(key)
    if us is None:
        if len(cache.times) >= _MAX_CACHED_TIMES:
            cache.times.clear()
        us = cache.times[key] = float(comm.time_us(kind, nbytes, axis))
    return us


def redistribution_matrix(comm: Any, global_shape: tuple[int, ...], itemsize_bytes: int,
                          srcs: Sequence[tuple[str, ...]], dsts: Sequence[tuple[str, ...]],
                          *, copy: bool = True) -> np.ndarray:
    """``M[a, b]`` = :func:`redistribution_us` ``(comm, global_shape, itemsize_bytes, srcs[a],
    dsts[b])`` in µs, for all pairs at once (same floating-point sums, so the same values).

    The shape-free step tables are cached on ``comm`` per ``(srcs, dsts)`` block, and the
    collective prices per ``(kind, axis, nbytes)``; an edge then costs a few ``time_us``
    calls and one gather. ``copy=False`` returns the cached matrix itself, read-only."""
    mesh = tuple(comm.mesh_shape)
    D = len(mesh)
    shape = tuple(int(x) for x in global_shape)
    itemsize = int(itemsize_bytes)
    srcs, dsts = tuple(tuple(s) for s in srcs), tuple(tuple(d) for d in dsts)
    cache = _matrix_cache(comm)
    src_codes: list[Any] = []
    dst_codes: list[Any] = []
    for plist, codes, what in ((srcs, src_codes, "source placement"), (dsts, dst_codes, "target placement")):
        for p in plist:
            c, top = _placement_codes(cache, p, D, what)
            if top >= len(shape):
                raise ValueError(f"{what} {p!r}: placement 'S({top})' shards dim {top} "
                                 f"of a {len(shape)}-d tensor")
            codes.extend(c)
    if not srcs or not dsts:
        return np.zeros((len(srcs), len(dsts)))
    key = (shape, itemsize, srcs, dsts)
    matrix = cache.matrices.get(key)
    if matrix is None:
        block = _block(cache, mesh, srcs, dsts, src_codes, dst_codes)
        token_us = np.array([_token_us(comm, cache, mesh, shape, itemsize, t) for t in block.tokens])
        flat = np.zeros(len(srcs) * len(dsts))
        for token_of, local in block.slots:  # step order, as redistribution_us sums
            flat += token_us[token_of][local]
        matrix = flat.reshape(len(srcs), len(dsts))
        if cache.matrix_pairs + matrix.size > _MAX_CACHED_PAIRS:
            cache.matrices.clear()
            cache.matrix_pairs = 0
        matrix.flags.writeable = False
        cache.matrices[key] = matrix
        cache.matrix_pairs += matrix.size
    return matrix.copy() if copy else matrix
