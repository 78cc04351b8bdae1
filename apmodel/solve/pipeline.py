"""Pipeline stages composed with SPMD plans: the pipeline degree, the stage split and each stage's
placements chosen together, from one cost model.

One mesh axis (``axis``) may carry a pipeline. For each allowed degree ``d`` (a divisor of the
axis size ``P``; 1 means no pipelining):

* **the stage mesh**: the mesh without the pipeline axis, or with ``P / d`` left of it (the inner
  part of the axis' coordinate; the outer part is the stage). Its axes keep their rank strides in
  the full mesh, so the collective model sees which of them cross nodes;
* **one SPMD plan** of the whole model on the stage mesh, at the microbatch size (batch /
  ``microbatches``), solved without a memory limit (each rank holds one stage, not the model) and
  with its parameters' gathers and gradients' reductions priced as their share of the step's
  microbatches (``weight_microbatches``: a stage synchronises its weights once per step): the
  repeated layers share one decision variable, so this is the plan every stage would get, and it
  is solved once per degree instead of once per stage. :mod:`apmodel.solve.stage_costs` reads it per unit
  (part before the layers, each layer, part after; forward and backward µs, the weights' traffic
  apart; bytes);
* **the split**: contiguous layers per stage minimising the slowest stage (the embedding on the
  first, head and loss on the last; :func:`apmodel.core.schedules.balanced_split`), under the memory
  limit (a stage's parameters, gradients and optimizer state, plus its activations times the
  microbatches the schedule's order keeps in flight there, :func:`apmodel.core.schedules.in_flight`:
  from a forward to its weight gradient, plus the plan's largest transient);
* **the weights**: per stage the cheapest weight sync that fits
  (:data:`apmodel.core.schedules.WEIGHT_SYNCS`: parameters gathered once per step and kept, or per
  microbatch, gradients reduced once after the stage's last backward; or both per microbatch);
* **the price**: the schedule's timeline (:func:`apmodel.core.schedules.simulate`) over per-microbatch
  stage times and each stage's once-per-step work, with the point-to-point transfer of each
  boundary's activation (and its gradient) on the pipeline axis priced by :mod:`costmodels.p2p`.
  The step's objective is the timeline's length; the bubble is its idle part on the busiest rank.
  A split backward's weight gradient (``W``, the zero-bubble schedules) is priced as the lowering
  runs it (:func:`lowered_weight_us`: the plan's price of the backward nodes only the
  parameters' gradients need, :func:`apmodel.solve.stage_costs.weight_only_nodes`; all of the
  first stage's backward);
* **the schedule**: ``pp_schedule`` names one, or ``"auto"``: every schedule that can run the
  degree and microbatches is priced on a stage plan of each stage size (one for 1F1B's stages,
  one for the schedules of two stages per rank) and the cheapest that fits kept, so the schedule
  is chosen with the degree.
  A degree over the memory limit is solved again before it is reported so (:func:`_plan_degree`).

Degree 1 is the ordinary plan of the full mesh and batch (memory-fitted as usual). The cheapest
degree whose every rank fits the memory limit wins; every degree is kept as an alternative.

Each boundary's transfer is each rank's local shard of the activation at the placement the stage
plan leaves it (a partial sum counted reduced), recorded with the choice (``boundary_bytes``,
``boundary_placements``) for :mod:`apmodel.lowering.pipeline`, which sends exactly that.

What the price leaves out (see the README's *Pipeline stages*): transfers do not overlap their
own rank's compute, and the reduction of a partial sum before a send is not charged; a stage's once-per-step gathers and reduction hold its rank (as
:mod:`apmodel.lowering.pipeline` runs them); the optimizer step is not priced (as in every plan).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import costmodels
import solvers
from apmodel.core import schedules
from apmodel.core.options import OptionsError, PlanOptions
from apmodel.frontend.workloads import Workload, WorkloadError, load_workload
from apmodel.graph.conventions import ModelConventions, layer_pattern_from_names
from apmodel.problem.memory import OutOfMemory
from apmodel.result.pipeline_record import DegreePrice, PipelineChoice, PipelineError
from apmodel.solve import search
from apmodel.solve.stage_costs import StepUnits, UnitCost, count_layers, step_units
from costmodels.p2p import peer_link, send_recv_us

if TYPE_CHECKING:
    from apmodel.result.plans import Plan

logger = logging.getLogger(__name__)

#: Default microbatches per pipeline rank: 2 per stage keeps 1F1B's bubble at (d - 1) / (3d - 1),
#: under a third (torchtitan's examples run 2-4 microbatches per stage).
DEFAULT_MICROBATCHES_PER_STAGE = 2
#: ``pp_schedule`` value that prices every schedule with each degree and keeps the cheapest that fits.
AUTO_SCHEDULE = "auto"


@dataclass(frozen=True)
class PipelineOptions:
    """The pipeline group of the planning options, which :func:`plan_pipeline` receives: the
    :class:`~apmodel.core.options.PlanOptions` fields of the same names, checked by their declarations
    (:meth:`of` takes them from a ``PlanOptions``).

    ``pp_axis``: the mesh axis that may carry the pipeline. ``pp_degrees``: the pipeline degrees
    allowed (divisors of the axis size; 1 means none, and the axis joins the SPMD plan); None:
    every divisor. ``microbatches``: per step (must divide the batch); None: the smallest divisor
    of the batch that is at least ``2 ×`` the largest degree (or the batch). ``pp_schedule``: one
    of :data:`apmodel.core.schedules.SCHEDULES`, or ``"auto"``: each degree priced under every
    schedule that can run it, the cheapest that fits kept (:meth:`candidates`)."""

    pp_axis: int
    pp_degrees: tuple[int, ...] | None = None
    microbatches: int | None = None
    pp_schedule: str = "1f1b"

    def __post_init__(self) -> None:
        if self.pp_axis is None:
            raise PipelineError("pp_axis None: expected a mesh axis index >= 0")
        try:  # the options' own checks: one declaration of what each takes
            checked = PlanOptions(pp_axis=self.pp_axis, pp_degrees=self.pp_degrees or (), microbatches=self.microbatches,
                                  pp_schedule=self.pp_schedule)
        except (OptionsError, TypeError, ValueError) as e:
            raise PipelineError(str(e)) from None
        object.__setattr__(self, "pp_degrees", checked.pp_degrees or None)

    @classmethod
    def of(cls, options: PlanOptions) -> "PipelineOptions":
        """The pipeline group of ``options`` (whose ``pp_axis`` is set)."""
        if options.pp_axis is None:
            raise PipelineError("no pipeline axis: set pp_axis (--pp-axis)")
        return cls(options.pp_axis, options.pp_degrees or None, options.microbatches, options.pp_schedule)

    def resolve(self, mesh_shape: Sequence[int], batch: int) -> tuple[tuple[int, ...], int]:
        """The degrees and microbatch count for ``mesh_shape`` and a global ``batch``, checked."""
        if self.pp_axis >= len(mesh_shape):
            raise PipelineError(f"pp_axis {self.pp_axis} is out of range for mesh {tuple(mesh_shape)} "
                                f"(axes 0..{len(mesh_shape) - 1})")
        size = mesh_shape[self.pp_axis]
        degrees = self.pp_degrees or tuple(d for d in range(1, size + 1) if size % d == 0)
        bad = [d for d in degrees if size % d]
        if bad:
            raise PipelineError(f"pp_degrees {list(degrees)}: degree {bad[0]} does not divide the size {size} of "
                                f"pipeline axis {self.pp_axis} of mesh {tuple(mesh_shape)}")
        m = self.microbatches
        if m is None:
            want = DEFAULT_MICROBATCHES_PER_STAGE * max(degrees)
            m = min((k for k in range(want, batch + 1) if batch % k == 0), default=batch)
        if batch % m:
            raise PipelineError(f"microbatches {m} does not divide the batch {batch}: each microbatch must hold "
                                f"the same number of samples")
        for d in degrees:
            if d > 1 and self.pp_schedule != AUTO_SCHEDULE:
                try:
                    schedules.check(self.pp_schedule, d, m)
                except schedules.ScheduleError as e:
                    raise PipelineError(f"pp_degrees: {e}") from None
            elif d > 1 and not self.candidates(d, m):
                raise PipelineError(f"pp_degrees: no pipeline schedule runs degree {d} with {m} microbatches "
                                    f"(1F1B needs microbatches >= degree)")
        return tuple(degrees), m

    def candidates(self, degree: int, microbatches: int, layers: int | None = None) -> tuple[str, ...]:
        """The schedules to price for ``degree``: ``pp_schedule``, or under ``"auto"`` every one of
        :data:`apmodel.core.schedules.SCHEDULES` that can run ``degree`` with ``microbatches`` (and
        give each of its stages one of ``layers`` layers, when given)."""
        out = []
        for name in schedules.SCHEDULES if self.pp_schedule == AUTO_SCHEDULE else (self.pp_schedule,):
            if self.pp_schedule == AUTO_SCHEDULE:
                try:
                    schedules.check(name, degree, microbatches)
                except schedules.ScheduleError:
                    continue
            if layers is None or degree * schedules.stages_per_rank(name) <= layers:
                out.append(name)
        return tuple(out)


def stage_mesh(mesh_shape: Sequence[int], axis: int, degree: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The SPMD mesh of one pipeline stage and the rank stride of each of its axes in the full mesh
    (``degree`` 1: the full mesh)."""
    shape = tuple(int(s) for s in mesh_shape)
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    if degree == 1:
        return shape, strides
    left = shape[axis] // degree
    sub = [(left if i == axis else s, st) for i, (s, st) in enumerate(zip(shape, strides, strict=True)) if i != axis or left > 1]
    if not sub:  # the whole mesh is the pipeline: each stage runs on one device
        return (1,), (1,)
    return tuple(s for s, _ in sub), tuple(st for _, st in sub)


