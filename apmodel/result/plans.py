"""The plan: chosen strategies, their price, and how they were found; JSON save/load, diff, explain.

A :class:`Plan` records the strategy of every node of the joint graph and the storage placement of
every parameter, the objective and its breakdown (compute; communication by collective kind and
mesh axis; per layer), solver statistics, and what it was made for (mesh shape, graph fingerprint,
workload). Plans are JSON files with a format version, never pickles.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from apmodel.candidates.strategies import Strategy
from apmodel.core import placements as pl
from apmodel.graph.regions import region_of
from apmodel.problem.clustering import local_signature
from apmodel.result.cost_labels import node_labels
from apmodel.result.plan_files import (
    PIPELINE_FORMAT_VERSION,
    PLAN_FORMAT_VERSION,
    PlanFileError,
    TensorRanks,
    collective_key,
    parse_collective_key,
    placements_to_json,
    plan_fields,
    read_plan_json,
    strategy_to_json,
)
from apmodel.result.step_timeline import step_timeline

if TYPE_CHECKING:
    from apmodel.graph.capture import CapturedGraph
    from apmodel.problem.placement_model import PlacementModel

logger = logging.getLogger(__name__)

#: what importers of apmodel.result.plans find here, though the plan file's own module holds them
__all__ = ["Plan", "PlanFileError", "PlanMismatch", "TensorRanks", "collective_key", "diff", "explain",
           "parse_collective_key", "plan_warnings", "planned_edges", "price", "structure_fingerprint", "tensor_ranks"]


class PlanMismatch(ValueError):
    """A plan used with a mesh or model other than the one it was made for."""


def tensor_ranks(node: Any) -> TensorRanks:
    """The ranks of what a node's strategy places: its outputs, then its tensor inputs in slot order."""
    from apmodel.candidates.strategies import input_slots

    def rank(v: Any) -> int | None:
        return v.dim() if hasattr(v, "dim") and hasattr(v, "shape") else None

    val = node.meta.get("val")
    outs = [rank(v) for v in (val if isinstance(val, (tuple, list)) else [val])]
    ins = []
    for producer, k in input_slots(node):
        pv = producer.meta.get("val")
        ins.append(rank(pv[k] if isinstance(pv, (tuple, list)) else pv))
    return TensorRanks(tuple(outs), tuple(ins))


