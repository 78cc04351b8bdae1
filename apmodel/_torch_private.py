"""Every use of PyTorch's private DTensor APIs lives here (torch 2.13).

apmodel asks DTensor's own sharding propagator which placements each ATen operator accepts, so
that every plan is semantically valid by construction. Those rules are private torch API; keeping
all access in this one module (checked by ``tests/test_torch_private.py``) means a torch upgrade
breaks one place.

Surface:

- :func:`fake_mesh` – a ``"cpu"`` :class:`DeviceMesh` for planning, without any process group.
- :func:`has_sharding_rule` / :func:`rule_kind` – does DTensor know this op, and through which registry.
- :class:`TensorArg` – one tensor argument: its metadata and the candidate placements of its producer.
- :func:`op_strategies` – the candidate (output placements, input placements) pairs for one op call.
- :class:`SingleDimRule` – a single-dim rule's per-axis entries, expanded over chosen per-axis
  combinations only (split-dimension seeding), with torch's own per-combination checks.
- :func:`composite_autograd_on_meta` – context in which tracing on the meta device differentiates
  every CompositeImplicitAutograd op (``F.cross_entropy``, dropout, ``var``) as eager PyTorch does.
- :func:`fused_attention_on_meta` – context in which SDPA traces on meta as the fused flash op.
- :func:`without_redistribute_costs` – context in which torch's own redistribution pricing
  (unused by apmodel, 85% of enumeration time) is skipped.

Two registries hold the rules (on ``DTensor._op_dispatcher.sharding_propagator``):

- ``op_strategy_funcs``: full-mesh strategy functions (view, t, sum, softmax, SDPA, ...). They look at
  the placements their inputs may have, so we pass every candidate placement of each producer; given
  a single input placement, "follow the input" ops (view, t, sum) return a single strategy. A rule
  that raises because one candidate is unusable (view: "Cannot unflatten unevenly sharded tensor")
  is asked again on halves of the widest candidate set, and unusable candidates are dropped.
- ``op_single_dim_strategy_funcs``: rules for ONE mesh axis (add, mul, silu, embedding, rms norm, ...),
  which torch expands to the full mesh with ``_expand_single_dim_strategy_to_mesh`` (cartesian
  product over axes, shardability filter). We call that expansion. Its answer does not depend on
  the inputs' placements except that sharding placeholders are filled with the Shard kinds seen
  on the inputs, so we give it one plain ``Shard`` input (no ``_StridedShard``). Where an op is in both
  registries (mm, addmm, bmm) we use the single-dim rule, as torch's dispatcher does.

A third registry, ``op_to_rules`` (convolution in 2.13), maps concrete input specs to one output
and cannot enumerate candidates; :func:`has_sharding_rule` reports such ops as unsupported.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops import utils as _ops_utils
from torch.distributed.tensor._ops.single_dim_strategy import (
    _expand_single_dim_strategy_to_mesh,
    _PreparedSingleDimStrategy,
)
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = [
    "composite_autograd_on_meta",
    "fused_attention_on_meta",
    "without_redistribute_costs",
    "fake_mesh",
    "has_sharding_rule",
    "rule_kind",
    "registries",
    "TensorArg",
    "op_strategies",
    "PlacementsT",
    "SingleDimRule",
]

logger = logging.getLogger(__name__)

PlacementsT = tuple[Placement, ...]



# ----------------------------------------------------------------------------------------------
# meshes


def fake_mesh(mesh_shape: Sequence[int]) -> DeviceMesh:
    """A ``"cpu"`` DeviceMesh of shape ``mesh_shape`` (1 to 4 axes) for planning; this process is rank 0.

    Strategy enumeration never communicates; it only needs the mesh's shape and identity, so the
    mesh is built without process groups (``_init_backend=False``). Planning therefore neither
    creates nor reads the default process group: a training script can plan, then initialise its
    real group and mesh, as if planning had not happened.
    """
    shape = tuple(int(s) for s in mesh_shape)
    if not 1 <= len(shape) <= 4 or any(s < 1 for s in shape):
        raise ValueError(f"mesh_shape {tuple(mesh_shape)}: expected 1 to 4 positive axis sizes")
    ranks = torch.arange(math.prod(shape), dtype=torch.int).reshape(shape)
    return DeviceMesh("cpu", ranks, _init_backend=False, _rank=0)


# ----------------------------------------------------------------------------------------------
# registries


def _propagator() -> Any:
    return DTensor._op_dispatcher.sharding_propagator


def registries() -> dict[str, dict]:
    """The three rule registries by name (for inspection and the conformance test)."""
    p = _propagator()
    return {
        "op_strategy_funcs": p.op_strategy_funcs,
        "op_single_dim_strategy_funcs": p.op_single_dim_strategy_funcs,
        "op_to_rules": p.op_to_rules,
    }


def rule_kind(op: object) -> str | None:
    """``"single_dim"``, ``"op_strategy"`` or None (no enumerable rule) for an OpOverload."""
    p = _propagator()
    if op in p.op_single_dim_strategy_funcs:
        return "single_dim"
    if op in p.op_strategy_funcs:
        return "op_strategy"
    return None


def has_sharding_rule(op: object) -> bool:
    """True when DTensor can enumerate candidate strategies for ``op`` (an OpOverload)."""
    return rule_kind(op) is not None


# ----------------------------------------------------------------------------------------------
# strategy query


@dataclass(frozen=True)
class TensorArg:
    """One tensor argument of an op call: global metadata plus the producer's candidate placements."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    candidates: tuple[PlacementsT, ...]

    def meta(self) -> TensorMeta:
        return TensorMeta(torch.Size(self.shape), self.stride, self.dtype)