def stage_rank(mesh_shape: Sequence[int], axis: int, degree: int, rank: int) -> int:
    """The global rank that holds pipeline rank ``rank`` for the stage mesh's first device."""
    strides = [math.prod(mesh_shape[i + 1:]) for i in range(len(mesh_shape))]
    return rank * (mesh_shape[axis] // degree) * strides[axis]


@dataclass(frozen=True)
class StageWork:
    """One stage under one weight synchronisation (:data:`apmodel.core.schedules.WEIGHT_SYNCS`):
    µs per microbatch, µs once per step, and the bytes per device it adds to the stage's state and
    activations (parameters kept gathered, gradients accumulated before their reduction).
    ``weight_us``: the part of ``backward_us`` only the parameters' gradients need (a split
    backward's ``W``; with the gradients reduced per microbatch, their reductions too)."""

    sync: str
    forward_us: float
    backward_us: float
    setup_us: float
    flush_us: float
    extra_bytes: float
    weight_us: float = 0.0


def stage_work(unit: UnitCost, sync: str) -> StageWork:
    """``unit`` (one stage, its costs of one microbatch) under weight synchronisation ``sync``. Kept
    gathered, the backward's gathers go too (they gather to what the forward's did)."""
    if sync == "microbatch":
        return StageWork(sync, unit.forward_us, unit.backward_us, 0.0, 0.0, 0.0, unit.weight_us + unit.reduce_us)
    if sync == "reduce_once":
        return StageWork(sync, unit.forward_us, unit.backward_us - unit.reduce_us, 0.0, unit.reduce_us,
                         unit.unreduced_grad_bytes, unit.weight_us)
    if sync == "gather_once":
        backward_gathers = unit.gather_us - unit.gather_once_us
        return StageWork(sync, unit.forward_us - unit.gather_once_us,
                         unit.backward_us - backward_gathers - unit.reduce_us, unit.gather_once_us, unit.reduce_us,
                         unit.unreduced_grad_bytes + unit.gathered_bytes, unit.weight_us)
    raise PipelineError(f"weight sync {sync!r}: expected one of {', '.join(schedules.WEIGHT_SYNCS)}")


def lowered_weight_us(work: Sequence[StageWork]) -> list[float]:
    """Per stage, µs of its backward (one microbatch) that the lowered split backward runs in
    ``W``: the stage's backward graph is cut into the part its input's gradient needs (``I``) and
    the rest (:mod:`apmodel.lowering.weight_split`, :class:`apmodel.lowering.pipeline.SplitBackwardStage`),
    priced as the plan prices those nodes (:attr:`StageWork.weight_us`); the first stage's input
    (the tokens) has no gradient, so its ``W`` runs its whole backward."""
    return [w.backward_us if k == 0 else min(w.weight_us, w.backward_us) for k, w in enumerate(work)]


def _balancing_us(unit: UnitCost, microbatches: int) -> float:
    """A layer's share of the step, per microbatch, kept gathered: its work without the weights'
    traffic, plus that traffic (once per step) spread over the microbatches."""
    work = stage_work(unit, "gather_once")
    return work.forward_us + work.backward_us + (work.setup_us + work.flush_us) / microbatches


def price_degree(
    units: StepUnits,
    degree: int,
    schedule: str,
    microbatches: int,
    transfer_us: Callable[[int, int, float], float],
    *,
    stage_mesh_shape: Sequence[int],
    memory_limit_bytes: float | None,
    stages: Sequence[tuple[int, int]] | None = None,
    stage_plan_layers: int | None = None,
    weight_sync: Sequence[str] | None = None,
) -> DegreePrice:
    """Split, schedule and price one degree (> 1) from the per-unit costs of a microbatch.

    ``transfer_us(src, dst, nbytes)``: moving ``nbytes`` per device from pipeline rank ``src`` to
    rank ``dst`` (a boundary's stages' ranks, :func:`apmodel.core.schedules.rank_of`). ``stages``: a split to price instead of the balanced one (a replayed plan);
    ``weight_sync``: each stage's weight synchronisation to price (a replayed plan) instead of the
    cheapest that fits: every stage starts kept gathered, and while a rank is over the memory limit
    its stage with the most extra bytes steps back (:func:`_less_memory`); the time of a stage only
    grows as it steps back, so no cheaper fitting choice is left out stage by stage."""
    v = schedules.stages_per_rank(schedule)
    n_stages = degree * v
    n_layers = len(units.layers)
    limit = memory_limit_bytes

    def stage_bytes(k: int, first: int, last: int, in_flight: float) -> float:
        u = units.stage(first, last, with_pre=k == 0, with_post=k == n_stages - 1)
        return u.state_bytes + in_flight * u.activation_bytes + units.transient_bytes

    fits = None
    if limit is not None:
        held = schedules.in_flight(schedule, degree, microbatches)  # 1F1B: stage k holds min(m, d - k)

        def fits(k: int, i: int, j: int) -> bool:
            return stage_bytes(k, i, j, held[k]) <= limit
    if stages is None:
        layer_us = [_balancing_us(u, microbatches) for u in units.layers]
        first_us, last_us = _balancing_us(units.pre, microbatches), _balancing_us(units.post, microbatches)
        try:
            split = schedules.balanced_split(layer_us, n_stages, first_us=first_us, last_us=last_us, fits=fits)
        except schedules.ScheduleError as e:
            if n_stages > n_layers:
                raise PipelineError(f"pipeline degree {degree} ({schedule}, {n_stages} stages): {e}") from None
            split = schedules.balanced_split(layer_us, n_stages, first_us=first_us, last_us=last_us)
    else:
        split = tuple((int(a), int(b)) for a, b in stages)
        _check_split(split, n_stages, n_layers)
    parts = [units.stage(a, b, with_pre=k == 0, with_post=k == n_stages - 1) for k, (a, b) in enumerate(split)]
    home = [schedules.rank_of(schedule, degree, k) for k in range(n_stages)]
    mine = [schedules.rank_stages(schedule, degree, r) for r in range(degree)]
    # the V's turn (two stages on one rank) hands its activation over in place
    sent = [units.boundary_bytes[b] for _, b in split[:-1]]  # each rank's shard at the boundary placement
    transfers = [transfer_us(home[k], home[k + 1], nbytes) if home[k] != home[k + 1] else 0.0
                 for k, nbytes in enumerate(sent)]
    placed = tuple(units.boundary_placements[b] for _, b in split[:-1]) if units.boundary_placements else ()
    if weight_sync is not None and len(weight_sync) != n_stages:
        raise PipelineError(f"weight sync {list(weight_sync)}: expected one per stage ({n_stages})")
    syncs = list(weight_sync) if weight_sync is not None else [schedules.WEIGHT_SYNCS[-1]] * n_stages
    while True:
        work = [stage_work(p, s) for p, s in zip(parts, syncs, strict=True)]
        timeline = schedules.simulate(schedule, degree, microbatches, [w.forward_us for w in work],
                                      [w.backward_us for w in work], transfers, [p.activation_bytes for p in parts],
                                      [w.setup_us for w in work], [w.flush_us for w in work],
                                      lowered_weight_us(work))
        per_rank = [sum(parts[k].state_bytes + work[k].extra_bytes for k in mine[r])
                    + timeline.held_bytes[r] + units.transient_bytes for r in range(degree)]
        over = [r for r in range(degree) if limit is not None and per_rank[r] > limit]
        if weight_sync is not None or not over or not _less_memory(syncs, work, [mine[r] for r in over]):
            break
    peak = max(per_rank)
    ok = None if limit is None else peak <= limit
    return DegreePrice(
        degree=degree, objective_us=timeline.step_us, peak_bytes=peak, fits=ok, stage_mesh=tuple(stage_mesh_shape),
        stages=split, bubble_us=timeline.bubble_us, p2p_us=2 * sum(transfers),
        stage_us=tuple(w.forward_us + w.backward_us for w in work), stage_plan_layers=stage_plan_layers,
        weight_sync=tuple(syncs), gather_step_us=tuple(w.setup_us for w in work),
        reduce_step_us=tuple(w.flush_us for w in work), schedule=schedule, boundary_bytes=tuple(sent),
        boundary_placements=placed,
        note="" if ok is not False else f"rank {per_rank.index(peak)} needs {peak / 1e9:.2f} GB",
    )


def _less_memory(syncs: list[str], work: Sequence[StageWork], over: Sequence[Sequence[int]]) -> bool:
    """Step back (in place) the weight sync of the stage holding the most extra bytes on each rank
    in ``over`` (its stages; gather_once -> reduce_once -> microbatch); False when none of them can."""
    changed = False
    for stages in over:
        mine = [k for k in stages if syncs[k] != schedules.WEIGHT_SYNCS[0]]
        if mine:
            k = max(mine, key=lambda k: work[k].extra_bytes)
            syncs[k] = schedules.WEIGHT_SYNCS[schedules.WEIGHT_SYNCS.index(syncs[k]) - 1]
            changed = True
    return changed


def _check_split(split: Sequence[tuple[int, int]], n_stages: int, n_layers: int) -> None:
    expect = 0
    for a, b in split:
        if a != expect or b < a:
            raise PipelineError(f"pipeline stages {[list(s) for s in split]}: expected contiguous [first, last] "
                                f"layer ranges from 0")
        expect = b + 1
    if len(split) != n_stages or expect != n_layers:
        raise PipelineError(f"pipeline stages {[list(s) for s in split]}: expected {n_stages} stages covering "
                            f"layers 0..{n_layers - 1}")


# ------------------------------------------------------------------------------ the choice
def choose(alternatives: Sequence[DegreePrice]) -> DegreePrice:
    """The cheapest degree that fits (unknown fit counts as fitting); :class:`OutOfMemory` naming
    every degree's need when none does."""
    fitting = [a for a in alternatives if a.fits is not False]
    if not fitting:
        needs = "; ".join(f"degree {a.degree}: {a.peak_bytes / 1e9:.2f} GB" if a.peak_bytes is not None
                          else f"degree {a.degree}: {a.note}" for a in alternatives)
        raise OutOfMemory(f"out of memory: no pipeline degree fits the memory limit ({needs}); use activation "
                          f"checkpointing (--ac selective), more microbatches, or more devices")
    return min(fitting, key=lambda a: (a.objective_us, a.degree))


# ------------------------------------------------------------------------------ orchestration
#: ``plan_spmd(workload, options, record) -> plan``: one SPMD plan by the caller's orchestration
#: (trace, build, solve; ``record``: extra keys of the plan's workload record); ``plan.model`` set.
PlanSpmd = Callable[[Workload, PlanOptions, Mapping[str, Any]], "Plan"]


def batch_of(workload: Workload) -> int:
    """The global batch of a workload: its record's, else the first tensor input's dim 0."""
    if workload.record.get("batch"):
        return int(workload.record["batch"])
    for x in workload.sample_inputs:
        if hasattr(x, "shape") and len(x.shape) >= 1:
            return int(x.shape[0])
    raise PipelineError("pipeline planning needs a batched tensor input (dim 0 is the batch) to cut into microbatches")


def layer_count(workload: Workload) -> int:
    """The number of repeated layers of the workload's model (from its parameter names)."""
    from apmodel.graph.capture import CapturedGraph

    model = workload.model
    fqns = (list(model.param_fqn.values()) if isinstance(model, CapturedGraph)
            else [n for n, _ in model.named_parameters(remove_duplicate=False)])
    n = count_layers(fqns)
    if n == 0:
        raise PipelineError("the model has no repeated layers (parameters named like layers.N.*) to split into "
                            "pipeline stages")
    return n


#: Module attributes a layer's kind does not depend on: its position in the stack.
_POSITION_ATTRIBUTES = ("layer_id", "layer_idx", "layer_index", "idx", "index", "block_idx")


def _layer_kind(layer: Any) -> tuple[Any, ...]:
    """What a repeated layer computes, to compare layers: each module's path, class, parameter
    shapes and integer, boolean and string settings (a sliding window, a head count), its position
    in the stack left out, and floats too (an initialisation scale that grows with the depth)."""
    kind = []
    for path, module in layer.named_modules():
        settings = tuple(sorted((k, v) for k, v in vars(module).items()
                                if not k.startswith("_") and k != "training" and k not in _POSITION_ATTRIBUTES
                                and (v is None or isinstance(v, (bool, int, str)))))  # floats: init scales
        shapes = tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False))
        kind.append((path, type(module).__name__, shapes, settings))
    return tuple(kind)