@dataclass
class Plan:
    """A solved placement plan. Costs in µs, times in seconds.

    ``comm_by_collective`` maps ``"all_gather@axis0"``-style keys to µs (a ``local_map`` region's own
    collectives: ``"all_to_all (routed_experts_top6)@axis1"``, ``@axis0+1`` over two axes); ``per_layer`` maps a layer
    label to ``{"compute_us": .., "comm_us": ..}`` (how nodes are booked: :mod:`apmodel.result.cost_labels`); ``solver`` holds backend, status, seconds,
    lower bound and gap; ``sizes`` holds nodes, groups, states, edges.
    """

    mesh_shape: tuple[int, ...]
    fingerprint: str
    structure_fingerprint: str
    node_strategy: dict[str, Strategy]
    param_placements: dict[str, tuple]
    objective_us: float
    compute_us: float
    comm_us: float
    comm_by_collective: dict[str, float] = field(default_factory=dict)
    per_layer: dict[str, dict[str, float]] = field(default_factory=dict)
    solver: dict[str, Any] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    workload: dict[str, Any] = field(default_factory=dict)
    #: Things the user should know about the plan (see :func:`plan_warnings`); saved in the file.
    warnings: list[str] = field(default_factory=list)
    #: Per-device bytes (:class:`apmodel.problem.memory.MemoryEstimate` fields: params_bytes, grads_bytes,
    #: optimizer_bytes, activations_bytes, peak_bytes, hbm_bytes); empty in files without it.
    memory: dict[str, float | None] = field(default_factory=dict)
    #: node -> ranks of the tensors its strategy places; fqn -> parameter rank (saved, checked on load)
    node_ranks: dict[str, TensorRanks] = field(default_factory=dict, repr=False, compare=False)
    param_ndim: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    #: The pipeline this plan is a stage plan of (:meth:`apmodel.result.pipeline_record.PipelineChoice.to_json`:
    #: degree, schedule, microbatches, stages, price, alternatives); None for a plan without one.
    pipeline: dict[str, Any] | None = None
    #: The step as the program runs it (:mod:`apmodel.result.step_timeline`): ``enabled`` (priced with
    #: overlap), ``step_us`` (= ``objective_us``), ``exposed_comm_us``, ``hidden_comm_us``,
    #: ``serial_us`` (compute + communication summed), ``peak_inflight_bytes``, ``inflight_mb``;
    #: empty in files written before overlap was priced (those were priced serially).
    overlap: dict[str, Any] = field(default_factory=dict)
    # Transient: what the plan was solved on (not saved).
    model: "PlacementModel | None" = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_assignment(
        cls,
        pmodel: "PlacementModel",
        assignment: np.ndarray,
        *,
        solver: Mapping[str, Any],
        timings: Mapping[str, float],
        workload: Mapping[str, Any] | None = None,
    ) -> "Plan":
        node_strategy = pmodel.decode(assignment)
        cap = pmodel.captured
        params: dict[str, tuple] = {}
        for node, fqn in cap.param_fqn.items():
            placed = node_strategy[node].outputs[0]
            assert placed is not None  # a parameter is a tensor
            params[fqn] = placed
        for node, others in getattr(cap, "tied_params", {}).items():  # tied weights: one placement, every name
            params.update({fqn: params[cap.param_fqn[node]] for fqn in others})
        breakdown = price(pmodel, node_strategy)
        plan = cls(
            mesh_shape=tuple(pmodel.mesh_shape),
            fingerprint=cap.fingerprint,
            structure_fingerprint=structure_fingerprint(cap),
            node_strategy=node_strategy,
            param_placements=params,
            objective_us=breakdown["objective_us"],
            compute_us=breakdown["compute_us"],
            comm_us=breakdown["comm_us"],
            comm_by_collective=breakdown["comm_by_collective"],
            per_layer=breakdown["per_layer"],
            overlap=breakdown["overlap"],
            solver=dict(solver),
            sizes=pmodel.summary(),
            timings=dict(timings),
            workload=dict(workload or {}),
            warnings=plan_warnings(pmodel, node_strategy),
            memory=pmodel.memory.estimate(node_strategy).to_json(),
            node_ranks={name: tensor_ranks(pmodel.node_by_name[name]) for name in node_strategy},
            param_ndim={fqn: pmodel.node_by_name[node].meta["val"].dim() for node, fqn in cap.param_fqn.items()},
            model=pmodel,
        )
        for node, others in getattr(cap, "tied_params", {}).items():
            plan.param_ndim.update({fqn: plan.param_ndim[cap.param_fqn[node]] for fqn in others})
        return plan

    @property
    def step_objective_us(self) -> float:
        """The training step's objective, µs: a pipeline's step (``pipeline.objective_us``) when this
        is the plan of one stage of it (degree > 1, priced per microbatch), else ``objective_us``."""
        if self.pipeline and self.pipeline.get("degree", 1) > 1:
            return float(self.pipeline["objective_us"])
        return self.objective_us

    @property
    def captured(self) -> "CapturedGraph | None":
        return None if self.model is None else self.model.captured

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        return {
            "format": "apmodel-plan",
            "version": PLAN_FORMAT_VERSION if self.pipeline is None else PIPELINE_FORMAT_VERSION,
            "mesh_shape": list(self.mesh_shape),
            "fingerprint": self.fingerprint,
            "structure_fingerprint": self.structure_fingerprint,
            "workload": self.workload,
            "objective_us": self.objective_us,
            # NaN: not recorded (a file written without them); left out rather than written as NaN
            **{k: v for k, v in (("compute_us", self.compute_us), ("comm_us", self.comm_us)) if not math.isnan(v)},
            "comm_by_collective": self.comm_by_collective,
            "per_layer": self.per_layer,
            "solver": self.solver,
            "sizes": self.sizes,
            "timings": self.timings,
            "param_placements": {k: pl.tuple_to_str(v) for k, v in self.param_placements.items()},
            "param_ndim": dict(self.param_ndim),
            "node_strategy": {k: strategy_to_json(v, self.node_ranks.get(k)) for k, v in self.node_strategy.items()},
            "warnings": list(self.warnings),
            "memory": dict(self.memory),
            **({} if self.pipeline is None else {"pipeline": self.pipeline}),
            **({"overlap": dict(self.overlap)} if self.overlap else {}),
        }

    def save(self, path: str | Path) -> None:
        """Write the plan as versioned JSON."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1, default=_json_default))
        logger.info("plan saved to %s", path)

    @classmethod
    def from_json(cls, data: Any, source: str = "plan") -> "Plan":
        """A plan from the object :meth:`to_json` writes: the one validation of every plan file
        reader (:meth:`load`: ``report``, ``diff``, ``explain``, replay; the plan ``parallelize``
        broadcasts).

        Raises :class:`PlanFileError` (a ValueError) naming ``source`` and the offending field for
        a missing or unknown field, a value of the wrong type or range (costs, times and counts
        finite and >= 0, fingerprints a sha256 in hex), a malformed placement, placements whose
        token count is not the mesh's number of axes, or fields that disagree (see
        :func:`apmodel.result.plan_files.check_consistent`).
        """
        return cls(**plan_fields(data, source))

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Read a plan written by :meth:`save`; a malformed file raises PlanFileError naming the field."""
        return cls.from_json(read_plan_json(path), str(path))

    # ------------------------------------------------------------------ checks
    def check_compatible(self, captured: "CapturedGraph", mesh_shape: tuple[int, ...], *, exact: bool = True) -> None:
        """Refuse a mesh or model other than the plan's, with a message saying what differs.

        ``exact=False`` (replay) accepts a graph with the same structure but other shapes, and says
        so: a fingerprint that differs there is also what an edited plan file shows.
        """
        if tuple(mesh_shape) != tuple(self.mesh_shape):
            raise PlanMismatch(f"plan was made for mesh {tuple(self.mesh_shape)}, got mesh {tuple(mesh_shape)}")
        if exact and captured.fingerprint != self.fingerprint:
            raise PlanMismatch(
                f"plan was made for a graph with fingerprint {self.fingerprint[:12]}, this model traces to "
                f"{captured.fingerprint[:12]}: the model, its shapes or its inputs changed; re-plan it"
            )
        if not exact and structure_fingerprint(captured) != self.structure_fingerprint:
            raise PlanMismatch("plan was made for a model with a different graph structure (ops or layers differ); it cannot be replayed")
        if not exact and captured.fingerprint != self.fingerprint:
            logger.warning("replayed plan was made for a graph with fingerprint %s, this model traces to %s: same ops "
                           "and layers, other shapes, and its placements are priced at these; if the model and its "
                           "inputs did not change, the plan file was edited: re-plan", self.fingerprint[:12],
                           captured.fingerprint[:12])

    # ------------------------------------------------------------------ inspection
    def explain(self, target: str) -> list[dict[str, Any]]:
        """Candidates of a node (or parameter FQN) priced against the plan's other choices.

        Each row: strategy, compute_us, comm_us (redistribution on the node's edges with its
        neighbours held at their planned strategies), total_us, chosen. Sorted by total.
        """
        if self.model is None:
            raise ValueError("explain needs the plan's model; plan with apmodel.plan(...) or re-attach one with apmodel.attach(plan)")
        return explain(self.model, self.node_strategy, target)


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"cannot serialise {type(o).__name__} into a plan file")