def _tensor_meta(t: object) -> TensorMeta | None:
    if isinstance(t, torch.Tensor):
        return TensorMeta(t.shape, t.stride(), t.dtype)
    return None


def output_tensor_meta(val: object) -> TensorMeta | tuple[TensorMeta | None, ...] | list | None:
    """TensorMeta of an FX node's ``meta["val"]`` (tuple/list for multi-output ops, None for non-tensors)."""
    if isinstance(val, torch.Tensor):
        return _tensor_meta(val)
    if isinstance(val, tuple):
        return tuple(_tensor_meta(v) for v in val)
    if isinstance(val, list):
        return [_tensor_meta(v) for v in val]
    return None


def _map_args(obj: object, fn) -> object:
    """Replace every TensorArg in a (nested list/tuple) argument structure by fn(TensorArg)."""
    if isinstance(obj, TensorArg):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        mapped = [_map_args(o, fn) for o in obj]
        if mapped and all(isinstance(m, OpStrategy) for m in mapped):
            # a list of tensors: DTensor represents it as a TupleStrategy
            return TupleStrategy(tuple(mapped) if isinstance(obj, tuple) else mapped)
        return type(obj)(mapped)
    return obj


def _spec_outputs(spec: object) -> tuple[PlacementsT | None, ...]:
    if isinstance(spec, DTensorSpec):
        return (tuple(spec.placements),)
    if isinstance(spec, (tuple, list)):
        return tuple(tuple(s.placements) if isinstance(s, DTensorSpec) else None for s in spec)
    return ()


def _first_shardable(args: Sequence[object]) -> TensorArg | None:
    for a in args:
        if isinstance(a, TensorArg) and len(a.shape) > 0:
            return a
        if isinstance(a, (list, tuple)):
            r = _first_shardable(a)
            if r is not None:
                return r
    return None


def _zero_redistribute_costs(src_strategy: OpStrategy, dst_spec: DTensorSpec) -> list[float]:
    return [0.0] * len(src_strategy.strategies)


@contextlib.contextmanager
def without_redistribute_costs() -> Iterator[None]:
    """Temporarily replace DTensor's ``generate_redistribute_costs`` by a zero-cost stub.

    Strategy functions price every (input candidate -> strategy input) pair with torch's
    ``redistribute_cost`` (tens of µs each); with full candidate sets that is 85% of enumeration
    time, and apmodel discards those numbers (it prices redistribution with its own cost model).
    The functions only record the costs in ``OpSpec.redistribute_cost``; no rule filters on them.
    The name is bound by ``from ... import`` in several ``_ops`` modules, so each binding is
    swapped and restored. Not thread-safe: do not run DTensor ops in other threads meanwhile.
    """
    original = _ops_utils.generate_redistribute_costs
    if original is _zero_redistribute_costs:  # already inside this context (nested use)
        yield
        return
    patched = []
    for name, mod in list(sys.modules.items()):
        if mod is not None and name.startswith("torch.distributed.tensor"):
            if getattr(mod, "generate_redistribute_costs", None) is original:
                mod.generate_redistribute_costs = _zero_redistribute_costs
                patched.append(mod)
    try:
        yield
    finally:
        for mod in patched:
            mod.generate_redistribute_costs = original


