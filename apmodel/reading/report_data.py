"""What the plan report shows, as data: the placement grid's cells (per layer, parameter and mesh
axis), the parameter table, and the bars of time, memory and recipes, read off a plan.

:mod:`apmodel.reading.report_figures` lays these out as figures; :mod:`apmodel.reading.report` writes the page.
How a parameter is stored and used comes from :func:`apmodel.reading.roles.read_param`, the reading the
CLI's table shows too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from apmodel.core.formatting import fmt_bytes

if TYPE_CHECKING:
    from apmodel.result.plans import Plan

#: role -> (legend label, colour, what it means). Per mesh axis, for a parameter or an activation.
ROLES: Mapping[str, tuple[str, str, str]] = MappingProxyType({
    "fsdp": ("FSDP", "#3b6fb6", "sharded in storage, all-gathered for use"),
    "tp": ("TP", "#f28e2b", "used sharded by the op that computes with it"),
    "ep": ("EP", "#76b7b2", "experts split over the axis; tokens travel to them (expert parallelism)"),
    "dp": ("data parallel", "#59a14f", "activation sharded on the batch dim S(0)"),
    "sp": ("sequence parallel", "#b07aa1", "activation sharded on the sequence dim S(1)"),
    "sharded": ("sharded", "#a0cbe8", "sharded in storage; use not known or not read by the forward"),
    "partial": ("partial", "#e15759", "partial sums awaiting a reduction"),
    "replicated": ("replicated", "#d9d9d9", "the whole tensor on every device of the axis"),
})



def pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole and math.isfinite(whole) and math.isfinite(part) else "—"


def natural(key: str) -> list[Any]:
    """Sort key that puts layers.2 before layers.10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def collective_label(key: str) -> str:
    kind, _, axis = key.partition("@")
    return f"{kind} {axis.replace('axis', 'axis ')}".strip()


# ------------------------------------------------------------------------ figures as data
@dataclass(frozen=True)
class _Stripe:
    role: str
    text: str
    tip: str


@dataclass(frozen=True)
class _Cell:
    name: str
    stripes: tuple[_Stripe, ...]  # one per mesh axis


@dataclass
class Block:
    title: str
    columns: list[str]
    rows: list[tuple[str, list[_Cell | None]]]


@dataclass
class ParamRow:
    """One parameter for the page's table."""

    name: str
    shape: str
    stored: str
    uses: str
    roles: list[str]


def activation_role(token: str) -> str:
    if token == "S(0)":
        return "dp"
    if token == "S(1)":
        return "sp"
    if token.startswith("S"):
        return "sharded"
    return "partial" if token.startswith("P") else "replicated"


def _column(rel: str) -> str:
    return rel[: -len(".weight")] if rel.endswith(".weight") else rel


def placement_data(plan: "Plan") -> tuple[list[Block], list[ParamRow]]:
    """The placement grid (layers x parameters, one stripe per axis) and the per-parameter table,
    both from :func:`apmodel.reading.roles.read_param` (what the CLI's table shows). Layers and norms come
    from the plan's model conventions (:func:`apmodel.graph.conventions.for_plan`)."""
    from apmodel.core import placements as pl
    from apmodel.graph.conventions import for_plan
    from apmodel.reading.roles import param_uses, read_param

    pm: Any = plan.model  # read only where read_param found the parameter's node (the model is attached)
    ns = plan.node_strategy
    conventions = for_plan(plan)
    groups: dict[str, dict[str, _Cell]] = {}
    table: list[ParamRow] = []
    for fqn in plan.param_placements:
        r = read_param(plan, fqn)
        group, rel = conventions.split(fqn)
        cells = groups.setdefault(group, {})
        stripes = []
        for a, (stored, role) in enumerate(zip(r.stored, r.roles, strict=False)):
            used = r.used(a)
            use_text = "?" if used is None else "/".join(used) or "–"
            text = stored if used is None else f"{stored}→{use_text}"
            stripes.append(_Stripe(role, text, f"{fqn}, axis {a}: stored {stored}, used {use_text}: {ROLES[role][0]}"))
        cells[_column(rel)] = _Cell(fqn, tuple(stripes))
        shape = "—"
        if r.node is not None:
            val = pm.node_by_name[r.node].meta.get("val")
            shape = "×".join(map(str, getattr(val, "shape", ()))) or "scalar"
        table.append(ParamRow(fqn, shape, "".join(r.stored),
                              "not known" if r.uses is None else "; ".join(f"{n}: {''.join(p)}" for n, p in r.uses) or "—",
                              list(r.roles)))
        if r.node is not None and conventions.is_norm_weight(fqn):
            # The norm's output shows how activations are split: batch (DP) or sequence (SP).
            out = next((ns[n].outputs[0] for n, _ in param_uses(pm, ns, pm.captured.param_fqn[r.node])
                        if ns[n].outputs and ns[n].outputs[0] is not None), None)
            if out is not None:
                toks = [pl.to_str(p) for p in out]
                cells[_column(rel) + " out"] = _Cell(f"{fqn} (output of the norm)", tuple(
                    _Stripe(activation_role(t), t, f"output of the norm {_column(fqn)}, axis {a}: {t}: "
                            f"{ROLES[activation_role(t)][0]}") for a, t in enumerate(toks)))
    layered = {g: c for g, c in groups.items() if g}
    blocks = []
    if layered:
        columns = list(dict.fromkeys(col for cells in layered.values() for col in cells))
        blocks.append(Block("per layer", columns,
                             [(g, [cells.get(c) for c in columns]) for g, cells in layered.items()]))
    if "" in groups:
        columns = list(groups[""])
        blocks.append(Block("outside the layers", columns, [("model", [groups[""][c] for c in columns])]))
    return blocks, table


