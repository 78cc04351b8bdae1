"""Pipeline stages run with ``torch.distributed.pipelining``, each stage's step lowered with its own
SPMD plan on the stage mesh.

A pipelined model on a mesh with a pipeline axis: the ranks that share a coordinate on the other
axes form one pipeline (``PipelineStage`` p2p over that group); the ranks that share a pipeline
coordinate form one stage mesh. Each rank:

1. cuts its stage out of the model (:func:`cut_stage`): the layer container keeps the stage's
   layers, parameter names staying those of the full model: an ``nn.ModuleDict`` keyed by layer
   index (torchtitan's convention) loses the others; an ``nn.ModuleList`` (transformers models) is
   replaced by a :class:`StageLayers` holding the stage's layers under their indices, which a
   forward iterates and slices as it did the list (the list kept with the other layers swapped
   out would need a pass-through that knows what each library's layer returns). The modules beside
   the layers that the stage does not run go: those the forward reads before its first layer
   (found by one forward on meta, :func:`children_before_layers`: the embeddings, GPT-2's
   position table read as a tensor too) on every stage but the first, the rest (final norm,
   output projection) on every stage but the last. A ``ModuleDict`` model's ``forward`` gets them
   as None and must accept that (the presets do: LLaMA and its MoE, DeepSeek-V3 and hybrid
   sliding-window descendants, and GPT-2: without the embeddings the input is the hidden state,
   without the output projection it is returned); a ``ModuleList`` model's, which calls every
   module, gets pass-throughs (``nn.Identity``: the hidden state goes in where the token ids did
   and comes out as the logits), so a learned position table added to the embedding (a second
   stage would add it again) is refused. A parameter tied across two of those modules (GPT-2's
   ``tie_embeddings``) would sit on two stages and is refused;
2. plans the stage's step at the microbatch size on the stage mesh (one rank of the stage mesh
   plans, the plan is sent to the others), its input and output placed as the boundaries agree
   (below), and lowers it (``plan_stage`` and ``lower_stage``, given by the caller:
   :func:`apmodel.entry.api.parallelize_pipeline` uses apmodel's planner and ``parallelize``);
3. wraps it (:class:`StageModule`) in a ``PipelineStage`` and builds the schedule
   (:data:`SCHEDULE_CLASSES`) with the loss function on the last stage. The V schedules
   (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) place stage ``k`` and stage ``2d - 1 - k``
   on pipeline rank ``k`` (:func:`apmodel.core.schedules.rank_of`) and split a backward into its
   input gradient and, later, its weight gradient (torch's ``stage_backward_input`` /
   ``stage_backward_weight``).

What crosses a boundary: the ranks of one pipeline share their coordinates on the other axes, so
rank ``c`` of stage ``k``'s mesh sends to rank ``c`` of stage ``k + 1``'s. Both stages agree on
the activation's placement on the stage mesh (:class:`Boundary`): the one the pipeline's price
assumed (the plan's record, ``boundary_placements``; :mod:`apmodel.solve.pipeline`), else the
default boundary placement (batch sharded on the stage mesh's axis 0 where it divides), never a
partial sum (the price counts one reduced, as replicated). The sender's stage plan places its
output there and each rank sends its local shard; the receiver makes it a DTensor again and its
stage plan takes its input placed there; the gradient goes back as a local shard the same way.
So each rank sends what the price charges (``boundary_bytes``, at the run's dtype). The lowered
stage still reads its input whole (the native program's inputs are global values: one gather
on the stage mesh where the placement shards it), which the price does not charge.

The schedule's ``step(inputs, target=..., losses=...)`` runs one training step; gradients are
accumulated over the microbatches and divided by their number (the schedule's ``scale_grads``), so
with a mean loss the step equals one step on the whole batch.

Weights are synchronised as priced (:data:`apmodel.core.schedules.WEIGHT_SYNCS`, one per stage): a
stage that reduces its gradients once per step runs each microbatch's backward without the
reduction (:func:`apmodel.lowering.defer_gradient_reduction`: the unreduced gradients are summed
locally) and reduces the sum when the schedule says the stage's backwards are done
(``perform_reduce_grad``, the ``REDUCE_GRAD`` action after its last backward, where torchtitan's
FSDP reduces too): one collective per bucket per step. Under a split backward the schedule's
``REDUCE_GRAD`` follows the stage's last weight-gradient action, so the reduction still sees
every microbatch's gradient. A stage priced as keeping its gathered
parameters (``gather_once``) also runs what its graphs compute from the parameters alone (their
gathers and casts, :mod:`apmodel.lowering.static_split`) on its first microbatch and keeps it
for the others, until that reduction.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from apmodel.core import placements as pl
from apmodel.core.schedules import V_SCHEDULES, WEIGHT_SYNCS, rank_stages
from apmodel.graph import conventions
from apmodel.lowering.module import (
    defer_gradient_reduction,
    reduce_gradients,
    release_kept,
    split_weight_backward,
)

logger = logging.getLogger(__name__)

#: ``torch.distributed.pipelining`` schedule of each schedule name of :mod:`apmodel.core.schedules`.
SCHEDULE_CLASSES: dict[str, type] = {"1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                                     "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}


#: A stage plan's boundary placements: its inputs' (None for the model's own, on the first stage)
#: and its outputs' (None for the last stage's), torch placements per stage-mesh axis.
StagePlacements = tuple[list[tuple[Placement, ...]] | None, list[tuple[Placement, ...]] | None]


class PipelineLoweringError(ValueError):
    """A model or request the pipeline lowering cannot follow; the message says which."""


class StageLayers(nn.ModuleDict):
    """The layers of one stage of a model whose layers are an ``nn.ModuleList``: kept under their
    indices in the full model (``model.layers.5.*`` stays ``model.layers.5.*``), iterated and sliced
    like the list was (a forward's ``for layer in self.layers[:n]`` runs the stage's layers)."""

    def __iter__(self) -> Any:  # the layers, as a ModuleList iterates (a ModuleDict gives its keys)
        return iter(self._modules.values())

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (slice, int)):
            return list(self._modules.values())[key]
        return super().__getitem__(key)


def _layer_container(model: nn.Module) -> tuple[str, nn.ModuleDict | nn.ModuleList]:
    path = conventions.from_module(model).layer_container
    if path is None:
        raise PipelineLoweringError(f"{type(model).__name__} has no repeated layers to split into pipeline stages")
    container = model.get_submodule(path) if path else model
    if not isinstance(container, (nn.ModuleDict, nn.ModuleList)):
        raise PipelineLoweringError(
            f"{type(model).__name__}.{path} is a {type(container).__name__}: pipeline stages need the layers in an "
            f"nn.ModuleDict keyed by index (torchtitan's convention) or an nn.ModuleList, so that a stage keeps the "
            f"full model's parameter names")
    return path, container


def _outside_layers(model: nn.Module, path: str) -> list[str]:
    """The modules beside the layer container: the children of the model and of every module on
    the container's path that are not on it (qualified names: ``lm_head``, ``model.embed_tokens``)."""
    parts = path.split(".") if path else []
    out = []
    for depth in range(len(parts)):
        prefix = ".".join(parts[:depth])
        parent = model.get_submodule(prefix) if prefix else model
        for name, _ in parent.named_children():
            if name != parts[depth]:
                out.append(f"{prefix}.{name}" if prefix else name)
    return out


