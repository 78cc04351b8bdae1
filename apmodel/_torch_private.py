"""Every use of PyTorch's private APIs lives here (torch 2.11 to 2.15).

apmodel asks DTensor's own sharding propagator which placements each ATen operator accepts, so
that every plan is semantically valid by construction. Those rules are private torch API, as are
AOTAutograd's joint export and its descriptors, ``OpOverload`` and pytree; keeping all access in
this one module (checked by ``tests/test_torch_private.py``; ``tests/test_layering.py`` checks that
no other module of apmodel names a private torch module or attribute) means a torch upgrade breaks
one place. Where releases differ, this module detects the feature (try-import, ``getattr``) rather
than parsing version strings; a feature a release lacks raises :class:`MissingTorchFeature`, which
names the release and the missing piece.

Surface:

- :data:`OpOverload`, :func:`tree_flatten` / :func:`tree_unflatten` – torch's own, re-exported.
- :func:`export_joint` and the AOT descriptor classes (``ParamAOTInput``, ``GradAOTOutput``, ...,
  imported lazily by name) – the joint forward-backward graph and the roles of its inputs/outputs.
- :func:`is_data_dependent_error`, :func:`op_schema`, :func:`overload_name`.
- :func:`torch_version`, :class:`MissingTorchFeature`, :func:`no_rule_reason`.

- :func:`fake_mesh` – a ``"cpu"`` :class:`DeviceMesh` for planning, without any process group.
- :func:`has_sharding_rule` / :func:`rule_kind` – does DTensor know this op, and through which registry.
- :class:`TensorArg` – one tensor argument: its metadata and the candidate placements of its producer.
- :func:`op_strategies` – the candidate (output placements, input placements) pairs for one op call.
- :class:`SingleDimRule` – a single-dim rule's per-axis entries, expanded over chosen per-axis
  combinations only (split-dimension seeding), with torch's own per-combination checks.
- :func:`composite_autograd_on_meta` – context in which tracing on the meta device differentiates
  every CompositeImplicitAutograd op (``F.cross_entropy``, dropout, ``var``) as eager PyTorch does.
- :func:`fused_attention_on_meta` – context in which SDPA traces on meta as the fused flash op.
- :func:`library_sees_tracing` – context in which ``torch.compiler.is_compiling()`` says a trace is running.
- :func:`grads_accumulate_into` – whether the running backward accumulates into given leaves.
- :func:`without_redistribute_costs` – context in which torch's own redistribution pricing
  (unused by apmodel, 85% of enumeration time) is skipped.
- :func:`register_einsum_rule` – DTensor's single-dim einsum rule (``mm``'s) for a custom op.
- :func:`grouped_mm_runs` / :func:`grouped_mm` – ``torch._grouped_mm`` (one grouped GEMM over
  row groups, the routed experts' kernel) and whether it runs on given operands.

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
import importlib
import logging
import math
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, cast

import torch
from torch._ops import OpOverload
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops import single_dim_strategy as _single_dim
from torch.distributed.tensor._ops import utils as _ops_utils
from torch.distributed.tensor._ops.single_dim_strategy import _expand_single_dim_strategy_to_mesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_unflatten

from apmodel.core.placements import is_partial

__all__ = [
    "OpOverload",
    "overload_packet",
    "tree_flatten",
    "tree_unflatten",
    "MissingTorchFeature",
    "torch_version",
    "no_rule_reason",
    "export_joint",
    "is_data_dependent_error",
    "op_schema",
    "overload_name",
    "BufferAOTInput",
    "GradAOTOutput",
    "InputMutationAOTOutput",
    "ParamAOTInput",
    "PlainAOTInput",
    "PlainAOTOutput",
    "TangentAOTInput",
    "composite_autograd_on_meta",
    "fused_attention_on_meta",
    "flex_attention_routed",
    "autocast_skips_meta",
    "aliases_first_input",
    "library_sees_tracing",
    "causal_mask_detection_off",
    "with_children",
    "lazy_graph_module",
    "without_redistribute_costs",
    "fake_mesh",
    "has_sharding_rule",
    "rule_kind",
    "registries",
    "TensorArg",
    "op_strategies",
    "PlacementsT",
    "SingleDimRule",
    "SpecMemo",
    "mixed_partials",
    "fake_tensor_mode",
    "tracing_graph",
    "dtensor_like",
    "bucket_collectives",
    "grouped_mm",
    "grouped_mm_runs",
]

logger = logging.getLogger(__name__)

PlacementsT = tuple[Placement, ...]


# ----------------------------------------------------------------------------------------------
# torch releases and the private features apmodel needs


class MissingTorchFeature(RuntimeError):
    """The installed torch lacks a private API the planner needs; the message names the release
    and the missing piece."""


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed torch, for messages and tests; behaviour that differs
    between releases is chosen by detecting the feature, not by this number."""
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _torch_feature(module: str, name: str, what: str) -> Any:
    """``module.name`` from torch, or :class:`MissingTorchFeature` naming the release and ``what``."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise MissingTorchFeature(
            f"torch {torch.__version__} has no {module}.{name} ({what}); apmodel is tested on torch 2.11 to 2.15"
        ) from e


def no_rule_reason(op: object) -> str:
    """Why ``op`` is planned replicated: no enumerable DTensor rule in this torch release."""
    return f"no DTensor sharding rule for {op} in torch {torch.__version__}"


#: names resolved on first use (``from apmodel._torch_private import ParamAOTInput``): the module
#: imports AOTAutograd only when a graph is captured, and a release without one of them fails
#: there, naming it, rather than at ``import apmodel``
_LAZY = {
    "aot_export_joint_with_descriptors": ("torch._functorch.aot_autograd", "the joint forward-backward export"),
    **{name: ("torch._functorch._aot_autograd.descriptors", "AOTAutograd's graph input/output descriptors")
       for name in ("BufferAOTInput", "GradAOTOutput", "InputMutationAOTOutput", "ParamAOTInput",
                    "PlainAOTInput", "PlainAOTOutput", "TangentAOTInput")},
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, what = _LAZY[name]
        value = _torch_feature(module, name, what)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fake_tensor_mode() -> Any:
    """A fresh FakeTensorMode (tensors with shapes, dtypes and devices but no storage): the native
    lowering traces a step's graphs on fake tensors of the real device, allocating nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=False)


