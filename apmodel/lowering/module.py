"""Module surgery: parameters become DTensors, the class runs the planned step; plus capturing
on meta for any model and planning on one rank of a process group.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Callable, Iterator, Sequence, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from apmodel.core.kernels import local_kernels as default_local_kernels
from apmodel.core.options import default_of, renamed_keywords
from apmodel.lowering.autograd import FromGlobal, JointStep
from apmodel.lowering.graph import add_to_grad, format_placements, placement_tokens
from apmodel.lowering.modes import ModelModes
from apmodel.lowering.native import NativeProgram, NativeStep, trace_device
from apmodel.lowering.program import LoweredProgram
from apmodel.lowering.records import planned_redistributions

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# module construction
# ----------------------------------------------------------------------------------------------


def _set_parameter(model: nn.Module, fqn: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = fqn.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    old = getattr(owner, leaf)
    owner.register_parameter(leaf, nn.Parameter(value, requires_grad=old.requires_grad))


#: How a plan runs: "native" (two FX graphs over local shards with functional collectives, see
#: :mod:`apmodel.lowering.native`) or "interpret" (the joint graph interpreted over DTensors every
#: step: slower, for debugging a plan node by node).
LOWERINGS = ("native", "interpret")
#: Default bucket size of the native program's collectives, in MB (as DDP's ``bucket_cap_mb``): the
#: planning option ``bucket_mb``'s default, the size plans are priced with.
DEFAULT_BUCKET_MB: float = default_of("bucket_mb")
#: Default in-flight limit of the overlapped native program, MB: the planning option ``inflight_mb``'s default.
DEFAULT_INFLIGHT_MB: float = default_of("inflight_mb")


def _native_program(prog: LoweredProgram, model: nn.Module) -> NativeProgram:
    """``prog``'s native program, traced on first use from the metadata of ``model``'s
    parameters and buffers and the plan's input shapes (no allocation, no communication)."""
    if prog.native is None:
        params = [cast(DTensor, model.get_parameter(prog.captured.param_fqn[n.name])).to_local() for n in prog.params]
        buffers = [_global(model.get_buffer(prog.captured.buffer_fqn[n.name])) for n in prog.buffers]
        inputs = [n.meta["val"] for n in prog.inputs]
        prog.native = NativeProgram(prog, params, buffers, inputs, trace_device(prog.mesh), prog.bucket_mb,
                                    prog.inflight_mb, defer_grad_reduction=prog.defer_grad_reduction,
                                    keep_gathered=prog.keep_gathered)
    return prog.native


def defer_gradient_reduction(model: nn.Module, *, keep_gathered: bool = False) -> None:
    """Make the parallel ``model`` (native lowering) leave its parameters' gradients unreduced in
    each backward and sum them, until :func:`reduce_gradients` reduces the sum once (gradient
    accumulation over a pipeline's microbatches). ``keep_gathered``: also gather the parameters
    once and keep them until :func:`release_kept` (which :func:`reduce_gradients` calls)."""
    prog: LoweredProgram | None = getattr(model, "_apmodel_program", None)
    if prog is None or prog.lowering != "native":
        raise ValueError(f"{type(model).__name__}: deferring gradient reduction needs a module lowered natively "
                         f"(apmodel.parallelize(..., lowering='native'))")
    prog.native = None  # traced again (if it was), with the reduction apart
    prog.defer_grad_reduction = True
    prog.keep_gathered = keep_gathered


@contextlib.contextmanager
def split_weight_backward(model: nn.Module) -> Iterator[list[Callable[[], None]]]:
    """Within: a backward through ``model`` (native lowering, eager) runs only the input-gradient
    part of its backward graph (:mod:`apmodel.lowering.weight_split`) and returns no parameter
    gradient; the weight-gradient part of each such backward is appended to the list yielded, a
    closure that computes the parameters' gradients and adds them to ``.grad`` (or, deferred,
    :func:`defer_gradient_reduction`, to the pending sum). Call each once, later (a zero-bubble
    pipeline's ``W`` action). Any other module: nothing is split and the list stays empty."""
    prog: LoweredProgram | None = getattr(model, "_apmodel_program", None)
    natives = [] if prog is None or prog.lowering != "native" else [
        p.native for p in (prog, *prog.variants.values()) if p.native is not None]
    work: list[Callable[[], None]] = []
    for native in natives:
        if native.weight_work is not None:
            raise RuntimeError(f"{type(model).__name__}: split_weight_backward entered twice")
        native.weight_work = work
    try:
        yield work
    finally:
        for native in natives:
            native.weight_work = None


