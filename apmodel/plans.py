"""The plan: chosen strategies, their price, and how they were found; JSON save/load, diff, explain.

A :class:`Plan` records the strategy of every node of the joint graph and the storage placement of
every parameter, the objective and its breakdown (compute; communication by collective kind and
mesh axis; per layer), solver statistics, and what it was made for (mesh shape, graph fingerprint,
workload). Plans are JSON files with a format version, never pickles.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from apmodel import placements as pl
from apmodel.strategies import Strategy

if TYPE_CHECKING:
    from apmodel.capture import CapturedGraph
    from apmodel.model import PlacementModel

logger = logging.getLogger(__name__)

#: Version of the plan file format; bump on incompatible changes.
PLAN_FORMAT_VERSION = 1

_LAYER = re.compile(r"^(.*?layers\.\d+)")


class PlanMismatch(ValueError):
    """A plan used with a mesh or model other than the one it was made for."""


def _placements_to_json(p) -> str | None:
    return None if p is None else pl.tuple_to_str(p)


def _placements_from_json(s: str | None, where: str):
    if s is None:
        return None
    try:
        return pl.parse(s)
    except (TypeError, ValueError) as e:
        raise ValueError(f"plan file: {where}: {e}") from None


def strategy_to_json(s: Strategy) -> dict[str, list[str | None]]:
    return {"out": [_placements_to_json(p) for p in s.outputs], "in": [_placements_to_json(p) for p in s.inputs]}


def strategy_from_json(d: Any, where: str) -> Strategy:
    if not isinstance(d, dict) or "out" not in d or "in" not in d:
        raise ValueError(f"plan file: {where}: expected an object with 'out' and 'in' lists, got {d!r}")
    return Strategy(
        outputs=tuple(_placements_from_json(p, f"{where}.out") for p in d["out"]),
        inputs=tuple(_placements_from_json(p, f"{where}.in") for p in d["in"]),
    )


def layer_of(node_meta: Mapping[str, Any], fallback: str = "other") -> str:
    """Layer label ("layers.3") of a node from its module stack, else ``fallback``."""
    for key in ("nn_module_stack", "fwd_nn_module_stack"):
        stack = node_meta.get(key)
        if stack:
            for path, _ in reversed(list(stack.values())):
                m = _LAYER.match(str(path))
                if m:
                    return m.group(1)
            return str(list(stack.values())[0][0]) or fallback
    return fallback


@dataclass
class Plan:
    """A solved placement plan. Costs in µs, times in seconds.

    ``comm_by_collective`` maps ``"all_gather@axis0"``-style keys to µs; ``per_layer`` maps a layer
    label to ``{"compute_us": .., "comm_us": ..}``; ``solver`` holds backend, status, seconds,
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
        params = {fqn: node_strategy[node].outputs[0] for node, fqn in cap.param_fqn.items()}
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
            solver=dict(solver),
            sizes=pmodel.summary(),
            timings=dict(timings),
            workload=dict(workload or {}),
            model=pmodel,
        )
        return plan

    @property
    def captured(self) -> "CapturedGraph | None":
        return None if self.model is None else self.model.captured

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        return {
            "format": "apmodel-plan",
            "version": PLAN_FORMAT_VERSION,
            "mesh_shape": list(self.mesh_shape),
            "fingerprint": self.fingerprint,
            "structure_fingerprint": self.structure_fingerprint,
            "workload": self.workload,
            "objective_us": self.objective_us,
            "compute_us": self.compute_us,
            "comm_us": self.comm_us,
            "comm_by_collective": self.comm_by_collective,
            "per_layer": self.per_layer,
            "solver": self.solver,
            "sizes": self.sizes,
            "timings": self.timings,
            "param_placements": {k: pl.tuple_to_str(v) for k, v in self.param_placements.items()},
            "node_strategy": {k: strategy_to_json(v) for k, v in self.node_strategy.items()},
        }

    def save(self, path: str | Path) -> None:
        """Write the plan as versioned JSON."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1, default=_json_default))
        logger.info("plan saved to %s", path)

    @classmethod
    def from_json(cls, data: Any, source: str = "plan") -> "Plan":
        if not isinstance(data, dict) or data.get("format") != "apmodel-plan":
            raise ValueError(f"{source}: not an apmodel plan file (missing \"format\": \"apmodel-plan\")")
        version = data.get("version")
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(f"{source}: plan format version {version!r} is not supported (this apmodel reads {PLAN_FORMAT_VERSION})")
        required = ["mesh_shape", "fingerprint", "structure_fingerprint", "node_strategy", "param_placements", "objective_us"]
        for key in required:
            if key not in data:
                raise ValueError(f"{source}: missing field {key!r}")
        try:
            mesh_shape = tuple(int(x) for x in data["mesh_shape"])
        except (TypeError, ValueError):
            raise ValueError(f"{source}: field 'mesh_shape' must be a list of integers, got {data['mesh_shape']!r}") from None
        nodes = {k: strategy_from_json(v, f"node_strategy[{k!r}]") for k, v in data["node_strategy"].items()}
        params = {k: _placements_from_json(v, f"param_placements[{k!r}]") for k, v in data["param_placements"].items()}
        return cls(
            mesh_shape=mesh_shape,
            fingerprint=str(data["fingerprint"]),
            structure_fingerprint=str(data["structure_fingerprint"]),
            node_strategy=nodes,
            param_placements=params,
            objective_us=float(data["objective_us"]),
            compute_us=float(data.get("compute_us", float("nan"))),
            comm_us=float(data.get("comm_us", float("nan"))),
            comm_by_collective=dict(data.get("comm_by_collective", {})),
            per_layer=dict(data.get("per_layer", {})),
            solver=dict(data.get("solver", {})),
            sizes=dict(data.get("sizes", {})),
            timings=dict(data.get("timings", {})),
            workload=dict(data.get("workload", {})),
        )

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Read a plan written by :meth:`save`; malformed files raise ValueError naming the field."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_json(data, str(path))

    # ------------------------------------------------------------------ checks
    def check_compatible(self, captured: "CapturedGraph", mesh_shape: tuple[int, ...], *, exact: bool = True) -> None:
        """Refuse a mesh or model other than the plan's, with a message saying what differs.

        ``exact=False`` (replay) accepts a graph with the same structure but other shapes.
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

    # ------------------------------------------------------------------ inspection
    def explain(self, target: str) -> list[dict[str, Any]]:
        """Candidates of a node (or parameter FQN) priced against the plan's other choices.

        Each row: strategy, compute_us, comm_us (redistribution on the node's edges with its
        neighbours held at their planned strategies), total_us, chosen. Sorted by total.
        """
        if self.model is None:
            raise ValueError("explain needs the plan's model; plan with apmodel.plan(...) or re-attach one with apmodel.cli.attach(plan)")
        return explain(self.model, self.node_strategy, target)

    def emerged(self) -> dict[str, str]:
        """A one-line reading of each mesh axis' role (FSDP / tensor parallel / data parallel)."""
        return describe_axes(self)


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


