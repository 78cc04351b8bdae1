"""The search stages: candidate strategies → placement model → solve → plan (and fit in memory).

Each function is one step the orchestration in :mod:`apmodel.entry.api` calls in order; the recipes
(:mod:`apmodel.reading.recipes`) call the last two on their own constrained models. All options come in
one :class:`~apmodel.core.options.PlanOptions`.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import solvers
from apmodel.candidates.strategies import enumerate_strategies
from apmodel.core.options import PlanOptions
from apmodel.graph.capture import CapturedGraph
from apmodel.graph.checkpointing import policy_of
from apmodel.problem import seeding as seeding_mod
from apmodel.problem.constraints import ConstraintLike, apply_all
from apmodel.problem.memory import HBM_RESERVE_FRACTION, MemoryEstimate, OutOfMemory
from apmodel.problem.placement_model import PlacementModel
from apmodel.problem.pricing import CostContext
from apmodel.result.plans import Plan

logger = logging.getLogger(__name__)


def candidate_strategies(
    captured: CapturedGraph,
    cost: CostContext,
    options: PlanOptions,
    *,
    mesh: Any = None,
    timings: dict[str, float] | None = None,
) -> tuple[dict[str, list], bool]:
    """Candidate strategies of every node, seeded on meshes of 3+ axes (``options.seeding``).

    Seeding solves one 1-D problem per mesh axis (with ``options.seed_solver`` within
    ``options.time_limit``) and keeps only candidates within Hamming distance
    ``options.seed_radius_for(mesh)`` of that seed (:mod:`apmodel.problem.seeding`): a restriction of the
    full space. Returns the strategies and whether seeding restricted them; ``timings`` gets
    ``seeding_s`` and ``strategies_s``.
    """
    mesh_shape = tuple(cost.mesh_shape)
    timings = timings if timings is not None else {}
    balls = None
    timings["seeding_s"] = 0.0
    if options.uses_seeding(len(mesh_shape)):
        t0 = time.perf_counter()
        seeds = seeding_mod.seed(captured, mesh_shape, options, cost=cost)
        balls = seeding_mod.balls(seeds, captured, mesh_shape, options=options)
        timings["seeding_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    strategies = enumerate_strategies(captured.gm, mesh if mesh is not None else mesh_shape, balls=balls)
    timings["strategies_s"] = time.perf_counter() - t0
    return strategies, balls is not None


def placement_model(
    captured: CapturedGraph,
    strategies: Mapping[str, list],
    cost: CostContext,
    options: PlanOptions,
    *,
    constraints: Sequence[ConstraintLike] = (),
) -> PlacementModel:
    """A compiled :class:`PlacementModel` from a capture and its candidate strategies.

    The strategies can be shared by several models (the free plan and each recipe priced by
    ``apmodel plan --compare-recipes``)."""
    pmodel = PlacementModel(captured, strategies, cost, **options.model_kwargs())
    apply_all(pmodel, constraints)
    pmodel.compile()
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
    options: PlanOptions,
    *,
    timings: dict[str, float] | None = None,
    workload: Mapping[str, Any] | None = None,
) -> Plan:
    """Solve a built model with ``options.solver`` and decode the plan.

    With overlap priced (``pmodel.cost.overlap``) the plan's objective is its simulated step, which
    is not a sum of pairwise terms. The solver minimises the serial objective (compute plus
    communication), and then surrogates in which the parameters' gathers and gradients'
    reductions, the traffic the program can prefetch and hide, weigh
    :data:`OVERLAP_WEIGHT_SCALES` of their price; each solution is priced by its step and the
    fastest kept. The serial optimum is always a candidate, so the plan's step is never worse than
    the serial optimum's. The solver's lower bound (``solver.lower_bound_us``) and gap certify the
    serial objective of the serial solve, not the step (``overlap.serial_us`` holds the plan's
    serial objective)."""
    timings = dict(timings or {})
    plan = _solve_once(pmodel, options, timings, workload)
    if not pmodel.cost.overlap or options.solver == "brute":  # brute force: the pairwise problem's exact truth
        return plan
    serial_stats = dict(plan.solver)
    candidates = [(plan, 1.0)]
    started = time.perf_counter()
    try:
        for scale in OVERLAP_WEIGHT_SCALES:
            pmodel.set_weight_traffic_scale(scale)
            candidates.append((_solve_once(pmodel, options, dict(timings), workload), scale))
    except solvers.Infeasible:
        pass  # the same constraints as the serial solve; only a time limit could make a surrogate fail
    finally:
        pmodel.set_weight_traffic_scale(1.0)
    best, scale = min(candidates, key=lambda c: c[0].objective_us)
    extra_s = time.perf_counter() - started  # the surrogates' builds and solves
    best.timings = {**plan.timings, "solve_s": plan.timings["solve_s"] + extra_s,
                    "total_s": plan.timings["total_s"] + extra_s}
    best.solver = {**serial_stats, "seconds": serial_stats["seconds"] + extra_s,
                   "overlap_candidates": [{"weight_traffic_scale": s, "step_us": c.objective_us,
                                           "serial_us": c.overlap.get("serial_us")} for c, s in candidates],
                   "weight_traffic_scale": scale}
    logger.info("overlap: %d candidate plans by step: %s; kept the one solved with weight traffic at %.2f",
                len(candidates), ", ".join(f"{c.objective_us:,.1f} µs" for c, _ in candidates), scale)
    return best


#: weights of the parameters' gathers and gradients' reductions in the surrogate problems solved
#: beside the serial one when overlap is priced (see solve_model): half price (free weight traffic
#: made the surrogate replicate every parameter, a far slower step on LLaMA-3 8B (4,8))
OVERLAP_WEIGHT_SCALES = (0.5,)


def _solve_once(pmodel: PlacementModel, options: PlanOptions, timings: dict[str, float],
                workload: Mapping[str, Any] | None) -> Plan:
    problem = pmodel.compile()
    sol = solvers.solve(problem, backend=options.solver, time_limit=options.time_limit, **dict(options.solver_options))
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
    if sol.info.get("runs"):  # a composition of backends says what ran (solvers.compositions)
        stats["runs"] = sol.info["runs"]
    plan = Plan.from_assignment(pmodel, sol.assignment, solver=stats, timings=timings, workload=workload)
    logger.info(
        "plan: objective %.1f µs (compute %.1f, comm %.1f), solver %s %s in %.2f s",
        plan.objective_us, plan.compute_us, plan.comm_us, sol.backend, sol.status, sol.seconds,
    )
    return plan


def prepare_solver(options: PlanOptions) -> None:
    """Start loading what the solve will need, in the background: TRW-S's compiled kernels (numba's
    import and cached machine code, paid once a process) while the planner traces and builds."""
    if options.solver == "trws" or (options.seeding is not False and options.seed_solver == "trws"):
        solvers.warm_up_in_background()


def memory_limit_bytes(options: PlanOptions, pmodel: PlacementModel) -> float | None:
    """The per-device limit a plan must fit (bytes), or None for no limit.

    ``options.memory_limit_bytes``, else the device's HBM less :data:`HBM_RESERVE_FRACTION`."""
    if options.memory_limit_bytes is not None:
        return None if math.isinf(options.memory_limit_bytes) else float(options.memory_limit_bytes)
    hbm = pmodel.memory.hbm_bytes
    return None if hbm is None else hbm * (1 - HBM_RESERVE_FRACTION)


