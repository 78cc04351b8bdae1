"""Split-dimension seeding (paper §4.3): plan each mesh axis alone, then search near that plan.

On a D-axis mesh a tensor of n dims has up to (1+n)^D placements, and single-dim DTensor rules
expand to the product of their per-axis entries over the D axes, so enumeration and pricing grow
exponentially with D. Seeding decomposes the problem:

1. one 1-D problem per mesh axis ``a``: the same graph on a one-axis mesh of size
   ``mesh_shape[a]``, priced with the full topology's axis ``a`` (:class:`AxisComm`: a collective
   on axis 0 of the 1-D mesh is priced as one on axis ``a`` of the full mesh) and the same compute
   model; boundary placements are projected on the axis (entry ``a`` of each input/output
   placement), as are the parameter policy and the replicated axes (:func:`axis_options`). Each
   is solved with ``PlanOptions.seed_solver`` (HiGHS by default: exactly) within
   ``PlanOptions.time_limit``. Axes of equal size share one strategy enumeration.
2. the per-axis solutions give every node a seed: its D-tuple of 1-D strategies;
3. the full problem is rebuilt with each node's candidates restricted to a Hamming ball of radius
   ``r`` around its seed (:class:`apmodel.candidates.strategies.Ball`): strategies whose projection differs
   from the seed on at most ``r`` axes. Single-dim rules expand only those per-axis combinations;
   full-mesh rules follow their (restricted) producers. All-Replicate is always kept
   (feasibility), and so are the boundary placements; parameters are not restricted. The seeded
   problem is a restriction of the full one (its optimum is never below the full optimum) and
   equals it for ``r >= D``.

Seeding roughly halves the strategies on 3 axes and cuts them by more on 4 (the README's
*Benchmarks* has the measurements). On 4 axes radius 2 stays above the optimum because of seeds
that no full-mesh strategy realises: every 1-D problem shards the batch (S(0)), but a batch of 8
cannot be split 32 ways, so the optimum lies 3 axes from such seeds.

The default radius (``PlanOptions.seed_radius_for``) is 2 on 3 axes and ``D - 1`` beyond: on
LLaMA-3 8B (2,2,2,4), seq 2048, batch 8, radius 2 stops above the unseeded optimum while radius 3
reaches it, in less time than the unseeded search.

User constraints are not projected; :func:`apmodel.entry.api.build_model` falls back to the full
enumeration when they conflict with the restricted candidates.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Mapping, Sequence

import torch

import solvers
from apmodel.candidates.strategies import Ball, Strategy, StrategyCache, enumerate_strategies
from apmodel.core import placements as pl
from apmodel.core.options import PlanOptions
from apmodel.graph.capture import CapturedGraph
from apmodel.problem.placement_model import PlacementModel, default_batch_placement
from apmodel.problem.pricing import CostContext, build_cost_context

__all__ = ["AxisComm", "Seed", "axis_options", "seed", "balls", "boundary_placements"]

logger = logging.getLogger(__name__)

#: A node's seed: the 1-D strategy chosen for it on each mesh axis (outputs/inputs are 1-tuples).
Seed = tuple[Strategy, ...]

class AxisComm:
    """A CommModel for the one-axis mesh of axis ``axis``: its axis 0 is ``full``'s axis ``axis``.

    Keeps the full topology's bandwidth and latency for that axis (intra-/inter-node, NVLS, ...).
    A plain object so that ``costmodels.redistribution`` can attach its per-object caches.
    """

    def __init__(self, full: Any, axis: int) -> None:
        shape = tuple(full.mesh_shape)
        if not 0 <= axis < len(shape):
            raise ValueError(f"AxisComm: axis {axis} is not an axis of mesh {shape}")
        self.full = full
        self.axis = axis
        self.mesh_shape: tuple[int, ...] = (shape[axis],)

    def time_us(self, kind: str, nbytes: float, axis: int) -> float:
        if axis != 0:
            raise ValueError(f"AxisComm: the 1-D mesh has only axis 0, got axis {axis}")
        return self.full.time_us(kind, nbytes, self.axis)

    def __repr__(self) -> str:
        return f"AxisComm({self.full!r}, axis={self.axis})"


def _val(captured: CapturedGraph, name: str) -> torch.Tensor | None:
    node = next(n for n in captured.gm.graph.nodes if n.name == name)
    v = node.meta.get("val")
    if isinstance(v, (list, tuple)):
        v = v[0] if v else None
    return v if isinstance(v, torch.Tensor) else None


def boundary_placements(
    captured: CapturedGraph,
    mesh_shape: Sequence[int],
    input_placements: Sequence[Any] | None = None,
    output_placements: Sequence[Any] | None = None,
) -> tuple[list[tuple[str, ...] | None], list[tuple[str, ...]]]:
    """The full boundary as :class:`PlacementModel` resolves it: placement strings of every model
    input (by position; None where no input has that position) and of every forward output."""
    D = len(mesh_shape)
    n_in = max(captured.input_index.values(), default=-1) + 1
    inputs: list[tuple[str, ...] | None] = [None] * n_in
    for name, idx in captured.input_index.items():
        given = input_placements[idx] if input_placements is not None and idx < len(input_placements) else None
        inputs[idx] = default_batch_placement(_val(captured, name), mesh_shape) if given is None else pl.to_strs(given, D, f"input {idx} ({name})")
    outs = [name for name, role in captured.roles.items() if role == "output"]
    outputs = []
    for i, name in enumerate(outs):
        given = output_placements[i] if output_placements is not None and i < len(output_placements) else None
        outputs.append(default_batch_placement(_val(captured, name), mesh_shape) if given is None else pl.to_strs(given, D, f"output {i} ({name})"))
    return inputs, outputs


def axis_options(options: PlanOptions, axis: int, inputs: Sequence[tuple[str, ...] | None],
                 outputs: Sequence[tuple[str, ...]]) -> PlanOptions:
    """The options of the 1-D problem of mesh axis ``axis``: the full boundary (``inputs``,
    ``outputs``: :func:`boundary_placements`), the parameter policy and the replicated axes
    projected on it; a parameter budget gives free 1-D parameters (the budget is the full mesh's)."""
    return options.replace(
        input_placements=[None if p is None else (p[axis],) for p in inputs],
        output_placements=[(p[axis],) for p in outputs],
        param_policy="full_shard" if options.param_policy == "full_shard" else "free",
        replicate_axes=(0,) if axis in options.replicate_axes else (),
        param_memory_fraction=None, param_budget_ratio=None,
    )


def seed(
    captured: CapturedGraph,
    mesh_shape: Sequence[int],
    options: PlanOptions | None = None,
    *,
    cost: CostContext | None = None,
    info: dict[str, Any] | None = None,
) -> dict[str, Seed]:
    """Solve one 1-D problem per mesh axis and return every node's seed (a 1-D strategy per axis).

    ``options`` (default: the defaults) as the full problem has them: each axis's problem is
    theirs projected on it (:func:`axis_options`) and solved with ``options.seed_solver`` within
    ``options.time_limit``. ``cost`` is the full mesh's cost context (else built from
    ``options``). ``info``, when given, receives per-axis statistics under ``"axes"`` (size,
    objective µs, solver status, groups, states, seconds).
    """
    options = options if options is not None else PlanOptions()
    mesh_shape = tuple(int(s) for s in mesh_shape)
    D = len(mesh_shape)
    if cost is None:
        cost = build_cost_context(mesh_shape, options, captured)
    elif tuple(cost.mesh_shape) != mesh_shape:
        raise ValueError(f"seed: cost context is for mesh {tuple(cost.mesh_shape)}, not {mesh_shape}")
    inputs, outputs = boundary_placements(captured, mesh_shape, options.input_placements, options.output_placements)
    enumerated: dict[int, dict[str, list[Strategy]]] = {}
    cache = StrategyCache()
    per_axis: list[dict[str, Strategy]] = []
    stats = []
    for a, k in enumerate(mesh_shape):
        t0 = time.perf_counter()
        if k not in enumerated:
            enumerated[k] = enumerate_strategies(captured.gm, (k,), cache=cache, progress=False)
        t_enum = time.perf_counter() - t0
        # the full context's pricing (dtype, mixed-precision reductions, HBM) on this axis alone
        axis_cost = dataclasses.replace(cost, mesh_shape=(k,), comm=AxisComm(cost.comm, a))
        pm = PlacementModel(captured, enumerated[k], axis_cost, **axis_options(options, a, inputs, outputs).model_kwargs())
        problem = pm.compile()
        sol = solvers.solve(problem, backend=options.seed_solver, time_limit=options.time_limit)
        per_axis.append(pm.decode(sol.assignment))
        summ = pm.summary()
        stats.append({
            "axis": a, "size": k, "objective_us": float(sol.energy), "status": sol.status,
            "groups": summ["groups"], "states": summ["states"], "strategies_s": t_enum,
            "seconds": time.perf_counter() - t0,
        })
        logger.info("seeding: axis %d (size %d): %d groups, %d states, objective %.1f µs (%s) in %.2f s",
                    a, k, summ["groups"], summ["states"], sol.energy, sol.status, stats[-1]["seconds"])
    if info is not None:
        info["axes"] = stats
    return {name: tuple(per_axis[a][name] for a in range(D)) for name in per_axis[0]}


def balls(
    seeds: Mapping[str, Seed],
    captured: CapturedGraph,
    mesh_shape: Sequence[int],
    radius: int | None = None,
    options: PlanOptions | None = None,
) -> dict[str, Ball]:
    """Hamming balls of ``radius`` around the seeds, for :func:`apmodel.candidates.strategies.enumerate_strategies`.

    ``options`` (default: the defaults) give the boundary placements, ``seed_widen_inputs`` and,
    when ``radius`` is None, the radius (:meth:`~apmodel.core.options.PlanOptions.seed_radius_for`).
    Parameters get no ball: their storage is fixed by the parameter policy anyway, and their full
    candidate list is what consumers that follow their input (``t``, ``view``) may ask for (on
    LLaMA-3 8B, 4x2x4, cutting it cost 2% of the optimum). Inputs keep their boundary placement
    and tangents their output's, so restricting never leaves a node without an allowed candidate.
    ``seed_widen_inputs``: see :class:`apmodel.candidates.strategies.Ball` (not a restriction any more).
    """
    options = options if options is not None else PlanOptions()
    mesh_shape = tuple(int(s) for s in mesh_shape)
    radius = options.seed_radius_for(len(mesh_shape)) if radius is None else radius
    if radius < 0:
        raise ValueError(f"seed_radius must be >= 0, got {radius}")
    D = len(mesh_shape)
    inputs, outputs = boundary_placements(captured, mesh_shape, options.input_placements, options.output_placements)
    keep: dict[str, set] = {}
    for name, idx in captured.input_index.items():
        placed = inputs[idx]
        assert placed is not None  # None only where no input has the position
        keep.setdefault(name, set()).add(tuple(pl.from_str(t) for t in placed))
    out_names = [name for name, role in captured.roles.items() if role == "output"]
    for i, name in enumerate(out_names):
        tangent = captured.output_tangent.get(name)
        if tangent is not None:
            keep.setdefault(tangent, set()).add(tuple(pl.from_str(t) for t in outputs[i]))
    radius = min(int(radius), D)
    params = set(captured.param_fqn)
    return {name: Ball(center=s, radius=radius, keep=frozenset(keep.get(name, ())), widen_inputs=options.seed_widen_inputs)
            for name, s in seeds.items() if name not in params}
