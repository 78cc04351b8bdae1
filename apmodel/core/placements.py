"""Placement vocabulary shared by apmodel and costmodels.

A *placement tuple* has one entry per mesh axis. Each entry is one of

- ``Replicate()``  written ``"R"``: the whole tensor is present on every device of that axis;
- ``Shard(d)``     written ``"S(d)"``: tensor dimension ``d`` is split over that axis;
- ``Partial()``    written ``"P"``: every device holds a partial sum awaiting reduction.

Tuples are written joined, one token per mesh axis: ``"S(0)S(1)"``, ``"RP"``.

This module converts between torch ``Placement`` objects and these strings, computes the
per-device (local) shape a placement implies, for pricing, and memoises functions of placement
tuples by identity (:class:`ByIdentity`: the planner's strategies share their tuples).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeGuard, TypeVar

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = [
    "to_str",
    "from_str",
    "tuple_to_str",
    "parse",
    "to_strs",
    "local_shape",
    "is_even",
    "shard_degrees",
    "is_shard",
    "is_replicate",
    "is_partial",
    "ByIdentity",
    "numbering",
]

_T = TypeVar("_T")

# isinstance on a placement class is a Python ``__instancecheck__`` in torch 2.13 (slow, and the
# 4-D strategy enumeration makes millions): the three common classes are answered by type first, any
# other (strided shards, masked partials) by isinstance.


def is_shard(p: Placement) -> TypeGuard[Shard]:
    """``isinstance(p, Shard)`` (strided shards included)."""
    kind = type(p)
    return kind is Shard or (kind is not Replicate and kind is not Partial and isinstance(p, Shard))


def is_replicate(p: Placement) -> TypeGuard[Replicate]:
    """``isinstance(p, Replicate)``."""
    kind = type(p)
    return kind is Replicate or (kind is not Shard and kind is not Partial and isinstance(p, Replicate))


def is_partial(p: Placement) -> TypeGuard[Partial]:
    """``isinstance(p, Partial)`` (masked partials included)."""
    kind = type(p)
    return kind is Partial or (kind is not Shard and kind is not Replicate and isinstance(p, Partial))

# One token: R, P, P(<reduce op>) or S(<non-negative int>).
_TOKEN = re.compile(r"R|P(?:\((sum|avg|max|min|product)\))?|S\((\d+)\)")


def to_str(p: Placement) -> str:
    """``Replicate()`` -> ``"R"``, ``Shard(d)`` -> ``"S(d)"``, ``Partial()`` -> ``"P"``.

    Raises TypeError for placements outside this vocabulary (e.g. ``_StridedShard``).
    """
    if type(p) is Shard:
        return f"S({p.dim})"
    if is_replicate(p):
        return "R"
    if is_partial(p) and (type(p) is Partial or p.reduce_op == "sum"):
        # DTensor's masked partial (embedding with a row-sharded weight) is reduced by a sum,
        # so it prices and is written as "P"; parsing "P" gives a plain Partial().
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    raise TypeError(f"placement {p!r} ({type(p).__name__}) has no string form; expected Replicate, Shard or Partial")


def _token(m: re.Match) -> Placement:
    if m.group(2) is not None:
        return Shard(int(m.group(2)))
    if m.group(0) == "R":
        return Replicate()
    return Partial(m.group(1) or "sum")


def from_str(s: str) -> Placement:
    """``"R"`` -> ``Replicate()``, ``"S(d)"`` -> ``Shard(d)``, ``"P"`` -> ``Partial()``, ``"P(avg)"`` -> ``Partial("avg")``."""
    if not isinstance(s, str):
        raise TypeError(f"placement string must be str, got {type(s).__name__}: {s!r}")
    m = _TOKEN.fullmatch(s.strip())
    if m is None:
        raise ValueError(f"malformed placement {s!r}: expected 'R', 'P' or 'S(d)' with d >= 0")
    return _token(m)


def tuple_to_str(placements: Sequence[Placement]) -> str:
    """``(Shard(0), Replicate())`` -> ``"S(0)R"``."""
    return "".join(to_str(p) for p in placements)


def parse(s: str, ndim: int | None = None) -> tuple[Placement, ...]:
    """``"S(0)S(1)"`` -> ``(Shard(0), Shard(1))``.

    ``ndim`` (optional) is the expected number of mesh axes. Raises ValueError for a malformed
    string (the offending position is named) or a wrong number of tokens.
    """
    if not isinstance(s, str):
        raise TypeError(f"placement string must be str, got {type(s).__name__}: {s!r}")
    text = s.replace(" ", "").replace(",", "")
    out: list[Placement] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(
                f"malformed placement string {s!r} at position {pos} ({text[pos:]!r}): "
                "expected tokens 'R', 'P' or 'S(d)', e.g. 'S(0)R'"
            )
        out.append(_token(m))
        pos = m.end()
    if not out:
        raise ValueError(f"empty placement string {s!r}")
    if ndim is not None and len(out) != ndim:
        raise ValueError(f"placement string {s!r} has {len(out)} tokens, the mesh has {ndim} axes")
    return tuple(out)


def to_strs(given: str | Sequence[Placement | str], ndim: int, what: str) -> tuple[str, ...]:
    """A user-given placement (``"S(0)R"``, torch placements or strings) as one string per mesh axis.

    ``what`` names the thing being placed in the ValueError raised for a malformed placement or a
    wrong number of mesh axes (``ndim``).
    """
    try:
        parsed = parse(given, ndim) if isinstance(given, str) else tuple(given)
        strs = tuple(p if isinstance(p, str) else to_str(p) for p in parsed)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: bad placement {given!r}: {e}") from None
    if len(strs) != ndim:
        raise ValueError(f"{what}: placement {given!r} has {len(strs)} entries, the mesh has {ndim} axes")
    return strs


_NOTATION_TOKEN = re.compile(r"S(\d+)")


def parse_notation(text: str, ndim: int | None) -> tuple[str, ...]:
    """A placement written in the paper's notation or apmodel's, as one string per mesh axis:
    ``"S0,S1"``, ``"P,S2"``, ``"(S(0), S(1))"``, ``"S(0)S(1)"`` and, for every axis at once,
    ``"R"``. ``ndim`` None checks the syntax only (``"R"`` stays one entry). Raises ValueError
    naming ``text`` for a malformed one or a wrong number of axes."""
    if not isinstance(text, str):
        raise TypeError(f"placement must be a string, got {type(text).__name__}: {text!r}")
    body = text.strip().replace(" ", "")
    if len(body) > 1 and body[0] + body[-1] in ("()", "[]") and "," in body:
        body = body[1:-1]
    tokens = [_NOTATION_TOKEN.sub(r"S(\1)", t) if _NOTATION_TOKEN.fullmatch(t) else t for t in body.split(",")]
    if tokens == ["R"] and ndim is not None:
        tokens = ["R"] * ndim
    joined = "".join(tokens)
    if ndim is None:
        try:
            return tuple(to_str(p) for p in parse(joined))
        except ValueError as e:
            raise ValueError(f"placement {text!r}: bad placement {joined!r}: {e}") from None
    return to_strs(joined, ndim, f"placement {text!r}")


def _as_placements(placements: Sequence[Placement] | str) -> tuple[Placement, ...]:
    return parse(placements) if isinstance(placements, str) else tuple(placements)


def shard_degrees(ndim: int, placements: Sequence[Placement] | str, mesh_shape: Sequence[int]) -> list[int]:
    """Number of shards of each tensor dimension (product of the mesh sizes sharding it)."""
    pl = _as_placements(placements)
    if len(pl) != len(mesh_shape):
        raise ValueError(f"placements {pl} have {len(pl)} entries, mesh_shape {tuple(mesh_shape)} has {len(mesh_shape)} axes")
    deg = [1] * ndim
    for p, size in zip(pl, mesh_shape, strict=True):
        if is_shard(p):
            if not 0 <= p.dim < ndim:
                raise ValueError(f"placement {to_str(p)} shards dim {p.dim} of a {ndim}-d tensor")
            deg[p.dim] *= int(size)
    return deg


def local_shape(
    global_shape: Sequence[int], placements: Sequence[Placement] | str, mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """Per-device shape of a tensor of ``global_shape`` placed as ``placements`` on a mesh.

    A dimension sharded over mesh axes of total size ``k`` has local size ``ceil(n / k)`` (the
    largest shard, which is what sets the time of an uneven computation). Replicate and Partial
    leave the shape unchanged. ``placements`` may be a tuple of Placement or a string like "S(0)R".
    """
    deg = shard_degrees(len(global_shape), placements, mesh_shape)
    return tuple(math.ceil(int(n) / k) for n, k in zip(global_shape, deg, strict=True))


def is_even(global_shape: Sequence[int], placements: Sequence[Placement] | str, mesh_shape: Sequence[int]) -> bool:
    """True when every sharded dimension divides evenly by the number of its shards."""
    deg = shard_degrees(len(global_shape), placements, mesh_shape)
    return all(int(n) % k == 0 for n, k in zip(global_shape, deg, strict=True))


class ByIdentity(Generic[_T]):
    """``fn(key)`` memoised by value, looked up by the key object's identity first: the planner's
    strategies share their placement tuples, so most lookups skip hashing a tuple of placements.
    The memo keeps each key object alive beside its entry, so an identity is never reused."""

    def __init__(self, fn: Callable[[Any], _T]) -> None:
        self._fn = fn
        self._by_value: dict[Hashable, _T] = {}
        self._by_id: dict[int, tuple[Any, _T]] = {}

    def __call__(self, key: Any) -> _T:
        hit = self._by_id.get(id(key))
        if hit is not None and hit[0] is key:
            return hit[1]
        if key in self._by_value:
            value = self._by_value[key]
        else:
            value = self._by_value[key] = self._fn(key)
        self._by_id[id(key)] = (key, value)
        return value


def numbering() -> ByIdentity[int]:
    """A number per distinct key (equal keys, equal numbers: 0, 1, 2... in order of first sight)."""
    counter = itertools.count()
    return ByIdentity(lambda _key: next(counter))
