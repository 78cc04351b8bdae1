"""The interpreter: a plan's joint graph prepared for one mesh and run node by node over DTensors.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, cast

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from apmodel._torch_private import OpOverload, has_sharding_rule, tracing_graph
from apmodel.core import placements
from apmodel.core.kernels import local_kernels as default_local_kernels
from apmodel.core.options import run_precision_of, torch_dtype
from apmodel.graph.regions import RegionComm, RegionError, is_backward, region_of, region_scope, traced_outputs
from apmodel.lowering.graph import (
    Placements,
    all_replicated,
    check_even,
    comm_free,
    flatten_args,
    format_placements,
    node_strategy_of,
    placement_tokens,
    shard_ways,
    tensor_leaves,
    tensor_vals,
    unflatten_args,
)
from apmodel.lowering.modes import ModelModes
from apmodel.lowering.records import Redistribution

logger = logging.getLogger(__name__)


@dataclass
class _Slot:
    leaf: int  # position in the flattened (args, kwargs) of the node
    producer: fx.Node
    index: int  # output index of producer (getitem index), else 0
    dst: Placements | None
    gradient: bool = False  # a parameter gradient on its way to the parameter (reduced in the reduce dtype)


@dataclass
class _Step:
    node: fx.Node
    target: Callable
    spec: Any  # structure of (args, kwargs), see flatten_args
    leaves: list  # constants, _Ref(node) or _DEVICE markers
    slots: list[_Slot]
    outputs: tuple  # planned output placements (one per tensor output, None for non-tensors)
    is_getitem: bool
    is_factory: bool
    without_rule: bool = False  # no DTensor rule: planned replicated, run on the local (= global) tensors
    fill: float | int | bool | None = None  # a fill of the output's shape (new_zeros, ones_like, ...): its value
    region_comms: dict[str, RegionComm] | None = None  # a local_map region: its alternatives' ranks
    last_use: list[fx.Node] = field(default_factory=list)  # values to free after this step


_DEVICE = object()  # marks a device argument (traced as meta), replaced by the runtime device

_aten = torch.ops.aten
#: Ops whose output is one value over a shape, whatever their inputs hold -> where the value is
#: (a constant, or the position of the fill argument). DTensor's rules offer several free output
#: placements for them and pick one at run time; lowering builds the output at the planned one.
_FILL_OPS: dict[Any, tuple[str, Any]] = {
    _aten.new_zeros.default: ("const", 0), _aten.new_ones.default: ("const", 1),
    _aten.new_empty.default: ("const", 0), _aten.new_empty_strided.default: ("const", 0),
    _aten.new_full.default: ("arg", 2), _aten.zeros_like.default: ("const", 0),
    _aten.ones_like.default: ("const", 1), _aten.empty_like.default: ("const", 0),
    _aten.full_like.default: ("arg", 1),
}


def _fill_value(n: fx.Node) -> float | int | bool | None:
    """The value a fill op writes (empty ones: 0, any value is right), None for other ops."""
    how = _FILL_OPS.get(n.target)
    if how is None:
        return None
    kind, where = how
    if kind == "const":
        return where
    value = n.args[where] if len(n.args) > where else n.kwargs.get("fill_value")
    return value if isinstance(value, (bool, int, float)) else None


@dataclass(frozen=True)
class _Ref:
    """Marks an argument that is the value of another graph node."""

    node: fx.Node

# Views whose local input may have lost the traced memory layout after a redistribution.
_VIEW_OPS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})
#: What a view refused for its input's memory layout says (eager kernels / fake tensors).
_VIEW_LAYOUT_ERRORS = ("view size is not compatible", "Cannot view a tensor with shape")


def _plain_partials(x: DTensor) -> DTensor:
    """Turn DTensor's masked partials (embedding over a vocabulary-sharded table: each rank holds
    rows looked up with out-of-range ids that must be zeroed before the sum) into plain partial
    sums by applying the mask now, locally. The masked placement carries one-shot state (the mask is
    released after its first reduction), so a value redistributed twice (two consumers, or forward
    and backward) would otherwise fail."""
    if not any(hasattr(p, "mask_buffer") for p in x.placements):
        return x
    local = x.to_local().clone()
    new: list[Placement] = []
    for axis, p in enumerate(x.placements):
        if isinstance(p, Partial) and hasattr(p, "mask_buffer"):  # torch's masked partial is a Partial
            if p.mask_buffer.data is None and x.device_mesh.size(axis) == 1:
                # DTensor skips size-1 axes when it partitions the ids, so no mask was made; the one
                # rank of the axis holds every row, so there is nothing to mask
                new.append(Partial(p.reduce_op))
                continue
            if p.mask_buffer.data is None:
                raise RuntimeError("masked partial value without its mask (already reduced?)")
            p.mask_buffer.apply_mask(local)
            # consumed, as DTensor's own reduction would release it: a mask left behind stays in
            # DTensor's cached strategy and breaks the next trace ("Mixing fake modes NYI")
            p.mask_buffer.release_mask()
            new.append(Partial(p.reduce_op))
        else:
            new.append(p)
    return DTensor.from_local(local, x.device_mesh, new, run_check=False, shape=x.shape, stride=x.stride())


def _tag_traced_nodes(name: str) -> None:
    """While the native program is traced: mark the graph nodes recorded since the last mark as
    made for joint-graph node ``name`` (a failure at run time is reported against it)."""
    graph = tracing_graph()
    if graph is None:
        return
    for node in reversed(graph.nodes):
        if "apmodel_node" in node.meta:
            break
        node.meta["apmodel_node"] = name


def _run_region(target: Callable, comms: dict[str, RegionComm], *args: Any,
                local_outputs: Sequence[tuple[tuple[int, ...], torch.dtype]] | None = None) -> Any:
    """A local_map region's operator on local shards, with its alternatives' ranks in scope
    (``local_outputs``: while tracing, its outputs' local shapes and dtypes)."""
    with region_scope(comms), traced_outputs(local_outputs) if local_outputs is not None else contextlib.nullcontext():
        return target(*args)


def _contiguous(x: Any) -> Any:
    """`x` with a contiguous local tensor (DTensor's own ``contiguous`` looks at the global strides,
    which may claim contiguity the local shard lacks)."""
    if isinstance(x, DTensor) and not x.to_local().is_contiguous():
        return x.clone(memory_format=torch.contiguous_format)
    return x


def _glob_literal(name: str) -> str:
    """``name`` as a glob pattern matching itself only."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


# ----------------------------------------------------------------------------------------------
# the lowered program
# ----------------------------------------------------------------------------------------------


class LoweredProgram:
    """The joint graph, prepared for execution on `mesh` under `plan`. Held by the parallel module
    (attribute ``_apmodel_program``); ``redistributions`` lists what the last step issued."""

    def __init__(self, mesh: DeviceMesh, plan: Any, captured: Any,
                 local_kernels: Callable[[torch.device], dict] = default_local_kernels,
                 region_groups: dict | None = None, lowering: str = "native", bucket_mb: float | None = None,
                 inflight_mb: float | None = None):
        self.mesh = mesh
        self.lowering = lowering
        """"native" or "interpret" (see :func:`apmodel.lowering.lower`)"""
        self.bucket_mb = bucket_mb
        """native: bucket size of runs of collectives, MB (see :func:`apmodel.lowering.lower`)"""
        self.inflight_mb = inflight_mb
        """native: collectives overlapped with computation, at most this many MB in flight; None: each
        waited as it is issued (see :func:`apmodel.lowering.lower`)"""
        self.defer_grad_reduction = False
        """native: gradients left unreduced by each backward, summed, and reduced once by
        :func:`apmodel.lowering.reduce_gradients` (a pipeline stage; see :class:`apmodel.lowering.native.NativeProgram`)"""
        self.keep_gathered = False
        """native, with ``defer_grad_reduction``: the parameters' gathers run once until
        :func:`apmodel.lowering.release_kept` (see :class:`apmodel.lowering.native.NativeProgram`)"""
        self.owners: Any = None
        """(module, attribute) of each parameter and buffer in the user's module, once looked up"""
        self.native: Any = None
        """the native program of these shapes (:class:`apmodel.lowering.native.NativeProgram`), once traced"""
        self.region_groups: dict[tuple[int, ...], tuple[Any, int]] = {} if region_groups is None else region_groups
        """mesh axes -> (process group over them holding this rank, its rank there), for regions"""
        self.local_kernels = local_kernels
        self.plan = plan
        self.captured = captured
        self._read_graph(captured)
        self.param_dtype: torch.dtype | None = None
        """mixed precision: floating parameters are cast to this dtype for compute (None: as stored)"""
        self.reduce_dtype: torch.dtype | None = None
        """mixed precision: parameter gradients are cast to this dtype before they are reduced"""
        self._apply_run_precision(plan)
        mesh_shape = tuple(mesh.shape)
        self.storage: dict[fx.Node, Placements] = self._storage_placements(plan, mesh_shape)
        """storage placements of the placeholders (parameters: R or S(d)), checked against the plan"""
        self.fwd_steps: list[_Step] = []
        self.bwd_steps: list[_Step] = []
        chain = captured.param_gradient_chain()
        for n in captured.gm.graph.nodes:
            if n.op == "call_function":
                step = self._step(n, node_strategy_of(plan, n), chain, mesh_shape)
                (self.bwd_steps if captured.is_backward.get(n.name, False) else self.fwd_steps).append(step)
        for n in self.storage:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                check_even(n.name, v.shape, self.storage[n], mesh_shape)
        self.saved: list[fx.Node] = self._saved_and_freed()
        """the values the backward reads from the forward"""
        self.redistributions: list[Redistribution] = []
        self.new_buffer_values: dict[str, torch.Tensor] = {}
        """buffer FQN -> its value after the last forward (global, replicated), to write back"""
        self.retrace_model: nn.Module | None = None
        """a meta copy of the user's model, to trace the step again for other input shapes"""
        self.training_modes: ModelModes | None = None
        """the model's modes when the step was captured (None: not known; taken as unchanged)"""
        self.replan: Callable[[Any, Sequence[Any]], Any] | None = None
        """``replan(captured, constraints)``: a plan for a graph of another structure (the model in
        eval mode), made under the plan's options; None: such a graph is refused"""
        self.variants: dict[tuple, LoweredProgram] = {}
        """the plan replayed on other input shapes or module modes, by (shapes, modes)"""
        self._kernels: dict[torch.device, dict] = {}

    def _read_graph(self, captured: Any) -> None:
        """The graph's placeholders by role, its forward outputs and their tangents, and the
        gradient and buffer-update nodes, as nodes."""
        gm: fx.GraphModule = captured.gm
        roles = captured.roles
        self.placeholders: list[fx.Node] = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.params = [n for n in self.placeholders if roles.get(n.name) == "param"]
        self.buffers = [n for n in self.placeholders if roles.get(n.name) == "buffer"]
        self.inputs = sorted(
            (n for n in self.placeholders if roles.get(n.name) == "input"),
            key=lambda n: captured.input_index[n.name],
        )
        self.tangents = [n for n in self.placeholders if roles.get(n.name) == "tangent"]
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        out_args = [a for a in flatten_args(out_node.args[0])[0] if isinstance(a, fx.Node)]
        self.fwd_outputs = [a for a in out_args if roles.get(a.name) == "output"]
        self.output_tangent = {
            o: next(t for t in self.tangents if t.name == captured.output_tangent[o.name])
            for o in self.fwd_outputs
            if o.name in captured.output_tangent
        }
        by_name = {n.name: n for n in gm.graph.nodes}
        self.param_grad = {p: by_name[captured.param_grad[p.name]] for p in self.params if p.name in captured.param_grad}
        self.input_grad = {by_name[i]: by_name[g] for i, g in captured.input_grad.items()}
        self.buffer_update = {by_name[b]: by_name[u] for b, u in captured.buffer_update.items()}
        self.signature = captured.signature

    def _apply_run_precision(self, plan: Any) -> None:
        """Mixed precision as the plan's workload records it: the compute and reduce dtypes, the
        graph's floating parameters checked to be traced in the compute dtype."""
        precision = run_precision_of(getattr(plan, "workload", None) or {})
        if precision is not None:
            self.param_dtype, self.reduce_dtype = (torch_dtype(name) for name in precision)
            traced = {n.meta["val"].dtype for n in self.params if n.meta["val"].is_floating_point()}
            if traced - {self.param_dtype}:
                raise ValueError(
                    f"the plan runs in mixed precision ({precision[0]} compute, {precision[1]} reductions) but its "
                    f"graph has {sorted(map(str, traced))} parameters: capture with param_dtype={self.param_dtype}"
                )

    def _storage_placements(self, plan: Any, mesh_shape: tuple[int, ...]) -> dict[fx.Node, Placements]:
        """The storage placements of params (must be R/S), buffers, inputs and tangents, checked
        against the node strategy and the plan's parameter placements."""
        storage: dict[fx.Node, Placements] = {}
        for n in self.params + self.buffers + self.inputs + self.tangents:
            strat = node_strategy_of(plan, n)
            pl = tuple(strat.outputs[0])
            if len(pl) != len(mesh_shape):
                raise ValueError(f"placement {format_placements(pl)} of {n.name!r} has {len(pl)} entries, mesh has {len(mesh_shape)} axes")
            if n in self.params:
                fqn = self.captured.param_fqn[n.name]
                planned = plan.param_placements.get(fqn) if hasattr(plan, "param_placements") else None
                if planned is not None and placement_tokens(planned) != placement_tokens(pl):
                    raise ValueError(
                        f"plan stores parameter {fqn!r} as {format_placements(planned)} but its graph node "
                        f"{n.name!r} is planned as {format_placements(pl)}"
                    )
                if any(isinstance(p, Partial) for p in pl):
                    raise ValueError(f"plan stores parameter {fqn!r} as partial ({format_placements(pl)}); storage must be R or S(d)")
            storage[n] = pl
        return storage

    def _step(self, n: fx.Node, strat: Any, chain: frozenset[str], mesh_shape: tuple[int, ...]) -> _Step:
        """The step that runs ``n`` under its planned strategy ``strat``: its arguments as leaves
        and input slots, the placements checked against the node's tensors and the mesh (an op
        without a DTensor rule kept replicated), a region's process groups made."""
        flat, spec = flatten_args((n.args, n.kwargs))
        leaves: list = []
        for a in flat:
            if isinstance(a, fx.Node):
                leaves.append(_Ref(a))
            elif isinstance(a, torch.device):
                leaves.append(_DEVICE)
            else:
                leaves.append(a)
        tl = tensor_leaves(n)
        ins = tuple(strat.inputs) if strat.inputs is not None else ()
        if len(ins) != len(tl):
            raise ValueError(
                f"plan strategy for node {n.name!r} ({n.target}) has {len(ins)} input placements, "
                f"the node has {len(tl)} tensor arguments"
            )
        is_getitem = n.target is operator.getitem
        slots = [_Slot(leaf, prod, k, None if dst is None else tuple(dst), gradient=prod.name in chain and n.name in chain)
                 for (leaf, prod, k), dst in zip(tl, ins, strict=True)]
        outs = tuple(None if o is None else tuple(o) for o in strat.outputs)
        for v, out_pl in zip(tensor_vals(n), outs, strict=False):
            if isinstance(v, torch.Tensor) and out_pl is not None:
                check_even(n.name, v.shape, out_pl, mesh_shape)
        for s in slots:
            if s.dst is not None:
                pv = tensor_vals(s.producer)[s.index]
                if isinstance(pv, torch.Tensor):
                    check_even(f"{s.producer.name} (as input of {n.name})", pv.shape, s.dst, mesh_shape)
        without_rule = isinstance(n.target, OpOverload) and not has_sharding_rule(n.target)
        if without_rule and not all(all_replicated(p) for p in [*(sl.dst for sl in slots), *outs] if p is not None):
            raise ValueError(f"node {n.name!r} ({n.target}) has no DTensor rule; the plan must keep it replicated")
        step = _Step(n, cast(Callable, n.target), spec, leaves, slots, outs, is_getitem, is_factory=not tl, without_rule=without_rule,
                     fill=_fill_value(n))
        region = region_of(n.target)
        if region is not None:
            try:
                modes = region.alternative_on_axes(ins, backward=is_backward(n.target))
            except RegionError as e:
                raise ValueError(f"node {n.name!r}: {e}") from None
            step.region_comms = self._region_comms(modes)
        return step

    def _saved_and_freed(self) -> list[fx.Node]:
        """The values the backward reads from the forward (returned), and where each step frees
        the values it reads last."""
        fwd_set = set(self.placeholders) - set(self.tangents) | {s.node for s in self.fwd_steps}
        saved: list[fx.Node] = []
        seen = set()
        for bwd_step in self.bwd_steps:
            for a in bwd_step.node.all_input_nodes:
                if a in fwd_set and a not in seen:
                    seen.add(a)
                    saved.append(a)
        for o in list(self.fwd_outputs) + list(self.buffer_update.values()):
            seen.add(o)
        for _, g in list(self.param_grad.items()) + list(self.input_grad.items()):
            if g in fwd_set:  # gradient computed without the tangent (rare); keep it
                seen.add(g)
                saved.append(g)
        self._plan_frees(self.fwd_steps, keep=seen)
        self._plan_frees(self.bwd_steps, keep=set(self.param_grad.values()) | set(self.input_grad.values()))
        return saved

    def _region_comms(self, modes: Sequence[str | None]) -> dict[str, RegionComm]:
        """Alternative name -> the ranks it spans here, for a region planned as ``modes`` (one
        alternative or None per mesh axis)."""
        comms = {}
        for name in sorted({m for m in modes if m is not None}):
            axes = tuple(i for i, m in enumerate(modes) if m == name)
            group, rank = self._group_over(axes)
            comms[name] = RegionComm(size=math.prod(self.mesh.shape[a] for a in axes), rank=rank, axes=axes, group=group)
        return comms

    def _group_over(self, axes: tuple[int, ...]) -> tuple[Any, int]:
        """The process group of the ranks that differ from this one only on ``axes``, ordered as
        the shards of a tensor sharded on those axes (outer axis first), and this rank's place.
        Every rank builds the same programs in the same order, so groups are made collectively."""
        if axes in self.region_groups:
            return self.region_groups[axes]
        import torch.distributed as dist

        if len(axes) == 1:
            group, rank = self.mesh.get_group(axes[0]), self.mesh.get_local_rank(axes[0])
        else:
            ranks = self.mesh.mesh
            keep = [a for a in range(ranks.dim()) if a not in axes]
            lists = ranks.permute(*keep, *axes).reshape(-1, math.prod(ranks.shape[a] for a in axes)).tolist()
            group, _ = dist.new_subgroups_by_enumeration(lists)
            me = dist.get_rank()
            rank = next(row.index(me) for row in lists if me in row)
        if dist.get_rank(group) != rank:
            raise ValueError(f"mesh axes {axes}: process group ranks are not in the mesh's shard order "
                             f"(rank {dist.get_rank()} is {dist.get_rank(group)} in the group, shard {rank}); "
                             "local_map regions need a mesh whose ranks increase along every axis")
        self.region_groups[axes] = (group, rank)
        return group, rank

    @staticmethod
    def _plan_frees(steps: list[_Step], keep: set) -> None:
        last: dict[fx.Node, int] = {}
        for i, s in enumerate(steps):
            for a in s.node.all_input_nodes:
                last[a] = i
        for a, i in last.items():
            if a not in keep:
                steps[i].last_use.append(a)

    # -------------------------------------------------------------------------------------------

    def for_inputs(self, inputs: Sequence[Any], modes: ModelModes | None = None) -> "LoweredProgram":
        """This program, or the plan replayed on the shapes of ``inputs`` and the model's ``modes``
        (None: as captured), traced once per (shapes, modes).

        Same dtypes are required. A new batch (or sequence) size re-traces the step on the meta
        device, checks that the graph has the plan's structure (same nodes and ops) and lowers the
        plan's node strategies on it; a size the plan's shardings cannot divide raises a
        ValueError naming the input, the node and the mesh axes. Modules switched to eval mode
        (BatchNorm on running statistics, dropout off) and parameters frozen or unfrozen since
        planning trace to another graph: that graph is planned (:attr:`replan`) with every
        parameter kept where it is stored."""
        sig = self.signature
        shapes = []
        for i, (node, x) in enumerate(zip(self.inputs, inputs, strict=False)):
            want = node.meta["val"]
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {sig.name(i)} must be a tensor, got {type(x).__name__}")
            if x.dtype != want.dtype or x.dim() != want.dim():
                raise ValueError(
                    f"input {sig.name(i)} has shape {tuple(x.shape)} and dtype {x.dtype}; the plan was made for "
                    f"shape {tuple(want.shape)} and dtype {want.dtype} (re-plan for another dtype or rank)"
                )
            shapes.append(tuple(x.shape))
        if modes is None or modes == self.training_modes:
            modes = None
        key = (tuple(shapes), modes)
        if modes is None and all(s == tuple(n.meta["val"].shape) for s, n in zip(shapes, self.inputs, strict=True)):
            return self
        variant = self.variants.get(key)
        if variant is None:
            variant = self.variants[key] = self._replay_on(inputs, modes)
        return variant

    def _replay_on(self, inputs: Sequence[Any], modes: ModelModes | None) -> "LoweredProgram":
        from apmodel.graph.capture import capture
        from apmodel.graph.checkpointing import checkpoint, policy_of
        from apmodel.result.plans import PlanMismatch, structure_fingerprint

        if self.retrace_model is None:
            raise ValueError("this program cannot be traced again (made without lower()); re-plan for new shapes")
        sig = self.signature
        shapes = ", ".join(f"{sig.name(i)} {tuple(x.shape)}" for i, x in enumerate(inputs))
        where = f"input shapes {shapes}"
        if modes is not None:
            where += f" with {modes.describe(self.retrace_model, self.training_modes)}"
        self._check_divisible(inputs)
        args, kwargs, targets = sig.split([torch.empty(x.shape, dtype=x.dtype, device="meta") for x in inputs])
        try:
            # the step's graph has its backward even when called under no_grad (evaluation), so
            # that it is the plan's graph; a forward-only call runs only the forward part of it
            with torch.enable_grad(), modes.applied(self.retrace_model) if modes else contextlib.nullcontext():
                captured = capture(self.retrace_model, args, kwargs=kwargs, targets=targets,
                                   **self.captured.trace_options)
        except Exception as e:  # the user's model rejects these shapes (mismatched batch, too long, ...)
            raise ValueError(f"the step cannot be traced at {where}: {type(e).__name__}: {e}") from e
        captured = checkpoint(captured, policy_of(self.captured))  # the plan's activation checkpointing
        if structure_fingerprint(captured) == structure_fingerprint(self.captured):
            plan = copy.copy(self.plan)
            plan.fingerprint = captured.fingerprint
        elif modes is None:
            raise PlanMismatch(f"at {where} the model traces to another graph; re-plan for these shapes")
        elif self.replan is None:
            raise PlanMismatch(
                f"at {where} the model traces to another graph than the planned step, and this program "
                "was lowered without a way to plan it (apmodel.lowering.lower(..., replan=None)): use "
                "apmodel.parallelize, which plans it, or keep the model in the mode it was planned in")
        else:
            logger.info("planning the step at %s (another graph than the training step's)", where)
            plan = self.replan(captured, self._storage_pins())
        try:
            variant = LoweredProgram(self.mesh, plan, captured, self.local_kernels, self.region_groups, self.lowering,
                                     self.bucket_mb, self.inflight_mb)
        except ValueError as e:
            raise ValueError(f"the plan cannot run at {where}: {e}") from None
        variant.training_modes = modes
        variant.defer_grad_reduction = self.defer_grad_reduction
        variant.keep_gathered = self.keep_gathered
        logger.info("replayed the plan at %s", where)
        return variant

    def _check_divisible(self, inputs: Sequence[torch.Tensor]) -> None:
        """Refuse inputs the plan's input placements cannot split evenly, saying how to pad."""
        mesh_shape = tuple(self.mesh.shape)
        for i, (node, x) in enumerate(zip(self.inputs, inputs, strict=True)):
            for d, size in enumerate(x.shape):
                ways = shard_ways(self.storage[node], mesh_shape, d)
                if size % ways:
                    name = self.signature.name(i)
                    raise ValueError(
                        f"input {name} has size {size} in dim {d}, which the plan splits {ways} ways "
                        f"({format_placements(self.storage[node])} on mesh {mesh_shape}): pad it to {-(-size // ways) * ways} "
                        f"(and mask the padding out of the loss), or drop the last partial batch "
                        f"(DataLoader(..., drop_last=True))")

    def _storage_pins(self) -> list[Any]:
        """Constraints keeping every parameter at its storage placement (a plan for another graph
        of the same model runs on the parameters as they are stored)."""
        from apmodel.problem.constraints import fix

        pins = []
        for n in self.params:
            fqn = self.captured.param_fqn[n.name]
            pins.append(fix(_glob_literal(fqn), format_placements(self.storage[n]), name=f"parameter {fqn} stored as {format_placements(self.storage[n])}"))
        return pins

    def _redistribute(self, x: DTensor, dst: Placements, consumer: str, producer: str, index: int, phase: str,
                      gradient: bool = False) -> DTensor:
        """`x` moved to `dst` (recorded); ``gradient``: a parameter gradient, cast to the reduce
        dtype first under mixed precision (the cast is local and happens only when it moves)."""
        if not isinstance(x, DTensor):
            raise TypeError(f"argument {producer!r} of node {consumer!r} is a {type(x).__name__}, expected a DTensor")
        if placement_tokens(x.placements) == placement_tokens(dst):
            return x
        if gradient and self.reduce_dtype is not None and x.is_floating_point():
            x = x.to(self.reduce_dtype)  # type: ignore[assignment]  # a DTensor's to() is a DTensor; torch's stub says Tensor
        self.redistributions.append(
            Redistribution(consumer, producer, index, phase, placement_tokens(x.placements), placement_tokens(dst), tuple(x.shape), x.dtype,
                           gradient=gradient)
        )
        return x.redistribute(self.mesh, dst)

    def _run(self, steps: list[_Step], env: dict, phase: str, device: torch.device,
             regions: list | None = None) -> None:
        """Run ``steps`` over DTensors in ``env``; ``regions`` (when tracing the native program)
        collects (operator, ranks, node name) of each region step, in order."""
        kernels = self._kernels.get(device)
        if kernels is None:
            kernels = self._kernels[device] = self.local_kernels(device)
        for s in steps:
            n = s.node
            flat = []
            for leaf in s.leaves:
                if type(leaf) is _Ref:
                    flat.append(env[leaf.node])
                elif leaf is _DEVICE:
                    flat.append(device)
                else:
                    flat.append(leaf)
            if s.fill is not None:
                env[n] = self._fill(s, device)
            elif s.is_getitem:
                slot = s.slots[0] if s.slots else None
                val = flat[0][flat[1]]
                if slot is not None and slot.dst is not None and isinstance(val, DTensor):
                    val = self._redistribute(val, slot.dst, n.name, slot.producer.name, slot.index, phase, slot.gradient)
                env[n] = val
            else:
                for slot in s.slots:
                    if slot.dst is not None:
                        flat[slot.leaf] = self._redistribute(flat[slot.leaf], slot.dst, n.name, slot.producer.name,
                                                             slot.index, phase, slot.gradient)
                kernel = kernels.get(s.target, s.target if s.without_rule else None)
                if s.region_comms is not None:
                    if regions is not None:  # traced as one call, its outputs shaped by the plan
                        regions.append((s.target, s.region_comms, n.name))
                    kernel = functools.partial(_run_region, s.target, s.region_comms,
                                               local_outputs=None if regions is None else self._local_outputs(s))
                try:
                    if kernel is not None:
                        out = self._run_local(s, kernel, flat)
                    else:
                        args, kwargs = unflatten_args(flat, s.spec)
                        try:
                            out = s.target(*args, **kwargs)
                        except (RuntimeError, ValueError) as e:  # eager says the first, fake tensors the second
                            if s.target not in _VIEW_OPS or not any(m in str(e) for m in _VIEW_LAYOUT_ERRORS):
                                raise
                            # The traced graph relied on a producer's memory layout (e.g. attention
                            # output laid out [b, s, h, d]) that a redistribution does not keep:
                            # functional graph, so a copy is as good as a view here (local, no comm).
                            args, kwargs = unflatten_args([_contiguous(x) for x in flat], s.spec)
                            out = s.target(*args, **kwargs)
                except Exception as e:
                    raise RuntimeError(
                        f"DTensor failed to run node {n.name!r} ({s.target}) with input placements "
                        f"{[format_placements(sl.dst) for sl in s.slots]}: {type(e).__name__}: {e}{self._mixed_dtypes_hint(flat)}"
                    ) from e
                env[n] = self._place_outputs(s, out)
            if regions is not None:
                _tag_traced_nodes(n.name)
            for a in s.last_use:
                env.pop(a, None)

    def _fill(self, s: _Step, device: torch.device) -> DTensor:
        """The output of a fill op built at its planned placement: each rank's shard of the fill
        (on a partial-sum axis the value sits on the axis' first rank, zeros elsewhere)."""
        val = s.node.meta["val"]
        pl = s.outputs[0] if s.outputs and s.outputs[0] is not None else tuple(Replicate() for _ in self.mesh.shape)
        value = s.fill
        assert value is not None  # a fill step has its value
        coordinate = self.mesh.get_coordinate() or [0] * self.mesh.ndim
        for axis, p in enumerate(pl):
            if isinstance(p, Partial) and p.reduce_op == "sum" and coordinate[axis] != 0:
                value = 0
        local = torch.full(placements.local_shape(tuple(val.shape), pl, tuple(self.mesh.shape)), value,
                           dtype=val.dtype, device=device)
        # from_local takes any int sequence as shape; torch's stub says torch.Size
        return DTensor.from_local(local, self.mesh, pl, run_check=False, shape=tuple(val.shape),  # type: ignore[arg-type]
                                  stride=tuple(val.stride()))

    def _local_outputs(self, s: _Step) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(local shape, dtype) of each tensor output of ``s`` at its planned placement."""
        return [(tuple(v.shape) if pl is None else placements.local_shape(tuple(v.shape), pl, tuple(self.mesh.shape)),
                 v.dtype) for v, pl in zip(tensor_vals(s.node), s.outputs, strict=False) if isinstance(v, torch.Tensor)]

    def failure_message(self, node_name: str, error: BaseException) -> str:
        """What a native graph's failure at the kernels of joint-graph node ``node_name`` says."""
        node = next((s for s in self.fwd_steps + self.bwd_steps if s.node.name == node_name), None)
        if node is None:
            return f"node {node_name!r}: {type(error).__name__}: {error}"
        vals = [a.meta.get("val") for a in node.node.all_input_nodes]
        return (f"node {node_name!r} ({node.target}) failed with input placements {[format_placements(sl.dst) for sl in node.slots]}: "
                f"{type(error).__name__}: {error}{self._mixed_dtypes_hint(vals)}")

    def _mixed_dtypes_hint(self, args: list) -> str:
        """Why an op may fail under mixed precision: its floating inputs mix the param dtype with a
        buffer's own (BatchNorm's fp32 running statistics, ...); '' otherwise."""
        dtypes = sorted({str(x.dtype).removeprefix("torch.") for x in args
                         if isinstance(x, torch.Tensor) and x.is_floating_point()})
        if self.param_dtype is None or len(dtypes) < 2:
            return ""
        return (f" (its floating inputs mix {' and '.join(dtypes)}: under mixed precision parameters compute in "
                f"{str(self.param_dtype).removeprefix('torch.')} while buffers keep their dtype, which this op does "
                f"not accept; plan without mixed precision, or give the module's buffers the param dtype)")

    def _run_local(self, s: _Step, kernel: Callable, flat: list) -> Any:
        """Run `kernel` on the local shards (inputs already at the planned placements) and wrap its
        tensor outputs as DTensors with the planned output placements and the traced global shapes."""
        local = [x.to_local() if isinstance(x, DTensor) else x for x in flat]
        args, kwargs = unflatten_args(local, s.spec)
        out = kernel(*args, **kwargs)
        single = not isinstance(out, (tuple, list))
        outs = [out] if single else list(out)
        vals = tensor_vals(s.node)
        R = tuple(Replicate() for _ in self.mesh.shape)
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                pl = s.outputs[i] if i < len(s.outputs) and s.outputs[i] is not None else R
                v = vals[i] if i < len(vals) else None
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) and pl is not R else None
                stride = tuple(v.stride()) if isinstance(v, torch.Tensor) and shape is not None else None
                # from_local takes any int sequence as shape; torch's stub says torch.Size
                outs[i] = DTensor.from_local(o, self.mesh, pl, run_check=False, shape=shape, stride=stride)  # type: ignore[arg-type]
        return outs[0] if single else tuple(outs)

    def _place_outputs(self, s: _Step, out: Any) -> Any:
        single = not isinstance(out, (tuple, list))
        outs = [out] if single else list(out)
        R = tuple(Replicate() for _ in self.mesh.shape)
        for i, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                continue
            pl = s.outputs[i] if i < len(s.outputs) else None
            if not isinstance(o, DTensor):  # factory: global value on every rank -> local chunk
                pl = R if pl is None else pl
                if any(isinstance(p, Partial) for p in pl):
                    raise RuntimeError(f"node {s.node.name!r} ({s.target}): a factory cannot be planned as partial ({format_placements(pl)})")
                outs[i] = distribute_tensor(o, self.mesh, pl, src_data_rank=None)
                continue
            o = _plain_partials(o)
            outs[i] = o
            if pl is None:
                continue
            if placement_tokens(o.placements) != placement_tokens(pl):
                if not comm_free(o.placements, pl):
                    raise RuntimeError(
                        f"node {s.node.name!r} ({s.target}): DTensor produced placement {format_placements(o.placements)}, "
                        f"the plan expects {format_placements(pl)} (inputs {[format_placements(sl.dst) for sl in s.slots]})"
                    )
                outs[i] = o.redistribute(self.mesh, pl)
        return outs[0] if single else tuple(outs) if isinstance(out, tuple) else outs