def _meta_kernels_shadowing_composites() -> list[tuple[torch._ops.OpOverload, Any]]:
    """Ops whose Python meta kernel hides their CompositeImplicitAutograd kernel from autograd.

    ``torch._meta_registrations`` installs every decomposition (PrimTorch refs included) as a
    Python ``Meta`` kernel (``OpOverload.py_kernels``), also for ops that are
    CompositeImplicitAutograd (``aten.nll_loss``, ``dropout``, ``var``, ``where``, ...). Under the
    Python dispatcher, which AOTAutograd enables while tracing, that kernel counts as a backend
    kernel for Meta, so ``AutogradMeta`` no longer decomposes the op: it reaches the meta kernel
    with no autograd formula and the traced graph gets no backward (``F.cross_entropy`` on the
    meta device). Eager meta tensors (no Python dispatcher) decompose as usual.
    """
    from torch._C import DispatchKey
    from torch._decomp import global_decomposition_table

    found: dict[torch._ops.OpOverload, Any] = {}
    for table in global_decomposition_table.values():
        for op in table:
            if (
                isinstance(op, torch._ops.OpOverload)
                and op not in found
                and DispatchKey.Meta in op.py_kernels
                and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
            ):
                found[op] = op.py_kernels[DispatchKey.Meta]
    return list(found.items())


@contextlib.contextmanager
def composite_autograd_on_meta() -> Iterator[int]:
    """Trace on the meta device with the autograd of eager PyTorch: while inside, ops listed by
    :func:`_meta_kernels_shadowing_composites` lose their Python meta kernel, so autograd
    decomposes them (``nll_loss`` -> ``nll_loss_forward``, which has a meta kernel and a
    backward). Restored on exit; yields the number of ops changed. Not thread-safe."""
    from torch._C import DispatchKey

    shadowing = _meta_kernels_shadowing_composites()
    for op, _ in shadowing:
        del op.py_kernels[DispatchKey.Meta]
        op._dispatch_cache.clear()
    try:
        yield len(shadowing)
    finally:
        for op, kernel in shadowing:
            op.py_kernels[DispatchKey.Meta] = kernel
            op._dispatch_cache.clear()


def _flash_fits(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float, enable_gqa: bool) -> bool:
    """Whether flash attention's kernel takes this SDPA call: meta tensors of rank 4, no mask, no
    dropout, equal head counts and head dims."""
    tensors = (query, key, value)
    return (
        all(isinstance(t, torch.Tensor) and t.device.type == "meta" and t.dim() == 4 for t in tensors)
        and attn_mask is None
        and not dropout_p
        and not enable_gqa
        and query.shape[1] == key.shape[1] == value.shape[1]
        and query.shape[-1] == key.shape[-1] == value.shape[-1]
    )