def cut_stage(model: nn.Module, first_layer: int, last_layer: int, *, is_first: bool, is_last: bool,
              before: Collection[str] | None = None) -> nn.Module:
    """Cut ``model`` (in place) to the stage holding layers ``first_layer .. last_layer``
    (inclusive); see the module docstring. ``before``: the modules beside the layers (qualified
    names) that run before them (:func:`children_before_layers`); None: those holding an
    embedding (by the model's conventions). Returns ``model``."""
    path, container = _layer_container(model)
    n = len(container)
    if not 0 <= first_layer <= last_layer < n:
        raise PipelineLoweringError(f"stage layers [{first_layer}, {last_layer}] are not within the "
                                    f"{type(model).__name__}'s {n} layers")
    outside = _outside_layers(model, path)
    _refuse_ties_across_stages(model, outside)
    listed = isinstance(container, nn.ModuleList)
    if isinstance(container, nn.ModuleList):
        _refuse_position_tables(model)
        kept = StageLayers({str(i): container[i] for i in range(first_layer, last_layer + 1)})
        parent_path, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, leaf, kept)
    else:
        for key in list(container.keys()):
            if not first_layer <= int(key) <= last_layer:
                del container[key]
    conv = conventions.from_module(model)
    for name in outside:
        child = model.get_submodule(name)
        if child is None or not any(True for _ in child.parameters()):
            continue
        runs_before = (name in before if before is not None
                       else any(conv.role(f"{name}.{p}") == "embedding" for p, _ in child.named_parameters()))
        if (runs_before and not is_first) or (not runs_before and not is_last):
            parent_path, _, leaf = name.rpartition(".")
            # a forward that takes a missing module (the presets') gets None; one that calls every
            # module (a transformers model, layers in a ModuleList) a pass-through
            setattr(model.get_submodule(parent_path) if parent_path else model, leaf, nn.Identity() if listed else None)
    return model


