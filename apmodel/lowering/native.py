"""The native program: a plan's step as two FX graphs over local shards, collectives explicit.

The interpreter (:mod:`apmodel.lowering.program`) decides, node by node over DTensors, which
redistribution each input needs and which local kernel runs. Doing that every step costs host time
(DTensor's propagation and dispatch per op) and hides the collectives from any compiler. Here it is
done once: the interpreter's forward and backward are traced with ``make_fx`` on fake tensors of
the run's device, and DTensor's dispatch unfolds into what it does locally, so each graph holds

* the local kernels the plan picked (mixed-precision casts, activation-checkpoint recomputation,
  masked embedding lookups, the reference kernels of :mod:`apmodel.core.kernels`),
* every redistribution as ``_c10d_functional`` collectives (``all_gather_into_tensor``,
  ``reduce_scatter_tensor``, ``all_reduce``, ``all_to_all_single``) and their ``wait_tensor``,
  on the process group of the mesh axis, and the local chunking around them,
* ``local_map`` regions as one call each (their function issues its own, data-dependent
  collectives; see :class:`_RegionCall`).

The graphs are per rank (a rank's shard offsets are constants in them). A step runs the forward
graph inside one ``torch.autograd.Function`` whose backward runs the backward graph; the user's
parameters stay DTensors and enter as their local tensors (``to_local``, whose gradient comes back
as a DTensor with the parameter's placement). The same planned redistributions are recorded while
tracing, so :func:`apmodel.lowering.issued_redistributions` reads what the graphs contain.

``torch.compile`` of the parallel module sees plain tensors, functional collectives and an
``autograd.Function`` with traceable forward and backward: Inductor compiles both graphs and can
reorder and bucket the collectives.
"""

from __future__ import annotations

import copy
import linecache
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.fx.experimental.proxy_tensor import make_fx

from apmodel._torch_private import (
    bucket_collectives,
    dtensor_like,
    fake_tensor_mode,
    grads_accumulate_into,
    overload_packet,
)
from apmodel.graph.linear3d import LOCAL_IMPLS
from apmodel.graph.regions import region_of
from apmodel.lowering.graph import add_to_grad, flatten_args, unflatten_args
from apmodel.lowering.static_split import StaticSplit, split_static
from apmodel.lowering.weight_split import WeightSplit, split_weight
from apmodel.result.step_timeline import op_kind
from costmodels.overlap import GLOO_MAX_INFLIGHT, ProgramOp, issue_order, serial_order

if TYPE_CHECKING:
    from apmodel.lowering.program import LoweredProgram

logger = logging.getLogger(__name__)
aten = torch.ops.aten


@dataclass(frozen=True)
class _Layout:
    """How a local tensor of the traced step is wrapped back into a DTensor (global shape and
    stride, placements), or None for a plain tensor."""

    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]

    @classmethod
    def of(cls, x: Any) -> "_Layout | None":
        return cls(tuple(x.placements), x.shape, tuple(x.stride())) if isinstance(x, DTensor) else None

    def wrap(self, local: torch.Tensor, mesh: Any) -> DTensor:
        return DTensor.from_local(local, mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride)


class _RegionCall:
    """A ``local_map`` region's operator in a native graph, with the ranks of its alternatives.

    The region's function reads them from a scope (:func:`apmodel.graph.regions.region_scope`) and sizes
    its all-to-alls from routed token counts, so it stays one opaque call: under ``torch.compile``
    it runs eagerly between compiled graphs."""

    def __init__(self, target: Callable, comms: dict, node_name: str) -> None:
        self.target, self.comms = target, comms
        self.__name__ = f"region_{node_name}"
        self.__qualname__ = self.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from apmodel.graph.regions import region_scope

        with region_scope(self.comms):
            return self.target(*args, **kwargs)


