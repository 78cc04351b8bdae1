"""Lowering: a solved :class:`~apmodel.plan.Plan` + the user's module -> an ordinary ``nn.Module``.

This is the last pipeline stage (paper §5.1). It takes the joint forward-backward ATen graph the plan
was solved on (:class:`apmodel.capture.CapturedGraph`) and runs it over DTensors on a real
:class:`~torch.distributed.device_mesh.DeviceMesh`, honouring every placement the plan chose.

Design
------
* **Parameters** become ``DTensor`` s with the plan's storage placement; buffers stay plain
  tensors with their global value (so the user's init fills them as usual) and are wrapped at their
  planned placement (replicated, by the planner's policy) at each step, without communication. The module is
  changed in place (as FSDP2's ``fully_shard`` does): its class becomes a dynamically created subclass
  of the user's class, so ``isinstance`` checks, the module hierarchy and the ``state_dict`` keys are
  unchanged (values are DTensors, so distributed checkpointing works). A model on the meta device stays
  on the meta device; call ``to_empty(device=...)`` and initialise it afterwards.
* **Execution** is one ``torch.autograd.Function`` per step. Its ``forward`` interprets the forward
  nodes of the joint graph; its ``backward`` interprets the backward nodes with the incoming tangent.
  Autograd never differentiates through DTensor, so forward and backward use exactly the layouts the
  plan chose for each (they may differ).
* **Redistribution**: before each node runs, every tensor argument whose current placement differs
  from the node's planned input placement is explicitly ``redistribute`` d (all-gather, reduce-scatter,
  all-reduce, all-to-all, or a local chunk). Each one is recorded (:class:`Redistribution`), so a
  step's communication can be compared with the plan's prediction (:func:`planned_redistributions`).
* **Shapes**: view and factory shape arguments stay global; DTensor's dispatch translates them to
  local shapes. Factories (ops without a tensor argument) are run at their global shape on every rank
  and then chunked locally to the planned placement (no communication).
* **Checks**: after each op the output placement is compared with the plan; a mismatch that needs no
  communication to fix (``R`` -> ``S(d)``) is fixed locally, any other mismatch raises. Uneven shards,
  a mesh of the wrong shape, a graph whose fingerprint differs from the plan's, and sample inputs of the
  wrong shape or dtype at call time raise ``ValueError`` naming the offending node / input.
* **Where DTensor eager needs help** (each found by lowering random feasible plans):
  DTensor's masked partial (embedding over a vocabulary-sharded table) holds a one-shot mask, so it
  is applied at once and the value kept as a plain partial sum; a view whose local input lost the
  traced memory layout in a redistribution (attention output laid out ``[b, s, h, d]``) runs on a
  contiguous local copy; ops without a kernel on the device (the flash-attention op on CPU) run a
  reference kernel on the local shards (handed in: :func:`apmodel.kernels.local_kernels`).

Communication is exactly the plan's: every collective comes from one of the recorded
redistributions, which equal :func:`planned_redistributions` (the tests check this against the
collectives seen at dispatch, by kind and mesh axis). On gloo DTensor performs all-to-all as
all-gather + local chunk (gloo has no all-to-all).
"""

from __future__ import annotations

import copy
import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from apmodel import placements
from apmodel._torch_private import OpOverload, has_sharding_rule
from apmodel.kernels import local_kernels as default_local_kernels

logger = logging.getLogger(__name__)

Placements = tuple[Placement, ...]

__all__ = [
    "Redistribution",
    "LoweredProgram",
    "lower",
    "capture_on_meta",
    "plan_on_one_rank",
    "planned_redistributions",
    "issued_redistributions",
    "load_full_state_dict",
]


# ----------------------------------------------------------------------------------------------
# placement helpers
# ----------------------------------------------------------------------------------------------


def _token(p: Placement) -> str:
    """One placement as its token in the shared vocabulary ("R", "S(d)", "P"; DTensor's masked and
    norm partials are partial sums: "P")."""
    return placements.to_str(p)


def _tokens(pl: Sequence[Placement]) -> tuple[str, ...]:
    return tuple(_token(p) for p in pl)


def _fmt(pl: Sequence[Placement] | None) -> str:
    return "None" if pl is None else "".join(_tokens(pl))


def _all_replicated(pl: Sequence[Placement]) -> bool:
    return all(isinstance(p, Replicate) for p in pl)