def _sdpa_as_flash_on_meta(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    from torch._C import DispatchKey

    if _flash_fits(query, key, value, attn_mask, dropout_p, enable_gqa):
        flash = torch.ops.aten._scaled_dot_product_flash_attention.default
        return flash(query, key, value, 0.0, is_causal, False, scale=scale)[0]
    # torch's own decomposition (the C++ CompositeImplicitAutograd kernel: the math path on meta)
    return torch.ops.aten.scaled_dot_product_attention.default._op_dk(
        DispatchKey.CompositeImplicitAutograd, query, key, value, attn_mask, dropout_p, is_causal,
        scale=scale, enable_gqa=enable_gqa,
    )


@contextlib.contextmanager
def fused_attention_on_meta() -> Iterator[None]:
    """Trace ``F.scaled_dot_product_attention`` on meta tensors as the fused flash op a GPU runs.

    SDPA is CompositeImplicitAutograd; on meta its backend choice (a per-device stub) is the math
    path (bmm + softmax + bmm, with a [seq, seq] score tensor), so an unmodified model's attention
    would be priced unfused and lose DTensor's attention rules. While inside, a Python kernel for
    SDPA's CompositeImplicitAutograd key (honoured by AOTAutograd's Python dispatcher, also for
    calls nested in ``nn.MultiheadAttention``) calls the flash op where its kernel takes the call,
    and torch's own decomposition otherwise. Restored on exit. Not thread-safe.
    """
    from torch._C import DispatchKey

    op = torch.ops.aten.scaled_dot_product_attention.default
    key = DispatchKey.CompositeImplicitAutograd
    previous = op.py_kernels.get(key)
    op.py_kernels[key] = _sdpa_as_flash_on_meta
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        if previous is None:
            del op.py_kernels[key]
        else:
            op.py_kernels[key] = previous
        op._dispatch_cache.clear()


def op_strategies(
    op: torch._ops.OpOverload,
    args: tuple,
    kwargs: dict,
    out_val: object,
    mesh: DeviceMesh,
    *,
    with_torch_costs: bool = False,
) -> list[tuple[tuple[PlacementsT | None, ...], tuple[PlacementsT, ...]]]:
    """Candidate strategies DTensor allows for one call of ``op``.

    ``args``/``kwargs`` are the call's arguments with every tensor replaced by a :class:`TensorArg`
    (global shape + the producer's candidate placements); ``out_val`` is the node's output
    (fake/meta tensor or tuple of them). Returns a list of ``(outputs, inputs)`` where ``outputs``
    has one placement tuple per op output (None for a masked-off/non-tensor output) and ``inputs``
    one per tensor argument, in the flattened order of ``args`` then ``kwargs``.

    ``with_torch_costs=False`` skips torch's own redistribution pricing (see
    :func:`without_redistribute_costs`); the returned strategies are the same either way.

    Raises KeyError when the op has no enumerable rule (see :func:`has_sharding_rule`); exceptions
    raised by DTensor's rule itself propagate.
    """
    p = _propagator()
    kind = rule_kind(op)
    if kind is None:
        raise KeyError(f"{op}: no DTensor strategy rule")
    out_meta = output_tensor_meta(out_val)
    ctx = contextlib.nullcontext() if with_torch_costs else without_redistribute_costs()
    with ctx:
        return _op_strategies(p, kind, op, args, kwargs, out_meta, mesh)


def _single_dim_schema(p, op, args, kwargs, mesh) -> OpSchema:
    """The schema a single-dim rule is asked with.

    The single-dim rule enumerates every placement regardless of the inputs' current ones; torch
    fills its sharding placeholders with the Shard kinds seen on the inputs, so the seed schema
    gives one input a plain Shard. Seeds are single-spec OpStrategies.
    """
    seed_arg = _first_shardable(list(args) + list(kwargs.values()))
    nd = mesh.ndim

    def seed(a: TensorArg) -> OpStrategy:
        pl: PlacementsT = (Shard(0),) + (Replicate(),) * (nd - 1) if a is seed_arg else (Replicate(),) * nd
        return OpStrategy([OpSpec(DTensorSpec(mesh, pl, a.meta()))])

    return OpSchema(op, tuple(_map_args(a, seed) for a in args),
                    {k: _map_args(v, seed) for k, v in kwargs.items()},
                    schema_info=p.op_to_schema_info_for_single_dim_strategy.get(op))


def _op_strategies(p, kind, op, args, kwargs, out_meta, mesh):
    if kind == "single_dim":
        schema = _single_dim_schema(p, op, args, kwargs, mesh)
        info = p.op_single_dim_strategy_funcs[op]
        fn = _expand_single_dim_strategy_to_mesh(mesh, schema, info, out_meta)
        strat = fn(op, schema.args_meta, schema.kwargs_meta)
    else:
        return _full_mesh_strategies(p, op, args, kwargs, mesh)
    return _to_pairs(op, strat, len(schema.args_strategy) + len(schema.kwargs_strategy))


# ----------------------------------------------------------------------------------------------
# single-dim rules, expanded over chosen per-axis combinations only

_FOREACH_PREFIXES = ("aten::_foreach_", "aten::_amp_foreach_", "aten::_fused_")


class SingleDimRule:
    """One call's single-mesh-axis rule, to expand over chosen combinations of per-axis entries.

    torch's ``_expand_single_dim_strategy_to_mesh`` takes the cartesian product of the rule's
    per-axis entries over all mesh axes ((1+n)^D combinations on a D-axis mesh). Split-dimension
    seeding wants only the combinations near a seed, so :meth:`expand` builds the strategies of
    given combinations with torch's own per-combination checks (as in torch 2.13's
    ``expand_to_full_mesh_op_strategy``): mixed partial kinds are skipped, every input must be
    shardable (``is_tensor_shardable``, or ``allow_uneven_sharding`` with the seed placement), a
    missing single output raises. Ops whose expansion has further checks (in-place, out=
    variants, multi-mesh arguments, foreach lists) are marked ``exact = False``: :meth:`expand`
    then returns torch's full expansion (a superset; the caller filters).

    ``entries[i]`` is one per-axis rule: a placement (or None) per output, then per tensor input.
    ``expand(all combinations)`` equals :func:`op_strategies` (checked in the tests).
    """

    def __init__(self, op: torch._ops.OpOverload, args: tuple, kwargs: dict, out_val: object, mesh: DeviceMesh) -> None:
        p = _propagator()
        if rule_kind(op) != "single_dim":
            raise KeyError(f"{op}: no single-dim DTensor rule")
        self.op, self.mesh = op, mesh
        self.out_meta = output_tensor_meta(out_val)
        self.info = p.op_single_dim_strategy_funcs[op]
        with without_redistribute_costs():
            self.schema = _single_dim_schema(p, op, args, kwargs, mesh)
            prepared = _PreparedSingleDimStrategy(self.info, self.schema, self.out_meta)
        self.num_outputs: int = prepared.num_outputs
        self.entries: tuple[tuple[Placement | None, ...], ...] = tuple(tuple(e) for e in prepared.expanded_strategies)
        self.allow_unbacked = prepared.allow_unbacked_sharding
        self.allow_uneven = prepared.allow_uneven_sharding
        self.inputs = list(self.schema.args_strategy) + list(self.schema.kwargs_strategy)
        base = op.name().split("::")[1].split(".")[0]
        foreach = op.name().startswith(_FOREACH_PREFIXES) and any(isinstance(a, TupleStrategy) for a in self.schema.args_schema)
        self.exact: bool = not (
            base.endswith("_") or self.schema.is_out_variant_op() or foreach
            or prepared.remapped_different_mesh_args is not None
            or (prepared.element_mesh is not None and prepared.element_mesh != mesh)
        )

    def expand(self, combos: Sequence[Sequence[int]]) -> list[tuple[tuple[PlacementsT | None, ...], tuple[PlacementsT, ...]]]:
        """(outputs, inputs) placements of each valid combination (one entry index per mesh axis)."""
        if not self.exact:
            return self._expand_full(combos)
        nout, mesh, entries = self.num_outputs, self.mesh, self.entries
        width = len(entries[0]) if entries else 0
        result = []
        for combo in combos:
            rows = [entries[i] for i in combo]
            specs: list[PlacementsT | None] = []
            for pos in range(width):
                specs.append(None if rows[0][pos] is None else tuple(r[pos] for r in rows))
            mixed = False
            for pl in specs:
                if pl is None:
                    continue
                kinds = {(type(x), x.reduce_op) for x in pl if isinstance(x, Partial)}
                if len(kinds) > 1 and not (len({t for t, _ in kinds}) == 1 and {r for _, r in kinds} == {"sum", "avg"}):
                    mixed = True
                    break
            if mixed:
                continue
            ins = [pl for pl in specs[nout:] if pl is not None]
            if len(ins) != len(self.inputs):
                raise AssertionError(f"{self.op}: {len(ins)} input placements for {len(self.inputs)} tensor inputs")
            if nout == 1 and specs[0] is None:
                raise RuntimeError(f"{self.op}: output spec is None")
            ok = True
            for inp, pl in zip(self.inputs, ins):
                seed_pl = tuple(inp.strategies[0].output_spec.placements)
                if not (_ops_utils.is_tensor_shardable(inp.shape, DTensorSpec(mesh, pl, inp.tensor_meta),
                                            allow_unbacked_sharding=self.allow_unbacked)
                        or (self.allow_uneven and seed_pl == pl)):
                    ok = False
                    break
            if not ok:
                continue
            outs: tuple[PlacementsT | None, ...] = tuple(specs[:nout])
            result.append((outs, tuple(ins)))
        return result

    def _expand_full(self, combos):
        """torch's full expansion (a superset of the combinations'; the caller filters)."""
        fn = _expand_single_dim_strategy_to_mesh(self.mesh, self.schema, self.info, self.out_meta)
        with without_redistribute_costs():
            strat = fn(self.op, self.schema.args_meta, self.schema.kwargs_meta)
        return _to_pairs(self.op, strat, len(self.inputs))


def _full_mesh_strategies(p, op, args, kwargs, mesh):
    """Ask a full-mesh rule, given every candidate placement of every tensor input.

    Some rules raise when ANY candidate is unusable (e.g. view: "Cannot unflatten unevenly sharded
    tensor") instead of skipping it. Then the candidate set of the input with the most candidates
    is halved and each half asked separately (union of the answers); a single candidate that still
    fails is dropped. If every candidate fails, the first error is raised.
    """

    def ask(a_args, a_kwargs):
        def full(a: TensorArg) -> OpStrategy:
            meta = a.meta()
            return OpStrategy([OpSpec(DTensorSpec(mesh, tuple(c), meta)) for c in a.candidates])

        schema = OpSchema(op, tuple(_map_args(a, full) for a in a_args),
                          {k: _map_args(v, full) for k, v in a_kwargs.items()},
                          schema_info=p.op_to_schema_info.get(op))
        strat = p.op_strategy_funcs[op](schema)
        return _to_pairs(op, strat, len(schema.args_strategy) + len(schema.kwargs_strategy))

    first_error: list[Exception] = []

    def solve(a_args, a_kwargs):
        try:
            return ask(a_args, a_kwargs)
        except (NotImplementedError, TypeError):
            raise
        except Exception as e:  # noqa: BLE001 - a rule rejecting some candidate
            first_error.append(e)
        tensor_args = _collect_tensor_args((a_args, a_kwargs))
        widest = max(tensor_args, key=lambda t: len(t.candidates), default=None)
        if widest is None or len(widest.candidates) <= 1:
            return []
        half = len(widest.candidates) // 2
        out = []
        for part in (widest.candidates[:half], widest.candidates[half:]):
            narrowed = TensorArg(widest.shape, widest.stride, widest.dtype, part)
            swap = lambda a: narrowed if a is widest else a  # noqa: E731
            out += solve(_replace(a_args, swap), {k: _replace(v, swap) for k, v in a_kwargs.items()})
        return out

    result = solve(args, kwargs)
    if not result and first_error:
        raise first_error[0]
    if first_error:
        logger.debug("%s: rule rejected some input candidates (%s); asked per candidate subset", op, first_error[0])
    return list(dict.fromkeys(result))


def _collect_tensor_args(obj: object) -> list[TensorArg]:
    if isinstance(obj, TensorArg):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _collect_tensor_args(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _collect_tensor_args(o)]
    return []


def _replace(obj: object, fn) -> object:
    if isinstance(obj, TensorArg):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(o, fn) for o in obj)
    return obj


def _to_pairs(op, strat, n_inputs):
    """OpStrategy -> [(output placements, input placements)]."""
    if isinstance(strat, TupleStrategy):
        raise NotImplementedError(f"{op}: rule returned a TupleStrategy (per-output strategies); not supported")
    if not isinstance(strat, OpStrategy):
        raise TypeError(f"{op}: rule returned {type(strat).__name__}, expected OpStrategy")
    result = []
    for spec in strat.strategies:
        outs = _spec_outputs(spec.output_specs)
        if spec.input_specs is None:
            # DTensor's convention: inputs follow the (single) output placement
            ins = (outs[0],) * n_inputs
        else:
            ins = tuple(tuple(s.placements) for s in spec.input_specs)
        result.append((outs, ins))
    return result
