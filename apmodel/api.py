"""The public entry points: ``apmodel.plan`` (and ``apmodel.build_model`` for users who constrain
the model step by step). ``apmodel.parallelize`` lives in :mod:`apmodel.lowering`.

The pipeline, top to bottom: capture → strategies → model (cluster, price, constrain) → solve → plan.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

import costmodels
import solvers
from apmodel.capture import CapturedGraph, capture
from apmodel.constraints import ConstraintLike, apply_all
from apmodel.costs import CostContext
from apmodel import seeding as seeding_mod
from apmodel.memory import HBM_RESERVE_FRACTION, MemoryEstimate, OutOfMemory
from apmodel.model import ConstraintConflict, PlacementModel
from apmodel.plans import Plan
from apmodel.strategies import enumerate_strategies

logger = logging.getLogger(__name__)

#: Pricing dtypes by their command-line names.
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}


def _pricing_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _cost_model(given: Any, default: Callable[[Any], Any], built_from: Any) -> Any:
    """``given`` itself, or a dotted name / the default class constructed from ``built_from``."""
    if given is None:
        return default(built_from)
    if isinstance(given, str):
        return costmodels.load_object(given)(built_from)
    return given


def cost_context(
    mesh_shape: Sequence[int],
    *,
    device: str | Any = "h100",
    gpus_per_node: int = 8,
    dtype: str | torch.dtype | None = "bf16",
    compute_model: Any = None,
    comm_model: Any = None,
    calibration: str | Path | None = None,
    mixed_precision: bool | None = None,
) -> CostContext:
    """The default cost models for a mesh on a device, with optional replacements.

    The default compute model is ``costmodels.compute_model(spec)``: the measured model where the
    device has a profile (h200, h100), else the roofline. ``compute_model``/``comm_model`` replace
    the compute and NCCL models: an object, or a dotted name ``"package.module:Name"`` constructed
    with the device spec / topology.

    ``mixed_precision`` (default: on when ``dtype`` is bf16 or fp16, as real recipes train): fp32
    master parameters, gradients and optimizer state (memory model) and gradient reductions in
    fp32 (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); compute and
    parameter gathers stay in ``dtype``.
    """
    mesh_shape = tuple(int(s) for s in mesh_shape)
    spec = costmodels.device(device) if isinstance(device, str) else device
    topo = costmodels.Topology(mesh_shape=mesh_shape, device=spec, gpus_per_node=gpus_per_node)
    compute = _cost_model(compute_model, costmodels.compute_model, spec)
    comm = _cost_model(comm_model, costmodels.NCCLCollectives, topo)
    if calibration is not None:
        comm = costmodels.CalibratedCollectives(comm, costmodels.Calibration.load(calibration))
    pricing = _pricing_dtype(dtype)
    if mixed_precision is None:
        mixed_precision = pricing in (torch.bfloat16, torch.float16)
    full = torch.float32 if mixed_precision else None
    return CostContext(
        mesh_shape=mesh_shape, compute=compute, comm=comm, dtype=pricing, hbm_bytes=spec.hbm_GiB * 2**30,
        reduce_dtype=full, master_dtype=full,
    )


def placement_model(
    captured: CapturedGraph,
    strategies: Mapping[str, list],
    cost: CostContext,
    *,
    constraints: Sequence[ConstraintLike] = (),
    **options: Any,
) -> PlacementModel:
    """A compiled :class:`PlacementModel` from a capture and its candidate strategies.

    The strategies can be shared by several models (e.g. the free plan and each recipe priced by
    ``apmodel plan --compare-recipes``). ``options`` go to :class:`PlacementModel`.
    """
    pmodel = PlacementModel(captured, strategies, cost, **options)
    apply_all(pmodel, constraints)
    pmodel.compile()
    return pmodel


def candidate_strategies(
    captured: CapturedGraph,
    mesh_shape: Sequence[int],
    cost: CostContext,
    *,
    mesh: Any = None,
    seeding: bool | None = None,
    seed_radius: int = seeding_mod.DEFAULT_RADIUS,
    seed_widen_inputs: bool = False,
    input_placements: Sequence[Any] | None = None,
    output_placements: Sequence[Any] | None = None,
    param_policy: str = "full_shard",
    replicate_axes: Sequence[int] = (),
    merge_copies: bool = True,
    flow_coupling: bool = True,
    timings: dict[str, float] | None = None,
) -> tuple[dict[str, list], bool]:
    """Candidate strategies of every node, seeded (see :func:`build_model`) on meshes of 3+ axes.

    Returns the strategies and whether seeding restricted them; ``timings`` gets ``seeding_s``
    and ``strategies_s``.
    """
    mesh_shape = tuple(int(s) for s in mesh_shape)
    timings = timings if timings is not None else {}
    use_seeding = len(mesh_shape) >= 3 if seeding is None else bool(seeding)
    balls = None
    timings["seeding_s"] = 0.0
    if use_seeding:
        t0 = time.perf_counter()
        seeds = seeding_mod.seed(
            captured, mesh_shape, cost=cost, input_placements=input_placements, output_placements=output_placements,
            param_policy=param_policy, replicate_axes=replicate_axes, merge_copies=merge_copies,
            flow_coupling=flow_coupling,
        )
        balls = seeding_mod.balls(
            seeds, captured, mesh_shape, seed_radius, input_placements=input_placements,
            output_placements=output_placements, widen_inputs=seed_widen_inputs,
        )
        timings["seeding_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    strategies = enumerate_strategies(captured.gm, mesh if mesh is not None else mesh_shape, balls=balls)
    timings["strategies_s"] = time.perf_counter() - t0
    return strategies, balls is not None


def build_model(
    model: nn.Module | CapturedGraph,
    mesh_shape: Sequence[int],
    sample_inputs: Sequence[Any] = (),
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    targets: Sequence[Any] | None = None,
    allow_unused_parameters: bool = False,
    cost: CostContext | None = None,
    mesh: Any = None,
    constraints: Sequence[ConstraintLike] = (),
    input_placements: Sequence[Any] | None = None,
    output_placements: Sequence[Any] | None = None,
    param_policy: str = "full_shard",
    replicate_axes: Sequence[int] = (),
    param_memory_fraction: float | None = None,
    merge_copies: bool = True,
    flow_coupling: bool = True,
    optimizer: str = "adamw",
    seeding: bool | None = None,
    seed_radius: int = seeding_mod.DEFAULT_RADIUS,
    seed_widen_inputs: bool = False,
    timings: dict[str, float] | None = None,
    **cost_options: Any,
) -> PlacementModel:
    """Capture (unless given a :class:`CapturedGraph`), enumerate strategies and build the model.

    ``loss_fn``, ``kwargs``, ``targets``, ``allow_unused_parameters``: how the step is traced (see
    :func:`apmodel.capture.capture`). ``cost_options`` (device, gpus_per_node, dtype,
    compute_model, comm_model, calibration) go to :func:`cost_context` when ``cost`` is not given.

    ``seeding`` (split-dimension seeding, :mod:`apmodel.seeding`): solve one 1-D problem per mesh
    axis and keep only candidates within Hamming distance ``seed_radius`` of that seed; ``None``
    turns it on for meshes of 3 or more axes. The result is a restriction of the full model (its
    optimum is never lower); when the given constraints conflict with the restricted candidates
    the model is rebuilt without seeding. ``timings`` gets ``seeding_s`` (part of ``build_s``).
    ``seed_widen_inputs`` also offers full-mesh rules (view, t, ...) the input placements within
    the ball, which no producer may output: a larger space than the unseeded one (experimental).
    """
    mesh_shape = tuple(int(s) for s in mesh_shape)
    timings = timings if timings is not None else {}
    if isinstance(model, CapturedGraph):
        captured = model
    else:
        captured = capture(
            model, tuple(sample_inputs), loss_fn, kwargs=kwargs, targets=targets,
            allow_unused_parameters=allow_unused_parameters,
        )
    timings["trace_s"] = captured.trace_s
    cost = cost or cost_context(mesh_shape, **cost_options)
    strategies, seeded = candidate_strategies(
        captured, mesh_shape, cost, mesh=mesh, seeding=seeding, seed_radius=seed_radius,
        seed_widen_inputs=seed_widen_inputs, input_placements=input_placements, output_placements=output_placements,
        param_policy=param_policy, replicate_axes=replicate_axes, merge_copies=merge_copies,
        flow_coupling=flow_coupling, timings=timings,
    )
    t0 = time.perf_counter()
    try:
        pmodel = placement_model(
            captured,
            strategies,
            cost,
            constraints=constraints,
            input_placements=input_placements,
            output_placements=output_placements,
            param_policy=param_policy,
            replicate_axes=replicate_axes,
            param_memory_fraction=param_memory_fraction,
            merge_copies=merge_copies,
            flow_coupling=flow_coupling,
            optimizer=optimizer,
        )
    except ConstraintConflict as e:
        if not seeded:
            raise
        logger.warning("seeded candidates conflict with the constraints (%s); rebuilding without seeding", e)
        spent = timings["seeding_s"] + timings["strategies_s"]
        pmodel = build_model(
            captured, mesh_shape, cost=cost, mesh=mesh, constraints=constraints, input_placements=input_placements,
            output_placements=output_placements, param_policy=param_policy, replicate_axes=replicate_axes,
            param_memory_fraction=param_memory_fraction, merge_copies=merge_copies, flow_coupling=flow_coupling,
            optimizer=optimizer, seeding=False, timings=timings,
        )
        timings["build_s"] += spent  # the discarded seeded attempt counts too
        return pmodel
    timings["build_s"] = time.perf_counter() - t0 + timings["strategies_s"] + timings["seeding_s"]
    return pmodel


def replay_constraints(saved: Plan | str | Path) -> Callable[[PlacementModel], None]:
    """A constraint that forces every node to its strategy in ``saved`` (to price a stale plan)."""
    plan = saved if isinstance(saved, Plan) else Plan.load(saved)

    def apply(m: PlacementModel) -> None:
        plan.check_compatible(m.captured, m.mesh_shape, exact=False)
        for node in m.strategies:
            if node not in plan.node_strategy:
                raise ValueError(f"replay: node {node!r} of this graph is not in the saved plan")
            m.fix_strategy(node, plan.node_strategy[node], f"replay of saved plan (node {node})")

    return apply


def solve_model(
    pmodel: PlacementModel,
    *,
    solver: str = "trws",
    time_limit: float | None = None,
    solver_options: Mapping[str, Any] | None = None,
    timings: dict[str, float] | None = None,
    workload: Mapping[str, Any] | None = None,
) -> Plan:
    """Solve a built model with a backend and decode the plan."""
    timings = dict(timings or {})
    problem = pmodel.compile()
    sol = solvers.solve(problem, backend=solver, time_limit=time_limit, **dict(solver_options or {}))
    timings["solve_s"] = sol.seconds
    timings["total_s"] = timings.get("trace_s", 0.0) + timings.get("build_s", 0.0) + sol.seconds
    stats = {
        "backend": sol.backend,
        "status": sol.status,
        "seconds": sol.seconds,
        "energy_us": sol.energy,
        "lower_bound_us": sol.lower_bound,
        "gap": sol.gap,
    }
    plan = Plan.from_assignment(pmodel, sol.assignment, solver=stats, timings=timings, workload=workload)
    logger.info(
        "plan: objective %.1f µs (compute %.1f, comm %.1f), solver %s %s in %.2f s",
        plan.objective_us, plan.compute_us, plan.comm_us, sol.backend, sol.status, sol.seconds,
    )
    return plan


def plan(
    model: nn.Module | CapturedGraph,
    mesh_shape: Sequence[int],
    sample_inputs: Sequence[Any] = (),
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    device: str | Any = "h100",
    gpus_per_node: int = 8,
    dtype: str | torch.dtype | None = "bf16",
    solver: str = "trws",
    time_limit: float | None = None,
    solver_options: Mapping[str, Any] | None = None,
    constraints: Sequence[ConstraintLike] = (),
    replay: Plan | str | Path | None = None,
    workload: Mapping[str, Any] | None = None,
    memory_limit: float | None = None,
    **model_options: Any,
) -> Plan:
    """Plan ``model`` on a mesh of ``mesh_shape``: the cheapest per-operator placements.

    ``model`` is an ``nn.Module`` (ideally on the meta device) called as
    ``model(*sample_inputs, **kwargs)``; ``loss_fn(output, *targets)`` turns its output into the
    scalar loss (``loss_fn(output, *sample_inputs)`` when no ``targets`` are given: models that
    take their labels). ``device`` names the
    target accelerator of the cost model (``"h100"``, ``"h200"``, ``"a100"``, ``"b200"``, ``"cpu"``);
    ``solver`` a backend of :func:`solvers.available`. ``replay`` prices a saved plan on this
    workload instead of searching. ``memory_limit`` (bytes per device; default: the device's HBM
    less 10%, ``math.inf`` for none): a plan over it is solved again under a memory row, or
    refused with :class:`~apmodel.memory.OutOfMemory`. Further options: see :func:`build_model`.
    """
    timings: dict[str, float] = {}
    constraints = list(constraints)
    if replay is not None:
        constraints.append(replay_constraints(replay))
    pmodel = build_model(
        model, mesh_shape, sample_inputs, loss_fn=loss_fn, constraints=constraints, timings=timings,
        device=device, gpus_per_node=gpus_per_node, dtype=dtype, **model_options,
    )
    # recorded as the CLI records it, so that `apmodel explain` can rebuild a preset model
    wl = {**pmodel.captured.workload, "mesh": list(pmodel.mesh_shape),
          "device": device if isinstance(device, str) else getattr(device, "name", str(device)),
          "gpus_per_node": gpus_per_node, "dtype": dtype if isinstance(dtype, str) or dtype is None else str(dtype),
          **{k: model_options[k] for k in ("param_policy", "replicate_axes", "param_memory_fraction", "optimizer",
                                           "mixed_precision") if k in model_options},
          **dict(workload or {})}
    result = solve_model(pmodel, solver=solver, time_limit=time_limit, solver_options=solver_options, timings=timings, workload=wl)
    return fit_in_memory(
        pmodel, result, memory_limit,
        lambda: solve_model(pmodel, solver=solver, time_limit=time_limit, solver_options=solver_options, timings=timings, workload=wl),
    )


def _memory_limit(memory_limit: float | None, pmodel: PlacementModel) -> float | None:
    if memory_limit is not None:
        if not memory_limit > 0:
            raise ValueError(f"memory_limit must be a positive number of bytes, got {memory_limit!r}")
        return None if math.isinf(memory_limit) else float(memory_limit)
    hbm = pmodel.memory.hbm_bytes
    return None if hbm is None else hbm * (1 - HBM_RESERVE_FRACTION)


def fit_in_memory(
    pmodel: PlacementModel, plan: Plan, memory_limit: float | None, solve: Callable[[], Plan]
) -> Plan:
    """``plan`` if its peak fits ``memory_limit`` (bytes per device; None: the device's HBM less
    :data:`~apmodel.memory.HBM_RESERVE_FRACTION`), else the cheapest plan under a memory row
    (:meth:`PlacementModel.add_memory_limit`), else :class:`~apmodel.memory.OutOfMemory` saying
    the smallest footprint the candidates allow and what dominates it."""
    limit = _memory_limit(memory_limit, pmodel)
    if limit is None or plan.memory.get("peak_bytes") is None or plan.memory["peak_bytes"] <= limit:
        return plan
    mem = plan.memory
    transient = mem["peak_bytes"] - sum(mem[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes"))
    logger.info(
        "plan needs %.2f GB per device, over the %.2f GB limit: solving again with a memory row",
        mem["peak_bytes"] / 1e9, limit / 1e9,
    )
    smallest = pmodel.memory.smallest({n: pmodel.allowed_mask(n) for n in pmodel.strategies}) + transient
    if smallest > limit:
        raise _out_of_memory(pmodel, plan, limit, smallest)
    pmodel.add_memory_limit(limit, reserved_bytes=transient)
    try:
        fitted = solve()
    except solvers.Infeasible:
        raise _out_of_memory(pmodel, plan, limit, smallest) from None
    if fitted.memory["peak_bytes"] > limit:
        raise _out_of_memory(pmodel, fitted, limit, smallest)
    return fitted


def _out_of_memory(pmodel: PlacementModel, plan: Plan, limit: float, smallest: float) -> OutOfMemory:
    est = MemoryEstimate(**{k: plan.memory[k] for k in MemoryEstimate.__dataclass_fields__})
    return OutOfMemory(
        f"out of memory: no plan fits {limit / 1e9:.2f} GB per device (memory_limit; by default the "
        f"device's HBM less {HBM_RESERVE_FRACTION:.0%}); the cheapest plan needs {est.peak_bytes / 1e9:.2f} GB "
        f"({est.dominant()}), the smallest any plan can need is about {smallest / 1e9:.2f} GB: use a smaller "
        "batch or sequence, more devices, or an optimizer with less state"
    )
