"""Pipeline stages run with ``torch.distributed.pipelining``, each stage's step lowered with its own
SPMD plan on the stage mesh.

A pipelined model on a mesh with a pipeline axis: the ranks that share a coordinate on the other
axes form one pipeline (``PipelineStage`` p2p over that group); the ranks that share a pipeline
coordinate form one stage mesh. Each rank:

1. cuts its stage out of the model (:func:`cut_stage`): the layer container keeps the stage's
   layers (an ``nn.ModuleDict`` keyed by layer index, torchtitan's convention, so parameter names
   stay those of the full model), and the modules outside the layers that the stage does not run
   are set to None: the embedding on every stage but the first, the final norm and output
   projection on every stage but the last. The model's ``forward`` must accept that
   (:class:`apmodel.models.llama3.Transformer` does: without its embedding it takes the hidden
   state, without its output projection it returns it);
2. plans the stage's step at the microbatch size on the stage mesh (one rank of the stage mesh
   plans, the plan is sent to the others), and lowers it (``plan_stage`` and ``lower_stage``,
   given by the caller: :func:`apmodel.entry.api.parallelize_pipeline` uses apmodel's planner and
   ``parallelize``);
3. wraps it (:class:`StageModule`: plain tensors in and out, the full activation) in a
   ``PipelineStage`` and builds the schedule (:data:`SCHEDULE_CLASSES`) with the loss function on
   the last stage. The V schedules (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) place stage
   ``k`` and stage ``2d - 1 - k`` on pipeline rank ``k`` (:func:`apmodel.core.schedules.rank_of`)
   and split a backward into its input gradient and, later, its weight gradient: the lowered
   stage's backward graph cut in two (:class:`SplitBackwardStage`, :mod:`apmodel.lowering.weight_split`).

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

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

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

from apmodel.core.schedules import WEIGHT_SYNCS, rank_stages
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


class PipelineLoweringError(ValueError):
    """A model or request the pipeline lowering cannot follow; the message says which."""


def _layer_container(model: nn.Module) -> tuple[str, nn.ModuleDict]:
    conv = conventions.from_module(model)
    pattern = conv.layer_pattern
    if pattern is None:
        raise PipelineLoweringError(f"{type(model).__name__} has no repeated layers to split into pipeline stages")
    path = pattern.split("{i}")[0].rstrip(".").lstrip("*")
    container = model.get_submodule(path) if path else model
    if not isinstance(container, nn.ModuleDict):
        raise PipelineLoweringError(
            f"{type(model).__name__}.{path} is a {type(container).__name__}: pipeline stages need the layers in an "
            f"nn.ModuleDict keyed by index (torchtitan's convention), so that a stage keeps the full model's "
            f"parameter names")
    return path, container


def cut_stage(model: nn.Module, first_layer: int, last_layer: int, *, is_first: bool, is_last: bool) -> nn.Module:
    """Cut ``model`` (in place) to the stage holding layers ``first_layer .. last_layer``
    (inclusive); see the module docstring. Returns ``model``."""
    path, container = _layer_container(model)
    keys = list(container.keys())
    if not 0 <= first_layer <= last_layer < len(keys):
        raise PipelineLoweringError(f"stage layers [{first_layer}, {last_layer}] are not within the model's "
                                    f"{len(keys)} layers")
    for key in keys:
        if not first_layer <= int(key) <= last_layer:
            del container[key]
    conv = conventions.from_module(model)
    top = path.split(".")[0]
    for name, child in list(model.named_children()):
        if name == top or child is None or not any(True for _ in child.parameters()):
            continue
        before = any(conv.role(f"{name}.{p}") == "embedding" for p, _ in child.named_parameters())
        if (before and not is_first) or (not before and not is_last):
            setattr(model, name, None)
    return model


class StageModule(nn.Module):
    """A lowered stage as ``PipelineStage`` runs it: the activation in and out as a plain tensor
    (the full value, the same on every rank of the stage mesh)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        out = self.inner(*args)
        return out.full_tensor() if isinstance(out, DTensor) else out


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
        module = self.submod.inner if isinstance(self.submod, StageModule) else self.submod
        reduce_gradients(module)

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
    plan_stage: Callable[[nn.Module, tuple[int, ...], tuple[torch.Tensor, ...]], Any],
    lower_stage: Callable[[nn.Module, DeviceMesh, tuple[torch.Tensor, ...], Any], nn.Module],
    schedule: str = "1f1b",
    weight_sync: Sequence[str] | None = None,
) -> PipelinedModel:
    """Cut, plan, lower and schedule this rank's stages (see the module docstring).

    ``make_model()``: a fresh full model (ideally on meta) to cut a stage from. ``mesh``: the full
    mesh; ``pp_dim``: its pipeline dimension, whose size is the pipeline degree. ``stages``: the
    ``[first, last]`` layers of every stage (``degree × 2`` for the interleaved and the V
    schedules; stage ``k`` on pipeline rank ``k mod degree``, or in a V on rank ``k`` and
    ``2·degree - 1 - k``). ``sample_inputs``: the model's inputs for the whole
    batch (meta tensors will do): shapes only. ``plan_stage(module, stage mesh shape, inputs)``
    plans one stage's step; ``lower_stage(module, stage mesh, inputs, plan)`` lowers it.
    ``weight_sync``: per stage, as priced (:data:`apmodel.core.schedules.WEIGHT_SYNCS`); None:
    every stage reduces its gradients once per step."""
    if schedule not in SCHEDULE_CLASSES:
        raise PipelineLoweringError(f"schedule {schedule!r}: expected one of {', '.join(SCHEDULE_CLASSES)}")
    syncs = list(weight_sync) if weight_sync else ["reduce_once"] * len(stages)
    if len(syncs) != len(stages) or any(x not in WEIGHT_SYNCS for x in syncs):
        raise PipelineLoweringError(f"weight_sync {list(syncs)}: expected one of {', '.join(WEIGHT_SYNCS)} for each "
                                    f"of the {len(stages)} stages")
    degree = mesh.shape[pp_dim]
    if len(stages) % degree:
        raise PipelineLoweringError(f"{len(stages)} stages on a pipeline of degree {degree}: expected a multiple")
    if schedule in ("zbv", "dualpipev") and len(stages) != 2 * degree:
        raise PipelineLoweringError(f"the {schedule} schedule runs two stages per rank in a V: expected "
                                    f"{2 * degree} stages on a pipeline of degree {degree}, got {len(stages)}")
    batch = int(sample_inputs[0].shape[0])
    if batch % microbatches:
        raise PipelineLoweringError(f"microbatches {microbatches} does not divide the batch {batch}")
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
    boundary = _boundary_inputs(make_model, stages, micro)
    mine, indices = [], []
    placed = (rank_stages(schedule, degree, rank) if schedule in ("zbv", "dualpipev")
              else list(range(rank, n_stages, degree)))
    for k in placed:
        first, last = stages[k]
        module = cut_stage(make_model(), first, last, is_first=k == 0, is_last=k == n_stages - 1)
        inputs = micro if k == 0 else (boundary[k - 1],)

        def solve(module: nn.Module = module, inputs: tuple[torch.Tensor, ...] = inputs) -> Any:
            return plan_stage(module, tuple(sub_mesh.shape), inputs)

        plan = plan_on_group(solve, sub_group, ranks[0])
        lowered = lower_stage(module, sub_mesh, inputs, plan)
        if syncs[k] != "microbatch":
            defer_gradient_reduction(lowered, keep_gathered=syncs[k] == "gather_once")
        mine.append(lowered)
        indices.append(k)
    pipeline_stages = [(StepReducingStage if syncs[k] != "microbatch" else SplitBackwardStage)(
        StageModule(m), k, n_stages, device, group=pp_group) for m, k in zip(mine, indices, strict=True)]
    cls = SCHEDULE_CLASSES[schedule]
    sched = (cls(pipeline_stages[0], microbatches, loss_fn=loss_fn) if schedule == "1f1b"
             else cls(pipeline_stages, microbatches, loss_fn=loss_fn))
    logger.info("pipeline rank %d: stages %s of %d, layers %s, %s over %d microbatches, weights %s", rank, indices,
                n_stages, [stages[k] for k in indices], schedule, microbatches, [syncs[k] for k in indices])
    return PipelinedModel(stages=mine, stage_indices=indices, n_stages=n_stages, schedule=sched)


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


def _boundary_inputs(make_model: Callable[[], nn.Module], stages: Sequence[tuple[int, int]],
                     micro: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The activation each stage hands to the next, as a meta tensor that requires grad (the stages
    run on meta in turn: shapes only)."""
    out = []
    x: tuple[torch.Tensor, ...] = micro
    with torch.no_grad():
        for k, (first, last) in enumerate(stages[:-1]):
            module = cut_stage(make_model(), first, last, is_first=k == 0, is_last=False).to("meta")
            y = module(*x)
            out.append(torch.empty_like(y, device="meta").requires_grad_(y.is_floating_point()))
            x = (out[-1],)
    return out