def structure_fingerprint(captured: "CapturedGraph") -> str:
    """Hash of the graph's node names and ops, without shapes (stable across sequence lengths)."""
    import hashlib

    h = hashlib.sha256()
    for n in captured.gm.graph.nodes:
        h.update(f"{n.name}:{n.op}:{n.target};".encode())
    return h.hexdigest()


def planned_edges(pmodel: "PlacementModel", node_strategy: Mapping[str, Strategy]) -> Iterator[tuple[Any, Any, tuple[str, ...], tuple[str, ...]]]:
    """Every edge of ``pmodel`` that carries a placed tensor under ``node_strategy``:
    ``(edge, value, placement at the producer, placement the consumer reads)`` (placement strings;
    a gradient edge's consumer reads at its parameter's own placement)."""
    for e in pmodel.edges:
        prod = pmodel.node_by_name[e.producer]
        val = prod.meta["val"][e.out_index] if isinstance(prod.meta["val"], (list, tuple)) else prod.meta["val"]
        src = pmodel.output_strs(node_strategy[e.producer], e.out_index)
        cons = node_strategy[e.consumer]
        dst_p = cons.outputs[0] if e.slot < 0 else cons.inputs[e.slot]
        if src is None or dst_p is None:
            continue
        yield e, val, src, tuple(pl.to_str(x) for x in dst_p)


