"""The public entry points and the one orchestration path of the planner.

``apmodel.plan`` plans a module given from Python; ``apmodel.parallelize`` plans and lowers it
onto a real mesh; the command line builds a :class:`~apmodel.frontend.workloads.Workload` from a name and
calls :func:`plan_workload`, the same path, which also prices the hand-written recipes when asked.
Stages, top to bottom: capture → strategies → model (cluster, price, constrain) → solve → fit in
memory → plan (→ lowering). Every option is one :class:`~apmodel.core.options.PlanOptions`; the
keyword arguments of these functions are its field names.

Progress is reported through a :class:`Progress` (``stage`` when a step starts, ``done`` when it
ends); the default logs at INFO, the CLI draws a status line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from apmodel.core.options import DEVICE_AUTO, PlanOptions, make_options, renamed_keywords, run_precision_of
from apmodel.entry.api_arguments import check_parallelize_target, check_step_arguments, mesh_shape_argument
from apmodel.frontend.machine import Machine
from apmodel.frontend.machine import detect as detect_machine
from apmodel.frontend.workloads import TraceFailed, Workload
from apmodel.graph.capture import CapturedGraph
from apmodel.graph.checkpointing import checkpoint, policy_of
from apmodel.lowering.module import DEFAULT_BUCKET_MB, DEFAULT_INFLIGHT_MB
from apmodel.problem.constraints import ConstraintLike
from apmodel.problem.placement_model import ConstraintConflict, PlacementModel
from apmodel.problem.pricing import DTYPES, CostContext, build_cost_context
from apmodel.result.plans import Plan
from apmodel.solve import search
from apmodel.solve.search import fit_in_memory, replay_constraints

logger = logging.getLogger(__name__)

__all__ = [
    "DTYPES", "PlanResult", "Progress", "LogProgress", "attach", "build_model", "cost_context", "fit_in_memory",
    "parallelize", "placement_model", "plan", "plan_workload", "replay_constraints", "solve_model",
]

#: Relative tolerance when checking that the found plan is no worse than a recipe.
RECIPE_TOLERANCE = 1e-6


class Progress(Protocol):
    """Where the planner reports its steps (the CLI draws them; the default logs them)."""

    def stage(self, text: str) -> None: ...

    def done(self, text: str) -> None: ...


class LogProgress:
    """Steps as INFO log records (the default progress of the Python API)."""

    def stage(self, text: str) -> None:
        logger.info("%s", text)

    def done(self, text: str) -> None:
        logger.info("%s", text)


@dataclass
class PlanResult:
    """A plan with what was learned making it: the capture, warnings and the recipe comparison."""

    plan: Plan
    captured: CapturedGraph
    options: PlanOptions
    param_bytes: float
    """parameter bytes per device in the pricing dtype, under the plan's storage placements"""
    warnings: list[str] = field(default_factory=list)
    recipes: list[Any] | None = None
    """:class:`~apmodel.reading.recipes.RecipeResult` of every recipe (``compare_recipes``), else None"""
    free_plan: Plan | None = None
    """the plan under the free storage policy (contains every recipe), when recipes were priced"""
    free_plan_param_bytes: float | None = None
    memory_limit_bytes: float | None = None
    """the per-device limit plans were held to (None: no limit)"""

    def fits(self, plan: Plan | None) -> bool | None:
        """Whether ``plan``'s peak memory fits :attr:`memory_limit_bytes` (None when unknown)."""
        peak = None if plan is None else plan.memory.get("peak_bytes")
        if peak is None:
            return None
        return self.memory_limit_bytes is None or peak <= self.memory_limit_bytes


# -------------------------------------------------------------------------------- building
def cost_context(mesh_shape: Sequence[int], options: PlanOptions | None = None, **option_values: Any) -> CostContext:
    """The cost models of ``options`` (or of the option keywords: ``device``, ``dtype``,
    ``compute_model``, ``comm_model``, ``calibration``, ``mixed_precision``, ...) on a mesh.
    See :func:`apmodel.problem.pricing.build_cost_context`."""
    opts = make_options(options, **option_values)
    opts.check_mesh(mesh_shape)
    return build_cost_context(mesh_shape, opts)