def _refuse_position_tables(model: nn.Module) -> None:
    """A learned position table added to the embedding (GPT-2's ``wpe``, BERT's) cannot be passed
    through on a later stage (it would be added again to the hidden state): refused."""
    from apmodel.frontend.hf import position_limit

    if position_limit(model) is not None:
        raise PipelineLoweringError(f"{type(model).__name__}: its forward adds a learned position table to the "
                                    f"embedding, which a later stage cannot skip; pipeline stages of a model with "
                                    f"layers in an nn.ModuleList need rotary positions (LLaMA-style)")


def _owners(model: nn.Module, outside: Sequence[str]) -> dict[int, set[str]]:
    """Per parameter (by id) of the modules beside the layers (qualified names), the modules holding it."""
    owners: dict[int, set[str]] = {}
    for name in outside:
        child = model.get_submodule(name)
        for _, p in (child.named_parameters(remove_duplicate=False) if child is not None else ()):
            owners.setdefault(id(p), set()).add(name)
    return owners


def _refuse_ties_across_stages(model: nn.Module, outside: Sequence[str]) -> None:
    """A parameter shared by two modules beside the layers (GPT-2's tied embedding and head)
    would land on two stages, each with part of its gradient: refused."""
    shared = sorted(sorted(o) for o in _owners(model, outside).values() if len(o) > 1)
    if shared:
        raise PipelineLoweringError(f"{type(model).__name__}: modules {', '.join(shared[0])} share a parameter (tied "
                                    f"weights), which pipeline stages would hold apart; untie them to pipeline it")


