"""Candidate strategies for every node of a joint forward/backward ATen graph.

A :class:`Strategy` fixes the placement (one entry per mesh axis) of every output and every tensor
input of a node. The candidates come from PyTorch's own DTensor rules (through
:mod:`apmodel._torch_private`), so every strategy the solver can pick is semantically valid.

Rules, node by node:

- placeholders (params, buffers, inputs, tangents): every tuple of ``Replicate``/``Shard(d)`` over
  the mesh axes, no ``Partial`` (a value that enters the step is whole);
- ops with a DTensor rule: the rule's strategies, given each producer's FULL set of candidate
  output placements;
- ``getitem`` of a multi-output node: one strategy per distinct placement of that output;
- ops without a rule (or whose rule fails): one all-Replicate strategy, and a warning naming the op
  (once per op per :class:`StrategyCache`);
- the ``output`` node is not a decision and gets no entry;
- under split-dimension seeding (:mod:`apmodel.problem.seeding`) a node may carry a :class:`Ball`:
  placeholders and single-dim rules keep only the strategies inside it (single-dim rules expand
  only the per-axis combinations inside it, never the whole product over the mesh axes).

Filters (after the rule, per tensor: :mod:`apmodel.candidates.strategy_filters`): a sharded tensor dim must
be at least as large as its number of shards, and, unless ``allow_uneven``, divisible by it (uneven
shards complicate lowering); strategies with placements outside the shared vocabulary
(``_StridedShard``, partials whose reduction is not in ``partial_reduce_ops``) are dropped;
DTensor's masked partial (embedding, gather) is written as Replicate on the indices input and
Partial on the output (see ``_unmask``); so are the combinations listed in :data:`EXCLUDED`
(broken in torch eager) and duplicates. A single-dim rule is expanded over the mesh axes on
integer codes (:mod:`apmodel.candidates.expansion`), each check asked once per distinct placement.

``node_strategies`` is pure given its arguments and memoised on a key of
(op, non-tensor arguments, shapes/strides/dtypes, producers' candidate placements, mesh shape,
options) in a :class:`StrategyCache`, so 32 identical transformer layers cost one enumeration.
Candidate placements enter the key only for full-mesh rules; single-dim rules ignore them.
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np
import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from apmodel import _torch_private as tp
from apmodel._torch_private import fake_mesh
from apmodel.candidates import expansion
from apmodel.candidates.strategy_filters import (
    EXCLUDED,
    Exclusion,
    Filter,
    Placements,
    TensorChecks,
    is_masked_partial,
    shardable,
    unmask_placements,
)
from apmodel.core.placements import ByIdentity, local_shape, numbering, tuple_to_str

__all__ = [
    "Placements",
    "Strategy",
    "Ball",
    "project",
    "StrategyCache",
    "Exclusion",
    "EXCLUDED",
    "input_slots",
    "placeholder_placements",
    "node_strategies",
    "enumerate_strategies",
    "fake_mesh",
    "local_shape",
]

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class Strategy:
    """Placements of a node's outputs (None for a non-tensor output) and of its input slots."""

    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements | None, ...]

    def __str__(self) -> str:
        def s(p: Placements | None) -> str:
            return "-" if p is None else tuple_to_str(p)

        return f"{', '.join(s(o) for o in self.outputs)} <- ({', '.join(s(i) for i in self.inputs)})"


def project(s: Strategy, axis: int) -> Strategy:
    """The 1-D strategy that ``s`` applies on mesh axis ``axis`` (every placement cut to that entry)."""

    def cut(pl: Placements | None) -> Placements | None:
        return None if pl is None else (pl[axis],)

    return Strategy(tuple(cut(p) for p in s.outputs), tuple(cut(p) for p in s.inputs))