def placement_model(
    captured: CapturedGraph,
    strategies: Mapping[str, list],
    cost: CostContext,
    options: PlanOptions | None = None,
    *,
    constraints: Sequence[ConstraintLike] = (),
    **option_values: Any,
) -> PlacementModel:
    """A compiled :class:`PlacementModel` (see :func:`apmodel.solve.search.placement_model`)."""
    return search.placement_model(captured, strategies, cost, make_options(options, **option_values),
                                  constraints=constraints)


def solve_model(
    pmodel: PlacementModel,
    options: PlanOptions | None = None,
    *,
    timings: dict[str, float] | None = None,
    workload: Mapping[str, Any] | None = None,
    **option_values: Any,
) -> Plan:
    """Solve a built model (``solver``, ``time_limit``, ``solver_options``) and decode the plan."""
    return search.solve_model(pmodel, make_options(options, **option_values), timings=timings, workload=workload)


def _capture(workload: Workload | CapturedGraph, options: PlanOptions) -> CapturedGraph:
    """The workload's traced step (at the param dtype when the plan runs in mixed precision),
    rewritten for activation checkpointing ``options.ac`` (:func:`apmodel.graph.checkpointing.checkpoint`;
    a graph the caller traced or checkpointed is kept as it is)."""
    return checkpoint(_trace_workload(workload, options.run_precision), options.ac)


def _trace_workload(workload: Workload | CapturedGraph, precision: tuple[str, str] | None) -> CapturedGraph:
    if isinstance(workload, CapturedGraph):
        return workload
    if isinstance(workload.model, CapturedGraph):
        return workload.model
    from apmodel import lowering

    try:
        # on the meta device whatever device the model and inputs are on (only shapes matter), as
        # parallelize traces it; mixed precision: as it runs, bf16 parameters and inputs
        return lowering.capture_on_meta(
            workload.model, workload.sample_inputs, workload.loss_fn,
            param_dtype=None if precision is None else DTYPES[precision[0]], kwargs=workload.kwargs,
            targets=workload.targets, allow_unused_parameters=workload.allow_unused_parameters)
    except Exception as e:
        if not workload.record.get("model"):
            raise  # a module from Python: its own error is the clearest
        raise TraceFailed(workload.name, "cannot trace the training step", e) from e


def _build(
    captured: CapturedGraph,
    options: PlanOptions,
    cost: CostContext,
    constraints: Sequence[ConstraintLike],
    timings: dict[str, float],
    progress: Progress,
    mesh: Any = None,
) -> PlacementModel:
    """Strategies and the constrained model; seeded candidates that conflict with the constraints
    are discarded and the full space is built instead (the same on every entry point)."""
    mesh_shape = tuple(cost.mesh_shape)
    use_seeding = options.uses_seeding(len(mesh_shape))
    progress.stage(f"enumerating strategies on mesh {mesh_shape}" + (" (seeded per axis)" if use_seeding else ""))
    strategies, seeded = search.candidate_strategies(captured, cost, options, mesh=mesh, timings=timings)
    progress.done(f"strategies in {timings['seeding_s'] + timings['strategies_s']:.1f} s")
    progress.stage("building the placement model")
    t0 = time.perf_counter()
    try:
        pmodel = search.placement_model(captured, strategies, cost, options, constraints=constraints)
    except ConstraintConflict as e:
        if not seeded:
            raise
        logger.warning("seeded candidates conflict with the constraints (%s); rebuilding without seeding", e)
        spent = timings["seeding_s"] + timings["strategies_s"]
        pmodel = _build(captured, options.replace(seeding=False), cost, constraints, timings, progress, mesh)
        timings["build_s"] += spent  # the discarded seeded attempt counts too
        return pmodel
    timings["build_s"] = time.perf_counter() - t0 + timings["strategies_s"] + timings["seeding_s"]
    sizes = pmodel.summary()
    progress.done(f"model: {sizes['groups']} groups, {sizes['states']} states, {sizes['edges']} edges "
                  f"in {timings['build_s']:.1f} s")
    return pmodel