def children_before_layers(model: nn.Module, inputs: Sequence[torch.Tensor]) -> set[str]:
    """The modules beside the layer container (qualified names, :func:`_outside_layers`) whose
    parameters the forward reads before its first layer runs: one forward on meta, every op's
    parameter arguments noted (GPT-2's position table is read as a tensor, not called as a module)."""
    path, container = _layer_container(model)
    owner = _owners(model, _outside_layers(model, path))
    seen: set[str] = set()
    started = [False]

    class _Reads(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if not started[0]:
                for a in [*args, *(kwargs or {}).values()]:
                    if isinstance(a, nn.Parameter) and id(a) in owner:
                        seen.update(owner[id(a)])
            return func(*args, **(kwargs or {}))

    first = next(iter(container.values() if isinstance(container, nn.ModuleDict) else container))
    handle = first.register_forward_pre_hook(lambda *_: started.__setitem__(0, True))
    try:
        with _on_meta(), _Reads():
            model(*inputs)
    finally:
        handle.remove()
    return seen


@contextlib.contextmanager
def _on_meta() -> Iterator[None]:
    """A forward on meta tensors for shapes only: no autograd, and libraries told they are traced
    (transformers then skips its value-dependent host checks, which meta tensors cannot answer)."""
    from apmodel._torch_private import composite_autograd_on_meta, fused_attention_on_meta, library_sees_tracing

    with torch.no_grad(), composite_autograd_on_meta(), fused_attention_on_meta(), library_sees_tracing():
        yield


def stage_output(out: Any) -> Any:
    """A stage's activation out of what its forward returned: the tensor itself, or the first
    value of a transformers ``ModelOutput`` (a stage without its head returns the hidden state
    as ``logits``) or of a one-element tuple."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)) and out:
        return out[0]
    return out


@dataclass(frozen=True)
class Boundary:
    """What crosses from one stage to the next: the activation of ``shape`` (global), placed
    ``placements`` on the stage mesh (never a partial sum); each rank sends its local shard."""

    shape: torch.Size
    placements: tuple[Placement, ...]


class StageModule(nn.Module):
    """A lowered stage as ``PipelineStage`` runs it: plain tensors in and out, the activations
    between stages as each rank's local shard at the boundary's placement (``receives``: the
    boundary before the stage, None for the first; ``sends``: the one after, None for the last).
    The received shard is made a DTensor again (``DTensor.from_local``; its gradient goes back as
    a local shard at the same placement); the stage's output is redistributed to the boundary's
    placement where the stage plan left it elsewhere (a partial sum reduced) and sent as its local
    shard."""

    def __init__(self, inner: nn.Module, mesh: DeviceMesh | None = None, receives: Boundary | None = None,
                 sends: Boundary | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.mesh = mesh
        self.receives = receives
        self.sends = sends

    def forward(self, *args: Any) -> Any:
        if self.receives is not None and self.mesh is not None and args and isinstance(args[0], torch.Tensor):
            b = self.receives
            args = (DTensor.from_local(args[0], self.mesh, b.placements, run_check=False, shape=b.shape,
                                       stride=_contiguous_stride(b.shape)), *args[1:])
        out = stage_output(self.inner(*args))
        if not isinstance(out, DTensor):
            return out
        if self.sends is None or self.mesh is None:
            return out.full_tensor()
        if tuple(out.placements) != self.sends.placements:
            out = out.redistribute(self.mesh, self.sends.placements)
        return out.to_local()


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, out = 1, []
    for n in reversed(shape):
        out.append(stride)
        stride *= max(int(n), 1)
    return tuple(reversed(out))


class SplitBackwardStage(PipelineStage):
    """A ``PipelineStage`` whose split backward runs the lowered stage's backward graph in two
    parts: the input-gradient part in the ``I`` action, the weight-gradient part in the ``W`` action.

    A lowered stage runs its step as one ``autograd.Function`` (:class:`apmodel.lowering.native.NativeStep`),
    so torch's own split (``stage_backward_input``, then ``autograd.grad`` from the saved
    intermediates to the weights) cannot cut inside it. The stage hands torch a ``dw_builder``
    instead (the hook ``PipelineStage`` has for this): the ``I`` action runs the autograd backward
    under :func:`apmodel.lowering.split_weight_backward`, so the native program runs the part of its
    backward graph the inputs' gradients need and leaves the rest
    (:mod:`apmodel.lowering.weight_split`); the builder, called right after, takes what was left as
    that microbatch's ``W`` runner, which computes the parameters' gradients and accumulates them
    (into ``.grad``, or into the pending sum of a stage that reduces once per step). A full
    backward (1F1B's ``B``) runs whole. A module the native program does not run (the
    interpreter) is not split: its ``I`` runs the whole backward and its ``W`` nothing.
    :attr:`weight_parts_run` counts the weight-gradient parts its ``W`` actions ran."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(submodule, stage_index, num_stages, device, group=group, dw_builder=self._weight_runner)
        self._weight_work: list[Callable[[], None]] | None = None
        self.weight_parts_run = 0

    def _lowered(self) -> nn.Module:
        return self.submod.inner if isinstance(self.submod, StageModule) else self.submod

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        if full_backward:
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=True, last_backward=last_backward)
            return
        with split_weight_backward(self._lowered()) as work:
            self._weight_work = work
            try:
                super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=False, last_backward=last_backward)
            finally:
                self._weight_work = None

    def _weight_runner(self) -> Callable[[], None]:
        """The ``W`` runner of the backward that just ran: its weight-gradient parts (none after a
        full backward)."""
        parts = list(self._weight_work or ())

        def run() -> None:
            for part in parts:
                part()
            self.weight_parts_run += len(parts)
            parts.clear()

        return run