@dataclass(frozen=True)
class Ball:
    """A Hamming ball of strategies around a seed (split-dimension seeding, paper §4.3).

    ``center[a]`` is the 1-D strategy chosen for mesh axis ``a`` (outputs/inputs are 1-tuples,
    as :func:`node_strategies` gives on a one-axis mesh). A strategy lies in the ball when its
    projections (:func:`project`) differ from the center on at most ``radius`` axes. ``keep``
    lists placeholder output placements kept regardless (boundary placements, parameter policy).
    The all-Replicate strategy is always kept, so every restricted problem stays feasible.
    """

    center: tuple[Strategy, ...]
    radius: int
    keep: frozenset = frozenset()
    widen_inputs: bool = False  # full-mesh rules also get input placements from the ball (see node_strategies)

    def distance(self, s: Strategy) -> int:
        return sum(1 for a, c in enumerate(self.center) if project(s, a) != c)

    def contains(self, s: Strategy) -> bool:
        if _all_replicate(s) or self.distance(s) <= self.radius:
            return True
        return bool(s.outputs) and s.outputs[0] in self.keep


def _all_replicate(s: Strategy) -> bool:
    return all(pl is None or all(isinstance(p, Replicate) for p in pl) for pl in s.outputs + s.inputs)


@dataclass
class StrategyCache:
    """Memo shared across calls: strategies by content key, warned ops, unsupported-op counts."""

    memo: dict[tuple, tuple[Strategy, ...]] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)
    unsupported: dict[str, int] = field(default_factory=dict)  # op name -> number of replicate-only nodes
    fallback_keys: set[tuple] = field(default_factory=set)  # memo keys whose entry is the replicate fallback
    #: (id of a producer's strategy list, output index) -> (that list, its distinct output placements)
    outputs: dict[tuple[int, int], tuple[Sequence[Strategy], tuple[Placements, ...]]] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    #: DTensorSpecs and shardability answers shared by the rule queries
    specs: tp.SpecMemo = field(default_factory=tp.SpecMemo)
    #: a number per distinct tuple of candidate placements: memo keys hold the number, not
    #: thousands of placements to hash (a tuple seen before is found by identity)
    candidate_numbers: ByIdentity[int] = field(default_factory=numbering)


# ----------------------------------------------------------------------------------------------
# graph helpers


def _is_tensor(v: object) -> TypeGuard[torch.Tensor]:
    return isinstance(v, torch.Tensor)


def _val(node: fx.Node) -> Any:
    """The node's traced value: a (fake) tensor, a tuple of them, a SymInt... (fx meta is untyped)."""
    return node.meta.get("val")


def input_slots(node: fx.Node) -> list[tuple[fx.Node, int]]:
    """(producer node, output index) for each tensor argument, in flattened args-then-kwargs order.

    The output index is 0, except for a ``getitem`` on a multi-output producer (then the index).
    """
    if node.op == "call_function" and node.target is operator.getitem:
        src, idx = node.args[0], node.args[1]
        if isinstance(src, fx.Node) and isinstance(_val(src), (tuple, list)):
            assert isinstance(idx, int), idx
            return [(src, idx)]
    slots: list[tuple[fx.Node, int]] = []

    def visit(a: object) -> None:
        if isinstance(a, fx.Node):
            if _is_tensor(_val(a)):
                slots.append((a, 0))
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)

    visit(node.args)
    visit(node.kwargs)
    return slots


def _distinct_outputs(cache: StrategyCache, producer_strategies: Sequence[Strategy], idx: int) -> tuple[Placements, ...]:
    """:func:`_out_placement`, memoised by the identity of the producer's list (the lists of
    :func:`enumerate_strategies` are shared by the nodes of one memo entry); the memo holds the
    list, so its id is not reused while the entry lives."""
    entry = cache.outputs.get((id(producer_strategies), idx))
    if entry is None or entry[0] is not producer_strategies:
        entry = (producer_strategies, _out_placement(producer_strategies, idx))
        cache.outputs[(id(producer_strategies), idx)] = entry
    return entry[1]


def _out_placement(producer_strategies: Sequence[Strategy], idx: int) -> tuple[Placements, ...]:
    """Distinct placements of output ``idx`` over a producer's strategies, in first-seen order."""
    seen: dict[Placements, None] = {}
    for s in producer_strategies:
        out = s.outputs[idx] if idx < len(s.outputs) else None
        if out is not None:
            seen.setdefault(out, None)
    return tuple(seen)


# ----------------------------------------------------------------------------------------------
# filters