def layers_to_plan(workload: Workload) -> tuple[int, tuple[int, ...] | None]:
    """How many leading layers a stage plan's model needs so that every layer of the model has one
    of its kind among them (:func:`_layer_kind`), and each layer's kind (a number; :func:`stand_ins`
    reads which planned layer prices it, :meth:`apmodel.solve.stage_costs.StepUnits.with_layers`).
    DeepSeek-V3's first three layers are dense and the rest mixtures of experts: a stage plan of
    two layers would price every MoE layer as a dense one; Gemma 3's hybrid needs its first full
    attention layer, the sixth. ``(1, None)`` where the layers cannot be compared (a captured
    graph, no layer container): every layer is priced as the stage plan's last."""
    from apmodel.graph.capture import CapturedGraph

    model = workload.model
    if isinstance(model, CapturedGraph):
        return 1, None
    pattern = layer_pattern_from_names([n for n, _ in model.named_parameters(remove_duplicate=False)])
    path = ModelConventions(layer_pattern=pattern).layer_container
    if path is None:
        return 1, None
    try:
        container = model.get_submodule(path) if path else model
    except AttributeError:
        return 1, None
    ids: dict[tuple[Any, ...], int] = {}
    kinds = tuple(ids.setdefault(_layer_kind(layer), len(ids)) for layer in container.children())
    return max(kinds.index(kind) for kind in set(kinds)) + 1 if kinds else 1, kinds


