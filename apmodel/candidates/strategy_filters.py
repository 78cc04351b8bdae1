"""The per-tensor filters and rewrites of candidate strategies (see :mod:`apmodel.candidates.strategies`).

A strategy is kept when each of its tensors passes: a sharded tensor dim at least as large as its
number of shards and, unless ``allow_uneven``, divisible by it; placements in the shared
vocabulary (no ``_StridedShard``, partials of the kept reductions only); inputs partial only as
the options allow; none of the :data:`EXCLUDED` combinations (broken in torch eager). DTensor's
masked partial (embedding, gather) is written in plain terms first (:func:`unmask_placements`).
Every check reads one tensor's placement, so :mod:`apmodel.candidates.expansion` asks each once per distinct
placement.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from apmodel.core.placements import is_partial, is_replicate, is_shard

__all__ = ["Placements", "Placed", "Exclusion", "EXCLUDED", "Filter", "TensorChecks", "shardable", "in_vocabulary",
           "is_masked_partial", "unmask_placements"]

Placements = tuple[Placement, ...]  # one per mesh axis


class Placed(Protocol):
    """What the filters read of a strategy (an :class:`apmodel.candidates.strategies.Strategy`)."""

    @property
    def outputs(self) -> tuple[Placements | None, ...]: ...

    @property
    def inputs(self) -> tuple[Placements | None, ...]: ...

aten = torch.ops.aten


@dataclass(frozen=True)
class Exclusion:
    """A strategy family kept out of the search because torch's eager DTensor execution fails on it."""

    op: Any  # OpOverload
    input_index: int  # input slot whose placement triggers the failure
    tensor_dim: int
    min_mesh_axes: int  # excluded when that dim is sharded over at least this many mesh axes
    reason: str

    def matches(self, op: object, strategy: Placed) -> bool:
        if self.input_index >= len(strategy.inputs):
            return False
        return self.matches_input(op, self.input_index, strategy.inputs[self.input_index])

    def matches_input(self, op: object, slot: int, pl: Placements | None) -> bool:
        """Whether input ``slot`` of ``op`` placed ``pl`` is excluded."""
        if op != self.op or slot != self.input_index or pl is None:
            return False
        n = sum(1 for p in pl if isinstance(p, Shard) and p.dim == self.tensor_dim)
        return n >= self.min_mesh_axes


# Known-broken-in-eager strategies (torch 2.13), measured on a real 2x2 gloo mesh
# (docs/design.md, "Known-broken strategies").
EXCLUDED: tuple[Exclusion, ...] = (
    Exclusion(
        op=aten.embedding.default,
        input_index=0,
        tensor_dim=0,
        min_mesh_axes=2,
        reason="torch 2.13 eager: embedding with weight Shard(0) on two or more mesh axes raises "
        "'MaskBuffer has been materialized with conflicting data' (works on one axis)",
    ),
)


def shardable(shape: Sequence[int], pl: Placements, mesh_shape: Sequence[int], allow_uneven: bool) -> bool:
    deg = [1] * len(shape)
    for p, k in zip(pl, mesh_shape, strict=False):
        if is_shard(p):
            if p.dim >= len(shape):
                return False
            deg[p.dim] *= k
    for n, k in zip(shape, deg, strict=True):
        if k > 1 and (n < k or (not allow_uneven and n % k)):
            return False
    return True


def in_vocabulary(pl: Placements, partial_reduce_ops: Iterable[str]) -> bool:
    for p in pl:
        if type(p) is Shard or is_replicate(p):
            continue
        if type(p) is Partial and p.reduce_op in partial_reduce_ops:
            continue
        return False
    return True


def is_masked_partial(p: Placement) -> bool:
    return type(p) is not Partial and is_partial(p) and p.reduce_op == "sum"


def unmask_placements(pl: Placements | None, repl: Placement) -> Placements | None:
    """``pl`` with each masked partial replaced by ``repl``: DTensor's ``_MaskPartial`` (an
    embedding or gather with a sharded table) means "replicated, each device masks out-of-range
    rows" on the indices (written Replicate) and a partial sum on the output (written Partial);
    see :func:`apmodel.candidates.strategies._unmask`."""
    if pl is None or not any(is_masked_partial(p) for p in pl):
        return pl
    return tuple(repl if is_masked_partial(p) else p for p in pl)


@dataclass(frozen=True)
class Filter:
    """The options the per-tensor filters read (see :func:`apmodel.candidates.strategies.node_strategies`)."""

    mesh_shape: tuple[int, ...]
    allow_uneven: bool
    partial_inputs: bool
    partial_reduce_ops: tuple[str, ...]
    partial_input_ops: tuple[str, ...]


def _keep_output(pl: Placements | None, shape: tuple[int, ...] | None, f: Filter) -> bool:
    if pl is None:
        return True
    return shape is not None and in_vocabulary(pl, f.partial_reduce_ops) and shardable(shape, pl, f.mesh_shape, f.allow_uneven)


def _keep_input(op: object, slot: int, pl: Placements | None, shape: tuple[int, ...], f: Filter) -> bool:
    if pl is None:
        return True
    if not in_vocabulary(pl, f.partial_reduce_ops) or not shardable(shape, pl, f.mesh_shape, f.allow_uneven):
        return False
    if not f.partial_inputs and any(is_partial(p) for p in pl):
        return False
    # Partial means are produced (a batch-sharded mean loss) but, by default, reduced before use:
    # consuming one (P(avg) x R -> P(avg) for every linear op) would double the strategies of mm.
    if any(is_partial(p) and p.reduce_op not in f.partial_input_ops for p in pl):
        return False
    return not any(ex.matches_input(op, slot, pl) for ex in EXCLUDED)


class TensorChecks:
    """One node's per-tensor rewrite (outputs the rule leaves unplaced are Replicate, masked
    partials unmasked) and filters: a strategy is kept when each of its tensors passes."""

    def __init__(self, op: object, out_shapes: Sequence[tuple[int, ...] | None], in_shapes: Sequence[tuple[int, ...]],
                 f: Filter) -> None:
        self.op, self.out_shapes, self.in_shapes, self.filter = op, out_shapes, in_shapes, f
        self.replicate: Placements = (Replicate(),) * len(f.mesh_shape)

    def keep(self, s: Placed) -> bool:
        """``s`` (aligned and unmasked, one input placement per input slot) passes every filter."""
        f = self.filter
        return (all(_keep_output(pl, shape, f) for pl, shape in zip(s.outputs, self.out_shapes, strict=False))
                and all(_keep_input(self.op, j, pl, shape, f) for j, (pl, shape) in enumerate(zip(s.inputs, self.in_shapes, strict=False))))

    def output(self, i: int, raw: Placements | None) -> tuple[Placements | None, bool]:
        """Output slot ``i`` as the rule places it (``raw``) -> (its placement in the strategy, kept)."""
        shape = self.out_shapes[i]
        pl = None if shape is None else unmask_placements(raw if raw is not None else self.replicate, Partial())
        return pl, _keep_output(pl, shape, self.filter)

    def input(self, j: int, raw: Placements) -> tuple[Placements, bool]:
        """Tensor input ``j`` as the rule places it -> (its placement in the strategy, kept)."""
        pl = unmask_placements(raw, Replicate())
        assert pl is not None  # a placement in, a placement out
        return pl, j < len(self.in_shapes) and _keep_input(self.op, j, pl, self.in_shapes[j], self.filter)