def _comm_free(src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
    """True when going from src to dst needs no collective (only local chunking)."""
    return all(
        _token(s) == _token(d) or (isinstance(s, Replicate) and isinstance(d, Shard))
        for s, d in zip(src, dst)
    )


# ----------------------------------------------------------------------------------------------
# records
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Redistribution:
    """One redistribution of one tensor: `producer`'s output (index `index`) moved from `src` to `dst`
    placements before `consumer` runs. `phase` is "forward", "backward" or "input" (call-time
    conversion of a user input). Shapes are global."""

    consumer: str
    producer: str
    index: int
    phase: str
    src: tuple[str, ...]
    dst: tuple[str, ...]
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    gradient: bool = False
    """it moves a parameter gradient (priced in the reduce dtype under mixed precision)"""

    @property
    def key(self) -> tuple:
        """Identity used to compare issued with planned redistributions."""
        return (self.consumer, self.producer, self.index, self.src, self.dst)


@dataclass
class _Slot:
    leaf: int  # position in the flattened (args, kwargs) of the node
    producer: fx.Node
    index: int  # output index of producer (getitem index), else 0
    dst: Placements | None


@dataclass
class _Step:
    node: fx.Node
    target: Callable
    spec: Any  # structure of (args, kwargs), see _flatten
    leaves: list  # constants, _Ref(node) or _DEVICE markers
    slots: list[_Slot]
    outputs: tuple  # planned output placements (one per tensor output, None for non-tensors)
    is_getitem: bool
    is_factory: bool
    without_rule: bool = False  # no DTensor rule: planned replicated, run on the local (= global) tensors
    last_use: list[fx.Node] = field(default_factory=list)  # values to free after this step


_DEVICE = object()  # marks a device argument (traced as meta), replaced by the runtime device


@dataclass(frozen=True)
class _Ref:
    """Marks an argument that is the value of another graph node."""

    node: fx.Node

# Views whose local input may have lost the traced memory layout after a redistribution.
_VIEW_OPS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})


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
    for p in x.placements:
        if hasattr(p, "mask_buffer"):
            if p.mask_buffer.data is None:
                raise RuntimeError("masked partial value without its mask (already reduced?)")
            p.mask_buffer.apply_mask(local)
            new.append(Partial(p.reduce_op))
        else:
            new.append(p)
    return DTensor.from_local(local, x.device_mesh, new, run_check=False, shape=x.shape, stride=x.stride())


def _contiguous(x: Any) -> Any:
    """`x` with a contiguous local tensor (DTensor's own ``contiguous`` looks at the global strides,
    which may claim contiguity the local shard lacks)."""
    if isinstance(x, DTensor) and not x.to_local().is_contiguous():
        return x.clone(memory_format=torch.contiguous_format)
    return x


def _flatten(obj: Any) -> tuple[list, Any]:
    """Leaves of nested tuples/lists/dicts (FX's immutable ones included) and a spec to rebuild them
    with :func:`_unflatten` (lists and tuples come back as tuples' and lists' plain types)."""
    leaves: list = []

    def walk(o: Any) -> Any:
        if isinstance(o, (tuple, list)):
            return (list if isinstance(o, list) else tuple, [walk(x) for x in o])
        if isinstance(o, dict):
            return (dict, [(k, walk(v)) for k, v in o.items()])
        leaves.append(o)
        return None

    return leaves, walk(obj)


def _unflatten(leaves: Sequence[Any], spec: Any) -> Any:
    it = iter(leaves)

    def build(sp: Any) -> Any:
        if sp is None:
            return next(it)
        kind, items = sp
        if kind is dict:
            return {k: build(v) for k, v in items}
        return kind(build(x) for x in items)

    return build(spec)


# ----------------------------------------------------------------------------------------------
# plan validation
# ----------------------------------------------------------------------------------------------


def _tensor_vals(node: fx.Node) -> list:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return list(v)
    return [v]


def _check_even(name: str, shape: Sequence[int], pl: Placements, mesh_shape: Sequence[int]) -> None:
    for d, size in enumerate(shape):
        ways = 1
        for axis, p in enumerate(pl):
            if isinstance(p, Shard) and p.dim == d:
                ways *= mesh_shape[axis]
        if ways > 1 and int(size) % ways:
            raise ValueError(
                f"plan shards node {name!r} dim {d} (size {size}) {ways} ways ({_fmt(pl)} on mesh "
                f"{tuple(mesh_shape)}): uneven shards are not supported by lowering"
            )


def _node_strategy(plan: Any, node: fx.Node):
    try:
        return plan.node_strategy[node.name]
    except KeyError:
        raise ValueError(f"plan has no strategy for graph node {node.name!r} ({node.target})") from None