def trace_device(mesh: Any) -> torch.device:
    """The device the step runs on: the mesh's (the current CUDA device for a CUDA mesh)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


class NativeProgram:
    """The forward and backward graphs of one :class:`LoweredProgram` (one set of input shapes).

    ``param_locals`` / ``buffers`` / ``inputs`` give the dtypes, local shapes and strides of the
    step's arguments (any device: only their metadata is read); tracing happens on fake tensors of
    ``device``, so nothing is allocated and no collective runs. ``bucket_mb``: collectives of
    one kind and process group that do not depend on one another are merged into buckets of at
    most this size, as the plan was priced with the same size (None or 0: one collective per
    planned step, as a plan made with ``bucket_mb=0`` was priced). ``inflight_mb``: collectives
    issued as soon as their inputs exist and waited just before their first reader, parameters'
    gathers prefetched, at most this many MB in flight (:func:`order_collectives`); None: each
    waited right after it is issued. ``defer_grad_reduction``: the backward graph leaves the
    parameters' gradients unreduced (as their placement before the reduction); each backward adds
    them into :attr:`pending_grads` and :meth:`reduce_gradients` reduces the sum once, in a graph
    of its own (a pipeline stage's step of several microbatches: the reduction is linear, so one
    reduction of the sum equals the sum of one per microbatch). ``keep_gathered`` (with
    ``defer_grad_reduction``): what the graphs compute from the parameters alone (their gathers
    and casts; :mod:`apmodel.lowering.static_split`) runs on the first call after
    :meth:`release_kept` and is kept for the calls after it (a pipeline stage's microbatches).
    A backward may also run in two parts (:attr:`weight_work`, :mod:`apmodel.lowering.weight_split`):
    the inputs' gradients now, the parameters' gradients later (a zero-bubble pipeline's ``I`` and
    ``W`` actions)."""

    def __init__(self, prog: LoweredProgram, param_locals: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
                 inputs: Sequence[torch.Tensor], device: torch.device, bucket_mb: float | None = None,
                 inflight_mb: float | None = None, *, defer_grad_reduction: bool = False,
                 keep_gathered: bool = False) -> None:
        self.prog = prog
        self.bucket_mb = bucket_mb
        self.inflight_mb = inflight_mb
        self.defer_grad_reduction = defer_grad_reduction
        self._grad_layouts: list[_Layout | None] = []  # deferred: per gradient, its placement before the reduction
        self.pending_grads: list[torch.Tensor] | None = None
        """deferred: the unreduced gradients summed over the backwards since the last reduction"""
        self.gradient_graph: fx.GraphModule | None = None
        """deferred: the graph that reduces :attr:`pending_grads` to the parameters' placements"""
        self.gradient_redistributions: list[Any] = []
        self._splits: dict[str, StaticSplit | None] = {}  # keep_gathered: per graph, its parameters-only prologue
        self._kept: dict[str, list[torch.Tensor]] = {}  # keep_gathered: each prologue's values since release_kept
        self._weight_split: WeightSplit | None = None
        self._weight_split_made = False
        self.weight_work: list[Callable[[], None]] | None = None
        """while not None (a pipeline stage's input-gradient action, :func:`apmodel.lowering.split_weight_backward`):
        a backward runs only its input-gradient part and appends here what runs its weight-gradient part"""
        self.device = device
        self.mesh = prog.mesh
        start = time.perf_counter()
        mode = fake_tensor_mode()
        with mode:
            fake = [[torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device) for t in group]
                    for group in (param_locals, buffers, inputs)]
        self.master_dtypes = [t.dtype for t in param_locals]
        self._saved_layout: list[Any] = []     # per saved node: its value's structure, leaves as _Layout / constants
        self._output_layouts: list[_Layout | None] = []
        self._regions: list[tuple[Callable, dict, str]] = []
        self._saved_static: list[bool] = []  # per saved tensor: a parameter's value (prefetchable in backward)
        self._inference_graph: fx.GraphModule | None = None
        prog.redistributions = []
        traced = make_fx(lambda p, b, x: self._forward(p, b, x), tracing_mode="fake")(*fake)
        n_static = len(param_locals) + len(buffers)
        self.forward_graph: fx.GraphModule = self._finish(traced, "forward", [True] * n_static)
        self.forward_redistributions = list(prog.redistributions)
        out_vals = self.forward_graph.graph.find_nodes(op="output")[0].args[0]
        n_out = len(prog.fwd_outputs)
        saved_fake = [n.meta["val"] for n in out_vals[n_out:n_out + self._n_saved]]
        with mode:
            tangents = [torch.empty_strided(v.meta["val"].shape, v.meta["val"].stride(), dtype=v.meta["val"].dtype,
                                            device=device) for v in out_vals[:n_out]]
        prog.redistributions = []
        self._regions = []
        self.backward_graph: fx.GraphModule = self._finish(
            make_fx(lambda s, t: self._backward(s, t), tracing_mode="fake")(saved_fake, tangents), "backward",
            self._saved_static)
        self.backward_redistributions = list(prog.redistributions)
        prog.redistributions = []
        if defer_grad_reduction:
            self._trace_gradient_graph(mode, out_vals_of(self.backward_graph)[:sum(self.param_has_grad)])
        if keep_gathered:  # the parameters (not the buffers: BatchNorm's change per call) and what is saved of them
            n_p, n_in = len(param_locals), len(buffers) + len(inputs)
            self._splits["forward"] = split_static(self.forward_graph, [True] * n_p + [False] * n_in)
            self._splits["backward"] = split_static(self.backward_graph, self._saved_static + [False] * n_out)
        self.trace_s = time.perf_counter() - start
        logger.info("native program: forward %d nodes, backward %d nodes, %d collectives, traced in %.2f s",
                    len(self.forward_graph.graph.nodes), len(self.backward_graph.graph.nodes),
                    sum(self.collective_counts().values()), self.trace_s)

    # ------------------------------------------------------------------------------- tracing
    def _forward(self, param_locals: list, buffers: list, inputs: list) -> tuple:
        prog, mesh = self.prog, self.mesh
        env: dict[fx.Node, Any] = {}
        for n, local in zip(prog.params, param_locals, strict=False):
            val = n.meta["val"]
            param: torch.Tensor = DTensor.from_local(local, mesh, prog.storage[n], run_check=False, shape=val.shape,
                                                     stride=val.stride())
            if prog.param_dtype is not None and param.is_floating_point():  # mixed precision: compute in the param dtype
                param = param.to(prog.param_dtype)
            env[n] = param
        for n, b in zip(prog.buffers, buffers, strict=False):  # the global value on every rank: its local chunk
            env[n] = distribute_tensor(b, mesh, prog.storage[n], src_data_rank=None)
        for n, x in zip(prog.inputs, inputs, strict=False):
            env[n] = distribute_tensor(x, mesh, prog.storage[n], src_data_rank=None)
        prog._run(prog.fwd_steps, env, "forward", self.device, regions=self._regions)
        outputs = []
        for o in prog.fwd_outputs:
            v = env[o]
            t = prog.output_tangent.get(o)
            if t is not None:
                v = prog._redistribute(v, prog.storage[t], f"output:{o.name}", o.name, 0, "forward")
            self._output_layouts.append(_Layout.of(v))
            outputs.append(v.to_local() if isinstance(v, DTensor) else v)
        saved: list[torch.Tensor] = []
        param_values = prog.captured.param_value_chain()
        for n in prog.saved:
            leaves, spec = flatten_args(env[n])
            layout = []
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    layout.append(("tensor", _Layout.of(leaf)))
                    saved.append(leaf.to_local() if isinstance(leaf, DTensor) else leaf)
                    self._saved_static.append(n.name in param_values)
                else:
                    layout.append(("constant", leaf))
            self._saved_layout.append((spec, layout))
        self._n_saved = len(saved)
        updates = []
        for b, u in prog.buffer_update.items():  # BatchNorm running statistics and the like
            fqn = prog.captured.buffer_fqn[b.name]
            v = prog._redistribute(env[u], prog.storage[b], f"buffer:{fqn}", u.name, 0, "forward")
            updates.append(v.full_tensor() if isinstance(v, DTensor) else v)
        return (*outputs, *saved, *updates)

    def _backward(self, saved: list, tangents: list) -> tuple:
        prog, mesh = self.prog, self.mesh
        env: dict[fx.Node, Any] = {}
        it = iter(saved)
        for n, (spec, layout) in zip(prog.saved, self._saved_layout, strict=False):
            leaves = []
            for kind, what in layout:
                if kind == "constant":
                    leaves.append(what)
                else:
                    local = next(it)
                    leaves.append(local if what is None else what.wrap(local, mesh))
            env[n] = unflatten_args(leaves, spec)
        for o, g, layout in zip(prog.fwd_outputs, tangents, self._output_layouts, strict=False):
            t = prog.output_tangent.get(o)
            if t is not None:
                env[t] = g if layout is None else layout.wrap(g, mesh)
        prog._run(prog.bwd_steps, env, "backward", self.device, regions=self._regions)
        grads: list[torch.Tensor | None] = []
        self.param_has_grad = []
        for p, master in zip(prog.params, self.master_dtypes, strict=False):
            g = prog.param_grad.get(p)
            self.param_has_grad.append(g is not None)
            if g is None:
                continue
            if self.defer_grad_reduction:  # left unreduced, in the dtype it will be reduced in (summed until then)
                v = env[g]
                self._grad_layouts.append(_Layout.of(v))
                local = v.to_local() if isinstance(v, DTensor) else v
                if prog.reduce_dtype is not None and local.is_floating_point():
                    local = local.to(prog.reduce_dtype)
                grads.append(local.contiguous())  # the reduction graph is traced for contiguous sums
                continue
            v = prog._redistribute(env[g], prog.storage[p], f"grad:{prog.captured.param_fqn[p.name]}", g.name, 0,
                                   "backward", gradient=True)
            # mixed precision: the gradient of the fp32 master (DTensor.to gives a DTensor; torch's stub says Tensor)
            grads.append(v.to(master).to_local())  # type: ignore[attr-defined]
        self.input_has_grad = []
        for i in prog.inputs:
            g = prog.input_grad.get(i)
            self.input_has_grad.append(g is not None)
            if g is None:
                continue
            v = prog._redistribute(env[g], prog.storage[i], f"grad:input{prog.captured.input_index[i.name]}", g.name, 0,
                                   "backward")
            grads.append(v.full_tensor() if isinstance(v, DTensor) else v)  # the input was the global tensor
        return tuple(grads)

    def _trace_gradient_graph(self, mode: Any, unreduced: Sequence[fx.Node]) -> None:
        """Trace the deferred reduction: unreduced gradients in (shaped as the backward graph's
        outputs ``unreduced``), the parameters' gradients at their storage placements out."""
        prog = self.prog
        with mode:
            fake = [torch.empty(n.meta["val"].shape, dtype=n.meta["val"].dtype, device=self.device) for n in unreduced]
        prog.redistributions = []
        self._regions = []
        traced = make_fx(lambda g: self._reduce(g), tracing_mode="fake")(fake)
        self.gradient_graph = self._finish(traced, "gradient reduction", [False] * len(fake))
        self.gradient_redistributions = list(prog.redistributions)
        prog.redistributions = []

    def _reduce(self, unreduced: list) -> tuple:
        prog = self.prog
        with_grad = [(p, m) for p, m, has in zip(prog.params, self.master_dtypes, self.param_has_grad, strict=True) if has]
        out = []
        for (p, master), local, layout in zip(with_grad, unreduced, self._grad_layouts, strict=True):
            g = prog.param_grad[p]
            v = local if layout is None else layout.wrap(local, self.mesh)
            v = prog._redistribute(v, prog.storage[p], f"grad:{prog.captured.param_fqn[p.name]}", g.name, 0,
                                   "backward", gradient=True)
            out.append(v.to(master).to_local())  # type: ignore[attr-defined]  # DTensor.to gives a DTensor
        return tuple(out)

    def accumulate(self, unreduced: Sequence[torch.Tensor]) -> None:
        """Add one backward's unreduced gradients into :attr:`pending_grads` (no communication)."""
        if self.pending_grads is None:
            self.pending_grads = [g.clone(memory_format=torch.contiguous_format) for g in unreduced]
        else:
            for acc, g in zip(self.pending_grads, unreduced, strict=True):
                acc.add_(g)

    def reduce_gradients(self) -> list[torch.Tensor] | None:
        """The pending gradients reduced (local tensors at the parameters' placements, one per
        parameter with a gradient), the pending sum cleared; None when no backward ran since."""
        if self.pending_grads is None or self.gradient_graph is None:
            return None
        grads = self.run(self.gradient_graph, list(self.pending_grads))
        self.pending_grads = None
        return list(grads)

    def _finish(self, gm: fx.GraphModule, phase: str, static: Sequence[bool]) -> fx.GraphModule:
        """The traced graph made lean (no-op aliases dropped, collectives bucketed and ordered,
        frequent ops through their Python bindings) and its region operators turned into
        :class:`_RegionCall` s with their ranks (in the order they ran: one traced node per region
        step). ``static``: per leading placeholder, whether it is a parameter's value (its
        collectives may be prefetched)."""
        _drop_aliases(gm.graph)
        gm.graph.eliminate_dead_code()
        region_ops = {target for target, _, _ in self._regions}
        talking = any(getattr(region_of(target), "communicates", True) for target in region_ops)
        # a region's function issues blocking collectives of its own (on other process groups, from
        # its backward's own thread): its graph keeps the traced order, each collective waited
        # right after it is issued, as the interpreter runs it
        if self.bucket_mb and not talking:
            gm = _bucketed(gm, self.bucket_mb, phase)
        # a region's own collectives are blocking: its graph keeps every collective waited as issued
        order_collectives(gm, None if talking else self.inflight_mb, static,
                          GLOO_MAX_INFLIGHT if self.mesh.device_type == "cpu" else None)
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in region_ops]
        if len(nodes) != len(self._regions):
            raise RuntimeError(f"native {phase} graph: {len(nodes)} region calls traced, {len(self._regions)} run")
        for node, (target, comms, name) in zip(nodes, self._regions, strict=True):
            if node.target is not target:
                raise RuntimeError(f"native {phase} graph: region node {node.name} calls {node.target}, expected {target}")
            node.target = _RegionCall(target, comms, name)
        _bind_python_calls(gm.graph)
        gm.recompile()
        return gm

    def run_step(self, phase: str, *groups: Sequence[Any]) -> Any:
        """The ``phase`` ("forward" or "backward") graph on its argument groups; kept gathered, its
        prologue's values computed on the first call since :meth:`release_kept` and reused."""
        graph = self.forward_graph if phase == "forward" else self.backward_graph
        split = self._splits.get(phase)
        if split is None:
            return self.run(graph, *[list(g) for g in groups])
        return self.run(split.main, *self._main_args(phase, split, [x for g in groups for x in g]))

    def _main_args(self, phase: str, split: StaticSplit, flat: list[Any]) -> list[Any]:
        """The main graph's arguments: the prologue's kept values (computed on the first call
        since :meth:`release_kept`), then the arguments that are not static."""
        flags = self._static_flags(phase, len(flat))
        static = [x for x, f in zip(flat, flags, strict=True) if f]
        rest = [x for x, f in zip(flat, flags, strict=True) if not f]
        kept = self._kept.get(phase)
        if kept is None:
            kept = self._kept[phase] = list(self.run(split.prologue, *static))
        return [*kept, *rest]

    def weight_split(self) -> WeightSplit | None:
        """The backward graph that runs (the main graph when kept gathered) cut into its
        input-gradient and weight-gradient parts (:func:`apmodel.lowering.weight_split.split_weight`),
        made on first use; None when no node is left for the weight part."""
        if not self._weight_split_made:
            split = self._splits.get("backward")
            graph = self.backward_graph if split is None else split.main
            self._weight_split = split_weight(graph, sum(self.param_has_grad))
            self._weight_split_made = True
            if self._weight_split is not None:
                logger.info("native backward graph split: %d nodes for the weight gradients, %d values kept for them",
                            self._weight_split.n_weight_nodes, self._weight_split.n_kept)
        return self._weight_split

    def run_backward_input(self, split: WeightSplit, saved: Sequence[torch.Tensor],
                           tangents: Sequence[torch.Tensor]) -> tuple[list[Any], list[Any]]:
        """The input-gradient part of the backward: (the inputs' gradients, one per input with a
        gradient; the values :meth:`run_backward_weight` reads)."""
        flat = [*saved, *tangents]
        static = self._splits.get("backward")
        args = flat if static is None else self._main_args("backward", static, flat)
        outs = self.run(split.input_part, *args)
        return list(outs[:split.n_input_grads]), list(outs[split.n_input_grads:])

    def run_backward_weight(self, split: WeightSplit, kept: Sequence[Any], params: Sequence[DTensor]) -> None:
        """The weight-gradient part of the backward on the values its input part ``kept``: the
        parameters' gradients added to ``params``' ``.grad`` (DTensors, as autograd would), or,
        deferred, into :attr:`pending_grads`."""
        grads = list(self.run(split.weight_part, *kept))
        if self.defer_grad_reduction:
            self.accumulate(grads)
            return
        it = iter(grads)
        with torch.no_grad():
            for param, has in zip(params, self.param_has_grad, strict=True):
                if not has:
                    continue
                g = next(it)
                if param.requires_grad:
                    add_to_grad(param, g)

    def _static_flags(self, phase: str, n: int) -> list[bool]:
        if phase == "forward":
            return [True] * len(self.master_dtypes) + [False] * (n - len(self.master_dtypes))
        return self._saved_static + [False] * (n - len(self._saved_static))

    def release_kept(self) -> None:
        """Forget the kept parameter values (the parameters change at the optimizer step)."""
        self._kept.clear()

    def run(self, graph: fx.GraphModule, *args: Any) -> Any:
        """``graph(*args)``; a failure inside it is re-raised naming the joint-graph node whose
        kernels failed (read off the generated code's line in the traceback)."""
        try:
            return graph(*args)
        except Exception as e:
            name = _failed_node(graph, e)
            if name is None:
                raise
            raise RuntimeError(self.prog.failure_message(name, e)) from e

    # ------------------------------------------------------------------------------- reading
    def collective_counts(self) -> dict[str, int]:
        """``_c10d_functional`` collectives in both graphs, by op name (``wait_tensor`` excluded)."""
        counts: dict[str, int] = {}
        for gm in (self.forward_graph, self.backward_graph, *([self.gradient_graph] if self.gradient_graph else [])):
            for name, n in _count_collectives(gm).items():
                counts[name] = counts.get(name, 0) + n
        return counts

    @property
    def output_layouts(self) -> list[_Layout | None]:
        return self._output_layouts

    @property
    def n_outputs(self) -> int:
        return len(self._output_layouts)

    @property
    def n_saved(self) -> int:
        return self._n_saved

    @property
    def inference_graph(self) -> fx.GraphModule:
        """The forward graph without what it saves for backward (those outputs None, the work
        and collectives only they needed dropped), made on first use: a call without gradients
        runs it. Every rank drops the same nodes, so the collectives still match across ranks."""
        if self._inference_graph is None:
            graph = copy.deepcopy(self.forward_graph.graph)
            output = graph.find_nodes(op="output")[0]
            values = list(output.args[0])
            n_out = self.n_outputs
            values[n_out:n_out + self._n_saved] = [None] * self._n_saved
            output.args = (type(output.args[0])(values),)
            graph.eliminate_dead_code()
            self._inference_graph = fx.GraphModule(self.forward_graph, graph)
        return self._inference_graph