def stand_ins(kinds: Sequence[int] | None, planned: int, n_layers: int) -> list[int]:
    """For each of ``n_layers`` layers of kinds ``kinds`` (:func:`layers_to_plan`), the layer of a
    stage plan of the first ``planned`` that prices it: itself where planned, else the last planned
    layer of its kind (the last planned layer where none is: ``kinds`` None, or a replayed plan cut
    shorter)."""
    out = list(range(min(planned, n_layers)))
    for i in range(planned, n_layers):
        same = [j for j in range(planned) if kinds is not None and kinds[j] == kinds[i]]
        out.append(same[-1] if same else planned - 1)
    return out


def microbatch_workload(workload: Workload, mesh_shape: Sequence[int], microbatches: int,
                        layers: int | None = None) -> tuple[Workload, bool]:
    """The workload of one microbatch on ``mesh_shape``, and whether it has ``layers`` layers: a
    named model is built again at ``batch / microbatches`` (with ``layers`` repeated layers when
    given); a module's inputs, targets and keyword inputs have that batch cut along dim 0 (its
    layers are kept)."""
    from apmodel.graph.capture import CapturedGraph

    batch = batch_of(workload)
    micro = batch // microbatches
    spec = workload.record.get("model")
    if spec and not isinstance(workload.model, CapturedGraph):
        try:
            return load_workload(spec, mesh_shape, batch=micro, seq=workload.record["seq"],
                                 layers=layers or workload.record.get("layers")), layers is not None
        except WorkloadError as e:
            raise PipelineError(f"microbatch of {spec!r}: {e}") from None
    if isinstance(workload.model, CapturedGraph):
        raise PipelineError("pipeline planning traces the step at the microbatch size: give the module, not a "
                            "captured graph")

    def cut(x: Any) -> Any:
        return x[:micro] if hasattr(x, "shape") and len(x.shape) >= 1 and x.shape[0] == batch else x

    return replace(workload, mesh_shape=tuple(mesh_shape), sample_inputs=tuple(cut(x) for x in workload.sample_inputs),
                   targets=None if workload.targets is None else tuple(cut(x) for x in workload.targets),
                   kwargs=None if workload.kwargs is None else {k: cut(v) for k, v in workload.kwargs.items()},
                   record={**workload.record, "batch": micro} if workload.record else {}), False