def _tensor_leaves(node: fx.Node) -> list[tuple[int, fx.Node, int]]:
    """(leaf position in the flattened (args, kwargs), producer, producer output index) for each
    input slot of ``node``, in the order of :func:`apmodel.strategies.input_slots` (the order of a
    strategy's ``inputs``)."""
    from apmodel.strategies import input_slots

    slots = input_slots(node)
    if node.target is operator.getitem and slots and slots[0][1] == int(node.args[1]) and isinstance(
        slots[0][0].meta.get("val"), (tuple, list)
    ):
        return [(0, slots[0][0], slots[0][1])]
    flat, _ = _flatten((node.args, node.kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    if len(positions) != len(slots):
        raise ValueError(f"node {node.name!r} ({node.target}): cannot match its {len(slots)} input slots to its arguments")
    return [(i, prod, k) for i, (prod, k) in zip(positions, slots)]


# ----------------------------------------------------------------------------------------------
# the lowered program
# ----------------------------------------------------------------------------------------------


class LoweredProgram:
    """The joint graph, prepared for execution on `mesh` under `plan`. Held by the parallel module
    (attribute ``_apmodel_program``); ``redistributions`` lists what the last step issued."""

    def __init__(self, mesh: DeviceMesh, plan: Any, captured: Any,
                 local_kernels: Callable[[torch.device], dict] = default_local_kernels):
        self.mesh = mesh
        self.local_kernels = local_kernels
        self.plan = plan
        self.captured = captured
        gm: fx.GraphModule = captured.gm
        roles = captured.roles
        mesh_shape = tuple(mesh.shape)
        self.placeholders: list[fx.Node] = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.params = [n for n in self.placeholders if roles.get(n.name) == "param"]
        self.buffers = [n for n in self.placeholders if roles.get(n.name) == "buffer"]
        self.inputs = sorted(
            (n for n in self.placeholders if roles.get(n.name) == "input"),
            key=lambda n: captured.input_index[n.name],
        )
        self.tangents = [n for n in self.placeholders if roles.get(n.name) == "tangent"]
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        out_args = [a for a in _flatten(out_node.args[0])[0] if isinstance(a, fx.Node)]
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

        # storage placements of params (must be R/S) and buffers, checked against the node strategy
        self.storage: dict[fx.Node, Placements] = {}
        for n in self.params + self.buffers + self.inputs + self.tangents:
            strat = _node_strategy(plan, n)
            pl = tuple(strat.outputs[0])
            if len(pl) != len(mesh_shape):
                raise ValueError(f"placement {_fmt(pl)} of {n.name!r} has {len(pl)} entries, mesh has {len(mesh_shape)} axes")
            if n in self.params:
                fqn = captured.param_fqn[n.name]
                planned = plan.param_placements.get(fqn) if hasattr(plan, "param_placements") else None
                if planned is not None and _tokens(planned) != _tokens(pl):
                    raise ValueError(
                        f"plan stores parameter {fqn!r} as {_fmt(planned)} but its graph node "
                        f"{n.name!r} is planned as {_fmt(pl)}"
                    )
                if any(isinstance(p, Partial) for p in pl):
                    raise ValueError(f"plan stores parameter {fqn!r} as partial ({_fmt(pl)}); storage must be R or S(d)")
            self.storage[n] = pl

        # steps
        is_bwd = captured.is_backward
        self.fwd_steps: list[_Step] = []
        self.bwd_steps: list[_Step] = []
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            strat = _node_strategy(plan, n)
            flat, spec = _flatten((n.args, n.kwargs))
            leaves: list = []
            for a in flat:
                if isinstance(a, fx.Node):
                    leaves.append(_Ref(a))
                elif isinstance(a, torch.device):
                    leaves.append(_DEVICE)
                else:
                    leaves.append(a)
            tl = _tensor_leaves(n)
            ins = tuple(strat.inputs) if strat.inputs is not None else ()
            if len(ins) != len(tl):
                raise ValueError(
                    f"plan strategy for node {n.name!r} ({n.target}) has {len(ins)} input placements, "
                    f"the node has {len(tl)} tensor arguments"
                )
            is_getitem = n.target is operator.getitem
            slots = [_Slot(leaf, prod, k, None if dst is None else tuple(dst)) for (leaf, prod, k), dst in zip(tl, ins)]
            outs = tuple(None if o is None else tuple(o) for o in strat.outputs)
            for v, pl in zip(_tensor_vals(n), outs):
                if isinstance(v, torch.Tensor) and pl is not None:
                    _check_even(n.name, v.shape, pl, mesh_shape)
            for s in slots:
                if s.dst is not None:
                    pv = _tensor_vals(s.producer)[s.index]
                    if isinstance(pv, torch.Tensor):
                        _check_even(f"{s.producer.name} (as input of {n.name})", pv.shape, s.dst, mesh_shape)
            without_rule = isinstance(n.target, OpOverload) and not has_sharding_rule(n.target)
            if without_rule and not all(_all_replicated(p) for p in [*(sl.dst for sl in slots), *outs] if p is not None):
                raise ValueError(f"node {n.name!r} ({n.target}) has no DTensor rule; the plan must keep it replicated")
            step = _Step(n, n.target, spec, leaves, slots, outs, is_getitem, is_factory=not tl, without_rule=without_rule)
            (self.bwd_steps if is_bwd.get(n.name, False) else self.fwd_steps).append(step)
        for n in self.storage:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                _check_even(n.name, v.shape, self.storage[n], mesh_shape)

        # values the backward reads from the forward
        fwd_set = set(self.placeholders) - set(self.tangents) | {s.node for s in self.fwd_steps}
        self.saved: list[fx.Node] = []
        seen = set()
        for s in self.bwd_steps:
            for a in s.node.all_input_nodes:
                if a in fwd_set and a not in seen:
                    seen.add(a)
                    self.saved.append(a)
        for o in list(self.fwd_outputs) + list(self.buffer_update.values()):
            seen.add(o)
        for p, g in list(self.param_grad.items()) + list(self.input_grad.items()):
            if g in fwd_set:  # gradient computed without the tangent (rare); keep it
                seen.add(g)
                self.saved.append(g)
        self._plan_frees(self.fwd_steps, keep=seen)
        self._plan_frees(self.bwd_steps, keep=set(self.param_grad.values()) | set(self.input_grad.values()))
        self.redistributions: list[Redistribution] = []
        self.new_buffer_values: dict[str, torch.Tensor] = {}
        """buffer FQN -> its value after the last forward (global, replicated), to write back"""
        self.retrace_model: nn.Module | None = None
        """a meta copy of the user's model, to trace the step again for other input shapes"""
        self.variants: dict[tuple, LoweredProgram] = {}
        """the plan replayed on other input shapes, by the inputs' shapes"""
        self._kernels: dict[torch.device, dict] = {}

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

    def for_inputs(self, inputs: Sequence[Any]) -> "LoweredProgram":
        """This program, or the plan replayed on the shapes of ``inputs`` (traced once per shape).

        Same dtypes are required. A new batch (or sequence) size re-traces the step on the meta
        device, checks that the graph has the plan's structure (same nodes and ops) and lowers the
        plan's node strategies on it; a size the plan's shardings cannot divide raises a
        ValueError naming the input, the node and the mesh axes."""
        sig = self.signature
        shapes = []
        for i, (node, x) in enumerate(zip(self.inputs, inputs)):
            want = node.meta["val"]
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {sig.name(i)} must be a tensor, got {type(x).__name__}")
            if x.dtype != want.dtype or x.dim() != want.dim():
                raise ValueError(
                    f"input {sig.name(i)} has shape {tuple(x.shape)} and dtype {x.dtype}; the plan was made for "
                    f"shape {tuple(want.shape)} and dtype {want.dtype} (re-plan for another dtype or rank)"
                )
            shapes.append(tuple(x.shape))
        key = tuple(shapes)
        if all(s == tuple(n.meta["val"].shape) for s, n in zip(shapes, self.inputs)):
            return self
        variant = self.variants.get(key)
        if variant is None:
            variant = self.variants[key] = self._replay_on(inputs)
        return variant

    def _replay_on(self, inputs: Sequence[Any]) -> "LoweredProgram":
        from apmodel.capture import capture
        from apmodel.plans import PlanMismatch, structure_fingerprint

        if self.retrace_model is None:
            raise ValueError("this program cannot be traced again (made without lower()); re-plan for new shapes")
        sig = self.signature
        shapes = ", ".join(f"{sig.name(i)} {tuple(x.shape)}" for i, x in enumerate(inputs))
        args, kwargs, targets = sig.split([torch.empty(x.shape, dtype=x.dtype, device="meta") for x in inputs])
        try:
            captured = capture(self.retrace_model, args, kwargs=kwargs, targets=targets, **self.captured.trace_options)
        except Exception as e:  # the user's model rejects these shapes (mismatched batch, too long, ...)
            raise ValueError(f"the step cannot be traced at input shapes {shapes}: {type(e).__name__}: {e}") from e
        if structure_fingerprint(captured) != structure_fingerprint(self.captured):
            raise PlanMismatch(f"at input shapes {shapes} the model traces to another graph; re-plan for these shapes")
        plan = copy.copy(self.plan)
        plan.fingerprint = captured.fingerprint
        try:
            variant = LoweredProgram(self.mesh, plan, captured, self.local_kernels)
        except ValueError as e:
            raise ValueError(f"the plan cannot run at input shapes {shapes}: {e}") from None
        logger.info("replayed the plan on input shapes %s", shapes)
        return variant

    def _redistribute(self, x: DTensor, dst: Placements, consumer: str, producer: str, index: int, phase: str) -> DTensor:
        if not isinstance(x, DTensor):
            raise TypeError(f"argument {producer!r} of node {consumer!r} is a {type(x).__name__}, expected a DTensor")
        if _tokens(x.placements) == _tokens(dst):
            return x
        self.redistributions.append(
            Redistribution(consumer, producer, index, phase, _tokens(x.placements), _tokens(dst), tuple(x.shape), x.dtype)
        )
        return x.redistribute(self.mesh, dst)

    def _run(self, steps: list[_Step], env: dict, phase: str, device: torch.device) -> None:
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
            if s.is_getitem:
                slot = s.slots[0] if s.slots else None
                val = flat[0][flat[1]]
                if slot is not None and slot.dst is not None and isinstance(val, DTensor):
                    val = self._redistribute(val, slot.dst, n.name, slot.producer.name, slot.index, phase)
                env[n] = val
            else:
                for slot in s.slots:
                    if slot.dst is not None:
                        flat[slot.leaf] = self._redistribute(flat[slot.leaf], slot.dst, n.name, slot.producer.name, slot.index, phase)
                kernel = kernels.get(s.target, s.target if s.without_rule else None)
                try:
                    if kernel is not None:
                        out = self._run_local(s, kernel, flat)
                    else:
                        args, kwargs = _unflatten(flat, s.spec)
                        try:
                            out = s.target(*args, **kwargs)
                        except RuntimeError as e:
                            if s.target not in _VIEW_OPS or "view size is not compatible" not in str(e):
                                raise
                            # The traced graph relied on a producer's memory layout (e.g. attention
                            # output laid out [b, s, h, d]) that a redistribution does not keep:
                            # functional graph, so a copy is as good as a view here (local, no comm).
                            args, kwargs = _unflatten([_contiguous(x) for x in flat], s.spec)
                            out = s.target(*args, **kwargs)
                except Exception as e:
                    raise RuntimeError(
                        f"DTensor failed to run node {n.name!r} ({s.target}) with input placements "
                        f"{[_fmt(sl.dst) for sl in s.slots]}: {type(e).__name__}: {e}"
                    ) from e
                env[n] = self._place_outputs(s, out)
            for a in s.last_use:
                env.pop(a, None)

    def _run_local(self, s: _Step, kernel: Callable, flat: list) -> Any:
        """Run `kernel` on the local shards (inputs already at the planned placements) and wrap its
        tensor outputs as DTensors with the planned output placements and the traced global shapes."""
        local = [x.to_local() if isinstance(x, DTensor) else x for x in flat]
        args, kwargs = _unflatten(local, s.spec)
        out = kernel(*args, **kwargs)
        single = not isinstance(out, (tuple, list))
        outs = [out] if single else list(out)
        vals = _tensor_vals(s.node)
        R = tuple(Replicate() for _ in self.mesh.shape)
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                pl = s.outputs[i] if i < len(s.outputs) and s.outputs[i] is not None else R
                v = vals[i] if i < len(vals) else None
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) and pl is not R else None
                stride = tuple(v.stride()) if shape is not None else None
                outs[i] = DTensor.from_local(o, self.mesh, pl, run_check=False, shape=shape, stride=stride)
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
                    raise RuntimeError(f"node {s.node.name!r} ({s.target}): a factory cannot be planned as partial ({_fmt(pl)})")
                outs[i] = distribute_tensor(o, self.mesh, pl, src_data_rank=None)
                continue
            o = _plain_partials(o)
            outs[i] = o
            if pl is None:
                continue
            if _tokens(o.placements) != _tokens(pl):
                if not _comm_free(o.placements, pl):
                    raise RuntimeError(
                        f"node {s.node.name!r} ({s.target}): DTensor produced placement {_fmt(o.placements)}, "
                        f"the plan expects {_fmt(pl)} (inputs {[_fmt(sl.dst) for sl in s.slots]})"
                    )
                outs[i] = o.redistribute(self.mesh, pl)
        return outs[0] if single else tuple(outs) if isinstance(out, tuple) else outs


class _FromGlobal(torch.autograd.Function):
    """A plain input (the global value, the same on every rank) -> its DTensor at the planned
    placement (local chunk, no communication). Its gradient comes back as the full global tensor:
    gathering it is the one collective outside the plan (only for inputs that require grad)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh, pl: Placements) -> DTensor:  # type: ignore[override]
        return distribute_tensor(x.detach(), mesh, pl, src_data_rank=None)

    @staticmethod
    def backward(ctx, g: DTensor):  # type: ignore[override]
        return g.full_tensor(), None, None


class _JointStep(torch.autograd.Function):
    """forward: the joint graph's forward nodes; backward: its backward nodes (both over DTensors)."""

    @staticmethod
    def forward(ctx, prog: LoweredProgram, device: torch.device, keep: bool, *values):  # type: ignore[override]
        env: dict[fx.Node, Any] = {}
        ph = prog.params + prog.buffers + prog.inputs
        for n, v in zip(ph, values):
            env[n] = v
        prog._run(prog.fwd_steps, env, "forward", device)
        for b, u in prog.buffer_update.items():  # BatchNorm running statistics and the like
            fqn = prog.captured.buffer_fqn[b.name]
            v = prog._redistribute(env[u], prog.storage[b], f"buffer:{fqn}", u.name, 0, "forward")
            prog.new_buffer_values[fqn] = v.to_local()
        ctx.prog = prog
        ctx.device = device
        ctx.saved_env = {n: env[n] for n in prog.saved} if keep else {}
        outs = []
        for o in prog.fwd_outputs:  # forward output -> its required placement (that of its tangent)
            t = prog.output_tangent.get(o)
            v = env[o]
            if t is not None:
                v = prog._redistribute(v, prog.storage[t], f"output:{o.name}", o.name, 0, "forward")
            outs.append(v)
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        prog: LoweredProgram = ctx.prog
        env = dict(ctx.saved_env)
        ctx.saved_env = None
        for o, g in zip(prog.fwd_outputs, grads):
            t = prog.output_tangent.get(o)
            if t is None:
                continue
            if g is None:
                g = torch.zeros_like(env.get(o)) if o in env else None
            env[t] = prog._redistribute(g, prog.storage[t], t.name, "<incoming grad>", 0, "backward")
        prog._run(prog.bwd_steps, env, "backward", ctx.device)
        result: list = [None, None, None]
        for p in prog.params:
            g = prog.param_grad.get(p)
            if g is None:
                result.append(None)
                continue
            val = prog._redistribute(env[g], prog.storage[p], f"grad:{prog.captured.param_fqn[p.name]}", g.name, 0, "backward")
            result.append(val)
        result.extend([None] * len(prog.buffers))
        for i in prog.inputs:
            g = prog.input_grad.get(i)
            result.append(None if g is None else prog._redistribute(env[g], prog.storage[i], f"grad:input{prog.captured.input_index[i.name]}", g.name, 0, "backward"))
        return tuple(result)


# ----------------------------------------------------------------------------------------------
# module construction
# ----------------------------------------------------------------------------------------------


def _set_parameter(model: nn.Module, fqn: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = fqn.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    old = getattr(owner, leaf)
    owner.register_parameter(leaf, nn.Parameter(value, requires_grad=old.requires_grad))


def _parallel_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    traced: LoweredProgram = self._apmodel_program
    sig = traced.signature
    inputs = sig.flatten(args, kwargs, f"{type(self).__name__}.forward")
    prog = traced.for_inputs(inputs)  # the plan as traced, or replayed on these shapes
    dinputs = []
    for i, (node, x) in enumerate(zip(prog.inputs, inputs)):
        pl = prog.storage[node]
        if isinstance(x, DTensor):
            x = prog._redistribute(x, pl, node.name, sig.name(i), 0, "input")
        elif x.requires_grad:
            x = _FromGlobal.apply(x, prog.mesh, pl)
        else:  # the global tensor, identical on every rank: keep the local chunk, no communication
            x = distribute_tensor(x, prog.mesh, pl, src_data_rank=None)
        dinputs.append(x)
    values: list = []
    device = None
    for n in prog.params:
        fqn = prog.captured.param_fqn[n.name]
        v = self.get_parameter(fqn)
        if not isinstance(v, DTensor) or _tokens(v.placements) != _tokens(prog.storage[n]):
            raise ValueError(f"parameter {fqn!r} must be a DTensor placed {_fmt(prog.storage[n])}, got {type(v).__name__}")
        if device is None:
            device = v.to_local().device
        values.append(v)
    for n in prog.buffers:  # plain tensors holding the global value (see lower): wrap, no communication
        fqn = prog.captured.buffer_fqn[n.name]
        v = self.get_buffer(fqn)
        pl = prog.storage[n]
        if isinstance(v, DTensor):
            v = prog._redistribute(v, pl, n.name, fqn, 0, "input")
        elif all(isinstance(p, Replicate) for p in pl):
            v = DTensor.from_local(v, prog.mesh, pl, run_check=False)
        else:
            v = distribute_tensor(v, prog.mesh, pl, src_data_rank=None)
        values.append(v)
    if device is None:
        device = dinputs[0].to_local().device if dinputs else torch.device(prog.mesh.device_type)
    prog.redistributions = traced.redistributions = []
    prog.new_buffer_values = {}
    keep = torch.is_grad_enabled() and any(v.requires_grad for v in values + dinputs)
    out = _JointStep.apply(prog, device, keep, *values, *dinputs)
    with torch.no_grad():  # buffer updates of the step (replicated: the local value is the global one)
        for fqn, new in prog.new_buffer_values.items():
            self.get_buffer(fqn).copy_(new)
    prog.new_buffer_values = {}
    return out


def lower(model: nn.Module, mesh: DeviceMesh, plan: Any, captured: Any, *,
          local_kernels: Callable[[torch.device], dict] = default_local_kernels) -> nn.Module:
    """Apply `plan` (made for `captured`, the joint graph of `model`) on the real `mesh`.

    ``local_kernels(device)`` maps ops without a kernel on ``device`` to the implementations run on
    local shards instead (default: :func:`apmodel.kernels.local_kernels`).

    Changes `model` in place and returns it: parameters become DTensors with the plan's storage
    placements (on the device they were on; meta stays meta; buffers stay plain tensors holding the
    global value), and its class becomes a subclass
    of the user's class whose ``forward(*inputs)`` runs the planned joint graph and returns the traced
    output (the loss when the graph was captured with a loss function) as a DTensor.

    Raises ValueError for a mesh of the wrong shape, a plan made for another graph (fingerprint), a
    plan with uneven shards, or a plan inconsistent with the graph.
    """
    from apmodel.plans import PlanMismatch

    if tuple(mesh.shape) != tuple(plan.mesh_shape):
        raise PlanMismatch(f"mesh shape {tuple(mesh.shape)} differs from the plan's mesh shape {tuple(plan.mesh_shape)}")
    if plan.fingerprint != captured.fingerprint:
        raise PlanMismatch(
            f"the model's graph (fingerprint {captured.fingerprint[:12]}) does not match the plan's "
            f"(fingerprint {plan.fingerprint[:12]}): re-plan for this model and these sample inputs"
        )
    if getattr(model, "_apmodel_program", None) is not None:
        raise ValueError(f"{type(model).__name__} has already been parallelized")
    prog = LoweredProgram(mesh, plan, captured, local_kernels)
    prog.retrace_model = _meta_twin(model)  # structure only (meta tensors): for other input shapes
    # params -> DTensors (local chunk of the tensor each rank holds: no communication). Buffers (RoPE
    # tables, ...) stay plain tensors with the global value, so the user's init code can fill them
    # as usual; each step wraps them at their planned placement (the planner keeps them replicated).
    for n in prog.params:
        fqn = captured.param_fqn[n.name]
        with torch.no_grad():
            dt = distribute_tensor(model.get_parameter(fqn).detach(), mesh, prog.storage[n], src_data_rank=None)
        _set_parameter(model, fqn, dt)
        for tied in captured.tied_params.get(n.name, ()):  # tied weights stay one Parameter
            owner_name, _, leaf = tied.rpartition(".")
            (model.get_submodule(owner_name) if owner_name else model).register_parameter(leaf, model.get_parameter(fqn))
    cls = type(model)
    new_cls = type(f"Parallel{cls.__name__}", (cls,), {"forward": _parallel_forward, "__module__": cls.__module__})
    model.__class__ = new_cls
    model._apmodel_program = prog
    logger.info(
        "lowered %s on mesh %s: %d forward + %d backward nodes, %d planned redistributions",
        cls.__name__, tuple(mesh.shape), len(prog.fwd_steps), len(prog.bwd_steps), len(planned_redistributions(plan, captured)),
    )
    return model


def planned_redistributions(plan: Any, captured: Any) -> list[Redistribution]:
    """The redistributions one training step issues under `plan`, read off the plan alone: for every
    node input whose planned placement differs from its producer's planned output placement, plus
    forward outputs whose planned placement differs from the required one (that of their tangent)
    and parameter / input gradients whose planned placement differs from the storage placement."""
    gm = captured.gm
    out: list[Redistribution] = []
    is_bwd = captured.is_backward
    chain = captured.param_gradient_chain()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        strat = plan.node_strategy[n.name]
        for (leaf, prod, idx), dst in zip(_tensor_leaves(n), strat.inputs):
            src = plan.node_strategy[prod.name].outputs[idx]
            if dst is None or src is None:
                continue
            val = _tensor_vals(prod)[idx]
            if _tokens(src) != _tokens(dst):
                out.append(Redistribution(n.name, prod.name, idx, "backward" if is_bwd.get(n.name) else "forward",
                                          _tokens(src), _tokens(dst), tuple(val.shape), val.dtype,
                                          gradient=prod.name in chain and n.name in chain))
    by_name = {n.name: n for n in gm.graph.nodes}
    # Boundary moves: a forward output to its required (tangent) placement, each gradient to its
    # parameter's storage placement or its input's placement.
    boundary = [(f"output:{o}", o, t, "forward") for o, t in captured.output_tangent.items()]
    boundary += [(f"grad:{captured.param_fqn[p]}", g, p, "backward") for p, g in captured.param_grad.items()]
    boundary += [(f"grad:input{captured.input_index[i]}", g, i, "backward") for i, g in captured.input_grad.items()]
    boundary += [(f"buffer:{captured.buffer_fqn[b]}", u, b, "forward") for b, u in captured.buffer_update.items()]
    for label, producer, target, phase in boundary:
        src, dst = plan.node_strategy[producer].outputs[0], plan.node_strategy[target].outputs[0]
        if _tokens(src) != _tokens(dst):
            val = by_name[producer].meta["val"]
            out.append(Redistribution(label, producer, 0, phase, _tokens(src), _tokens(dst), tuple(val.shape), val.dtype,
                                      gradient=label.startswith("grad:") and target in captured.param_fqn))
    return out


def issued_redistributions(module: nn.Module) -> list[Redistribution]:
    """The redistributions the parallel `module` issued in its last step (forward, and backward if
    it ran), in order; compare with :func:`planned_redistributions`."""
    prog = getattr(module, "_apmodel_program", None)
    if prog is None:
        raise TypeError(f"{type(module).__name__} was not made by apmodel.parallelize / lower")
    return list(prog.redistributions)


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy full (global, unsharded) tensors, identical on every rank, into a parallelized model's
    DTensor parameters and buffers: each rank keeps its own chunk; no communication. Use after
    ``to_empty`` to load single-device weights (e.g. a reference model's ``state_dict()``)."""
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    missing = [k for k in own if k not in state_dict]
    if missing:
        raise ValueError(f"state_dict lacks {missing[:5]}{'...' if len(missing) > 5 else ''}")
    with torch.no_grad():
        for k, t in own.items():
            src = state_dict[k]
            if tuple(src.shape) != tuple(t.shape):
                raise ValueError(f"{k!r}: state_dict shape {tuple(src.shape)} != model shape {tuple(t.shape)}")
            if isinstance(t, DTensor):
                chunk = distribute_tensor(src.detach().to(t.dtype), t.device_mesh, t.placements, src_data_rank=None)
                t.to_local().copy_(chunk.to_local())
            else:
                t.copy_(src)


def _meta_twin(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are empty meta tensors (for tracing; costs no
    memory): the module structure is deep-copied, tensors are not."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _to_meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def capture_on_meta(model: nn.Module, sample_inputs: Sequence[Any], loss_fn: Callable | None, **capture_options: Any) -> Any:
    """Capture `model`'s training step on the meta device (as the planner does), whatever device the
    model and the sample inputs are on. ``capture_options``: kwargs, targets,
    allow_unused_parameters (see :func:`apmodel.capture.capture`)."""
    from apmodel.capture import capture  # lazy: tracing machinery is heavy to import

    on_meta = all(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))
    meta_model = model if on_meta else _meta_twin(model)
    if capture_options.get("kwargs") is not None:
        capture_options["kwargs"] = {k: _to_meta(v) for k, v in capture_options["kwargs"].items()}
    if capture_options.get("targets") is not None:
        capture_options["targets"] = tuple(_to_meta(x) for x in capture_options["targets"])
    meta_inputs = tuple(_to_meta(x) for x in sample_inputs)
    return capture(meta_model, meta_inputs, loss_fn, **capture_options)


def plan_on_one_rank(solve: Callable[[], Any], mesh: DeviceMesh) -> Any:
    """Run `solve` on the mesh's first rank and send the plan (as JSON) to every rank of the default
    process group, so that all ranks lower the same plan (and only one pays for planning)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return solve()
    from apmodel.plans import Plan

    if dist.get_world_size() != mesh.size():
        raise ValueError(
            f"parallelize plans on one rank and broadcasts over the default process group, which has "
            f"{dist.get_world_size()} ranks; the mesh has {mesh.size()}: plan yourself and pass plan="
        )
    src = int(mesh.mesh.flatten()[0])
    box: list = [None]
    plan = None
    if dist.get_rank() == src:
        plan = solve()
        box[0] = plan.to_json()
    dist.broadcast_object_list(box, src=src)
    return plan if plan is not None else Plan.from_json(box[0], "plan broadcast by rank %d" % src)