def placeholder_placements(shape: Sequence[int], mesh_shape: Sequence[int], allow_uneven: bool = False) -> list[Placements]:
    """All R / S(d) tuples over the mesh for a tensor of ``shape`` that pass the shardability filter."""
    options: list[Placement] = [Replicate()] + [Shard(d) for d in range(len(shape))]
    return [
        pl
        for pl in itertools.product(options, repeat=len(mesh_shape))
        if shardable(shape, pl, mesh_shape, allow_uneven)
    ]


# ----------------------------------------------------------------------------------------------
# one node


def _freeze(a: object, cands: Callable[[tuple], int] | None = None) -> object:
    """Hashable form of an argument structure (tensors as shape/stride/dtype[/candidates, as
    ``cands`` numbers them])."""
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_freeze(x, cands) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple(sorted((k, _freeze(v, cands)) for k, v in a.items())))
    if isinstance(a, tp.TensorArg):
        return ("T", a.shape, a.stride, a.dtype, None if cands is None else cands(a.candidates))
    if isinstance(a, fx.Node):  # non-tensor node (e.g. a SymInt); static shapes make these rare
        return ("N", repr(_val(a)))
    try:
        hash(a)
        return a
    except TypeError:
        return repr(a)


def _out_shapes(val: object) -> tuple[tuple[int, ...] | None, ...]:
    if _is_tensor(val):
        return (tuple(val.shape),)
    if isinstance(val, (tuple, list)):
        return tuple(tuple(v.shape) if _is_tensor(v) else None for v in val)
    return (None,)


def _replicate_only(out_shapes: Sequence[object], n_inputs: int, ndim: int) -> Strategy:
    r = (Replicate(),) * ndim
    return Strategy(tuple(r if s is not None else None for s in out_shapes), (r,) * n_inputs)


def _mesh_shape(mesh: DeviceMesh | Sequence[int]) -> tuple[int, ...]:
    return tuple(mesh.shape) if isinstance(mesh, DeviceMesh) else tuple(int(s) for s in mesh)