@dataclass
class Bars:
    id: str
    title: str
    unit: str  # "us" | "bytes"
    rows: list[tuple[str, list[tuple[str, float]]]]
    markers: list[tuple[str, float]] = field(default_factory=list)
    caption: str = ""


def time_bars(plan: "Plan") -> Bars:
    segs = [("compute", plan.compute_us)] + sorted(plan.comm_by_collective.items(), key=natural_item)
    return Bars("time-breakdown", "Where the step's time goes (µs per training step)", "us", [("step", segs)],
                 caption="Compute, then communication by collective kind and mesh axis.")


def natural_item(kv: tuple[str, float]) -> list[Any]:
    return natural(kv[0])


def layer_bars(plan: "Plan") -> Bars:
    rows = [(k, [("compute", v.get("compute_us", 0.0)), ("communication", v.get("comm_us", 0.0))])
            for k, v in sorted(plan.per_layer.items(), key=lambda kv: natural(kv[0]))]
    caption = ("Compute and communication per layer; the modules outside the repeated layers and the loss function "
               "have rows of their own, and a parameter's gradient reduction counts in its own layer "
               "(apmodel.result.cost_labels), so the rows sum to the objective.")
    if len(rows) == 1:
        caption = (f"The plan records no per-layer split: every node fell in {rows[0][0]!r} "
                   "(the traced graph carried no module paths).")
    elif not rows:
        caption = "The plan records no per-layer costs."
    return Bars("per-layer", "Compute and communication per layer (µs)", "us", rows, caption=caption)


def memory_bars(plan: "Plan") -> Bars | None:
    m = plan.memory
    peak_bytes = m.get("peak_bytes") if m else None
    if peak_bytes is None:
        return None
    parts = [("parameters", "params_bytes"), ("gradients", "grads_bytes"), ("optimizer state", "optimizer_bytes"),
             ("activations", "activations_bytes")]
    peak = float(peak_bytes)
    markers = [("peak", peak)]
    caption = "Parameters, gradients, optimizer state and saved activations; the peak adds transients."
    hbm = m.get("hbm_bytes")
    if hbm and hbm <= 20 * peak:
        markers.append(("HBM", hbm))
    elif hbm:  # on HBM's scale the bars would vanish: drop the marker and say so
        caption += f" HBM ({fmt_bytes(hbm)}) is off the scale: the peak uses {pct(peak, hbm)} of it."
    return Bars("memory", "Memory per device against HBM", "bytes",
                 [("per device", [(label, m.get(key) or 0.0) for label, key in parts])], markers, caption=caption)