def price(pmodel: "PlacementModel", node_strategy: Mapping[str, Strategy], *, keep_spans: bool = False) -> dict[str, Any]:
    """Objective of ``node_strategy`` under ``pmodel``'s costs, broken down (all in µs): the step
    (``overlap``: the timeline of :mod:`apmodel.result.step_timeline` when the cost context prices overlap,
    else the serial sum), compute and communication sums, per collective and per layer;
    ``timeline``: the :class:`~apmodel.result.step_timeline.StepTimeline` priced with overlap (with its
    spans if ``keep_spans``), else None."""
    cost = pmodel.cost
    compute_total = 0.0
    per_layer: dict[str, dict[str, float]] = defaultdict(lambda: {"compute_us": 0.0, "comm_us": 0.0})
    compute_memo: dict[Any, float] = {}
    node_compute: dict[str, float] = {}
    label = node_labels(pmodel.nodes, pmodel.captured.is_backward)  # where each node's cost is booked
    region_nodes = [n for n in pmodel.nodes if n.op == "call_function" and region_of(n.target) is not None]
    for n in pmodel.nodes:
        s = node_strategy[n.name]
        key = (local_signature(n, None, False), s)  # op, arguments, shapes and dtypes
        c = compute_memo.get(key)
        if c is None:
            c = compute_memo[key] = float(cost.compute_vector(n, [s])[0])
        node_compute[n.name] = c
        compute_total += c
        per_layer[label[n.name]]["compute_us"] += c
    by_collective: dict[str, float] = defaultdict(float)
    comm_total = 0.0
    for n in region_nodes:  # a local_map region's own collectives: comm, not compute
        region = region_of(n.target)
        assert region is not None  # region_nodes have one
        for kind, axes, us in cost.region_collectives(n, node_strategy[n.name]):
            by_collective[collective_key(kind, axes, region.name)] += us
            compute_total -= us
            comm_total += us
            per_layer[label[n.name]]["compute_us"] -= us
            per_layer[label[n.name]]["comm_us"] += us

    def add_steps(shape, dtype, src, dst, layer, gradient=False, bucketed=False) -> list:
        nonlocal comm_total
        steps = cost.redistribution_steps(shape, dtype, src, dst, gradient=gradient, bucketed=bucketed)
        for kind, axis, _nbytes, us in steps:
            by_collective[collective_key(kind, (axis,))] += us
            comm_total += us
            per_layer[layer]["comm_us"] += us
        return steps

    # each redistribution's collectives, by (producer, output, consumer, slot) and by boundary output:
    # the step timeline runs the same ones
    edge_steps = {(e.producer, e.out_index, e.consumer, e.slot): add_steps(
        tuple(val.shape), val.dtype, src, dst, label[e.consumer], gradient=pmodel.is_param_gradient(e),
        bucketed=pmodel.is_bucketed(e)) for e, val, src, dst in planned_edges(pmodel, node_strategy)}
    boundary_steps = {}
    for name, want in pmodel.boundary_outputs.items():
        val = pmodel.node_by_name[name].meta["val"]
        boundary_steps[name] = add_steps(tuple(val.shape), val.dtype, pmodel.output_strs(node_strategy[name], 0), want,
                                         "outputs")
    serial = compute_total + comm_total
    step: dict[str, Any] = {"enabled": False, "step_us": serial, "exposed_comm_us": comm_total, "hidden_comm_us": 0.0,
                            "serial_us": serial}
    timeline = None
    if cost.overlap:
        timeline = step_timeline(pmodel, node_compute, edge_steps, boundary_steps, overlap=True,
                                 inflight_bytes=cost.inflight_bytes, overlap_slowdown=cost.overlap_slowdown,
                                 max_inflight=cost.max_inflight, keep_spans=keep_spans)
        exposed = max(0.0, timeline.step_us - compute_total)
        step = {"enabled": True, "step_us": timeline.step_us, "exposed_comm_us": exposed,
                "hidden_comm_us": max(0.0, comm_total - exposed), "serial_us": serial,
                "peak_inflight_bytes": timeline.peak_inflight_bytes, "inflight_mb": cost.inflight_bytes / 2**20}
    return {
        "objective_us": step["step_us"],
        "overlap": step,
        "timeline": timeline,
        "compute_us": compute_total,
        "comm_us": comm_total,
        "comm_by_collective": dict(sorted(by_collective.items())),
        "per_layer": {k: dict(v) for k, v in per_layer.items() if v["compute_us"] or v["comm_us"]},
    }