def dtensor_like(reference: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor holding ``local`` with ``reference``'s mesh, placements, global shape, stride and
    dtype (a parameter's gradient), made without ``from_local``'s checks and autograd node: the
    native step returns one per parameter per step."""
    return DTensor(local, reference._spec, requires_grad=False)


def grads_accumulate_into(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the backward now running accumulates into any of the leaves ``tensors`` (their
    ``AccumulateGrad`` nodes belong to the engine's graph task, ``torch._C._will_engine_execute_node``):
    False under ``torch.autograd.grad`` for other inputs, as ``torch.distributed.pipelining``
    infers its stages' input gradients on the first step. Call it from a ``backward``."""
    from torch.autograd.graph import get_gradient_edge

    return any(torch._C._will_engine_execute_node(get_gradient_edge(t).node) for t in tensors if t.requires_grad)


def bucket_collectives(gm: torch.fx.GraphModule, cap_mb: float) -> None:
    """Merge the all-gathers, reduce-scatters and all-reduces of one process group, reduce op and
    dtype (one key) that do not depend on one another into one collective per bucket of at most
    ``cap_mb`` MB, in graph order, with Inductor's FX bucketing (``torch._inductor.fx_passes.
    bucketing``, what ``bucket_all_gathers_fx`` and friends turn on under ``torch.compile``); then
    restores a topological node order. Each element is gathered or reduced exactly as before.

    Inductor's own passes merge runs of one key only while no collective of another key comes
    between; here each key is bucketed on its own, so the parameters' gathers on a 2-D mesh (axis
    1, then axis 0, parameter after parameter) merge into one bucket per axis. A collective that
    depends on a member of the bucket being filled stays alone (Inductor's check), so a merge
    never makes a cycle; every rank runs the same graph, so the order stays the same on all."""
    from torch._inductor.fx_passes import bucketing
    from torch.fx.passes import tools_common

    def cap(bucket_index: int) -> float:
        return cap_mb

    # per kind: (is a collective of that kind, merge a list of buckets of them)
    passes = {"all_gather": (getattr(bucketing, "is_all_gather_into_tensor", None),
                             getattr(bucketing, "merge_all_gather", None)),
              "reduce_scatter": (getattr(bucketing, "is_reduce_scatter_tensor", None),
                                 getattr(bucketing, "merge_reduce_scatter", None)),
              "all_reduce": (getattr(bucketing, "is_all_reduce_tensor", None), _merge_all_reduce(bucketing))}
    greedy = getattr(bucketing, "greedy_bucket_collective_by_mb", None)
    key_of = getattr(bucketing, "bucket_key", None)
    for kind, (is_kind, merge) in passes.items():
        if merge is None or is_kind is None or greedy is None or key_of is None:
            logger.info("torch %s has no FX bucketing of %s; those collectives are not bucketed", torch.__version__, kind)
            continue
        keys = list(dict.fromkeys(key_of(n) for n in gm.graph.nodes if n.op == "call_function" and is_kind(n)))
        for key in keys:  # one key at a time: the others' collectives do not break its runs
            def of_key(n: torch.fx.Node, key: Any = key, is_kind: Callable[[torch.fx.Node], bool] = is_kind) -> bool:
                return is_kind(n) and key_of(n) == key

            buckets = greedy(gm, cap, of_key, lambda n, key=key: key)
            if buckets:
                merge(gm, buckets)
    # back to a topological order, kept as close to the traced one as the merges allow (where each
    # collective is waited is decided after: apmodel.lowering.native)
    sort = getattr(tools_common, "stable_topological_sort", None) or tools_common.legalize_graph
    sort(gm)
    gm.recompile()


def _merge_all_reduce(bucketing: Any) -> Callable[[torch.fx.GraphModule, list], None] | None:
    """Inductor merges all-reduce buckets one at a time (``merge_all_reduce_bucket``)."""
    merge_one = getattr(bucketing, "merge_all_reduce_bucket", None)
    if merge_one is None:
        return None

    def merge(gm: torch.fx.GraphModule, buckets: list) -> None:
        for bucket in buckets:
            merge_one(gm.graph, bucket)

    return merge


#: dtypes ``torch._grouped_mm`` takes, per device type (torch 2.13): the CPU kernel takes the three
#: floating types; CUDA's grouped kernel (CUTLASS) takes bf16 only (other dtypes go through a
#: loop over the groups), and torch's meta function mirrors CUDA (bf16 only).
_GROUPED_MM_DTYPES = MappingProxyType({"cpu": (torch.float32, torch.bfloat16, torch.float16),
                                       "cuda": (torch.bfloat16,), "meta": (torch.bfloat16,)})
#: CUDA compute capabilities (major) with the grouped kernel: Hopper (9) and Blackwell (10)
_GROUPED_MM_CUDA_MAJORS = (9, 10)
#: row strides ``torch._grouped_mm`` requires to be a multiple of (bytes), every device
_GROUPED_MM_ALIGN_BYTES = 16


def grouped_mm_runs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm(a, b, offs=...)`` (``a [rows, k]``, ``b [groups, k, n]``) runs as
    one grouped kernel here: the release has it, the device and dtype have the kernel (CUDA:
    bf16 on compute capability 9.x / 10.x), and both operands' rows are 16-byte aligned."""
    if getattr(torch, "_grouped_mm", None) is None or a.dtype != b.dtype or a.dim() != 2 or b.dim() != 3:
        return False
    if a.dtype not in _GROUPED_MM_DTYPES.get(a.device.type, ()):
        return False
    if a.device.type == "cuda" and torch.cuda.get_device_capability(a.device)[0] not in _GROUPED_MM_CUDA_MAJORS:
        return False
    return all(t.shape[-1] * t.element_size() % _GROUPED_MM_ALIGN_BYTES == 0 for t in (a, b))


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``: ``a [rows, k]`` whose rows ``offs[i-1]:offs[i]`` (``offs`` int32, the
    groups' cumulative ends) are multiplied by ``b[i]`` (``[groups, k, n]``) -> ``[rows, n]``, one
    kernel (differentiable; check :func:`grouped_mm_runs` first)."""
    op = getattr(torch, "_grouped_mm", None)
    if op is None:
        raise MissingTorchFeature(f"torch {torch.__version__} has no torch._grouped_mm (the grouped GEMM)")
    return op(a.contiguous(), b.contiguous(), offs=offs)


def tracing_graph() -> Any:
    """The FX graph ``make_fx`` is recording into, or None outside a trace."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else mode.tracer.graph


def export_joint(stack: contextlib.ExitStack, module: torch.nn.Module, inputs: tuple, *, functionalize: bool) -> tuple[Any, Any]:
    """The joint forward-backward graph of ``module(*inputs)`` (its ``graph_module`` and the
    output pytree spec), traced by AOTAutograd with input/output descriptors in ``node.meta["desc"]``."""
    export = __getattr__("aot_export_joint_with_descriptors")
    joint = export(stack, module, inputs, disable_functionalization=not functionalize)
    return joint.graph_module, joint.out_spec


#: torch's errors for an op whose output (shape or value) depends on tensor data
_DATA_DEPENDENT_ERRORS = (
    ("torch._subclasses.fake_tensor", "DataDependentOutputException"),
    ("torch._subclasses.fake_tensor", "DynamicOutputShapeException"),
    ("torch.fx.experimental.symbolic_shapes", "GuardOnDataDependentSymNode"),
)


def is_data_dependent_error(e: BaseException) -> bool:
    """True when tracing failed because an op's result depends on tensor values; by class where
    this release defines it, by class name otherwise (a class that moved modules still counts)."""
    for module, name in _DATA_DEPENDENT_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if (isinstance(cls, type) and isinstance(e, cls)) or type(e).__name__ == name:
            return True
    return False


def op_schema(target: object) -> Any:
    """The ``torch._C.FunctionSchema`` of an operator (an OpOverload, a higher-order op), None
    for a plain Python callable."""
    return getattr(target, "_schema", None)


def aliases_first_input(node: torch.fx.Node) -> bool:
    """A view of its first input (``t``, ``view``, ``transpose``, ``_unsafe_view``...), by the
    alias annotation of the op's schema."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.target is torch.ops.aten._unsafe_view.default:  # a view that does not say so in its schema
        return True
    schema = op_schema(node.target)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def overload_packet(op: Any) -> Any:
    """The ``OpOverloadPacket`` an operator overload belongs to (``torch.ops.ns.name``), else None."""
    return getattr(op, "_overloadpacket", None)


def overload_name(op: OpOverload) -> str:
    """``"Tensor"`` for ``aten.add.Tensor``, ``"default"`` for ``aten.mm.default``."""
    return op._overloadname


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


def register_einsum_rule(op: OpOverload, equation_of: Callable[[tuple[int, ...]], str]) -> bool:
    """Give ``op`` DTensor's single-dim einsum rule, the one ``mm`` has (per mesh axis: a free dim
    sharded, a contracted dim sharded on both inputs -> partial, one input partial -> partial), its
    equation ``equation_of(ranks of the tensor arguments)``. A single-dim rule is what the
    split-dimension seeding restricts and what apmodel expands on integer codes. False where this
    torch has no such rule generator (the caller falls back to ``register_sharding``)."""
    try:
        from torch.distributed.tensor._ops._matrix_ops import gen_single_dim_einsum_strategies
        from torch.distributed.tensor._ops.single_dim_strategy import register_single_dim_strategy
    except ImportError:
        return False

    def rule(op: Any, args_schema: Any, kwargs_schema: Any) -> Any:
        ranks = tuple(len(a.shape) for a in args_schema if hasattr(a, "shape"))
        return gen_single_dim_einsum_strategies(equation_of(ranks))

    register_single_dim_strategy(op, allow_unbacked_sharding=True)(rule)
    return True


def has_sharding_rule(op: object) -> bool:
    """True when DTensor can enumerate candidate strategies for ``op`` (an OpOverload)."""
    return rule_kind(op) is not None


# ----------------------------------------------------------------------------------------------
# strategy query


class SpecMemo:
    """DTensorSpecs and torch's shardability answers, shared by the strategy queries on one mesh
    (one enumeration): building a ``DTensorSpec`` costs tens of µs, and the same (tensor,
    placement) recurs across ops and layers. Bound to the first mesh it serves; asked on another
    it builds afresh (the specs carry their mesh)."""

    def __init__(self) -> None:
        self.mesh: DeviceMesh | None = None
        self.mesh_shape: tuple[int, ...] = ()  # read once: a DeviceMesh's shape takes tens of µs
        self._specs: dict[tuple, DTensorSpec] = {}
        self._shardable: dict[tuple, bool] = {}

    def _serves(self, mesh: DeviceMesh) -> bool:
        if self.mesh is None:
            self.mesh, self.mesh_shape = mesh, tuple(mesh.shape)
        return self.mesh is mesh

    def spec(self, mesh: DeviceMesh, placements: PlacementsT, arg: "TensorArg") -> DTensorSpec:
        """``DTensorSpec(mesh, placements, arg.meta())``, shared."""
        if not self._serves(mesh):
            return DTensorSpec(mesh, placements, arg.meta())
        key = (arg.shape, arg.stride, arg.dtype, placements)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = DTensorSpec(mesh, placements, arg.meta())
        return spec

    def shardable(self, mesh: DeviceMesh, placements: PlacementsT, strategy: OpStrategy,
                  allow_unbacked: bool | None) -> bool:
        """torch's ``is_tensor_shardable`` of the tensor ``strategy`` describes, placed ``placements``."""
        shape = tuple(strategy.shape)
        key = (shape, placements, allow_unbacked)
        serves = self._serves(mesh)
        ok = self._shardable.get(key) if serves else None
        if ok is None:
            ok = _static_shardable(shape, placements, self.mesh_shape if serves else tuple(mesh.shape))
            if ok is None:
                ok = bool(_ops_utils.is_tensor_shardable(strategy.shape, DTensorSpec(mesh, placements, strategy.tensor_meta),
                                                         allow_unbacked_sharding=allow_unbacked))
            if serves:
                self._shardable[key] = ok
        return ok


def _static_shardable(shape: tuple, placements: PlacementsT, mesh_shape: tuple[int, ...]) -> bool | None:
    """torch's ``is_tensor_shardable`` where its answer needs no DTensorSpec: integer sizes and
    plain ``Shard`` / ``Replicate`` / ``Partial`` placements (each sharded dim at least as large as
    the product of the mesh axes sharding it so far). None otherwise (symbolic sizes,
    ``_StridedShard``): ask torch."""
    if not all(type(n) is int for n in shape):
        return None
    shards = [1] * len(shape)
    for p, k in zip(placements, mesh_shape, strict=False):
        if type(p) is Shard:  # not a subclass (_StridedShard)
            if p.dim >= len(shape):
                return False
            shards[p.dim] *= k
            if shape[p.dim] < shards[p.dim]:
                return False
        elif type(p) is not Replicate and type(p) is not Partial:
            return None
    return True


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
        strategies = [m for m in mapped if isinstance(m, OpStrategy)]
        if mapped and len(strategies) == len(mapped):
            # a list of tensors: DTensor represents it as a TupleStrategy
            return TupleStrategy(tuple(strategies) if isinstance(obj, tuple) else strategies)
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
    # a copy made in one C call: another thread may import meanwhile (the planner's background
    # warm-up loads numba while strategies are enumerated), and list(sys.modules.items()) can
    # be interrupted mid-iteration by a garbage collection running Python code
    for name, mod in sys.modules.copy().items():
        if mod is not None and name.startswith("torch.distributed.tensor"):
            if getattr(mod, "generate_redistribute_costs", None) is original:
                mod.generate_redistribute_costs = _zero_redistribute_costs  # type: ignore[attr-defined]  # torch's private module, untyped
                patched.append(mod)
    try:
        yield
    finally:
        for mod in patched:
            mod.generate_redistribute_costs = original  # type: ignore[attr-defined]


def _meta_kernels_shadowing_composites() -> list[tuple[OpOverload, Any]]:
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

    found: dict[OpOverload, Any] = {}
    for table in global_decomposition_table.values():
        for op in table:
            if (
                isinstance(op, OpOverload)
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
    dropout, equal head dims, and equal head counts (with ``enable_gqa``: key/value head counts
    equal and dividing the query's, as the CUDA kernel takes grouped-query heads)."""
    tensors = (query, key, value)
    if not (all(isinstance(t, torch.Tensor) and t.device.type == "meta" and t.dim() == 4 for t in tensors)
            and attn_mask is None and not dropout_p
            and query.shape[-1] == key.shape[-1] == value.shape[-1] and key.shape[1] == value.shape[1]):
        return False
    if enable_gqa:
        return key.shape[1] > 0 and query.shape[1] % key.shape[1] == 0
    return query.shape[1] == key.shape[1]


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
        if query.shape[1] != key.shape[1]:  # grouped-query heads: SDPA's repeat_interleave of key/value heads
            groups = query.shape[1] // key.shape[1]
            b, h, s, d = key.shape
            key, value = (t.unsqueeze(2).expand(b, h, groups, s, d).reshape(b, h * groups, s, d) for t in (key, value))
        return flash(query, key, value, 0.0, is_causal, False, scale=scale)[0]
    # torch's own decomposition (the C++ CompositeImplicitAutograd kernel: the math path on meta)
    return torch.ops.aten.scaled_dot_product_attention.default._op_dk(
        DispatchKey.CompositeImplicitAutograd, query, key, value, attn_mask, dropout_p, is_causal,
        scale=scale, enable_gqa=enable_gqa,
    )


@contextlib.contextmanager
def library_sees_tracing() -> Iterator[None]:
    """While inside, ``torch.compiler.is_compiling()`` is True, as during ``torch.compile`` and
    ``torch.export``'s non-strict tracing (which sets the same private flag, ``_is_compiling_flag``).

    Libraries read it to skip value-dependent host checks a trace cannot make (Hugging Face
    transformers' packed-sequence and padding checks call ``.all()`` on a tensor unless it says
    so), and take their trace-safe path instead. apmodel's capture is such a trace. Restored on
    exit; a release without the flag raises :class:`MissingTorchFeature`. Not thread-safe."""
    import torch.compiler as compiler

    if not hasattr(compiler, "_is_compiling_flag"):
        raise MissingTorchFeature(f"torch {torch.__version__} has no torch.compiler._is_compiling_flag "
                                  "(what torch.compiler.is_compiling() reads)")
    previous = compiler._is_compiling_flag
    compiler._is_compiling_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag = previous


def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """``fx.GraphModule(root, graph)`` that generates its Python code on first use (a call,
    ``.code``, printing) instead of at once: torch's ``_LazyGraphModule``. Planning reads only the
    graph, and the code of a joint graph of 9,000 nodes takes a quarter of a second to generate.
    ``root.meta`` is carried over."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    gm = _LazyGraphModule(root, graph)
    gm.meta.update(getattr(root, "meta", {}))
    return gm


def with_children(module: torch.nn.Module, children: dict[str, torch.nn.Module]) -> torch.nn.Module:
    """A shallow copy of ``module`` whose child modules are exactly ``children`` (in that order):
    the same parameters, buffers and attributes otherwise. ``nn.Module`` has no public way to
    replace its children wholesale (``_modules`` is the registry ``add_module`` writes)."""
    import copy

    new = copy.copy(module)
    new._modules = dict(children)
    return new


@contextlib.contextmanager
def causal_mask_detection_off() -> Iterator[None]:
    """While inside, ``nn.TransformerEncoder``/``Decoder`` do not compare a given attention mask with
    a causal one to decide whether to pass ``is_causal`` (``_detect_is_causal_mask`` calls ``bool()``
    on the comparison, which a trace on the meta device cannot answer): only an explicit
    ``is_causal=True`` counts, and the mask itself is applied, which computes the same values.
    Restored on exit; a release without the helper leaves nothing to patch. Not thread-safe."""
    import torch.nn.modules.transformer as transformer

    detect = getattr(transformer, "_detect_is_causal_mask", None)
    if detect is None:
        yield
        return

    def explicit_only(mask: Any, is_causal: bool | None = None, size: int | None = None) -> bool:
        return is_causal is True

    transformer._detect_is_causal_mask = explicit_only
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = detect


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
    op: OpOverload,
    args: tuple,
    kwargs: dict,
    out_val: object,
    mesh: DeviceMesh,
    *,
    with_torch_costs: bool = False,
    memo: SpecMemo | None = None,
) -> list[tuple[tuple[PlacementsT | None, ...], tuple[PlacementsT, ...]]]:
    """Candidate strategies DTensor allows for one call of ``op``.

    ``args``/``kwargs`` are the call's arguments with every tensor replaced by a :class:`TensorArg`
    (global shape + the producer's candidate placements); ``out_val`` is the node's output
    (fake/meta tensor or tuple of them). Returns a list of ``(outputs, inputs)`` where ``outputs``
    has one placement tuple per op output (None for a masked-off/non-tensor output) and ``inputs``
    one per tensor argument, in the flattened order of ``args`` then ``kwargs``.

    ``with_torch_costs=False`` skips torch's own redistribution pricing (see
    :func:`without_redistribute_costs`); the returned strategies are the same either way.
    ``memo`` shares the DTensorSpecs of full-mesh rules' inputs between queries.

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
        return _op_strategies(p, kind, op, args, kwargs, out_meta, mesh, memo if memo is not None else SpecMemo())


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


def _op_strategies(p, kind, op, args, kwargs, out_meta, mesh, memo):
    if kind == "single_dim":
        schema = _single_dim_schema(p, op, args, kwargs, mesh)
        info = p.op_single_dim_strategy_funcs[op]
        fn = _expand_single_dim_strategy_to_mesh(mesh, schema, info, out_meta)
        strat = fn(op, schema.args_meta, schema.kwargs_meta)
    else:
        return _full_mesh_strategies(p, op, args, kwargs, mesh, memo)
    return _single_dim_pairs(op, strat, len(schema.args_strategy) + len(schema.kwargs_strategy))


def _single_dim_pairs(op, strat, n_inputs):
    """torch's expansion of a single-dim rule, less mixed-partial combinations (see :func:`mixed_partials`)."""
    return [(outs, ins) for outs, ins in _to_pairs(op, strat, n_inputs) if not mixed_partials(outs + ins)]


# ----------------------------------------------------------------------------------------------
# single-dim rules, expanded over chosen per-axis combinations only


@dataclass(frozen=True)
class _PreparedRule:
    """One call's single-dim rule with its sharding placeholders filled: the fields apmodel reads
    of torch's ``_PreparedSingleDimStrategy`` (torch 2.13 on; 2.11 has no such class)."""

    num_outputs: int
    expanded_strategies: list[list[Placement | None]]
    allow_unbacked_sharding: bool | None
    allow_uneven_sharding: bool
    remapped_different_mesh_args: list[int] | None
    element_mesh: DeviceMesh | None
    full_mesh_filter: bool  # the rule checks each full-mesh combination further (torch 2.14 on)


def _prepare_single_dim(info: Any, schema: OpSchema, out_meta: Any) -> _PreparedRule:
    """Fill one call's single-dim rule, as torch's own expansion does before taking the product."""
    prepared_cls = getattr(_single_dim, "_PreparedSingleDimStrategy", None)
    if prepared_cls is not None:
        p = prepared_cls(info, schema, out_meta)
        return _PreparedRule(p.num_outputs, p.expanded_strategies, p.allow_unbacked_sharding,
                             p.allow_uneven_sharding, p.remapped_different_mesh_args, p.element_mesh,
                             getattr(p, "full_mesh_strategy_filter", None) is not None)
    # torch 2.11: ``_expand_single_dim_strategy_to_mesh`` fills the rule inline with these
    # helpers (their 2.11 signatures); no uneven sharding, one mesh for every argument.
    if out_meta is None:
        nout = 0
    elif isinstance(out_meta, TensorMeta):
        nout = 1
    else:
        nout = len(out_meta)
    nin = _single_dim._get_num_tensor_inputs(schema)
    rows = info.func(schema.op, schema.args_meta, schema.kwargs_meta)
    rows = _single_dim._insert_single_dim_replication_strategy(rows, nout, nin)
    rows = _single_dim._fill_single_dim_strategy_placeholders(_single_dim._get_unique_placements(schema), rows)
    return _PreparedRule(nout, rows, getattr(info, "allow_unbacked_sharding", None),
                         bool(getattr(info, "allow_uneven_sharding", False)), None, None, False)


def mixed_partials(specs: Sequence[PlacementsT | None]) -> bool:
    """True when one tensor would be partial of different reduce kinds over different mesh axes
    (sum with avg excepted): such a tensor has no well-defined value. torch 2.13 on skips these
    combinations when expanding a single-dim rule; apmodel skips them on every version."""
    for pl in specs:
        if pl is None:
            continue
        kinds = {(type(x), x.reduce_op) for x in pl if is_partial(x)}
        if len(kinds) > 1 and not (len({t for t, _ in kinds}) == 1 and {r for _, r in kinds} == {"sum", "avg"}):
            return True
    return False

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
    variants, multi-mesh arguments, foreach lists, and from torch 2.14 a rule's own
    ``full_mesh_strategy_filter``: mean, argmax/argmin, convolution, grouped mm) are marked
    ``exact = False``: :meth:`expand` then returns torch's full expansion (a superset; the caller
    filters). On torch 2.11 every single-dim rule is exact (no uneven sharding, one mesh).

    ``entries[i]`` is one per-axis rule: a placement (or None) per output, then per tensor input.
    ``expand(all combinations)`` equals :func:`op_strategies` (checked in the tests).
    """

    def __init__(self, op: OpOverload, args: tuple, kwargs: dict, out_val: object, mesh: DeviceMesh,
                 memo: SpecMemo | None = None) -> None:
        p = _propagator()
        if rule_kind(op) != "single_dim":
            raise KeyError(f"{op}: no single-dim DTensor rule")
        self.op, self.mesh = op, mesh
        self.out_meta = output_tensor_meta(out_val)
        self.info = p.op_single_dim_strategy_funcs[op]
        with without_redistribute_costs():
            self.schema = _single_dim_schema(p, op, args, kwargs, mesh)
            prepared = _prepare_single_dim(self.info, self.schema, self.out_meta)
        self.num_outputs: int = prepared.num_outputs
        self.entries: tuple[tuple[Placement | None, ...], ...] = tuple(tuple(e) for e in prepared.expanded_strategies)
        self.allow_unbacked = prepared.allow_unbacked_sharding
        self.allow_uneven = prepared.allow_uneven_sharding
        self.inputs = list(self.schema.args_strategy) + list(self.schema.kwargs_strategy)
        self._shardable: dict[tuple[int, PlacementsT], bool] = {}
        self._memo = memo if memo is not None else SpecMemo()
        base = op.name().split("::")[1].split(".")[0]
        foreach = op.name().startswith(_FOREACH_PREFIXES) and any(isinstance(a, TupleStrategy) for a in self.schema.args_schema)
        self.exact: bool = not (
            base.endswith("_") or self.schema.is_out_variant_op() or foreach
            or prepared.remapped_different_mesh_args is not None
            or (prepared.element_mesh is not None and prepared.element_mesh != mesh)
            or prepared.full_mesh_filter
        )

    def expand(self, combos: Sequence[Sequence[int]]) -> list[tuple[tuple[PlacementsT | None, ...], tuple[PlacementsT, ...]]]:
        """(outputs, inputs) placements of each valid combination (one entry index per mesh axis)."""
        if not self.exact:
            return self._expand_full(combos)
        nout, entries = self.num_outputs, self.entries
        width = len(entries[0]) if entries else 0
        result = []
        for combo in combos:
            rows = [entries[i] for i in combo]
            specs: list[PlacementsT | None] = []
            for pos in range(width):
                # a column's None (a non-tensor slot) is None in every entry
                specs.append(None if rows[0][pos] is None else cast(PlacementsT, tuple(r[pos] for r in rows)))
            if mixed_partials(specs):
                continue
            ins = [pl for pl in specs[nout:] if pl is not None]
            if len(ins) != len(self.inputs):
                raise AssertionError(f"{self.op}: {len(ins)} input placements for {len(self.inputs)} tensor inputs")
            if nout == 1 and specs[0] is None:
                raise RuntimeError(f"{self.op}: output spec is None")
            if not all(self.input_shardable(j, pl) for j, pl in enumerate(ins)):
                continue
            outs: tuple[PlacementsT | None, ...] = tuple(specs[:nout])
            result.append((outs, tuple(ins)))
        return result

    def input_shardable(self, j: int, pl: PlacementsT) -> bool:
        """torch's check of tensor input ``j`` placed ``pl`` (``is_tensor_shardable``, or uneven
        sharding where the rule allows it and ``pl`` is the seed's), memoised per placement."""
        key = (j, pl)
        ok = self._shardable.get(key)
        if ok is None:
            inp = self.inputs[j]
            seed_pl = tuple(inp.strategies[0].output_spec.placements)
            ok = self._shardable[key] = (self._memo.shardable(self.mesh, pl, inp, self.allow_unbacked)
                                         or (self.allow_uneven and seed_pl == pl))
        return ok

    def _expand_full(self, combos):
        """torch's full expansion (a superset of the combinations'; the caller filters)."""
        fn = _expand_single_dim_strategy_to_mesh(self.mesh, self.schema, self.info, self.out_meta)
        with without_redistribute_costs():
            strat = fn(self.op, self.schema.args_meta, self.schema.kwargs_meta)
        return _single_dim_pairs(self.op, strat, len(self.inputs))


def _ask_full_mesh(p, op, args, kwargs, mesh, memo):
    """One call of a full-mesh rule, each tensor argument offered in all of its candidates."""

    def full(a: TensorArg) -> OpStrategy:
        return OpStrategy([OpSpec(memo.spec(mesh, tuple(c), a)) for c in a.candidates])

    schema = OpSchema(op, tuple(_map_args(a, full) for a in args),
                      {k: _map_args(v, full) for k, v in kwargs.items()},
                      schema_info=p.op_to_schema_info.get(op))
    strat = p.op_strategy_funcs[op](schema)
    return _to_pairs(op, strat, len(schema.args_strategy) + len(schema.kwargs_strategy))


#: norm backwards whose full-mesh rule (torch 2.11's ``_common_norm_backward_strategy``; 2.13 on
#: has single-dim rules instead) pairs the k-th candidate of ``input`` with the k-th of ``mean``,
#: ``rstd``, ``weight`` and ``bias`` and keeps those four as given: asked with independent candidate
#: lists it offers invalid pairs (a sharded weight with a replicated input fails when run:
#: "Expected weight to be of same shape as normalized_shape"). Positions in the argument list:
#: (statistics, affine parameters).
_INDEX_PAIRED_NORM_BACKWARD: dict[Any, tuple[tuple[int, ...], tuple[int, ...]]] = {
    torch.ops.aten.native_layer_norm_backward.default: ((3, 4), (5, 6)),  # grad, x, shape, mean, rstd, w, b, mask
    torch.ops.aten._fused_rms_norm_backward.default: ((3,), (4,)),  # grad, x, shape, rstd, w, mask
}


def _norm_backward_paired(p, op, args, kwargs, mesh, memo):
    """Ask an index-pairing norm-backward rule with partners aligned to each ``input`` candidate:
    the statistics in the placement the rule gives ``input`` (the forward emits them so), the
    affine parameters replicated (the forward rule requires it). Two calls: the first, with
    everything but ``input`` replicated, tells the rule's placement of ``input`` per candidate."""
    stats, params = _INDEX_PAIRED_NORM_BACKWARD[op]
    n = len(args[1].candidates)
    replicated = [(Replicate(),) * mesh.ndim] * n

    def aligned(per_position: dict[int, Sequence[PlacementsT]]) -> tuple:
        out = list(args)
        for i, per_candidate in per_position.items():
            if i < len(out) and isinstance(out[i], TensorArg):
                a = out[i]
                out[i] = TensorArg(a.shape, a.stride, a.dtype, tuple(per_candidate))
        return tuple(out)

    first = _ask_full_mesh(p, op, aligned({i: replicated for i in stats + params}), kwargs, mesh, memo)
    if len(first) != n:
        raise RuntimeError(f"{op}: rule gave {len(first)} strategies for {n} input candidates")
    x_targets = [ins[1] for _, ins in first]  # tensor inputs: grad_out, input, ...
    second = aligned({**{i: x_targets for i in stats}, **{i: replicated for i in params}})
    return list(dict.fromkeys(_ask_full_mesh(p, op, second, kwargs, mesh, memo)))


def _full_mesh_strategies(p, op, args, kwargs, mesh, memo):
    """Ask a full-mesh rule, given every candidate placement of every tensor input.

    Some rules raise when ANY candidate is unusable (e.g. view: "Cannot unflatten unevenly sharded
    tensor") instead of skipping it. Then the candidate set of the input with the most candidates
    is halved and each half asked separately (union of the answers); a single candidate that still
    fails is dropped. If every candidate fails, the first error is raised.
    """

    if op in _INDEX_PAIRED_NORM_BACKWARD:
        return _norm_backward_paired(p, op, args, kwargs, mesh, memo)

    def ask(a_args, a_kwargs):
        return _ask_full_mesh(p, op, a_args, a_kwargs, mesh, memo)

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
            swap = lambda a, narrowed=narrowed: narrowed if a is widest else a  # noqa: E731
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


@contextlib.contextmanager
def flex_attention_routed(route: Callable[..., torch.Tensor]) -> Iterator[None]:
    """While inside, ``torch.nn.attention.flex_attention.flex_attention`` (however a model
    imported it) checks its arguments as usual, then returns ``route(query, key, value,
    score_mod=, mask_mod=, mask_shape=(B, H, q_len, kv_len), scale=)`` instead of running its
    higher-order op: ``score_mod`` None for none, ``mask_mod`` None for none, ``B``/``H`` the block
    mask's batch and head sizes (1 where it broadcasts).

    Three module globals of ``torch.nn.attention.flex_attention`` are swapped, restored on exit:
    ``_validate_device`` (it refuses meta tensors, and CPU tensors that need a gradient: ``route``
    brings its own kernels), ``flex_attention_hop`` (the higher-order op the function calls last),
    and ``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`` (else the op is called through ``torch.compile``).
    A logsumexp asked for (``return_lse``, ``return_aux``) comes back None. Not thread-safe."""
    import torch.nn.attention.flex_attention as flex

    names = ("_validate_device", "flex_attention_hop", "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", "_identity")
    missing = [n for n in names if not hasattr(flex, n)]
    if missing:
        raise MissingTorchFeature(f"torch {torch.__version__}: torch.nn.attention.flex_attention has no "
                                  f"{', '.join(missing)} (what apmodel swaps to capture flex_attention)")
    identity = flex._identity

    def hop(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Any, block_mask: tuple,
            scale: float, kernel_options: Any, *rest: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # block_mask is BlockMask.as_tuple(): (q_len, kv_len, kv_num_blocks [B, H, ...], ..., mask_mod)
        q_len, kv_len, kv_num_blocks, mask_mod = block_mask[0], block_mask[1], block_mask[2], block_mask[-1]
        noop = getattr(flex, "noop_mask", None)
        out = route(query, key, value, score_mod=None if score_mod is identity else score_mod,
                    mask_mod=None if mask_mod is noop else mask_mod,
                    mask_shape=(int(kv_num_blocks.shape[0]), int(kv_num_blocks.shape[1]), int(q_len), int(kv_len)),
                    scale=float(scale))
        return out, out.new_empty(0), out.new_empty(0)

    saved = {n: getattr(flex, n) for n in names[:3]}
    swapped: dict[str, Any] = {"_validate_device": lambda *args: None,
                               "flex_attention_hop": hop,  # a plain function where torch has its op object
                               "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG": True}
    for name, value in swapped.items():
        setattr(flex, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(flex, name, value)


@contextlib.contextmanager
def autocast_skips_meta() -> Iterator[None]:
    """While inside, ``torch.autocast(device_type="meta", ...)`` is a context that does nothing
    instead of an error (``unsupported autocast device_type 'meta'``): models that open autocast on
    their tensors' device (torchtitan's MoE router, in fp32) trace on meta, their ops at the dtypes
    of their tensors. Other device types autocast as before; code that bound ``torch.autocast``
    under another name at import is not reached. Restored on exit. Not thread-safe."""
    autocast = torch.autocast

    class MetaAutocast(autocast):  # type: ignore[misc, valid-type]  # torch.autocast is a class
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            self._meta = device_type == "meta"
            if not self._meta:
                super().__init__(device_type, *args, **kwargs)

        def __enter__(self) -> Any:
            return None if self._meta else super().__enter__()

        def __exit__(self, *exc: Any) -> Any:
            return None if self._meta else super().__exit__(*exc)

    torch.autocast = MetaAutocast  # type: ignore[misc]
    try:
        yield
    finally:
        torch.autocast = autocast  # type: ignore[misc]