def recipe_rows(plan: "Plan", recipes: Sequence[Any], free_plan: "Plan | None") -> list[dict[str, Any]]:
    """The found plan, the free-storage plan and each recipe, as rows for the table and the bars."""
    from apmodel.reading import recipes as R

    policy = plan.workload.get("param_policy", "full_shard")
    rows = [{"name": "apmodel (found)", "policy": policy, "objective": plan.objective_us, "compute": plan.compute_us,
             "comm": plan.comm_us, "bytes": plan.memory.get("params_bytes"), "status": "ok", "reason": ""}]
    if free_plan is not None and free_plan is not plan:
        rows.append({"name": "apmodel (free storage)", "policy": "free", "objective": free_plan.objective_us,
                     "compute": free_plan.compute_us, "comm": free_plan.comm_us,
                     "bytes": free_plan.memory.get("params_bytes"), "status": "ok", "reason": ""})
    for r in recipes:
        try:
            inside = R.within_default_space(R.get(r.name))
        except (KeyError, ValueError):  # a recipe registered elsewhere: no claim about the space
            inside = True
        rows.append({"name": r.title, "policy": r.param_policy + ("" if inside else " *"), "objective": r.objective_us,
                     "compute": r.compute_us, "comm": r.comm_us, "status": r.status,
                     # what a device stores, as for the found plan (fp32 masters under mixed precision)
                     "bytes": None if r.plan is None else r.plan.memory.get("params_bytes"),
                     "reason": (r.reason or "").splitlines()[0][:300] if r.reason else "; ".join(getattr(r, "notes", ()))})
    return rows


def recipe_bars(rows: list[dict[str, Any]]) -> Bars:
    bars = [(r["name"], [("compute", r["compute"] or 0.0), ("communication", r["comm"] or 0.0)])
            for r in rows if r["objective"] is not None]
    return Bars("recipes-chart", "Found plan versus hand-written recipes (µs per step)", "us", bars,
                 caption="Same cost model, same solver; recipes that do not apply are listed in the table only.")


@dataclass
class Lanes:
    """One layer's forward or backward on the step's timeline: per lane (``"compute"``, ``"axis 0"``,
    ...) the spans ``(start µs, end µs, colour key, tooltip)`` from the window's start."""

    id: str
    title: str
    lanes: list[tuple[str, list[tuple[float, float, str, str]]]]
    caption: str = ""


def timeline_lanes(plan: "Plan", layer: str | None = None) -> list[Lanes]:
    """The forward and the backward of one layer (default: the middle one) as the program runs them
    (the timeline :func:`apmodel.result.plans.price` prices, with its spans); empty without the plan's
    model or without overlap."""
    from apmodel.result.cost_labels import node_labels
    from apmodel.result.plans import price

    pm = plan.model
    if pm is None or not plan.overlap.get("enabled"):
        return []
    label = node_labels(pm.nodes, pm.captured.is_backward)
    layers = sorted({v for v in label.values() if re.fullmatch(r".*\.\d+", v)}, key=natural)
    if not layers:
        return []
    layer = layer if layer in layers else layers[len(layers) // 2]
    tl = price(pm, plan.node_strategy, keep_spans=True)["timeline"]
    if tl is None:  # the model's costs price no overlap (a plan file's record said otherwise)
        return []
    out = []
    for phase, (ops, timed) in tl.phases.items():
        spans: dict[str, list[tuple[float, float, str, str]]] = {}
        for i, lane, start, end in timed.spans:
            op = ops[i]
            if op.kind == "issue":
                kind, _, ends = op.label.partition(" ")
                producer, _, consumer = ends.partition("->")
                owner = producer if consumer == "output" else consumer
                key, name = kind, f"axis {lane}"
            else:
                owner, key, name = op.label, "compute", "compute"
            if label.get(owner) != layer or end <= start:
                continue
            spans.setdefault(name, []).append((start, end, key, f"{op.label} {end - start:,.1f} µs"))
        if "compute" not in spans:
            continue
        # the window starts with the layer's computation; a collective prefetched earlier is clipped
        t0 = min(s for s, _, _, _ in spans["compute"])
        lanes = [(name, [(max(s, t0) - t0, e - t0, k, tip + (" (started earlier)" if s < t0 else ""))
                         for s, e, k, tip in spans[name] if e > t0])
                 for name in ["compute", *sorted(n for n in spans if n != "compute")] if name in spans]
        out.append(Lanes(f"timeline-{phase}", f"{layer}, {phase}: computation and communication lanes (µs)",
                         lanes, caption="Each collective on its mesh axis's lane, from its start to its end; the "
                                        "computation waits where a reader needs a collective not yet done."))
    return out