#: solves under a memory row at most: each round reserves the largest transient seen so far
MEMORY_ROUNDS = 3


def fit_in_memory(pmodel: PlacementModel, plan: Plan, limit_bytes: float | None, solve: Callable[[], Plan]) -> Plan:
    """``plan`` if its peak fits ``limit_bytes`` per device (None: no limit), else the cheapest
    plan under a memory row (:meth:`PlacementModel.add_memory_limit`, solved by ``solve``), else
    :class:`~apmodel.problem.memory.OutOfMemory` saying the smallest footprint the candidates allow and
    what dominates it."""
    peak = plan.memory.get("peak_bytes")
    if limit_bytes is None or peak is None or peak <= limit_bytes:
        return plan
    transient = _transient_bytes(plan)
    logger.info(
        "plan needs %.2f GB per device, over the %.2f GB limit: solving again with a memory row",
        peak / 1e9, limit_bytes / 1e9,
    )
    smallest = pmodel.memory.smallest({n: pmodel.allowed_mask(n) for n in pmodel.strategies}) + transient
    ac = policy_of(pmodel.captured)
    if smallest > limit_bytes:
        raise _out_of_memory(plan, limit_bytes, smallest, ac)
    fitted = plan
    for _ in range(MEMORY_ROUNDS):
        # the row cannot see the step's transient: reserve the largest one seen so far
        pmodel.add_memory_limit(limit_bytes, reserved_bytes=transient)
        try:
            fitted = solve()
        except solvers.Infeasible:
            raise _out_of_memory(fitted, limit_bytes, smallest, ac) from None
        if _bytes(fitted, "peak_bytes") <= limit_bytes:
            return fitted
        grown = _transient_bytes(fitted)
        if grown <= transient:
            break
        transient = grown
    raise _out_of_memory(fitted, limit_bytes, smallest, ac)


def _bytes(plan: Plan, key: str) -> float:
    """``plan.memory[key]``, a byte count (only ``hbm_bytes`` may be None in a priced plan)."""
    value = plan.memory[key]
    assert value is not None, key
    return value


def _transient_bytes(plan: Plan) -> float:
    """Bytes of ``plan``'s peak that the memory row does not count (the step's largest transient)."""
    return _bytes(plan, "peak_bytes") - sum(
        _bytes(plan, k) for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes"))


def _out_of_memory(plan: Plan, limit: float, smallest: float, ac: str = "none") -> OutOfMemory:
    est = MemoryEstimate(
        params_bytes=_bytes(plan, "params_bytes"), grads_bytes=_bytes(plan, "grads_bytes"),
        optimizer_bytes=_bytes(plan, "optimizer_bytes"), activations_bytes=_bytes(plan, "activations_bytes"),
        peak_bytes=_bytes(plan, "peak_bytes"), hbm_bytes=plan.memory["hbm_bytes"],
    )
    stronger = {"none": "selective", "selective": "full"}.get(ac)
    checkpointing = ""
    if est.dominant_kind() == "activations" and stronger is not None:
        checkpointing = f"activation checkpointing (--ac {stronger}; ac={stronger!r} in Python), "
    return OutOfMemory(
        f"out of memory: no plan fits {limit / 1e9:.2f} GB per device (memory_limit_bytes; by default the "
        f"device's HBM less {HBM_RESERVE_FRACTION:.0%}); the cheapest plan needs {est.peak_bytes / 1e9:.2f} GB "
        f"({est.dominant()}), the smallest any plan can need is about {smallest / 1e9:.2f} GB: use "
        f"{checkpointing}a smaller batch or sequence, more devices, or an optimizer with less state"
    )