def _stage_options(options: PlanOptions, mesh_shape: Sequence[int], axis: int, degree: int) -> PlanOptions:
    """``options`` for the stage mesh: mesh-axis options renumbered; the collective model on the
    stage mesh's real rank strides (when they are not row-major over its own shape); priced
    serially: the schedule's timeline adds up each unit's forward and backward (stage_costs), so
    a stage plan's overlap is not modelled yet."""
    if options.input_placements is not None or options.output_placements is not None:
        raise PipelineError("input_placements / output_placements name mesh axes of the full mesh; they cannot be "
                            "combined with a pipeline axis yet")
    sub, strides = stage_mesh(mesh_shape, axis, degree)
    kept = [i for i in range(len(mesh_shape)) if i != axis or mesh_shape[axis] // degree > 1]
    changes: dict[str, Any] = {"replicate_axes": tuple(kept.index(a) for a in options.replicate_axes if a in kept),
                               "overlap": False}
    row_major = tuple(math.prod(sub[i + 1:]) for i in range(len(sub)))
    if strides != row_major and options.comm_model is None:
        spec = costmodels.device(options.device) if isinstance(options.device, str) else options.device
        topo = costmodels.Topology(sub, spec, options.gpus_per_node, strides=strides, **options.topology)
        changes["comm_model"] = costmodels.NCCLCollectives(topo)
    return options.replace(**changes)


def plan_pipeline(
    workload: Workload,
    options: PlanOptions,
    pp: PipelineOptions,
    plan_spmd: PlanSpmd,
    *,
    replay: "Plan | None" = None,
    progress: Callable[[str], None] = logger.info,
) -> tuple["Plan", PipelineChoice]:
    """Price every allowed degree and choose one (see the module docstring). Returns the chosen
    degree's SPMD plan (on its stage mesh, at the microbatch size; degree 1: the full mesh and
    batch) with ``plan.pipeline`` set, and the choice. ``replay``: a plan with a recorded pipeline
    (its axis, degree, microbatches, schedule and split are kept instead of ``pp``'s; its placements
    are forced by the caller's ``plan_spmd``)."""
    start = time.perf_counter()
    mesh = tuple(workload.mesh_shape)
    batch = batch_of(workload)
    fixed_stages, fixed_layers, fixed_sync = None, None, None
    if replay is not None and replay.pipeline:  # the recorded degree, split and schedule; the stage plan replayed
        recorded = PipelineChoice.from_json(replay.pipeline, "replayed plan")
        if tuple(recorded.mesh) != mesh:
            raise PipelineError(f"the replayed plan's pipeline was made for mesh {tuple(recorded.mesh)}, got {mesh}")
        pp = PipelineOptions(pp_axis=recorded.axis, pp_degrees=(recorded.degree,), microbatches=recorded.microbatches,
                             pp_schedule=recorded.schedule)
        fixed_stages, fixed_layers = recorded.chosen.stages or None, recorded.chosen.stage_plan_layers
        # a plan recorded before weight sync was priced synchronised every stage per microbatch
        fixed_sync = recorded.chosen.weight_sync or (schedules.WEIGHT_SYNCS[0],) * len(recorded.chosen.stages)
    degrees, m = pp.resolve(mesh, batch)
    full_topo = costmodels.Topology(mesh, costmodels.device(options.device) if isinstance(options.device, str)
                                    else options.device, options.gpus_per_node, **options.topology)
    record = {"comm_model": options.to_record()["comm_model"], "memory_limit_bytes": options.memory_limit_bytes,
              "replicate_axes": list(options.replicate_axes)}
    plans: dict[int, "Plan"] = {}
    priced: list[DegreePrice] = []
    n_layers = layer_count(workload)
    kept_layers, kinds = layers_to_plan(workload)
    for d in degrees:  # before any planning: each stage needs a layer
        if d > 1 and not pp.candidates(d, m, n_layers):
            v = min((schedules.stages_per_rank(s) for s in pp.candidates(d, m)), default=1)
            raise PipelineError(f"pipeline degree {d} ({pp.pp_schedule}, {d * v} stages): more stages than the model's "
                                f"{n_layers} repeated layers; each stage needs at least one layer (allow smaller "
                                f"degrees with pp_degrees / --pp-degrees)")
    for d in degrees:
        sub, _ = stage_mesh(mesh, pp.pp_axis, d)
        sub_options = _stage_options(options, mesh, pp.pp_axis, d)
        if d == 1:
            progress(f"pipeline degree 1 (no pipelining): the full mesh {mesh}, batch {batch}")
            plan = plan_spmd(workload, sub_options.replace(memory_limit_bytes=math.inf), record)
            pmodel = _placement_model(plan)
            limit = search.memory_limit_bytes(options, pmodel)
            fits: bool | None = None if limit is None else True
            try:
                plan = search.fit_in_memory(pmodel, plan, limit, functools.partial(
                    search.solve_model, pmodel, options, timings=plan.timings, workload=plan.workload))
            except OutOfMemory as e:
                fits = False
                logger.info("pipeline degree 1: %s", e)
            peak = plan.memory.get("peak_bytes")
            priced.append(DegreePrice(1, plan.objective_us, peak, fits, tuple(sub), stage_us=(plan.objective_us,),
                                      note="" if fits is not False else "no plan fits"))
            plans[1] = plan
            continue
        def transfer(src: int, dst: int, nbytes: float, d: int = d) -> float:
            return send_recv_us(nbytes, peer_link(full_topo, stage_rank(mesh, pp.pp_axis, d, src),
                                                  stage_rank(mesh, pp.pp_axis, d, dst)))

        # a stage plan per stage size (1F1B's stages hold twice the layers of the two-per-rank
        # schedules'), every schedule priced on each: the per-layer costs of either may be the better
        names = pp.candidates(d, m, n_layers)
        tried: list[tuple[Plan, DegreePrice]] = []
        for v in sorted({schedules.stages_per_rank(name) for name in names}, reverse=True):
            # the largest balanced stage, with at least one layer of every kind the model has
            k_layers = fixed_layers or min(n_layers, max(-(-n_layers // (d * v)), kept_layers))
            progress(f"pipeline degree {d}: stage mesh {sub}, {m} microbatches of {batch // m}, {', '.join(names)}; "
                     f"stage plan of {k_layers} layers")
            job = _StageJob(d, names, m, n_layers, k_layers, kinds, tuple(sub), transfer, fixed_stages, fixed_sync)
            # the second plan is solved again under memory only where the first left nothing that fits
            tried.append(_plan_degree(job, workload, options, sub_options, record, plan_spmd, progress,
                                      solve_again=all(t[1].fits is False for t in tried)))
        plans[d], price = min(tried, key=lambda t: (t[1].fits is False, t[1].objective_us if t[1].fits is not False
                                                    else t[1].peak_bytes or math.inf))
        priced.append(price)
    best = choose(priced)
    choice = PipelineChoice(axis=pp.pp_axis, mesh=mesh, schedule=best.schedule or pp.pp_schedule, microbatches=m,
                            chosen=best,
                            alternatives=priced, planning_s=time.perf_counter() - start)
    plan = plans[best.degree]
    plan.pipeline = choice.to_json()
    return plan, choice


@dataclass(frozen=True)
class _StageJob:
    """One degree (> 1) to plan and price: the schedules to price it under (the cheapest that fits
    kept), microbatches, layers and transfers, and a replayed plan's split and weight syncs (None:
    chosen here)."""

    degree: int
    schedules: tuple[str, ...]
    microbatches: int
    n_layers: int
    stage_layers: int
    layer_kinds: tuple[int, ...] | None
    stage_mesh: tuple[int, ...]
    transfer_us: Callable[[int, int, float], float]
    stages: Sequence[tuple[int, int]] | None
    weight_sync: Sequence[str] | None


def _plan_degree(job: _StageJob, workload: Workload, options: PlanOptions, sub_options: PlanOptions,
                 record: Mapping[str, Any], plan_spmd: PlanSpmd,
                 progress: Callable[[str], None], *, solve_again: bool = True) -> tuple["Plan", DegreePrice]:
    """The stage plan of one degree and its price. The stage plan is solved with its weights'
    traffic shared by the microbatches; if its split does not fit the memory limit, or fits only
    with some stage's weights synchronised per microbatch, two more are tried before the degree is
    reported as not fitting, the cheapest that fits kept: the stage plan
    solved with that traffic paid per microbatch (it prefers sharded weights: less memory), and,
    if that does not fit either, the first one solved again with a memory row on the stage mesh
    (:func:`_under_memory_row`)."""
    m = job.microbatches
    micro, cut = microbatch_workload(workload, job.stage_mesh, m, job.stage_layers)
    # the stage plan sees its weights' traffic as one step of m microbatches pays it
    stage_options = sub_options.replace(memory_limit_bytes=math.inf, weight_microbatches=m)
    plan = plan_spmd(micro, stage_options, record)
    limit = search.memory_limit_bytes(options, _placement_model(plan))

    def price(stage_plan: "Plan") -> DegreePrice:
        units = step_units(_placement_model(stage_plan), stage_plan.node_strategy)
        if cut or len(units.layers) != job.n_layers:
            units = units.with_layers(job.n_layers, stand_ins(job.layer_kinds, len(units.layers), job.n_layers))
        prices = []
        for name in job.schedules:
            one = price_degree(units, job.degree, name, m, job.transfer_us, stage_mesh_shape=job.stage_mesh,
                               memory_limit_bytes=limit, stages=job.stages,
                               stage_plan_layers=job.stage_layers if cut else None, weight_sync=job.weight_sync)
            logger.info("pipeline degree %d, %s: %.1f µs (bubble %.1f µs), fits %s", job.degree, name,
                        one.objective_us, one.bubble_us, one.fits)
            prices.append(one)
        fitting = [p for p in prices if p.fits is not False]
        return min(fitting or prices, key=lambda p: p.objective_us if fitting else p.peak_bytes or math.inf)

    tried = [(plan, price(plan))]
    first = tried[0][1]
    # kept within the limit only by synchronising some stage's weights per microbatch, or not at all
    squeezed = first.fits is False or schedules.WEIGHT_SYNCS[0] in first.weight_sync
    if not squeezed or job.stages is not None or limit is None or not solve_again:
        return plan, first
    progress(f"pipeline degree {job.degree}: a rank needs {(first.peak_bytes or 0) / 1e9:.2f} GB with weight syncs "
             f"{', '.join(first.weight_sync)}; the stage plan solved again, its weights' traffic per microbatch")
    if m > 1:
        plain = plan_spmd(micro, stage_options.replace(weight_microbatches=1), record)
        tried.append((plain, replace(price(plain), note="stage plan solved with weight traffic per microbatch")))
    if all(t[1].fits is False for t in tried):  # the memory row's solves only where nothing fits yet
        tried.extend(_under_memory_row(plan, job, stage_options, limit, price))
    fitting = [t for t in tried if t[1].fits is not False]
    if fitting:
        return min(fitting, key=lambda t: t[1].objective_us)
    return min(tried, key=lambda t: t[1].peak_bytes or math.inf)


def _under_memory_row(plan: "Plan", job: _StageJob, stage_options: PlanOptions, limit: float,
                      price: Callable[["Plan"], DegreePrice]) -> list[tuple["Plan", DegreePrice]]:
    """``plan`` solved again with a memory row on its stage mesh, its activations counted as many
    times as a rank holds microbatches of them on average (:func:`_activation_copies`), the row
    lowered by what the fullest rank is still over, for at most
    :data:`apmodel.solve.search.MEMORY_ROUNDS` solves; each solve's plan and price."""
    pmodel = _placement_model(plan)
    row, copies = limit, _activation_copies(job)
    out: list[tuple["Plan", DegreePrice]] = []
    for _ in range(search.MEMORY_ROUNDS):
        pmodel.add_memory_limit(row, reserved_bytes=step_units(pmodel, plan.node_strategy).transient_bytes,
                                activation_copies=copies)
        try:
            plan = search.solve_model(pmodel, stage_options, timings=plan.timings, workload=plan.workload)
        except solvers.Infeasible:
            logger.info("pipeline degree %d: no stage plan fits a memory row of %.2f GB", job.degree, row / 1e9)
            break
        again = price(plan)
        out.append((plan, replace(again, note="; ".join(x for x in (again.note, "stage plan solved under a memory row")
                                                         if x))))
        if again.fits is not False:
            break
        row -= (again.peak_bytes or 0.0) - limit  # still over: the row lower by as much
    return out


def _activation_copies(job: _StageJob) -> float:
    """Microbatches of a stage's activations a rank holds at once, on average over the ranks (the
    memory-aware split gives the ranks that hold more fewer layers): the schedule's timeline with
    every stage holding one unit per microbatch, a rank's layers split in ``v`` chunks."""
    copies = 0.0
    for name in job.schedules:  # the schedule that holds the most
        v = schedules.stages_per_rank(name)
        n = job.degree * v
        timeline = schedules.simulate(name, job.degree, job.microbatches, [1.0] * n, [1.0] * n,
                                      activation_bytes=[1.0 / v] * n)
        copies = max(copies, sum(timeline.held_bytes) / job.degree)
    return copies


def _placement_model(plan: "Plan") -> Any:
    """The placement model a plan was solved on (``plan_spmd`` returns plans that keep it)."""
    if plan.model is None:
        raise PipelineError("pipeline planning needs the SPMD plan's placement model (plan.model)")
    return plan.model
