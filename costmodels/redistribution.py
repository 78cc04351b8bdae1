"""Cost of moving a tensor from one placement tuple to another.

Placements are tuples of strings, one per mesh axis: ``"R"``, ``"S(d)"``, ``"P"``.
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
from typing import Any

_SHARD = re.compile(r"^S\((\d+)\)$")

#: placement token kinds
_R, _P = "R", "P"


def _parse(p: str, ndim: int, what: str) -> tuple[str, int]:
    if p == _R or p == _P:
        return (p, -1)
    m = _SHARD.match(p) if isinstance(p, str) else None
    if not m:
        raise ValueError(f"{what}: bad placement {p!r}; expected 'R', 'P' or 'S(d)'")
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
            nbytes = n * -(-L[d] // n) * math.prod(L[:d] + L[d + 1:]) * itemsize
        elif old[0] == _P and new[0] == _R:
            kind, nbytes = "all_reduce", math.prod(L) * itemsize
        elif old[0] == _P and new[0] == "S":
            kind, d = "reduce_scatter", new[1]
            nbytes = n * -(-L[d] // n) * math.prod(L[:d] + L[d + 1:]) * itemsize
        else:  # S(i) -> S(j)
            kind, i = "all_to_all", old[1]
            local = list(L)
            local[i] = -(-L[i] // n)
            nbytes = math.prod(local) * itemsize
        if kind is not None and n > 1:
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