def explain(pmodel: "PlacementModel", node_strategy: Mapping[str, Strategy], target: str) -> list[dict[str, Any]]:
    if target in pmodel.fqn_to_node:
        node = pmodel.fqn_to_node[target]
    elif target in pmodel.node_by_name:
        node = target
    else:
        raise KeyError(f"{target!r} is neither a parameter nor a node of the planned graph")
    strats = pmodel.strategies[node]
    compute = pmodel.compute_vector(node)
    # a local_map region's own collectives: communication, not compute
    own = np.array([sum(us for _, _, us in pmodel.cost.region_collectives(pmodel.node_by_name[node], s)) for s in strats],
                   dtype=float)
    compute = compute - own
    comm = own.copy()
    for e in pmodel.edges:
        if e.producer == node:
            mat = pmodel.edge_matrix(e)
            j = pmodel.strategies[e.consumer].index(node_strategy[e.consumer])
            comm += mat[:, j]
        if e.consumer == node:
            mat = pmodel.edge_matrix(e)
            i = pmodel.strategies[e.producer].index(node_strategy[e.producer])
            comm += mat[i, :]
    if node in pmodel.boundary_outputs:
        comm += pmodel.boundary_vector(node)
    allowed = pmodel.allowed_mask(node)
    chosen = node_strategy[node]
    rows = [
        {
            "strategy": str(s),
            "compute_us": float(compute[i]),
            "comm_us": float(comm[i]),
            "total_us": float(compute[i] + comm[i]),
            "allowed": bool(allowed[i]),
            "chosen": s == chosen,
        }
        for i, s in enumerate(strats)
    ]
    return sorted(rows, key=lambda r: r["total_us"])


def diff(a: Plan, b: Plan, *, allow_mismatch: bool = False) -> list[dict[str, Any]]:
    """Nodes (and parameters) whose placements differ between two plans.

    Plans for different meshes or different graph structures are not comparable node by node:
    they raise :class:`PlanMismatch` saying what differs, unless ``allow_mismatch`` (then
    parameters and nodes are matched by name and everything that differs is listed).
    """
    problems = []
    if tuple(a.mesh_shape) != tuple(b.mesh_shape):
        problems.append(f"mesh {tuple(a.mesh_shape)} vs {tuple(b.mesh_shape)}")
    if a.structure_fingerprint != b.structure_fingerprint:
        problems.append(f"graph structure {a.structure_fingerprint[:12]} vs {b.structure_fingerprint[:12]} (ops or layers differ)")
    if problems and not allow_mismatch:
        raise PlanMismatch(f"plans were made for different {' and '.join(problems)}; "
                           "pass allow_mismatch=True to compare them by parameter and node name anyway")
    rows = []
    for fqn in sorted(set(a.param_placements) | set(b.param_placements)):
        pa, pb = a.param_placements.get(fqn), b.param_placements.get(fqn)
        if pa != pb:
            rows.append({"kind": "param", "name": fqn, "a": placements_to_json(pa), "b": placements_to_json(pb)})
    for name in sorted(set(a.node_strategy) | set(b.node_strategy)):
        sa, sb = a.node_strategy.get(name), b.node_strategy.get(name)
        if sa != sb:
            rows.append({"kind": "node", "name": name, "a": None if sa is None else str(sa), "b": None if sb is None else str(sb)})
    return rows