#: Ops that return their input unchanged when the output's shape, stride, offset and dtype equal the
#: input's (DTensor's from_local/to_local and its sharding propagation leave many such views).
_ALIASING_OPS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
                           aten.detach.default, aten.alias.default, aten.slice.Tensor})


def out_vals_of(gm: fx.GraphModule) -> list[fx.Node]:
    """The values a graph returns, in order."""
    return list(gm.graph.find_nodes(op="output")[0].args[0])


def _drop_aliases(graph: fx.Graph) -> None:
    """Replace ops that return their input unchanged (an alias of the same layout) by the input:
    each costs a dispatch per step and changes nothing in a functional graph."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _ALIASING_OPS or not node.args:
            continue
        src = node.args[0]
        a, b = getattr(src, "meta", {}).get("val"), node.meta.get("val")
        if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.stride() == b.stride() and a.dtype == b.dtype and a.storage_offset() == b.storage_offset()):
            node.replace_all_uses_with(src)
            graph.erase_node(node)


#: Ops called through their Python bindings instead of ``torch.ops.aten...``: the same kernel,
#: reached in less host time, for the ops a transformer step repeats most. Tensor methods are "call_method"
#: nodes; the rest torch functions. Views become ``reshape`` (a view wherever the input's layout
#: allows one, else a copy): a bucketed collective hands out slices of its flat buffer, whose
#: strides differ from the traced ones; the graphs are functional, so only values matter.
_TENSOR_METHODS = {aten.view.default: "reshape", aten._unsafe_view.default: "reshape", aten.expand.default: "expand"}
_TORCH_FUNCTIONS = {
    aten.mm.default: torch.mm, aten.bmm.default: torch.bmm, aten.t.default: torch.t,
    aten.mul.Tensor: torch.mul, aten.add.Tensor: torch.add, aten.sub.Tensor: torch.sub, aten.div.Tensor: torch.div,
    aten.neg.default: torch.neg, aten.rsqrt.default: torch.rsqrt, aten.unsqueeze.default: torch.unsqueeze,
    aten.transpose.int: torch.transpose, aten.permute.default: torch.permute, aten.sum.dim_IntList: torch.sum,
    aten.mean.dim: torch.mean, aten.pow.Tensor_Scalar: torch.pow, aten.clone.default: torch.clone,
    aten.cat.default: torch.cat, aten.exp.default: torch.exp,
    **LOCAL_IMPLS,  # the N-D linears as a reshape and torch.mm: Inductor sees plain ATen ops
}


def _count_collectives(gm: fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and _is_collective(n.target):
            name = overload_packet(n.target).__name__
            if name != "wait_tensor":
                counts[name] = counts.get(name, 0) + 1
    return counts


def _bucketed(gm: fx.GraphModule, cap_mb: float, phase: str) -> fx.GraphModule:
    """``gm`` with its collectives bucketed (:func:`apmodel._torch_private.bucket_collectives`),
    or unchanged, with a warning, if the pass fails on it."""
    before = _count_collectives(gm)
    candidate = copy.deepcopy(gm)
    try:
        bucket_collectives(candidate, cap_mb)
    except Exception as e:  # Inductor's passes are private and evolve: run unbucketed rather than fail
        logger.warning("native %s graph: bucketing collectives failed (%s: %s); running them one by one",
                       phase, type(e).__name__, e)
        return gm
    logger.info("native %s graph: %d collectives bucketed into %d (cap %.0f MB)", phase, sum(before.values()),
                sum(_count_collectives(candidate).values()), cap_mb)
    return candidate


def _program_ops(graph: fx.Graph, static: Sequence[bool]) -> tuple[list[fx.Node], list[ProgramOp]]:
    """The graph's nodes as a step program (:class:`costmodels.overlap.ProgramOp`): placeholders
    are sources (static: the leading ``static`` flags), functional collectives issues and waits,
    views views, the rest compute (heavy as :func:`apmodel.result.step_timeline.op_kind` says); no durations."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    ops: list[ProgramOp] = []
    placeholder = 0
    for n in nodes:
        inputs = tuple(dict.fromkeys(index[a] for a in n.all_input_nodes))
        if n.op == "placeholder":
            ops.append(ProgramOp("source", static=placeholder < len(static) and bool(static[placeholder]), label=n.name))
            placeholder += 1
        elif n.op == "get_attr":
            ops.append(ProgramOp("source", static=True, label=n.name))
        elif n.op == "call_function" and _is_collective(n.target):
            if overload_packet(n.target).__name__ == "wait_tensor":
                producer = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
                if producer is not None and ops[index[producer]].kind == "issue":
                    ops.append(ProgramOp("wait", (index[producer],), label=n.name))
                    continue
                ops.append(ProgramOp("compute", inputs, label=n.name))
            else:
                ops.append(ProgramOp("issue", inputs, nbytes=_bytes(n), label=n.name))
        elif n.op in ("call_function", "call_method"):
            kind, weight = op_kind(n.target)
            ops.append(ProgramOp(kind, inputs, weight=weight, label=n.name))  # type: ignore[arg-type]
        else:  # the output, a call_module
            ops.append(ProgramOp("compute", inputs, label=n.name))
    return nodes, ops