class StepReducingStage(SplitBackwardStage):
    """A ``PipelineStage`` whose module's gradients wait, unreduced, for the step's reduction: run
    when the schedule finishes the stage's backwards (``perform_reduce_grad``; or ``scale_grads``,
    which schedules without that action call after the last backward), before their scaling."""

    def _reduce(self) -> None:
        reduce_gradients(self._lowered())

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        self._reduce()
        super().perform_reduce_grad(grad_scale_factor)

    def scale_grads(self, grad_scale_factor: int) -> None:
        self._reduce()  # nothing left to reduce when perform_reduce_grad came first
        super().scale_grads(grad_scale_factor)


def plan_on_group(solve: Callable[[], Any], group: dist.ProcessGroup | None, src: int) -> Any:
    """``solve()`` on global rank ``src`` only; its plan (as JSON) sent to every rank of ``group``."""
    from apmodel.result.plans import Plan

    if group is None or dist.get_world_size(group) == 1:
        return solve()
    box: list[Any] = [None]
    plan = None
    if dist.get_rank() == src:
        plan = solve()
        box[0] = plan.to_json()
    dist.broadcast_object_list(box, src=src, group=group)
    return plan if plan is not None else Plan.from_json(box[0], f"stage plan broadcast by rank {src}")


@dataclass
class PipelinedModel:
    """What :func:`build` returns on one rank: its stage modules (lowered, for the optimizer and
    for loading weights) and the schedule whose ``step`` runs a training step."""

    stages: list[nn.Module]
    stage_indices: list[int]
    n_stages: int
    schedule: Any

    def parameters(self) -> list[nn.Parameter]:
        return [p for s in self.stages for p in s.parameters()]

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor | None:
        """One training step; returns the mean loss over the microbatches on the rank that holds
        the last stage (None elsewhere)."""
        last = max(self.stage_indices) == self.n_stages - 1
        losses: list[torch.Tensor] = []
        for module in self.stages:  # gathered parameters kept from a step that did not finish are stale
            if getattr(getattr(module, "_apmodel_program", None), "lowering", None) == "native":
                release_kept(module)
        self.schedule.step(*(inputs if 0 in self.stage_indices else ()), target=target if last else None,
                           losses=losses if last else None)
        return torch.stack([loss.detach() for loss in losses]).mean() if last else None


def stage_ranks(mesh: DeviceMesh, pp_dim: int) -> tuple[int, list[int]]:
    """This rank's pipeline coordinate and the global ranks of its stage mesh (same coordinate)."""
    coord = mesh.get_coordinate()
    if coord is None:
        raise PipelineLoweringError("this rank is not part of the mesh")
    grid = mesh.mesh.movedim(pp_dim, 0)[coord[pp_dim]]
    return coord[pp_dim], [int(r) for r in grid.flatten()]