def build_model(
    model: nn.Module | CapturedGraph,
    mesh_shape: Sequence[int],
    sample_inputs: Sequence[Any] = (),
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    targets: Sequence[Any] | None = None,
    allow_unused_parameters: bool = False,
    options: PlanOptions | None = None,
    cost: CostContext | None = None,
    mesh: Any = None,
    constraints: Sequence[ConstraintLike] = (),
    timings: dict[str, float] | None = None,
    progress: Progress | None = None,
    **option_values: Any,
) -> PlacementModel:
    """Capture (unless given a :class:`CapturedGraph`), enumerate strategies and build the model.

    ``loss_fn``, ``kwargs``, ``targets``, ``allow_unused_parameters``: how the step is traced (see
    :func:`apmodel.graph.capture.capture`). ``options`` / the option keywords: see
    :class:`~apmodel.core.options.PlanOptions`; ``cost`` replaces the cost models they describe.
    When seeded candidates (meshes of 3+ axes) conflict with the constraints, the model is
    rebuilt without seeding. ``timings`` gets ``trace_s``, ``seeding_s``, ``strategies_s`` and
    ``build_s``.
    """
    mesh_shape = mesh_shape_argument(mesh_shape, "apmodel.build_model")
    check_step_arguments("apmodel.build_model", model, sample_inputs, loss_fn, kwargs, targets, allow_captured=True)
    opts = make_options(options, **option_values)
    opts.check_mesh(mesh_shape)
    timings = timings if timings is not None else {}
    workload = model if isinstance(model, CapturedGraph) else Workload(
        model, mesh_shape, tuple(sample_inputs), loss_fn, kwargs, targets, allow_unused_parameters)
    captured = _capture(workload, opts)
    timings["trace_s"] = captured.trace_s
    cost = cost or build_cost_context(mesh_shape, opts, captured)
    return _build(captured, opts, cost, constraints, timings, progress or LogProgress(), mesh)


# -------------------------------------------------------------------------------- planning
def _solve(pmodel: PlacementModel, options: PlanOptions, timings: dict[str, float], record: Mapping[str, Any]) -> Plan:
    return search.solve_model(pmodel, options, timings=timings, workload=record)