def _op_name(target: object) -> str:
    """"aten.mm.default" for an OpOverload, the function name otherwise."""
    if isinstance(target, tp.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def node_strategies(
    node: fx.Node,
    mesh: DeviceMesh | Sequence[int],
    producer_strategies: Mapping[str, Sequence[Strategy]],
    **options: Any,
) -> list[Strategy]:
    """Candidate strategies of one node (a new list; see :func:`_node_strategies` for the
    options ``allow_uneven``, ``partial_inputs``, ``partial_reduce_ops``, ``partial_input_ops``,
    ``cache`` and ``ball``).

    ``producer_strategies`` maps the name of every producer of ``node`` (see :func:`input_slots`)
    to its candidate strategies; each input slot's candidate placements are the distinct output
    placements of its producer. ``mesh`` is a DeviceMesh (or a mesh shape, for which a planning
    mesh is made). Returns a non-empty list; the output node returns [].
    """
    return list(_node_strategies(node, mesh, producer_strategies, **options))


def _node_strategies(
    node: fx.Node,
    mesh: DeviceMesh | Sequence[int],
    producer_strategies: Mapping[str, Sequence[Strategy]],
    *,
    allow_uneven: bool = False,
    partial_inputs: bool = True,
    partial_reduce_ops: Sequence[str] = ("sum", "avg"),
    partial_input_ops: Sequence[str] = ("sum",),
    cache: StrategyCache | None = None,
    ball: Ball | None = None,
    mesh_shape: tuple[int, ...] | None = None,
) -> tuple[Strategy, ...]:
    """:func:`node_strategies` as the memo's tuple (shared by every node of one entry).

    ``partial_inputs=False`` drops strategies that consume a Partial input (e.g. the single-dim
    mm rule's P x R -> P), which shrinks the search space. ``partial_reduce_ops`` are the Partial
    reductions kept (DTensor's mean gives Partial("avg"), amax Partial("max")); the default keeps
    sums and means, the "P" and "P(avg)" of the costmodels vocabulary (a batch-sharded mean loss
    is a partial mean); ``partial_input_ops`` are the Partial reductions a strategy may consume
    (default: sums only). ``ball`` (split-dimension seeding) keeps only the strategies inside it;
    single-dim rules then expand only the per-axis combinations inside the ball instead of the
    whole product over the mesh axes. ``mesh_shape``: the mesh's shape, when the caller knows it
    (reading a DeviceMesh's shape takes tens of µs).
    """
    if node.op == "output":
        return ()
    if not isinstance(mesh, DeviceMesh):
        mesh = fake_mesh(mesh)
    ms = mesh_shape if mesh_shape is not None else _mesh_shape(mesh)
    nd = len(ms)
    cache = cache if cache is not None else StrategyCache()
    val = _val(node)

    if node.op == "placeholder":
        return _placeholder_strategies(node, val, ms, allow_uneven, ball, cache)

    if node.op != "call_function":
        raise ValueError(f"node {node.name}: unsupported FX op kind {node.op!r} (expected placeholder/call_function/output)")

    slots = input_slots(node)
    cand = _input_candidates(node, slots, producer_strategies, cache)

    if node.target is operator.getitem and slots and slots[0][1] >= 0 and isinstance(_val(slots[0][0]), (tuple, list)):
        return tuple(Strategy((pl,), (pl,)) for pl in cand[0])

    op = node.target
    if (ball is not None and ball.widen_inputs and ball.radius < nd and isinstance(op, tp.OpOverload)
            and tp.rule_kind(op) == "op_strategy"):
        # A full-mesh rule offers only strategies that follow its inputs' candidates, and under
        # seeding the producers' candidates are restricted. Widening gives each input also the
        # placements within the ball around this node's seeded input placement (targets a
        # redistribution can reach). Those need not be outputs of any producer strategy, so the
        # widened problem is no longer a restriction of the unseeded one (it can be cheaper).
        cand = [_with_ball_inputs(c, ball, j, _slot_shape(p, i), ms, allow_uneven) for j, (c, (p, i)) in enumerate(zip(cand, slots, strict=True))]
    args, kwargs = _tensor_args(node, cand)
    out_shapes = _out_shapes(val)
    # Only full-mesh rules look at the producers' candidate placements; single-dim rules (and the
    # replicate fallback) do not, so their key leaves them out and more nodes share one entry.
    with_cands = isinstance(op, tp.OpOverload) and tp.rule_kind(op) == "op_strategy"
    # Single-dim rules expand only the combinations in the ball. Full-mesh rules follow their
    # producers' (already restricted) candidates and are not cut further: a view or transpose
    # must be able to pass on whatever its producer may output.
    in_ball = ball if (ball is not None and ball.radius < nd and isinstance(op, tp.OpOverload)
                       and tp.rule_kind(op) == "single_dim") else None
    number = cache.candidate_numbers if with_cands else None
    key = (op, _freeze(args, number), _freeze(kwargs, number), out_shapes, ms, allow_uneven,
           partial_inputs, tuple(partial_reduce_ops), tuple(partial_input_ops), in_ball)
    hit = cache.memo.get(key)
    if hit is not None:
        cache.hits += 1
        if key in cache.fallback_keys:
            name = _op_name(op)
            cache.unsupported[name] = cache.unsupported.get(name, 0) + 1
        return hit
    cache.misses += 1

    in_shapes = [tuple(_val(p).shape) if i == 0 else tuple(_val(p)[i].shape) for p, i in slots]
    result: list[Strategy] = []
    reason = None
    if not isinstance(op, tp.OpOverload) or not tp.has_sharding_rule(op):
        reason = tp.no_rule_reason(_op_name(op))
    else:
        filt = Filter(ms, allow_uneven, partial_inputs, tuple(partial_reduce_ops), tuple(partial_input_ops))
        result, reason = _rule_strategies(op, args, kwargs, val, mesh, cache, TensorChecks(op, out_shapes, in_shapes, filt),
                                          len(slots), in_ball, nd)
    if reason is not None and not result:
        name = _op_name(op)
        cache.unsupported[name] = cache.unsupported.get(name, 0) + 1
        if name not in cache.warned:
            cache.warned.add(name)
            logger.warning("%s (node %s): %s; using the replicate-only strategy", name, node.name, reason)
        result = [_replicate_only(out_shapes, len(slots), nd)]
        cache.fallback_keys.add(key)
    cache.memo[key] = tuple(result)
    return cache.memo[key]


def _input_candidates(node: fx.Node, slots: Sequence[tuple[fx.Node, int]],
                      producer_strategies: Mapping[str, Sequence[Strategy]], cache: StrategyCache) -> list[tuple[Placements, ...]]:
    """Per input slot, the distinct placements its producer's candidates output there."""
    try:
        cand = [_distinct_outputs(cache, producer_strategies[p.name], i) for p, i in slots]
    except KeyError as e:
        raise ValueError(f"node {node.name}: no strategies given for its producer {e.args[0]!r}") from None
    for (p, i), c in zip(slots, cand, strict=True):
        if not c:
            raise ValueError(f"node {node.name}: producer {p.name} output {i} has no candidate placement")
    return cand


def _placeholder_strategies(node: fx.Node, val: Any, ms: tuple[int, ...], allow_uneven: bool, ball: Ball | None,
                            cache: StrategyCache) -> tuple[Strategy, ...]:
    """A placeholder's candidates: every placement of its tensor on the mesh (in the ball, if any)."""
    if not _is_tensor(val):
        return (Strategy((None,), ()),)
    key: tuple = ("placeholder", tuple(val.shape), ms, allow_uneven, ball)
    hit = cache.memo.get(key)
    if hit is None:
        hit = tuple(Strategy((pl,), ()) for pl in placeholder_placements(tuple(val.shape), ms, allow_uneven))
        if ball is not None:
            hit = tuple(s for s in hit if ball.contains(s))
        if not hit:  # unreachable: all-Replicate always passes
            raise AssertionError(f"placeholder {node.name}: no placement")
        cache.memo[key] = hit
    return hit


def _tensor_args(node: fx.Node, cand: Sequence[tuple[Placements, ...]]) -> tuple[tuple, dict[str, Any]]:
    """The node's arguments with every tensor replaced by a TensorArg (shape + candidate
    placements, ``cand`` in slot order)."""
    it = iter(cand)

    def sub(a: object) -> object:
        if isinstance(a, fx.Node):
            v = _val(a)
            if _is_tensor(v):
                return tp.TensorArg(tuple(v.shape), tuple(v.stride()), v.dtype, next(it))
            return v  # a non-tensor value (e.g. a SymInt) stands for itself
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return a

    return tuple(sub(a) for a in node.args), {k: sub(v) for k, v in node.kwargs.items()}


def _rule_strategies(op: Any, args: tuple, kwargs: dict[str, Any], val: Any, mesh: DeviceMesh, cache: StrategyCache,
                     checks: TensorChecks, n_inputs: int, in_ball: Ball | None, nd: int) -> tuple[list[Strategy], str | None]:
    """The strategies DTensor's sharding rule of ``op`` gives (expanded on codes where the
    single-dim rule is exact), filtered by ``checks`` and ``in_ball``; with the reason when there
    are none (the rule failed, disagreed with the node's inputs, or all were filtered out)."""
    out_shapes = checks.out_shapes
    result: list[Strategy] = []
    reason = None
    coded: expansion.Expansion | None = None
    raw: list = []
    try:
        rule = tp.SingleDimRule(op, args, kwargs, val, mesh, cache.specs) if tp.rule_kind(op) == "single_dim" else None
        if rule is not None and rule.exact:  # expanded on codes (apmodel.candidates.expansion)
            combos = (np.array(_ball_combos(rule, in_ball, out_shapes), dtype=np.int64).reshape(-1, nd)
                      if in_ball is not None else expansion.all_combinations(len(rule.entries), nd))
            coded = expansion.expand(rule, combos, len(out_shapes), checks.output, checks.input)
        elif in_ball is not None:
            assert rule is not None  # restricting to a ball implies a single-dim rule
            raw = rule.expand(_ball_combos(rule, in_ball, out_shapes))
        else:
            raw = tp.op_strategies(op, args, kwargs, val, mesh, memo=cache.specs)
    except Exception as e:  # a rule that rejects these arguments: fall back to replicate
        reason = f"DTensor rule of torch {torch.__version__} failed ({type(e).__name__}: {e})"
        coded, raw = None, []
    if coded is not None:
        if coded.raw and coded.raw_inputs != n_inputs:
            reason = f"rule gave {coded.raw_inputs} input placements for {n_inputs} tensor inputs"
        else:
            result = [s for s in (Strategy(outs, ins) for outs, ins in coded.strategies)
                      if in_ball is None or in_ball.contains(s)]
    seen: set[Strategy] = set()
    for outs, ins in raw:
        if len(ins) != n_inputs:
            reason = f"rule gave {len(ins)} input placements for {n_inputs} tensor inputs"
            result = []
            break
        s = _unmask(Strategy(_align_outputs(outs, out_shapes, nd), tuple(ins)))
        if s in seen:
            continue
        seen.add(s)
        if in_ball is not None and not in_ball.contains(s):
            continue
        if checks.keep(s):
            result.append(s)
    if reason is None and not result:
        reason = "every strategy of the rule was filtered out"
    return result, reason


def _slot_shape(producer: fx.Node, index: int) -> tuple[int, ...]:
    v = _val(producer)
    return tuple(v.shape) if index == 0 or not isinstance(v, (tuple, list)) else tuple(v[index].shape)


def _with_ball_inputs(
    cands: tuple[Placements, ...], ball: Ball, slot: int, shape: tuple[int, ...], ms: tuple[int, ...], allow_uneven: bool
) -> tuple[Placements, ...]:
    """``cands`` plus the R/S(d)/P placements of input ``slot`` within ``ball`` of its seeded placement."""
    center = []
    for c in ball.center:
        inp = c.inputs[slot] if slot < len(c.inputs) else None
        if inp is None:
            return cands
        center.append(inp[0])
    nd = len(center)
    options: list[Placement] = [Replicate(), Partial()] + [Shard(d) for d in range(len(shape))]
    extra: dict[Placements, None] = dict.fromkeys(cands)
    for k in range(min(ball.radius, nd) + 1):
        for axes in itertools.combinations(range(nd), k):
            per_axis = [[o for o in options if o != center[a]] if a in axes else [center[a]] for a in range(nd)]
            for p in itertools.product(*per_axis):
                if p not in extra and shardable(shape, p, ms, allow_uneven):
                    extra[p] = None
    return tuple(extra)


def _ball_combos(rule: tp.SingleDimRule, ball: Ball, out_shapes: Sequence[object]) -> list[tuple[int, ...]]:
    """Per-axis entry combinations of a single-dim rule within ``ball`` (plus all-Replicate).

    An entry "is the seed" on axis ``a`` when the 1-D strategy it makes (as :func:`node_strategies`
    would give it on a one-axis mesh) equals ``ball.center[a]``; a combination lies in the ball when
    at most ``radius`` axes use a non-seed entry. Sorted, i.e. in torch's product order.
    """
    nd = len(ball.center)
    nout = rule.num_outputs
    proj = []
    for e in rule.entries:
        outs = tuple(None if (p := e[i]) is None else (p,) for i in range(nout))
        ins = tuple((x,) for x in e[nout:] if x is not None)
        proj.append(_unmask(Strategy(_align_outputs(outs, out_shapes, 1), ins)))
    n = len(rule.entries)
    seed = [[i for i in range(n) if proj[i] == ball.center[a]] for a in range(nd)]
    other = [[i for i in range(n) if proj[i] != ball.center[a]] for a in range(nd)]
    combos: set[tuple[int, ...]] = set()
    for k in range(min(ball.radius, nd) + 1):
        for axes in itertools.combinations(range(nd), k):
            combos.update(itertools.product(*(other[a] if a in axes else seed[a] for a in range(nd))))
    for i, e in enumerate(rule.entries):
        if all(x is None or isinstance(x, Replicate) for x in e):
            combos.add((i,) * nd)
            break
    return sorted(combos)


def _unmask(s: Strategy) -> Strategy:
    """Write DTensor's masked partial (embedding/gather with a sharded table) in plain terms.

    Such a rule puts ``_MaskPartial`` on the indices input and on the output. For the indices it
    means "replicated; each device masks out-of-range rows locally" (DTensor does that itself when
    given replicated indices), so the input is written Replicate; the output is a partial sum,
    written Partial(). This keeps strategies comparable (a _MaskPartial carries a mask buffer) and
    in the costmodels vocabulary, where R -> P would otherwise be forbidden.
    """
    if not any(pl is not None and any(is_masked_partial(p) for p in pl) for pl in s.outputs + s.inputs):
        return s

    return Strategy(tuple(unmask_placements(pl, Partial()) for pl in s.outputs),
                    tuple(unmask_placements(pl, Replicate()) for pl in s.inputs))


def _align_outputs(outs: Sequence[Placements | None], out_shapes: Sequence[object], nd: int) -> tuple[Placements | None, ...]:
    """One placement per output of the node: None for non-tensor outputs; Replicate for a tensor
    output the rule leaves unplaced (e.g. SDPA's philox offset, a per-rank RNG scalar)."""
    r = (Replicate(),) * nd
    return tuple(
        None if shape is None else (outs[i] if i < len(outs) and outs[i] is not None else r)
        for i, shape in enumerate(out_shapes)
    )


# ----------------------------------------------------------------------------------------------
# whole graph


def enumerate_strategies(
    gm: fx.GraphModule,
    mesh: DeviceMesh | Sequence[int],
    *,
    allow_uneven: bool = False,
    partial_inputs: bool = True,
    partial_reduce_ops: Sequence[str] = ("sum", "avg"),
    partial_input_ops: Sequence[str] = ("sum",),
    cache: StrategyCache | None = None,
    progress: bool = True,
    balls: dict[str, Ball] | None = None,
) -> dict[str, list[Strategy]]:
    """Candidate strategies for every node of ``gm`` except the output node, in graph order.

    Nodes whose op, arguments, shapes and producers' candidate placements coincide (repeated
    layers) share one enumeration through ``cache``. Options as in :func:`node_strategies`;
    ``balls`` restricts nodes to a Hamming ball around their seed (:mod:`apmodel.problem.seeding`).
    The nodes of one memo entry get one list object (do not change the lists in place). Logs the
    time taken and the unsupported ops at INFO.
    """
    if not isinstance(mesh, DeviceMesh):
        mesh = fake_mesh(mesh)
    cache = cache if cache is not None else StrategyCache()
    ms = _mesh_shape(mesh)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    out: dict[str, list[Strategy]] = {}
    t0 = time.perf_counter()
    with tp.without_redistribute_costs(), _progress(progress, len(nodes), "strategies") as advance:
        # one list per memo entry, shared by its nodes (the copies of a layer): the list's
        # identity then keys the distinct outputs of a producer and the model's interning
        shared: dict[int, tuple[tuple[Strategy, ...], list[Strategy]]] = {}
        for n in nodes:
            found = _node_strategies(
                n, mesh, out, allow_uneven=allow_uneven, partial_inputs=partial_inputs,
                partial_reduce_ops=partial_reduce_ops, partial_input_ops=partial_input_ops, cache=cache,
                ball=balls.get(n.name) if balls is not None else None, mesh_shape=ms,
            )
            entry = shared.get(id(found))
            if entry is None or entry[0] is not found:
                entry = shared[id(found)] = (found, list(found))
            out[n.name] = entry[1]
            advance()
    dt = time.perf_counter() - t0
    logger.info(
        "strategies: %d nodes on mesh %s in %.2f s (%d enumerated, %d reused), %d strategies in all",
        len(nodes), ms, dt, cache.misses, cache.hits, sum(len(v) for v in out.values()),
    )
    if cache.unsupported:
        logger.info("ops without a usable DTensor rule (replicate-only): %s", dict(cache.unsupported))
    return out


class _progress:
    """A transient rich progress bar on stderr when it is a terminal (else a no-op); yields an
    advance()."""

    def __init__(self, enabled: bool, total: int, label: str) -> None:
        self.enabled, self.total, self.label = enabled, total, label
        self.bar: Any = None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import Progress

            console = Console(stderr=True)
            if console.is_terminal:
                self.bar = Progress(console=console, transient=True)
                self.bar.__enter__()
                task = self.bar.add_task(self.label, total=self.total)
                return lambda: self.bar.advance(task)
        return lambda: None

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