def plan_warnings(pmodel: "PlacementModel", node_strategy: Mapping[str, Strategy]) -> list[str]:
    """What a user should know about a solved plan; each warning is also logged.

    * a mesh axis (of size > 1) on which no node output is sharded only duplicates work; say so,
      and say when no candidate of any node could shard on it (tensors too small or indivisible);
    * a plan that replicates everything (all-R inputs and outputs everywhere): one warning instead;
    * a forward output that is not a scalar: the model was planned without its loss.
    """
    mesh = tuple(pmodel.mesh_shape)
    axes = [a for a, size in enumerate(mesh) if size > 1]  # a size-1 axis has nothing to split
    sharded: set[int] = set()
    all_replicated = True
    for s in node_strategy.values():  # one pass over the plan
        for p in s.outputs:
            if p is None:
                continue
            for a in axes:
                if isinstance(p[a], Shard):
                    sharded.add(a)
                    all_replicated = False
                elif not isinstance(p[a], Replicate):
                    all_replicated = False
        if all_replicated:  # inputs matter only while the plan still looks all-R
            all_replicated = all(p is None or all(isinstance(p[a], Replicate) for a in axes) for p in s.inputs)
    idle = [a for a in axes if a not in sharded]
    unshardable = _axes_without_shard_candidates(pmodel, idle) if idle else set()
    out: list[str] = []

    def why(axis_list: list[int]) -> str:
        hit = [a for a in axis_list if a in unshardable]
        if not hit:
            return ""
        names = ", ".join(f"axis {a} (size {mesh[a]})" for a in hit)
        return (f"; no candidate strategy of any node shards on {names}: every tensor dimension is smaller "
                "than or not divisible by the axis size")

    if axes and all_replicated:
        out.append(f"the plan replicates everything on mesh {mesh}: every device holds all parameters and repeats "
                   f"the whole computation, so the mesh brings no speed-up or memory saving{why(axes)}")
    else:
        for a in idle:
            out.append(f"mesh axis {a} (size {mesh[a]}): nothing is sharded on it (every parameter and activation is "
                       f"replicated or partial across its {mesh[a]} devices), so it only duplicates work{why([a])}")
    cap = pmodel.captured
    for name, role in cap.roles.items():
        node = pmodel.node_by_name.get(name)
        val = None if node is None else node.meta.get("val")
        if role == "output" and isinstance(val, torch.Tensor) and val.dim() != 0:
            out.append(f"model output {name} has shape {tuple(val.shape)} and is not a scalar loss; the plan treats its "
                       "gradient as an input of the step (fine when you compute the loss outside the model, "
                       "otherwise pass loss_fn)")
    for w in out:
        logger.warning("%s", w)
    return out


def _axes_without_shard_candidates(pmodel: "PlacementModel", axes: list[int]) -> set[int]:
    """Those of ``axes`` on which no candidate strategy of any node places a Shard."""
    left = set(axes)
    seen: set[int] = set()
    for strats in pmodel.strategies.values():
        if id(strats) in seen:  # candidate lists are interned: identical nodes share one
            continue
        seen.add(id(strats))
        for s in strats:
            for p in (*s.outputs, *s.inputs):
                if p is not None:
                    left -= {a for a in left if isinstance(p[a], Shard)}
            if not left:
                return left
    return left