def release_kept(model: nn.Module) -> None:
    """Forget the parameter values ``model`` keeps gathered (:func:`defer_gradient_reduction`)."""
    prog: LoweredProgram = model._apmodel_program  # type: ignore[assignment]  # torch's stub: Module attributes are Tensor | Module
    for program in (prog, *prog.variants.values()):
        if program.native is not None:
            program.native.release_kept()


def reduce_gradients(model: nn.Module) -> int:
    """Reduce the gradients ``model`` summed since the last call (:func:`defer_gradient_reduction`)
    and add them to its parameters' ``.grad``; returns how many parameters got one."""
    prog: LoweredProgram = model._apmodel_program  # type: ignore[assignment]  # torch's stub: Module attributes are Tensor | Module
    count = 0
    for program in (prog, *prog.variants.values()):
        native = program.native
        reduced = None if native is None else native.reduce_gradients()
        if reduced is None:
            continue
        param_owners, _ = _owners(model, program)
        with_grad = [o for o, has in zip(param_owners, native.param_has_grad, strict=True) if has]
        for (owner, leaf), local in zip(with_grad, reduced, strict=True):
            add_to_grad(getattr(owner, leaf), local)
            count += 1
    release_kept(model)  # the step's backwards are done: what they kept gathered goes
    return count


def _owners(model: nn.Module, prog: LoweredProgram) -> tuple[list[tuple[nn.Module, str]], dict[Any, tuple[nn.Module, str]]]:
    """(owning module, attribute) of each parameter (in order) and buffer (by node) of the step, found once: a step
    reads them with one ``getattr`` each (``to_empty`` and ``load_state_dict`` replace or refill
    the tensors, never the modules that hold them)."""
    if prog.owners is None:
        def owner(fqn: str) -> tuple[nn.Module, str]:
            path, _, leaf = fqn.rpartition(".")
            return (model.get_submodule(path) if path else model), leaf

        prog.owners = ([owner(prog.captured.param_fqn[n.name]) for n in prog.params],
                       {n: owner(prog.captured.buffer_fqn[n.name]) for n in prog.buffers})
    return prog.owners