def _is_collective(target: Any) -> bool:
    return getattr(target, "namespace", None) in ("_c10d_functional", "c10d_functional")


def _bytes(node: fx.Node) -> float:
    """Bytes a collective holds while in flight: the larger of its output and its inputs."""
    sizes = [0]
    for v in [node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes)]:
        for t in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(t, torch.Tensor):
                sizes.append(t.numel() * t.element_size())
    return float(max(sizes))


def order_collectives(gm: fx.GraphModule, inflight_mb: float | None, static: Sequence[bool],
                      max_inflight: int | None = None) -> None:
    """Put ``gm``'s nodes in the order the program runs: with ``inflight_mb``, each collective
    issued as soon as its inputs exist and waited just before its first reader, parameters'
    gathers prefetched, at most ``inflight_mb`` MB in flight (:func:`costmodels.overlap.issue_order`,
    the order the planner priced; ``max_inflight`` collectives at most, one on gloo:
    :data:`costmodels.overlap.GLOO_MAX_INFLIGHT`); None: each collective waited right after it is
    issued. The order depends on the graph's structure only, so every rank issues its collectives
    alike."""
    nodes, ops = _program_ops(gm.graph, static)
    order = serial_order(ops) if inflight_mb is None else issue_order(ops, inflight_mb * 2**20, max_inflight)
    cursor = nodes[order[0]]
    for i in order[1:]:
        node = nodes[i]
        if node.op == "output":
            continue
        cursor.append(node)
        cursor = node
    output = next(n for n in nodes if n.op == "output")
    cursor.append(output)
    gm.graph.lint()
    gm.recompile()