def price(pmodel: "PlacementModel", node_strategy: Mapping[str, Strategy]) -> dict[str, Any]:
    """Objective of ``node_strategy`` under ``pmodel``'s costs, broken down (all in µs)."""
    cost = pmodel.cost
    compute_total = 0.0
    per_layer: dict[str, dict[str, float]] = defaultdict(lambda: {"compute_us": 0.0, "comm_us": 0.0})
    compute_memo: dict[Any, float] = {}
    for n in pmodel.nodes:
        s = node_strategy[n.name]
        key = (n.target, tuple(str(getattr(p.meta.get("val"), "shape", None)) for p in n.all_input_nodes), s)
        c = compute_memo.get(key)
        if c is None:
            c = compute_memo[key] = float(cost.compute_vector(n, [s])[0])
        compute_total += c
        per_layer[layer_of(n.meta)]["compute_us"] += c
    by_collective: dict[str, float] = defaultdict(float)
    comm_total = 0.0

    def add_steps(shape, dtype, src, dst, layer):
        nonlocal comm_total
        for kind, axis, _nbytes, us in cost.redistribution_steps(shape, dtype, src, dst):
            by_collective[f"{kind}@axis{axis}"] += us
            comm_total += us
            per_layer[layer]["comm_us"] += us

    for e in pmodel.edges:
        prod = pmodel.node_by_name[e.producer]
        val = prod.meta["val"][e.out_index] if isinstance(prod.meta["val"], (list, tuple)) else prod.meta["val"]
        src = pmodel.output_strs(node_strategy[e.producer], e.out_index)
        cons = node_strategy[e.consumer]
        dst_p = cons.outputs[0] if e.slot < 0 else cons.inputs[e.slot]
        if src is None or dst_p is None:
            continue
        dst = tuple(pl.to_str(x) for x in dst_p)
        add_steps(tuple(val.shape), val.dtype, src, dst, layer_of(pmodel.node_by_name[e.consumer].meta))
    for name, want in pmodel.boundary_outputs.items():
        val = pmodel.node_by_name[name].meta["val"]
        add_steps(tuple(val.shape), val.dtype, pmodel.output_strs(node_strategy[name], 0), want, "outputs")
    return {
        "objective_us": compute_total + comm_total,
        "compute_us": compute_total,
        "comm_us": comm_total,
        "comm_by_collective": dict(sorted(by_collective.items())),
        "per_layer": {k: dict(v) for k, v in per_layer.items()},
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
    comm = np.zeros(len(strats))
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


def diff(a: Plan, b: Plan) -> list[dict[str, Any]]:
    """Nodes (and parameters) whose placements differ between two plans."""
    rows = []
    for fqn in sorted(set(a.param_placements) | set(b.param_placements)):
        pa, pb = a.param_placements.get(fqn), b.param_placements.get(fqn)
        if pa != pb:
            rows.append({"kind": "param", "name": fqn, "a": _placements_to_json(pa), "b": _placements_to_json(pb)})
    for name in sorted(set(a.node_strategy) | set(b.node_strategy)):
        sa, sb = a.node_strategy.get(name), b.node_strategy.get(name)
        if sa != sb:
            rows.append({"kind": "node", "name": name, "a": None if sa is None else str(sa), "b": None if sb is None else str(sb)})
    return rows


def describe_axes(plan: Plan) -> dict[str, str]:
    """What each mesh axis does for the parameters of the plan, read off their placements."""
    roles = {}
    D = len(plan.mesh_shape)
    for axis in range(D):
        sharded = sum(1 for p in plan.param_placements.values() if pl.to_str(p[axis]).startswith("S"))
        total = max(1, len(plan.param_placements))
        gathers = plan.comm_by_collective.get(f"all_gather@axis{axis}", 0.0)
        a2a = plan.comm_by_collective.get(f"all_to_all@axis{axis}", 0.0)
        rs = plan.comm_by_collective.get(f"reduce_scatter@axis{axis}", 0.0)
        ar = plan.comm_by_collective.get(f"all_reduce@axis{axis}", 0.0)
        desc = f"params sharded {sharded}/{total}; all-gather {gathers:.0f} µs, reduce-scatter {rs:.0f} µs, all-reduce {ar:.0f} µs, all-to-all {a2a:.0f} µs"
        roles[f"axis{axis}"] = desc
    return roles