def plan_workload(
    workload: Workload,
    options: PlanOptions | None = None,
    *,
    constraints: Sequence[ConstraintLike] = (),
    replay: Plan | str | Path | None = None,
    compare_recipes: bool = False,
    record: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> PlanResult:
    """Plan a :class:`~apmodel.frontend.workloads.Workload`: the one path every entry point takes.

    Traces the step, builds the model under ``constraints`` (plus ``replay``: force a saved plan),
    solves with ``options.solver``, re-solves under a memory row when the plan does not fit
    (:func:`~apmodel.solve.search.fit_in_memory`), and with ``compare_recipes`` prices every recipe of
    :mod:`apmodel.reading.recipes` on the same candidates and checks none beats the search. ``record``:
    extra keys for the plan file's ``workload`` record (beside the workload's and the options').
    """
    from apmodel.reading import recipes as R

    options = options or PlanOptions()
    options.check_mesh(workload.mesh_shape)
    progress = progress or LogProgress()
    options.check_available()
    saved = Plan.load(replay) if isinstance(replay, (str, Path)) else replay
    if options.pp_axis is not None or (saved is not None and saved.pipeline):  # pipeline stages (apmodel.solve.pipeline)
        if compare_recipes:
            raise ValueError("compare_recipes prices the recipes without a pipeline: plan without pp_axis "
                             "(--pp-axis) to compare them")
        return plan_pipelined(workload, options, constraints=constraints, replay=saved, record=record,
                              progress=progress)
    constraints = list(constraints)
    if saved is not None:
        constraints.append(replay_constraints(saved))
    timings: dict[str, float] = {}
    search.prepare_solver(options)  # loads in the background while the step is traced
    progress.stage(f"tracing {workload.name}")
    captured = _capture(workload, options)
    if policy_of(captured) != options.ac:  # a graph the caller checkpointed: its plan records that policy
        options = options.replace(ac=policy_of(captured))
    timings["trace_s"] = captured.trace_s
    progress.done(f"traced {len(captured.gm.graph.nodes)} nodes in {captured.trace_s:.1f} s")
    cost = build_cost_context(workload.mesh_shape, options, captured)
    pmodel = _build(captured, options, cost, constraints, timings, progress)
    wl = {**captured.workload, **{k: v for k, v in workload.record.items() if v is not None},
          "mesh": list(workload.mesh_shape), **options.to_record(), **dict(record or {})}
    progress.stage(f"solving with {options.solver}")
    found = _solve(pmodel, options, timings, wl)
    limit = search.memory_limit_bytes(options, pmodel)
    found = fit_in_memory(pmodel, found, limit, lambda: _solve(pmodel, options, timings, wl))
    progress.done(f"solved ({found.solver.get('status')}) in {found.timings['solve_s']:.1f} s: "
                  f"{found.objective_us:,.1f} µs")
    itemsize = options.dtype_bytes
    result = PlanResult(found, captured, options, R.param_bytes_per_device(found, captured, itemsize),
                        warnings=list(dict.fromkeys(found.warnings or [])), memory_limit_bytes=limit)
    if compare_recipes:
        _compare_recipes(result, pmodel, cost, constraints, itemsize, progress)
    return result


def _compare_recipes(result: PlanResult, pmodel: PlacementModel, cost: CostContext,
                     constraints: Sequence[ConstraintLike], itemsize: int, progress: Progress) -> None:
    """Price every recipe on the found plan's candidates; warn where one beats the search."""
    from apmodel.reading import recipes as R

    options, captured, found = result.options, result.captured, result.plan
    strategies = pmodel.strategies
    default_space = options.param_policy == "full_shard" and not options.replicate_axes \
        and options.param_memory_fraction is None and options.param_budget_ratio is None
    if options.param_policy == "free" and not options.replicate_axes and options.param_memory_fraction is None \
            and options.param_budget_ratio is None:
        free = found  # this run already searched the free-storage space, which contains every recipe
    else:
        progress.stage(f"solving with {options.solver} under the free parameter-storage policy")
        free_options = options.replace(param_policy="free", replicate_axes=(), param_memory_fraction=None,
                                       param_budget_ratio=None)
        free = search.solve_model(search.placement_model(captured, strategies, cost, free_options,
                                                         constraints=constraints), free_options,
                                  workload={"policy": "free"})
    result.free_plan = free
    result.free_plan_param_bytes = R.param_bytes_per_device(free, captured, itemsize)
    priced = []
    for recipe in R.RECIPES:
        if not recipe.applies_to(captured):  # expert / context-parallel recipes on a model without the region
            continue
        progress.stage(f"pricing recipe {recipe.name}")
        priced.append(R.run(recipe, captured, strategies, cost, options, itemsize=itemsize))
    result.recipes = priced
    # The honest check: every recipe lies in the free-policy space; full_shard recipes also in the default one.
    for r in priced:
        if r.objective_us is None:
            continue
        refs = [("free-policy plan", free.objective_us)]
        if default_space and R.within_default_space(R.get(r.name)):
            refs.append(("found plan", found.objective_us))
        for label, ref in refs:
            if r.objective_us < ref * (1 - RECIPE_TOLERANCE) - 1e-9:
                msg = (f"recipe {r.name} ({r.objective_us:,.1f} µs) is cheaper than the {label} ({ref:,.1f} µs): "
                       f"the search missed a plan its space contains (solver {options.solver} is approximate"
                       f"{'; user constraints restrict the search' if constraints else ''}) — please report")
                result.warnings = list(dict.fromkeys([*result.warnings, msg]))
                logger.warning("%s", msg)


def plan(
    model: nn.Module | CapturedGraph,
    mesh_shape: Sequence[int],
    sample_inputs: Sequence[Any] = (),
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    targets: Sequence[Any] | None = None,
    allow_unused_parameters: bool = False,
    options: PlanOptions | None = None,
    constraints: Sequence[ConstraintLike] = (),
    replay: Plan | str | Path | None = None,
    workload: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
    **option_values: Any,
) -> Plan:
    """Plan ``model`` on a mesh of ``mesh_shape``: the cheapest per-operator placements.

    ``model`` is an ``nn.Module`` (ideally on the meta device) called as
    ``model(*sample_inputs, **kwargs)``; the step is traced on the meta device whatever device the
    module and its inputs are on (only shapes matter, as for :func:`parallelize`), so inputs made
    on the CPU do for a model built on meta. ``loss_fn(output, *targets)`` turns its output into the
    scalar loss (``loss_fn(output, *sample_inputs)`` when no ``targets`` are given: models that
    take their labels). Options: ``options`` and/or their keywords (:class:`PlanOptions`), e.g.
    ``device="h200"`` (the accelerator of the cost model: ``"h100"``, ``"h200"``, ``"a100"``,
    ``"b200"``, ``"cpu"``), ``solver="highs"``, ``param_policy="free"``. ``replay`` prices a saved
    plan on this workload instead of searching. ``memory_limit_bytes`` (bytes per device; default:
    the device's HBM less 10%, ``math.inf`` for none; ``memory_limit=``, its old name, is read with
    a DeprecationWarning): a plan over it is solved again under a memory row, or refused with
    :class:`~apmodel.problem.memory.OutOfMemory`. ``workload``: extra keys for the plan file's workload record.
    """
    mesh_shape = mesh_shape_argument(mesh_shape)
    check_step_arguments("apmodel.plan", model, sample_inputs, loss_fn, kwargs, targets, allow_captured=True)
    opts = make_options(options, **option_values)
    wl = Workload(model, mesh_shape, tuple(sample_inputs), loss_fn, kwargs, targets, allow_unused_parameters)
    return plan_workload(wl, opts, constraints=constraints, replay=replay, record=workload, progress=progress).plan


def attach(saved: Plan | str | Path, *, progress: Progress | None = None) -> Plan:
    """Rebuild the placement model of a saved plan from its ``workload`` record and attach it
    (``saved.model``), so that ``explain`` and the report can read how parameters are used.
    ``saved``: a :class:`Plan`, or the path of a plan file.

    The record must name a preset or ``package.module:factory`` (plans made from a name, or from a
    preset model built with :func:`apmodel.models.build`)."""
    from apmodel.candidates.strategies import enumerate_strategies
    from apmodel.frontend.config import Config, load_config
    from apmodel.frontend.workloads import DEFAULT_BATCH, default_seq, load_workload

    if isinstance(saved, (str, Path)):
        saved = Plan.load(saved)
    if not isinstance(saved, Plan):
        raise TypeError(f"apmodel.attach: expected a Plan (apmodel.plan(...) or Plan.load(path)) or a plan file's "
                        f"path, got {type(saved).__name__}")
    record = saved.workload
    if not record.get("model"):
        raise ValueError("the plan file records no workload model; re-plan it with `apmodel plan ... --out` to explain it")
    progress = progress or LogProgress()
    options = PlanOptions.from_record(record)
    user_constraints = []
    if record.get("config") and Path(record["config"]).is_file():
        cfg = load_config(record["config"])
        user_constraints = cfg.constraints
    else:
        cfg = Config()
    progress.stage(f"re-tracing {record['model']}")
    mesh = tuple(saved.mesh_shape)
    # a record without batch or seq was planned with the command line's defaults
    workload = load_workload(record["model"], mesh, batch=record.get("batch") or DEFAULT_BATCH,
                             seq=record.get("seq") or default_seq(record["model"]), layers=record.get("layers"))
    captured = _capture(workload, options)
    saved.check_compatible(captured, mesh)
    progress.stage("enumerating strategies and building the model")
    strategies = enumerate_strategies(captured.gm, mesh)
    saved.model = search.placement_model(captured, strategies, build_cost_context(mesh, options, captured), options,
                                         constraints=user_constraints)
    return saved


# ------------------------------------------------------------------------------ lowering
def parallelize(
    model: nn.Module,
    mesh: Any,
    sample_inputs: Sequence[Any],
    *,
    loss_fn: Callable | None = None,
    kwargs: dict[str, Any] | None = None,
    targets: Sequence[Any] | None = None,
    allow_unused_parameters: bool = False,
    constraints: Sequence[Any] = (),
    plan: Plan | None = None,
    lowering: str = "native",
    bucket_mb: float | None = None,
    overlap: bool | None = None,
    options: PlanOptions | None = None,
    **option_values: Any,
) -> nn.Module:
    """Plan ``model``'s training step for ``mesh`` (unless ``plan`` is given) and lower it onto ``mesh``.

    Args:
        model: the user's module, ideally on the meta device (then nothing is allocated); it is
            changed in place and returned (see :func:`apmodel.lowering.lower`).
        mesh: the real ``DeviceMesh`` to run on; its shape is the planning mesh shape.
        sample_inputs: the model's positional inputs of one step, global shapes.
        loss_fn: ``loss_fn(model(*inputs, **kwargs), *targets)`` gives the scalar loss (then
            ``forward`` returns the loss); without ``targets`` it is called as
            ``loss_fn(output, *inputs)``; None when the model returns what is to be differentiated.
        kwargs: the model's keyword inputs (tensors, or constants traced into the graph).
        targets: tensors only the loss reads (labels); the returned module is then called as
            ``module(*inputs, *targets, **kwargs)``.
        allow_unused_parameters: plan even if a trainable parameter gets no gradient.
        constraints, options and option keywords (``device``, ``solver``, ``input_placements``...):
            as for :func:`plan`, except that ``device`` defaults to ``"auto"`` (when ``options``
            is not given): the mesh's own hardware (the GPU's spec and GPUs per node; on CPU
            processes the CPU spec with collectives timed on the mesh's process groups and a
            compute profile fitted once per machine and cached; see :mod:`apmodel.frontend.machine`). The
            plan's ``workload["priced_for"]`` says what was priced.
        plan: a :class:`~apmodel.result.plans.Plan` (e.g. ``Plan.load(path)``): skip planning.
        lowering: "native" (default): the step traced once into a forward and a backward graph
            over local shards with explicit functional collectives, which ``torch.compile``
            compiles; "interpret": the joint graph run node by node over DTensors (for debugging).
        bucket_mb: the option ``bucket_mb``: the plan is priced with it and the native program
            merges independent collectives of one kind and process group (parameter gathers,
            gradient reductions) into buckets of at most this many MB; 0: one collective per planned
            step. With ``plan``: what the program runs (default: the size the plan was priced with).
            ``bucket_cap_mb=``, its old name, is read with a DeprecationWarning.
        overlap: native lowering: collectives issued as soon as their inputs exist and waited just
            before their first reader, parameter gathers prefetched, at most the option
            ``inflight_mb`` in flight; False: each waited as it is issued. None (default): as the
            plan was priced (the option ``overlap``, on unless set; plans saved before it: off).

    Returns the module, with DTensor parameters placed as planned (tied parameters stay one
    Parameter; buffers updated in forward, such as BatchNorm statistics, are written back after
    each step). For a meta model call ``to_empty(device=...)`` and initialise it (its
    ``init_weights``, or :func:`apmodel.lowering.load_full_state_dict`) before training.
    """
    from apmodel import lowering as lowering_stage
    from apmodel.core import kernels

    check_parallelize_target(model, mesh, lowering, lowering_stage.LOWERINGS)
    check_step_arguments("apmodel.parallelize", model, sample_inputs, loss_fn, kwargs, targets, allow_captured=False)
    option_values = renamed_keywords(option_values, stacklevel=3)
    if "bucket_mb" in option_values:  # given by its old name
        bucket_mb = option_values.pop("bucket_mb")
    machine = None
    if plan is None and bucket_mb is not None:  # priced with the size the program runs
        option_values["bucket_mb"] = bucket_mb
    if plan is None:
        opts, machine = _planning_options(mesh, options, option_values)
        precision, priced_bucket_mb = opts.run_precision, opts.bucket_mb
        priced_overlap, inflight_mb = opts.overlap, opts.inflight_mb
    elif option_values or options is not None or constraints:
        raise TypeError("planning options given together with plan=: the plan is used as it is")
    else:
        precision, priced_bucket_mb, priced_overlap, inflight_mb = _as_priced(plan)
    if bucket_mb is None:
        bucket_mb = priced_bucket_mb
    if overlap is None:
        overlap = priced_overlap
    # Mixed precision: traced as it runs (bf16 parameters and inputs), so the graph holds the casts
    # the model's code makes at that dtype; the parameters themselves stay in the model's dtype.
    captured = lowering_stage.capture_on_meta(
        model, sample_inputs, loss_fn, kwargs=kwargs, targets=targets, allow_unused_parameters=allow_unused_parameters,
        param_dtype=None if precision is None else DTYPES[precision[0]],
    )
    if plan is None:
        captured = checkpoint(captured, opts.ac)  # the lowered graph is the one planned
        plan = _plan_on_mesh(captured, mesh, opts, constraints, machine)
    else:  # a saved plan: rewrite the graph with the checkpointing policy it was made with
        captured = checkpoint(captured, str(plan.workload.get("ac") or "none"))
        opts = PlanOptions.from_record(plan.workload)

    return lowering_stage.lower(model, mesh, plan, captured, local_kernels=kernels.local_kernels, lowering=lowering,
                                  bucket_mb=bucket_mb, inflight_mb=inflight_mb if overlap else None,
                                  replan=_replanner(mesh, opts))


def _planning_options(mesh: DeviceMesh, options: PlanOptions | None,
                      option_values: dict[str, Any]) -> tuple[PlanOptions, Machine | None]:
    """:func:`parallelize`'s options, and the machine detected when ``device`` is "auto" (its
    default without ``options``); checked against the mesh on every rank, before one plans for all."""
    machine = None
    if option_values.get("device", DEVICE_AUTO if options is None else None) == DEVICE_AUTO:
        machine = detect_machine(mesh, {k: v for k, v in option_values.items() if k != "device"})
        logger.info("parallelize prices this machine: %s", machine.description)
        option_values = machine.options
    opts = make_options(options, **option_values)
    opts.check_mesh(tuple(mesh.shape))
    return opts, machine


def _as_priced(plan: Plan) -> tuple[tuple[str, str] | None, float, bool, float]:
    """How a saved plan runs, as it was priced: (run precision, bucket MB, overlap, in-flight MB).
    Plans saved before an option existed run as they ran then: 25 MB buckets (they were priced per
    collective), serially."""
    recorded = plan.workload.get("bucket_mb")
    return (run_precision_of(plan.workload), DEFAULT_BUCKET_MB if recorded is None else float(recorded),
            bool(plan.workload.get("overlap", False)), float(plan.workload.get("inflight_mb") or DEFAULT_INFLIGHT_MB))


def _plan_on_mesh(captured: CapturedGraph, mesh: DeviceMesh, opts: PlanOptions, constraints: Sequence[Any],
                  machine: Machine | None) -> Plan:
    """The plan of :func:`parallelize`: made on one rank, for all (the plan says which machine it
    priced when ``machine`` was detected)."""
    from apmodel import lowering as lowering_stage

    def solve() -> Plan:
        found = plan_workload(Workload(captured, tuple(mesh.shape)), opts, constraints=constraints).plan
        if machine is not None:  # the plan says what it priced
            found.workload["priced_for"] = f"this machine (device='auto'): {machine.description}"
        return found

    return lowering_stage.plan_on_one_rank(solve, mesh)


def _replanner(mesh: DeviceMesh, opts: PlanOptions) -> Callable[[CapturedGraph, Sequence[Any]], Plan]:
    """What the lowered module calls for a step traced in other module modes (eval): a plan made
    like this one, around the stored parameters (``pins``)."""
    def replan(other: CapturedGraph, pins: Sequence[Any]) -> Plan:
        return _plan_on_mesh(other, mesh, opts, pins, None)

    return replan


def parallelize_pipeline(
    make_model: Callable[[], nn.Module],
    mesh: DeviceMesh,
    sample_inputs: Sequence[Any],
    *,
    loss_fn: Callable[..., torch.Tensor],
    pp_axis: int,
    stages: Sequence[Sequence[int]] | None = None,
    microbatches: int | None = None,
    pp_schedule: str | None = None,
    weight_sync: Sequence[str] | None = None,
    plan: Plan | None = None,
    lowering: str = "native",
    options: PlanOptions | None = None,
    **option_values: Any,
) -> Any:
    """Pipeline stages over mesh dimension ``pp_axis`` of ``mesh``, each stage's step planned and
    lowered on the stage mesh (see :mod:`apmodel.lowering.pipeline`); returns a
    :class:`~apmodel.lowering.pipeline.PipelinedModel` whose ``step(inputs, target=...)`` runs a
    training step (the loss on the rank of the last stage) and whose ``stages`` hold this rank's
    parameters.

    ``make_model()``: a fresh full model, ideally on meta (called once per stage cut).
    ``sample_inputs``: the model's inputs for the whole batch (targets go to ``loss_fn(output,
    target)`` on the last stage). ``stages`` (``[first, last]`` layers per stage), ``microbatches``
    and ``pp_schedule`` (``"1f1b"``, ``"interleaved"``; ``schedule=``, its old name, is read with a
    DeprecationWarning): as planned, or read from ``plan.pipeline`` (a plan made with a pipeline
    axis). ``weight_sync``: per stage, how it synchronises its weights
    (:data:`apmodel.core.schedules.WEIGHT_SYNCS`), as planned (default: each stage reduces its
    gradients once per step). Options: as for :func:`parallelize`, for every stage plan."""
    from apmodel import lowering as lowering_stage
    from apmodel.lowering import pipeline as lowered_pipeline

    option_values = renamed_keywords(option_values, stacklevel=3)
    boundary_placements = None
    if "pp_schedule" in option_values:  # given by its old name
        pp_schedule = option_values.pop("pp_schedule")

    if plan is not None:
        if not plan.pipeline:
            raise ValueError("apmodel.parallelize_pipeline: the plan records no pipeline (plan with a pipeline axis)")
        record = plan.pipeline
        if record["degree"] == 1:
            raise ValueError("apmodel.parallelize_pipeline: the plan chose no pipelining (degree 1): lower it with "
                             "apmodel.parallelize on the whole mesh")
        stages = stages or [tuple(s) for s in record["stages"]]
        microbatches = microbatches or record["microbatches"]
        pp_schedule = pp_schedule or record["schedule"]
        weight_sync = weight_sync or record.get("weight_sync") or None
        if [list(s) for s in stages] == record["stages"]:  # the priced split: its boundaries as priced
            boundary_placements = record.get("boundary_placements") or None
    if not stages or microbatches is None:
        raise TypeError("apmodel.parallelize_pipeline: give stages and microbatches (or a plan with a pipeline)")
    opts = make_options(options, **option_values)

    def plan_stage(module: nn.Module, shape: tuple[int, ...], inputs: tuple[torch.Tensor, ...],
                   placed: lowered_pipeline.StagePlacements) -> Plan:
        captured = checkpoint(lowering_stage.capture_on_meta(module, inputs, None), opts.ac)
        return plan_workload(Workload(captured, shape), opts.replace(input_placements=placed[0],
                                                                     output_placements=placed[1])).plan

    def lower_stage(module: nn.Module, sub_mesh: DeviceMesh, inputs: tuple[torch.Tensor, ...], stage_plan: Plan) -> nn.Module:
        return parallelize(module, sub_mesh, inputs, plan=stage_plan, lowering=lowering)

    return lowered_pipeline.build(make_model, mesh, pp_axis, [(int(a), int(b)) for a, b in stages], microbatches,
                                  sample_inputs, loss_fn=loss_fn, plan_stage=plan_stage, lower_stage=lower_stage,
                                  schedule=pp_schedule or "1f1b", weight_sync=weight_sync,
                                  boundary_placements=boundary_placements)


def plan_pipelined(
    workload: Workload,
    options: PlanOptions,
    pipeline: Any = None,
    *,
    constraints: Sequence[ConstraintLike] = (),
    replay: Plan | str | Path | None = None,
    record: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> PlanResult:
    """Plan ``workload`` with a pipeline: every allowed degree priced, the cheapest that fits chosen
    (:func:`apmodel.solve.pipeline.plan_pipeline`), each SPMD plan made by :func:`plan_workload`.
    ``pipeline``: a :class:`apmodel.solve.pipeline.PipelineOptions` (default: from the options ``pp_axis``,
    ``pp_degrees``, ``microbatches``, ``pp_schedule``, or the replayed plan's record). Returns the
    chosen degree's stage plan (on its stage mesh, at the microbatch size; ``plan.pipeline`` holds
    the choice and every degree's price); :func:`plan_workload` comes here when ``pp_axis`` is set."""
    from apmodel.reading import recipes as R
    from apmodel.solve import pipeline as P

    progress = progress or LogProgress()
    saved = Plan.load(replay) if isinstance(replay, (str, Path)) else replay
    if pipeline is None:
        if options.pp_axis is not None:
            pipeline = P.PipelineOptions.of(options)
        elif saved is not None and saved.pipeline:
            pipeline = P.PipelineOptions(int(saved.pipeline["axis"]))
        else:
            raise TypeError("apmodel.plan_pipelined: give pp_axis (or a PipelineOptions, or a replayed pipelined plan)")

    forced = [*constraints, *([] if saved is None else [replay_constraints(saved)])]  # the recorded stage plan

    def plan_spmd(wl: Workload, opts: PlanOptions, rec: Mapping[str, Any]) -> Plan:
        return plan_workload(wl, opts.replace(pp_axis=None), constraints=forced, record={**dict(record or {}), **rec},
                             progress=progress).plan

    plan, choice = P.plan_pipeline(workload, options, pipeline, plan_spmd, replay=saved, progress=progress.stage)
    captured = plan.captured
    if captured is None:
        raise P.PipelineError("the chosen stage plan lost its captured graph")
    itemsize = options.dtype_bytes
    limit = None if plan.model is None else search.memory_limit_bytes(options, plan.model)
    progress.done(f"pipeline degree {choice.degree} ({choice.schedule}, {choice.microbatches} microbatches): "
                  f"{choice.chosen.objective_us:,.1f} µs")
    return PlanResult(plan, captured, options, R.param_bytes_per_device(plan, captured, itemsize),
                      warnings=list(dict.fromkeys(plan.warnings or [])), memory_limit_bytes=limit)