def _bind_python_calls(graph: fx.Graph) -> None:
    """Call the frequent ops through their Python bindings (see :data:`_TORCH_FUNCTIONS`)."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _TENSOR_METHODS:
            node.op, node.target = "call_method", _TENSOR_METHODS[node.target]
        elif node.target in _TORCH_FUNCTIONS:
            node.target = _TORCH_FUNCTIONS[node.target]


def _failed_node(graph: fx.GraphModule, error: BaseException) -> str | None:
    """The joint-graph node whose kernels raised ``error`` inside ``graph``'s generated code."""
    filename = graph.forward.__code__.co_filename
    tb = error.__traceback__
    lineno = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    if lineno is None:
        return None
    line = linecache.getline(filename, lineno).strip()
    target = line.split("=", 1)[0].strip().split(",")[0].strip() if "=" in line else ""
    node = next((n for n in graph.graph.nodes if n.name == target), None)
    return None if node is None else node.meta.get("apmodel_node")


class NativeStep(torch.autograd.Function):
    """One step: the forward graph now, the backward graph when autograd asks.

    Arguments: the native program, whether the parameters come as DTensors (eager: their local
    tensors are read here and their gradients come back as DTensors; under ``torch.compile`` they
    come as local tensors from a differentiable ``to_local``, which dynamo traces), then the
    parameters, the buffers and the inputs (global values). Returns the forward outputs (local, at
    their planned placements) and the buffers' new values.

    While the program's :attr:`NativeProgram.weight_work` is set (eager, accumulating into the
    parameters), the backward runs the input-gradient part of the graph only and returns no
    parameter gradient; the closure it appends there runs the weight-gradient part later."""

    @staticmethod
    def forward(ctx: Any, native: NativeProgram, as_dtensors: bool, *values: torch.Tensor) -> Any:
        n_p, n_b = len(native.prog.params), len(native.prog.buffers)
        params = values[:n_p]
        locals_ = [cast(DTensor, p).to_local() for p in params] if as_dtensors else list(params)  # no grad here: no autograd node
        outs = native.run_step("forward", locals_, values[n_p:n_p + n_b], values[n_p + n_b:])
        n_out, n_saved = native.n_outputs, native.n_saved
        ctx.native = native
        ctx.params = params if as_dtensors else None
        ctx.save_for_backward(*outs[n_out:n_out + n_saved])
        updates = outs[n_out + n_saved:]
        ctx.mark_non_differentiable(*updates)
        return (*outs[:n_out], *updates)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        native: NativeProgram = ctx.native
        n_out = native.n_outputs
        params = ctx.params
        work = native.weight_work
        split = native.weight_split() if work is not None and params is not None else None
        if work is not None and split is not None and grads_accumulate_into(params):
            # a pipeline's input-gradient action: the weight-gradient part waits for its W action
            input_grads, kept = native.run_backward_input(split, ctx.saved_tensors, grads[:n_out])
            dparams = cast(Sequence[DTensor], params)  # eager: the DTensor parameters themselves
            work.append(lambda: native.run_backward_weight(split, kept, dparams))
            ctx.params = None
            it_in = iter(input_grads)
            return (None, None, *[None] * len(native.param_has_grad), *[None] * len(native.prog.buffers),
                    *[next(it_in) if has else None for has in native.input_has_grad])
        grads_in = native.run_step("backward", ctx.saved_tensors, grads[:n_out])
        it = iter(grads_in)
        result: list[Any] = [None, None]
        if native.defer_grad_reduction:  # the parameters' gradients wait in the program for the step's reduction
            unreduced = [next(it) for has in native.param_has_grad if has]
            if params is None or grads_accumulate_into(params):  # not for autograd.grad of the inputs alone
                native.accumulate(unreduced)
            result += [None] * len(native.param_has_grad)
        for i, has in enumerate([] if native.defer_grad_reduction else native.param_has_grad):
            g = next(it) if has else None
            result.append(g if g is None or params is None else dtensor_like(params[i], g))
        result += [None] * len(native.prog.buffers)
        result += [next(it) if has else None for has in native.input_has_grad]
        ctx.params = None
        return tuple(result)