def _global(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


def _native_forward(self: nn.Module, traced: LoweredProgram, inputs: list) -> Any:
    """One step of the native program: local tensors in, the forward graph, DTensor outputs.
    Without gradients (``no_grad``, ``inference_mode``) the forward graph runs without what it
    saves for backward (:attr:`NativeProgram.inference_graph`)."""
    inputs = [_global(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    prog = traced.for_inputs(inputs, ModelModes.of(self))
    native = _native_program(prog, self)
    device = native.device
    param_owners, buffer_owners = _owners(self, prog)
    params = []
    for n, (owner, leaf) in zip(prog.params, param_owners, strict=True):
        v = getattr(owner, leaf)
        if not isinstance(v, DTensor) or v.placements != prog.storage[n]:
            raise ValueError(f"parameter {prog.captured.param_fqn[n.name]!r} must be a DTensor placed "
                             f"{format_placements(prog.storage[n])}, got {format_placements(v.placements) if isinstance(v, DTensor) else type(v).__name__}")
        params.append(v)
    buffers = [_global(getattr(*buffer_owners[n])) for n in prog.buffers]
    inputs = [x if x.device == device else x.to(device) for x in inputs]
    # eager: DTensor parameters in, DTensor gradients out (cheap); dynamo traces to_local instead
    compiling = torch.compiler.is_compiling()
    if compiling or torch.is_grad_enabled():
        step_params: Sequence[torch.Tensor] = [v.to_local() for v in params] if compiling else params
        outs = NativeStep.apply(native, not compiling, *step_params, *buffers, *inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
    else:  # forward only: nothing kept for a backward
        outs = native.run(native.inference_graph, [v.to_local() for v in params], buffers, inputs)
        outs = (*outs[:native.n_outputs], *outs[native.n_outputs + native.n_saved:])
    n_out = native.n_outputs
    with torch.no_grad():  # buffer updates of the step (the global value)
        for n, new in zip(prog.buffer_update, outs[n_out:], strict=False):
            getattr(*buffer_owners[n]).copy_(new)
    results = [o if layout is None else layout.wrap(o, prog.mesh) for o, layout in zip(outs[:n_out], native.output_layouts, strict=False)]
    traced.redistributions = native.forward_redistributions + (
        native.backward_redistributions if torch.is_grad_enabled() else [])
    return results[0] if len(results) == 1 else tuple(results)


def _parallel_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    traced: LoweredProgram = self._apmodel_program  # type: ignore[assignment]  # torch's stub: Module attributes are Tensor | Module
    sig = traced.signature
    inputs = sig.flatten(args, kwargs, f"{type(self).__name__}.forward")
    if traced.param_dtype is not None:  # mixed precision: floating inputs compute in the param dtype (as FSDP2)
        inputs = [x.to(traced.param_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
    if traced.lowering == "native":
        return _native_forward(self, traced, inputs)
    prog = traced.for_inputs(inputs, ModelModes.of(self))  # the plan as traced, or replayed on these shapes/modes
    dinputs = []
    for i, (node, x) in enumerate(zip(prog.inputs, inputs, strict=False)):
        pl = prog.storage[node]
        if isinstance(x, DTensor):
            x = prog._redistribute(x, pl, node.name, sig.name(i), 0, "input")
        elif x.requires_grad:
            x = FromGlobal.apply(x, prog.mesh, pl)
        else:  # the global tensor, identical on every rank: keep the local chunk, no communication
            x = distribute_tensor(x, prog.mesh, pl, src_data_rank=None)
        dinputs.append(x)
    values: list = []
    device = None
    for n in prog.params:
        fqn = prog.captured.param_fqn[n.name]
        v = self.get_parameter(fqn)
        if not isinstance(v, DTensor) or placement_tokens(v.placements) != placement_tokens(prog.storage[n]):
            raise ValueError(f"parameter {fqn!r} must be a DTensor placed {format_placements(prog.storage[n])}, got {type(v).__name__}")
        if device is None:
            device = v.to_local().device
        values.append(v)
    for n in prog.buffers:  # plain tensors holding the global value (see lower): wrap, no communication
        fqn = prog.captured.buffer_fqn[n.name]
        b = self.get_buffer(fqn)
        pl = prog.storage[n]
        if isinstance(b, DTensor):
            b = prog._redistribute(b, pl, n.name, fqn, 0, "input")
        elif all(isinstance(p, Replicate) for p in pl):
            b = DTensor.from_local(b, prog.mesh, pl, run_check=False)
        else:
            b = distribute_tensor(b, prog.mesh, pl, src_data_rank=None)
        values.append(b)
    if device is None:
        device = dinputs[0].to_local().device if dinputs else torch.device(prog.mesh.device_type)
    prog.redistributions = traced.redistributions = []
    prog.new_buffer_values = {}
    keep = torch.is_grad_enabled() and any(v.requires_grad for v in values + dinputs)
    out = JointStep.apply(prog, device, keep, *values, *dinputs)
    with torch.no_grad():  # buffer updates of the step (replicated: the local value is the global one)
        for fqn, new in prog.new_buffer_values.items():
            self.get_buffer(fqn).copy_(new)
    prog.new_buffer_values = {}
    return out


def lower(model: nn.Module, mesh: DeviceMesh, plan: Any, captured: Any, *,
          local_kernels: Callable[[torch.device], dict] = default_local_kernels,
          lowering: str = "native", bucket_mb: float | None = DEFAULT_BUCKET_MB,
          inflight_mb: float | None = DEFAULT_INFLIGHT_MB,
          replan: Callable[[Any, Sequence[Any]], Any] | None = None, **old_keywords: Any) -> nn.Module:
    """Apply `plan` (made for `captured`, the joint graph of `model`) on the real `mesh`.

    ``local_kernels(device)`` maps ops without a kernel on ``device`` to the implementations run on
    local shards instead (default: :func:`apmodel.core.kernels.local_kernels`).

    Changes `model` in place and returns it: parameters become DTensors with the plan's storage
    placements (on the device they were on; meta stays meta; buffers stay plain tensors holding the
    global value), and its class becomes a subclass
    of the user's class whose ``forward(*inputs)`` runs the planned joint graph and returns the traced
    output (the loss when the graph was captured with a loss function) as a DTensor.

    ``lowering``: "native" (default) traces the step once into a forward and a backward graph over
    local shards with explicit functional collectives (see :mod:`apmodel.lowering.native`);
    ``torch.compile`` of the returned module compiles them. "interpret" runs the joint graph node by
    node over DTensors each step (slower; for debugging a plan). ``bucket_mb``: the native program
    merges independent collectives of one kind and group into buckets of at most this many MB (the
    planning option ``bucket_mb``; 0 or None: one collective per planned step; ``bucket_cap_mb=``,
    its old name, is read with a DeprecationWarning). ``inflight_mb``: the native program
    issues each collective as soon as its input exists and waits for it just before its first
    reader, parameter gathers prefetched, at most this many MB in flight (the planning option
    ``inflight_mb``); None: each collective waited as it is issued (a plan priced without overlap).

    ``replan(captured, constraints)``: a plan for the step at modules' other modes when it traces
    to another graph (a model with BatchNorm or dropout called after ``eval()``); ``constraints``
    keep the parameters where they are stored. :func:`apmodel.parallelize` passes one that plans on
    one rank under the plan's options; None: such a call is refused with a message.

    Raises ValueError for an unknown ``lowering``, a mesh of the wrong shape, a plan made for another graph (fingerprint), a
    plan with uneven shards, or a plan inconsistent with the graph.
    """
    from apmodel.result.plans import PlanMismatch

    renamed = renamed_keywords(old_keywords, stacklevel=3)
    bucket_mb = renamed.pop("bucket_mb", bucket_mb)
    if renamed:
        raise TypeError(f"apmodel.lowering.lower: unexpected keyword arguments {sorted(renamed)}")
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering={lowering!r}: expected one of {', '.join(map(repr, LOWERINGS))}")
    if tuple(mesh.shape) != tuple(plan.mesh_shape):
        raise PlanMismatch(f"mesh shape {tuple(mesh.shape)} differs from the plan's mesh shape {tuple(plan.mesh_shape)}")
    if plan.fingerprint != captured.fingerprint:
        raise PlanMismatch(
            f"the model's graph (fingerprint {captured.fingerprint[:12]}) does not match the plan's "
            f"(fingerprint {plan.fingerprint[:12]}): re-plan for this model and these sample inputs"
        )
    if getattr(model, "_apmodel_program", None) is not None:
        raise ValueError(f"{type(model).__name__} has already been parallelized")
    prog = LoweredProgram(mesh, plan, captured, local_kernels, lowering=lowering, bucket_mb=bucket_mb,
                          inflight_mb=inflight_mb)
    prog.retrace_model = _meta_twin(model, prog.param_dtype)  # structure only (meta tensors): for other input shapes
    prog.training_modes = ModelModes.of(model)  # the modes the step was captured in
    prog.replan = replan
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
    model._apmodel_program = prog  # type: ignore[assignment]  # torch's stub: Module attributes are Tensor | Module
    if lowering == "native" and torch.distributed.is_initialized():
        # traced now, so that torch.compile of the module finds the graphs made (a mesh without
        # process groups, made for planning, is traced at the first step)
        _native_program(prog, model)
    logger.info(
        "lowered %s on mesh %s: %d forward + %d backward nodes, %d planned redistributions",
        cls.__name__, tuple(mesh.shape), len(prog.fwd_steps), len(prog.bwd_steps), len(planned_redistributions(plan, captured)),
    )
    return model


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy full (global, unsharded) tensors, identical on every rank, into a parallelized model's
    DTensor parameters and buffers: each rank keeps its own chunk; no communication. Use after
    ``to_empty`` to load single-device weights (e.g. a reference model's ``state_dict()``)."""
    own: dict[str, torch.Tensor] = dict(model.named_parameters())
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


def _meta_twin(model: nn.Module, param_dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of `model` whose parameters and buffers are empty meta tensors (for tracing; costs no
    memory): the module structure is deep-copied, tensors are not. ``param_dtype``: floating
    parameters (not buffers) take this dtype, as a mixed-precision step computes with them."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        dtype = param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta", dtype=dtype), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _to_meta(x: Any, float_dtype: torch.dtype | None = None) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if float_dtype is not None and x.is_floating_point():
        return x.to("meta", dtype=float_dtype)
    return x.to("meta")


def capture_on_meta(model: nn.Module, sample_inputs: Sequence[Any], loss_fn: Callable | None, *,
                    param_dtype: torch.dtype | None = None, **capture_options: Any) -> Any:
    """Capture `model`'s training step on the meta device (as the planner does), whatever device the
    model and the sample inputs are on. ``capture_options``: kwargs, targets,
    allow_unused_parameters (see :func:`apmodel.graph.capture.capture`).

    ``param_dtype`` (mixed precision): the step is traced with floating parameters and floating
    inputs in this dtype, as the lowered step computes (buffers keep theirs), so that the casts
    the model's code makes at that dtype (norms computed in fp32, ...) are in the graph."""
    from apmodel.graph.capture import capture  # lazy: tracing machinery is heavy to import

    on_meta = all(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))
    meta_model = model if on_meta and param_dtype is None else _meta_twin(model, param_dtype)
    if capture_options.get("kwargs") is not None:
        capture_options["kwargs"] = {k: _to_meta(v, param_dtype) for k, v in capture_options["kwargs"].items()}
    if capture_options.get("targets") is not None:
        capture_options["targets"] = tuple(_to_meta(x, param_dtype) for x in capture_options["targets"])
    meta_inputs = tuple(_to_meta(x, param_dtype) for x in sample_inputs)
    return capture(meta_model, meta_inputs, loss_fn, **capture_options)


def plan_on_one_rank(solve: Callable[[], Any], mesh: DeviceMesh) -> Any:
    """Run `solve` on the mesh's first rank and send the plan (as JSON) to every rank of the default
    process group, so that all ranks lower the same plan (and only one pays for planning)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return solve()
    from apmodel.result.plans import Plan

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