def build(
    make_model: Callable[[], nn.Module],
    mesh: DeviceMesh,
    pp_dim: int,
    stages: Sequence[tuple[int, int]],
    microbatches: int,
    sample_inputs: Sequence[torch.Tensor],
    *,
    loss_fn: Callable[..., torch.Tensor],
    plan_stage: Callable[[nn.Module, tuple[int, ...], tuple[torch.Tensor, ...], StagePlacements], Any],
    lower_stage: Callable[[nn.Module, DeviceMesh, tuple[torch.Tensor, ...], Any], nn.Module],
    schedule: str = "1f1b",
    weight_sync: Sequence[str] | None = None,
    boundary_placements: Sequence[Sequence[str] | None] | None = None,
) -> PipelinedModel:
    """Cut, plan, lower and schedule this rank's stages (see the module docstring).

    ``make_model()``: a fresh full model (ideally on meta) to cut a stage from. ``mesh``: the full
    mesh; ``pp_dim``: its pipeline dimension, whose size is the pipeline degree. ``stages``: the
    ``[first, last]`` layers of every stage (``degree × 2`` for the interleaved and the V
    schedules; stage ``k`` on pipeline rank ``k mod degree``, or in a V on rank ``k`` and
    ``2·degree - 1 - k``). ``sample_inputs``: the model's inputs for the whole
    batch (meta tensors will do): shapes only. ``plan_stage(module, stage mesh shape, inputs,
    placements)`` plans one stage's step, its input and output placed as ``placements`` says
    (:data:`StagePlacements`: the boundaries'); ``lower_stage(module, stage mesh, inputs, plan)``
    lowers it. ``weight_sync``: per stage, as priced (:data:`apmodel.core.schedules.WEIGHT_SYNCS`);
    None: every stage reduces its gradients once per step. ``boundary_placements``: per boundary
    (stage ``k`` to ``k + 1``), the activation's placement on the stage mesh as priced (strings,
    one per stage-mesh axis; ``apmodel.solve.pipeline`` records them); None (or a None entry): the
    default boundary placement (batch sharded on the stage mesh's axis 0 where it divides)."""
    degree = mesh.shape[pp_dim]
    batch = int(sample_inputs[0].shape[0])
    syncs = _checked_request(schedule, degree, len(stages), weight_sync, batch, microbatches)
    micro = tuple(torch.empty((batch // microbatches, *x.shape[1:]), dtype=x.dtype, device="meta")
                  for x in sample_inputs)
    rank, ranks = stage_ranks(mesh, pp_dim)
    names = mesh.mesh_dim_names
    sub_dims = [d for d in range(mesh.ndim) if d != pp_dim]
    if names is None or not sub_dims:
        raise PipelineLoweringError("the mesh needs named dimensions and at least one besides the pipeline's "
                                    "(init_device_mesh(..., mesh_dim_names=(...)))")
    sub_mesh = mesh[tuple(names[d] for d in sub_dims)] if len(sub_dims) > 1 else mesh[names[sub_dims[0]]]
    sub_group = _stage_group(mesh, pp_dim, ranks)
    pp_group = mesh.get_group(pp_dim)
    device = torch.device(mesh.device_type)
    n_stages = len(stages)
    before = children_before_layers(make_model().to("meta"), micro)
    boundary = _boundary_inputs(make_model, stages, micro, before)
    agreed = _agreed_boundaries(boundary, boundary_placements, tuple(sub_mesh.shape))
    mine, indices = [], []
    my_stages = (rank_stages(schedule, degree, rank) if schedule in V_SCHEDULES
                 else list(range(rank, n_stages, degree)))
    for k in my_stages:
        first, last = stages[k]
        module = cut_stage(make_model(), first, last, is_first=k == 0, is_last=k == n_stages - 1, before=before)
        inputs = micro if k == 0 else (boundary[k - 1],)
        placed: StagePlacements = (None if k == 0 else [agreed[k - 1].placements],
                                   None if k == n_stages - 1 else [agreed[k].placements])

        def solve(module: nn.Module = module, inputs: tuple[torch.Tensor, ...] = inputs,
                  placed: StagePlacements = placed) -> Any:
            return plan_stage(module, tuple(sub_mesh.shape), inputs, placed)

        plan = plan_on_group(solve, sub_group, ranks[0])
        lowered = lower_stage(module, sub_mesh, inputs, plan)
        if syncs[k] != "microbatch":
            defer_gradient_reduction(lowered, keep_gathered=syncs[k] == "gather_once")
        mine.append(lowered)
        indices.append(k)
    pipeline_stages = [(StepReducingStage if syncs[k] != "microbatch" else SplitBackwardStage)(
        StageModule(m, sub_mesh, agreed[k - 1] if k > 0 else None, agreed[k] if k < n_stages - 1 else None),
        k, n_stages, device, group=pp_group) for m, k in zip(mine, indices, strict=True)]
    cls = SCHEDULE_CLASSES[schedule]
    sched = (cls(pipeline_stages[0], microbatches, loss_fn=loss_fn) if schedule == "1f1b"
             else cls(pipeline_stages, microbatches, loss_fn=loss_fn))
    logger.info("pipeline rank %d: stages %s of %d, layers %s, %s over %d microbatches, weights %s, sending shards "
                "placed %s", rank, indices, n_stages, [stages[k] for k in indices], schedule, microbatches,
                [syncs[k] for k in indices], [pl.tuple_to_str(b.placements) for b in agreed])
    return PipelinedModel(stages=mine, stage_indices=indices, n_stages=n_stages, schedule=sched)


def _checked_request(schedule: str, degree: int, n_stages: int, weight_sync: Sequence[str] | None, batch: int,
                     microbatches: int) -> list[str]:
    """Refuse a request :func:`build` cannot run, naming what is at fault; the weight sync per stage."""
    if schedule not in SCHEDULE_CLASSES:
        raise PipelineLoweringError(f"schedule {schedule!r}: expected one of {', '.join(SCHEDULE_CLASSES)}")
    syncs = list(weight_sync) if weight_sync else ["reduce_once"] * n_stages
    if len(syncs) != n_stages or any(x not in WEIGHT_SYNCS for x in syncs):
        raise PipelineLoweringError(f"weight_sync {list(syncs)}: expected one of {', '.join(WEIGHT_SYNCS)} for each "
                                    f"of the {n_stages} stages")
    if n_stages % degree:
        raise PipelineLoweringError(f"{n_stages} stages on a pipeline of degree {degree}: expected a multiple")
    if schedule in V_SCHEDULES and n_stages != 2 * degree:
        raise PipelineLoweringError(f"the {schedule} schedule runs two stages per rank in a V: expected "
                                    f"{2 * degree} stages on a pipeline of degree {degree}, got {n_stages}")
    if batch % microbatches:
        raise PipelineLoweringError(f"microbatches {microbatches} does not divide the batch {batch}")
    return syncs


def _stage_group(mesh: DeviceMesh, pp_dim: int, mine: list[int]) -> dist.ProcessGroup | None:
    """A process group over this rank's stage mesh (every rank makes every stage's group, in order)."""
    if len(mine) == 1:
        return None
    if mesh.ndim == 2:
        return mesh.get_group(1 - pp_dim)
    group = None
    grid = mesh.mesh.movedim(pp_dim, 0)
    for coord in range(grid.shape[0]):
        ranks = [int(r) for r in grid[coord].flatten()]
        g = dist.new_group(ranks)
        if ranks == mine:
            group = g
    return group


def _agreed_boundaries(boundary: Sequence[torch.Tensor], given: Sequence[Sequence[str] | None] | None,
                       mesh_shape: tuple[int, ...]) -> list[Boundary]:
    """The placement each boundary's activation is sent at: ``given`` (as priced), else the
    default boundary placement; a partial sum is refused (a stage sends reduced values)."""
    from apmodel.problem.placement_model import default_batch_placement

    if given is not None and len(given) != len(boundary):
        raise PipelineLoweringError(f"boundary placements {list(given)}: expected one per boundary ({len(boundary)})")
    out = []
    for k, value in enumerate(boundary):
        recorded = None if given is None else given[k]
        strs: Sequence[str] = recorded if recorded is not None else default_batch_placement(value, mesh_shape)
        try:
            placed = tuple(pl.from_str(x) for x in strs)
        except (TypeError, ValueError) as e:
            raise PipelineLoweringError(f"boundary {k} (stage {k} to {k + 1}): placement {strs}: {e}") from None
        if len(placed) != len(mesh_shape) or any(pl.is_partial(x) for x in placed):
            raise PipelineLoweringError(f"boundary {k} (stage {k} to {k + 1}): placement {list(strs)}: expected one "
                                        f"Replicate or Shard per axis of the stage mesh {mesh_shape} (a stage sends "
                                        f"no partial sums)")
        out.append(Boundary(value.shape, placed))
    return out


def _boundary_inputs(make_model: Callable[[], nn.Module], stages: Sequence[tuple[int, int]],
                     micro: tuple[torch.Tensor, ...], before: Collection[str] | None = None) -> list[torch.Tensor]:
    """The activation each stage hands to the next, as a meta tensor that requires grad (the stages
    run on meta in turn: shapes only)."""
    out = []
    x: tuple[torch.Tensor, ...] = micro
    with _on_meta():
        for k, (first, last) in enumerate(stages[:-1]):
            module = cut_stage(make_model(), first, last, is_first=k == 0, is_last=False, before=before).to("meta")
            y = stage_output(module(*x))
            out.append(torch.empty_like(y, device="meta").requires_grad_(y.is_floating_point()))
            x = (out[-1],)
    return out
