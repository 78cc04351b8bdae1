"""Plan reports a person reads in a minute: one self-contained HTML page (and PNGs) per plan.

    page = report.plan_page(plan, recipes=results)          # str: one HTML file, nothing to fetch
    report.write_pngs(plan, "figures/")                      # the same figures with matplotlib (Agg)
    page = report.diff_page(a, b, names=("a.json", "b.json"))

The page has no script and loads nothing: CSS and the SVG figures are inline, so it can be mailed
or attached to an issue as one file. Each figure is laid out once, in pixels, as a list of shapes
(:class:`Drawing`), and painted twice: as inline SVG for the page and with matplotlib for the PNGs,
so both show the same thing. matplotlib is imported only by :func:`write_pngs`.

How a parameter is *used* (gathered for the op that computes with it, or read sharded) needs the
graph: it is read with :func:`apmodel.roles.param_uses` when the plan has its model attached
(``plan.model``: a plan just solved, or one re-attached with :func:`apmodel.api.attach`). A plan
read from a file alone shows storage placements only, and says so.
"""

from __future__ import annotations

import html
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from apmodel.plans import Plan

__all__ = ["ROLES", "Drawing", "plan_figures", "plan_page", "diff_page", "write_pngs"]

logger = logging.getLogger(__name__)

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

#: Fill colours of the bar segments; collectives are shaded lighter on higher mesh axes.
_SEGMENT_COLOURS = MappingProxyType({
    "compute": "#4e5d6c", "communication": "#e15759",
    "all_gather": "#4c72b0", "reduce_scatter": "#76b7b2", "all_reduce": "#e15759",
    "all_to_all": "#b07aa1", "broadcast": "#edc948",
    "parameters": "#2f4b7c", "gradients": "#76b7b2", "optimizer state": "#edc948", "activations": "#8cd17d",
})
_DARK_TEXT_ROLES = frozenset({"sharded", "replicated"})
_FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', sans-serif"


# ------------------------------------------------------------------------------ formatting
def _fmt_us(x: float | None) -> str:
    from apmodel.formatting import fmt_us as fmt  # one number format for the terminal and the page

    return fmt(x)


def _fmt_bytes(b: float | None) -> str:
    from apmodel.formatting import fmt_bytes as fmt

    return fmt(b)


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole and math.isfinite(whole) and math.isfinite(part) else "—"


def _natural(key: str) -> list[Any]:
    """Sort key that puts layers.2 before layers.10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def _collective_label(key: str) -> str:
    kind, _, axis = key.partition("@")
    return f"{kind} {axis.replace('axis', 'axis ')}".strip()


def _segment_colour(key: str) -> str:
    from apmodel.plans import parse_collective_key

    kind, _, axis = key.partition("@")
    base = _SEGMENT_COLOURS.get(parse_collective_key(key)[0], "#9c755f")
    level = int(axis[4:]) if axis.startswith("axis") and axis[4:].isdigit() else 0
    return _mix_white(base, min(0.6, 0.3 * level))


def _mix_white(colour: str, frac: float) -> str:
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * frac):02x}" for c in (r, g, b))


def _text_width(text: str, size: float) -> float:
    """Rough width of ``text`` in a sans font: enough to lay out labels without a font engine."""
    return 0.6 * size * len(text)


# ---------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class _Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str
    tip: str = ""
    stroke: str | None = None


@dataclass(frozen=True)
class _Text:
    x: float
    y: float  # baseline
    text: str
    size: float = 11.0
    anchor: str = "start"  # start | middle | end
    fill: str = "#222222"
    rotate: float = 0.0  # degrees, counter-clockwise as seen on the page
    bold: bool = False


@dataclass(frozen=True)
class _Line:
    x1: float
    y1: float
    x2: float
    y2: float
    stroke: str = "#888888"
    dash: bool = False


@dataclass
class Drawing:
    """One figure laid out in pixels (y down); :func:`_svg` and :func:`_paint` draw it."""

    id: str
    title: str
    width: float
    height: float
    shapes: list[Any] = field(default_factory=list)
    caption: str = ""


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
class _Block:
    title: str
    columns: list[str]
    rows: list[tuple[str, list[_Cell | None]]]


@dataclass
class _ParamRow:
    """One parameter for the page's table."""

    name: str
    shape: str
    stored: str
    uses: str
    roles: list[str]


def _param_role(stored: str, uses: list[str] | None) -> str:
    """Role of a parameter on one mesh axis, from its storage and the placements its ops read."""
    if any(u.startswith("S") for u in uses or ()):
        return "tp"
    if stored.startswith("S"):
        return "fsdp" if uses and all(u == "R" for u in uses) else "sharded"
    if stored.startswith("P") or any(u.startswith("P") for u in uses or ()):
        return "partial"
    return "replicated"


def _expert_parallel_use(pm: Any, ns: Mapping[str, Any], uses: list, axis: int) -> bool:
    """Whether a parameter is read sharded on ``axis`` by a ``local_map`` region that runs its
    expert-parallel alternative there (stacked expert weights: EP, not tensor parallelism)."""
    from apmodel.regions import is_backward, region_of

    for name, placements in uses:
        node = pm.node_by_name.get(name)
        region = region_of(node.target) if node is not None and node.op == "call_function" else None
        if region is None or is_backward(node.target) or name not in ns or not placements[axis].startswith("S"):
            continue
        if (region.alternative_on_axes(ns[name].inputs, backward=False)[axis] or "").startswith("expert"):
            return True
    return False


def _activation_role(token: str) -> str:
    if token == "S(0)":
        return "dp"
    if token == "S(1)":
        return "sp"
    if token.startswith("S"):
        return "sharded"
    return "partial" if token.startswith("P") else "replicated"


def _column(rel: str) -> str:
    return rel[: -len(".weight")] if rel.endswith(".weight") else rel


def _placement_data(plan: "Plan") -> tuple[list[_Block], list[_ParamRow]]:
    """The placement grid (layers x parameters, one stripe per axis) and the per-parameter table.
    Layers and norms come from the plan's model conventions (:func:`apmodel.conventions.for_plan`)."""
    from apmodel import placements as pl
    from apmodel.conventions import for_plan
    from apmodel.roles import param_uses

    pm, ns = plan.model, plan.node_strategy
    conventions = for_plan(plan)
    axes = range(len(plan.mesh_shape))
    groups: dict[str, dict[str, _Cell]] = {}
    table: list[_ParamRow] = []
    for fqn, placement in plan.param_placements.items():
        stored = [pl.to_str(p) for p in placement]
        known = pm is not None and fqn in pm.fqn_to_node  # a tied alias has no node of its own
        uses = param_uses(pm, ns, fqn, through_views=True) if known else None
        group, rel = conventions.split(fqn)
        cells = groups.setdefault(group, {})
        stripes, roles = [], []
        for a in axes:
            used = None if uses is None else sorted({u[1][a] for u in uses})
            role = _param_role(stored[a], used)
            if role == "tp" and uses is not None and _expert_parallel_use(pm, ns, uses, a):
                role = "ep"
            roles.append(role)
            use_text = "?" if used is None else "/".join(used) or "–"
            text = stored[a] if used is None else f"{stored[a]}→{use_text}"
            stripes.append(_Stripe(role, text, f"{fqn}, axis {a}: stored {stored[a]}, used {use_text}: {ROLES[role][0]}"))
        cells[_column(rel)] = _Cell(fqn, tuple(stripes))
        shape = "—"
        if known:
            val = pm.node_by_name[pm.fqn_to_node[fqn]].meta.get("val")
            shape = "×".join(map(str, getattr(val, "shape", ()))) or "scalar"
        table.append(_ParamRow(fqn, shape, "".join(stored),
                               "not known" if uses is None else "; ".join(f"{n}: {''.join(p)}" for n, p in uses) or "—",
                               roles))
        if known and conventions.is_norm_weight(fqn):
            # The norm's output shows how activations are split: batch (DP) or sequence (SP).
            out = next((ns[n].outputs[0] for n, _ in param_uses(pm, ns, fqn) if ns[n].outputs and ns[n].outputs[0] is not None), None)
            if out is not None:
                toks = [pl.to_str(p) for p in out]
                cells[_column(rel) + " out"] = _Cell(f"{fqn} (output of the norm)", tuple(
                    _Stripe(_activation_role(t), t, f"output of the norm {_column(fqn)}, axis {a}: {t}: "
                            f"{ROLES[_activation_role(t)][0]}") for a, t in enumerate(toks)))
    layered = {g: c for g, c in groups.items() if g}
    blocks = []
    if layered:
        columns = list(dict.fromkeys(col for cells in layered.values() for col in cells))
        blocks.append(_Block("per layer", columns,
                             [(g, [cells.get(c) for c in columns]) for g, cells in layered.items()]))
    if "" in groups:
        columns = list(groups[""])
        blocks.append(_Block("outside the layers", columns, [("model", [groups[""][c] for c in columns])]))
    return blocks, table


@dataclass
class _Bars:
    id: str
    title: str
    unit: str  # "us" | "bytes"
    rows: list[tuple[str, list[tuple[str, float]]]]
    markers: list[tuple[str, float]] = field(default_factory=list)
    caption: str = ""


def _time_bars(plan: "Plan") -> _Bars:
    segs = [("compute", plan.compute_us)] + sorted(plan.comm_by_collective.items(), key=_natural_item)
    return _Bars("time-breakdown", "Where the step's time goes (µs per training step)", "us", [("step", segs)],
                 caption="Compute, then communication by collective kind and mesh axis.")


def _natural_item(kv: tuple[str, float]) -> list[Any]:
    return _natural(kv[0])


def _layer_bars(plan: "Plan") -> _Bars:
    rows = [(k, [("compute", v.get("compute_us", 0.0)), ("communication", v.get("comm_us", 0.0))])
            for k, v in sorted(plan.per_layer.items(), key=lambda kv: _natural(kv[0]))]
    caption = "Compute and communication per layer."
    if len(rows) == 1:
        caption = (f"The plan records no per-layer split: every node fell in {rows[0][0]!r} "
                   "(the traced graph carried no module paths).")
    elif not rows:
        caption = "The plan records no per-layer costs."
    return _Bars("per-layer", "Compute and communication per layer (µs)", "us", rows, caption=caption)


def _memory_bars(plan: "Plan") -> _Bars | None:
    m = plan.memory
    if not m or m.get("peak_bytes") is None:
        return None
    parts = [("parameters", "params_bytes"), ("gradients", "grads_bytes"), ("optimizer state", "optimizer_bytes"),
             ("activations", "activations_bytes")]
    markers = [("peak", m["peak_bytes"])]
    caption = "Parameters, gradients, optimizer state and saved activations; the peak adds transients."
    hbm = m.get("hbm_bytes")
    if hbm and hbm <= 20 * m["peak_bytes"]:
        markers.append(("HBM", hbm))
    elif hbm:  # on HBM's scale the bars would vanish: drop the marker and say so
        caption += f" HBM ({_fmt_bytes(hbm)}) is off the scale: the peak uses {_pct(m['peak_bytes'], hbm)} of it."
    return _Bars("memory", "Memory per device against HBM", "bytes",
                 [("per device", [(label, m.get(key) or 0.0) for label, key in parts])], markers, caption=caption)


def _recipe_rows(plan: "Plan", recipes: Sequence[Any], free_plan: "Plan | None") -> list[dict[str, Any]]:
    """The found plan, the free-storage plan and each recipe, as rows for the table and the bars."""
    from apmodel import recipes as R

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


def _recipe_bars(rows: list[dict[str, Any]]) -> _Bars:
    bars = [(r["name"], [("compute", r["compute"] or 0.0), ("communication", r["comm"] or 0.0)])
            for r in rows if r["objective"] is not None]
    return _Bars("recipes-chart", "Found plan versus hand-written recipes (µs per step)", "us", bars,
                 caption="Same cost model, same solver; recipes that do not apply are listed in the table only.")


# ------------------------------------------------------------------------------- layouts
def _layout_grid(blocks: list[_Block], mesh_shape: Sequence[int]) -> Drawing:
    """The placement grid: rows are layers, columns parameters, one coloured stripe per mesh axis."""
    D = len(mesh_shape)
    stripe_w, row_h, pad = 52.0, 17.0, 8.0
    cell_w = stripe_w * D + 6
    labels = [label for b in blocks for label, _ in b.rows]
    label_w = max([_text_width(x, 11) for x in labels] + [40]) + 14
    header_h = max([_text_width(c, 11) * 0.65 for b in blocks for c in b.columns] + [30]) + 16
    ncols = max([len(b.columns) for b in blocks] + [1])
    width = label_w + ncols * cell_w + header_h * 0.8 + pad
    d = Drawing("placement-grid", "Parameter placements per layer and mesh axis", width, 0)
    y = _title(d, pad)
    d.shapes.append(_Text(pad, y + 12, "Each cell: one stripe per mesh axis, left to right: " + ", ".join(
        f"axis {a} ({n} devices)" for a, n in enumerate(mesh_shape)) + "; text: stored→used", 11, fill="#555555"))
    y += 22
    for b in blocks:
        d.shapes.append(_Text(pad, y + 13, b.title, 12, bold=True))
        y += header_h
        for j, col in enumerate(b.columns):
            cx = label_w + j * cell_w + cell_w / 2
            d.shapes.append(_Text(cx, y - 4, col, 11, rotate=35.0))
        for label, cells in b.rows:
            d.shapes.append(_Text(label_w - 8, y + row_h - 4.5, label, 11, anchor="end"))
            for j, cell in enumerate(cells):
                if cell is None:
                    continue
                x0 = label_w + j * cell_w + 3
                for a, s in enumerate(cell.stripes):
                    colour = ROLES[s.role][1]
                    d.shapes.append(_Rect(x0 + a * stripe_w, y + 1, stripe_w - 1, row_h - 2, colour, s.tip))
                    text = s.text if len(s.text) <= 11 else s.text[:10] + "…"
                    d.shapes.append(_Text(x0 + (a + 0.5) * stripe_w, y + row_h - 5, text, 8.5, anchor="middle",
                                          fill="#222222" if s.role in _DARK_TEXT_ROLES else "#ffffff"))
            y += row_h
        y += 12
    used = [r for r in ROLES if any(s.role == r for b in blocks for _, cells in b.rows for c in cells if c for s in c.stripes)]
    y = _legend(d, [(f"{ROLES[r][0]}: {ROLES[r][2]}", ROLES[r][1]) for r in used], pad, y, width - pad)
    d.height = y + pad
    return d


def _title(d: Drawing, y: float) -> float:
    """The figure's title as its first line (a PNG has no page around it); returns the y below."""
    d.shapes.append(_Text(8, y + 14, d.title, 13, bold=True))
    return y + 24


def _legend(d: Drawing, items: list[tuple[str, str]], x0: float, y: float, right: float) -> float:
    """Swatches with labels, wrapped at ``right``; returns the y below them."""
    x = x0
    for label, colour in items:
        w = 18 + _text_width(label, 11) + 14
        if x > x0 and x + w > right:
            x, y = x0, y + 18
        d.shapes.append(_Rect(x, y + 2, 12, 12, colour))
        d.shapes.append(_Text(x + 17, y + 12, label, 11))
        x += w
    return y + 20


def _nice_step(vmax: float) -> float:
    raw = vmax / 5
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)


def _tick_label(v: float, unit: str) -> str:
    if unit == "bytes":
        base, name = next(((u, n) for u, n in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")) if v >= u), (1, "B"))
        return f"{v / base:,.4g} {name}" if v else "0"
    return f"{v / 1000:,.0f} ms" if v >= 10_000 else f"{v:,.0f}"


def _drawable(v: float | None) -> float:
    """A bar length: missing, negative or infinite values (an infeasible recipe) draw as nothing."""
    return v if v is not None and math.isfinite(v) and v > 0 else 0.0


def _layout_bars(b: _Bars, width: float = 900.0) -> Drawing:
    """Horizontal stacked bars, one row per label, optional vertical markers (peak, HBM)."""
    pad, row_h, gap = 8.0, 20.0, 6.0
    label_w = max([_text_width(label, 11) for label, _ in b.rows] + [40]) + 14
    plot_w = width - label_w - pad - 40
    rows = [(label, [(k, _drawable(v)) for k, v in segs]) for label, segs in b.rows]
    markers = [(name, _drawable(v)) for name, v in b.markers]
    totals = [sum(v for _, v in segs) for _, segs in rows]
    vmax = max(totals + [v for _, v in markers] + [0.0]) or 1.0
    # bytes tick at round GiB (MiB, KiB) steps, times at round decimal ones
    base = next((u for u in (2**30, 2**20, 2**10) if vmax >= u), 1) if b.unit == "bytes" else 1
    step = _nice_step(vmax / base) * base
    vmax = math.ceil(vmax / step - 1e-9) * step
    d = Drawing(b.id, b.title, width, 0, caption=b.caption)
    top = _title(d, pad) + (16 if markers else 4)
    y = top
    fmt = _fmt_bytes if b.unit == "bytes" else (lambda v: f"{_fmt_us(v)} µs")
    bottom = top + len(rows) * (row_h + gap) - gap
    for name, v in markers:  # drawn first: the bars' total labels stay readable over them
        x = label_w + plot_w * v / vmax
        d.shapes.append(_Line(x, top - 4, x, bottom, "#222222", dash=True))
        d.shapes.append(_Text(x, top - 7, f"{name} {fmt(v)}", 10, anchor="end" if x > width * 0.7 else "middle"))
    for (label, segs), total in zip(rows, totals):
        d.shapes.append(_Text(label_w - 8, y + row_h - 5.5, label, 11, anchor="end"))
        x = label_w
        for key, v in segs:
            if v <= 0:
                continue
            w = plot_w * v / vmax
            d.shapes.append(_Rect(x, y, w, row_h, _segment_colour(key),
                                  f"{label}: {_collective_label(key)} {fmt(v)} ({_pct(v, total)})"))
            x += w
        d.shapes.append(_Text(x + 4, y + row_h - 5.5, fmt(total), 10, fill="#555555"))
        y += row_h + gap
    d.shapes.append(_Line(label_w, bottom, label_w + plot_w, bottom, "#999999"))
    for i in range(int(round(vmax / step)) + 1):
        v = i * step
        x = label_w + plot_w * v / vmax
        d.shapes.append(_Line(x, bottom, x, bottom + 4, "#999999"))
        d.shapes.append(_Text(x, bottom + 16, _tick_label(v, b.unit), 10, anchor="middle", fill="#555555"))
    keys = list(dict.fromkeys(k for _, segs in rows for k, v in segs if v > 0))
    y = _legend(d, [(_collective_label(k), _segment_colour(k)) for k in keys], label_w, bottom + 26, width - pad)
    d.height = y + pad
    return d


def plan_figures(plan: "Plan", *, recipes: Sequence[Any] | None = None,
                 free_plan: "Plan | None" = None) -> list[Drawing]:
    """The report's figures: placement grid, time breakdown, per layer, memory, recipes (if given)."""
    blocks, _ = _placement_data(plan)
    out = [_layout_grid(blocks, plan.mesh_shape), _layout_bars(_time_bars(plan)), _layout_bars(_layer_bars(plan))]
    mem = _memory_bars(plan)
    if mem is not None:
        out.append(_layout_bars(mem))
    if recipes is not None:
        out.append(_layout_bars(_recipe_bars(_recipe_rows(plan, recipes, free_plan))))
    return out


# ------------------------------------------------------------------------------ painters
def _svg(d: Drawing) -> str:
    parts = [f'<svg id="{_esc(d.id)}" role="img" aria-label="{_esc(d.title)}" width="{d.width:.0f}" '
             f'height="{d.height:.0f}" viewBox="0 0 {d.width:.1f} {d.height:.1f}" font-family="{_esc(_FONT)}">',
             f"<title>{_esc(d.title)}</title>"]
    for s in d.shapes:
        if isinstance(s, _Rect):
            stroke = f' stroke="{s.stroke}"' if s.stroke else ""
            rect = f'<rect x="{s.x:.1f}" y="{s.y:.1f}" width="{max(s.w, 0):.1f}" height="{s.h:.1f}" fill="{s.fill}"{stroke}'
            parts.append(f"{rect}><title>{_esc(s.tip)}</title></rect>" if s.tip else f"{rect}/>")
        elif isinstance(s, _Text):
            anchor = {"start": "start", "middle": "middle", "end": "end"}[s.anchor]
            extra = f' transform="rotate({-s.rotate:g} {s.x:.1f} {s.y:.1f})"' if s.rotate else ""
            weight = ' font-weight="bold"' if s.bold else ""
            parts.append(f'<text x="{s.x:.1f}" y="{s.y:.1f}" font-size="{s.size:g}" text-anchor="{anchor}" '
                         f'fill="{s.fill}"{weight}{extra}>{_esc(s.text)}</text>')
        elif isinstance(s, _Line):
            dash = ' stroke-dasharray="4 3"' if s.dash else ""
            parts.append(f'<line x1="{s.x1:.1f}" y1="{s.y1:.1f}" x2="{s.x2:.1f}" y2="{s.y2:.1f}" stroke="{s.stroke}"{dash}/>')
    parts.append("</svg>")
    return "".join(parts)


def _paint(d: Drawing, path: Path, dpi: int = 150) -> None:
    """Draw ``d`` with matplotlib's Agg canvas (no pyplot: no global backend or figure state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    px = 1 / 100  # layout pixels -> inches at the figure's nominal 100 dpi
    fig = Figure(figsize=(d.width * px, d.height * px), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, d.width)
    ax.set_ylim(d.height, 0)
    ax.axis("off")
    pt = 72 / 100  # font sizes are layout pixels
    for s in d.shapes:
        if isinstance(s, _Rect):
            ax.add_patch(Rectangle((s.x, s.y), max(s.w, 0), s.h, facecolor=s.fill, edgecolor=s.stroke or "none", linewidth=0.5))
        elif isinstance(s, _Text):
            ax.text(s.x, s.y, s.text, fontsize=s.size * pt, ha={"start": "left", "middle": "center", "end": "right"}[s.anchor],
                    va="baseline", color=s.fill, rotation=s.rotate, rotation_mode="anchor",
                    fontweight="bold" if s.bold else "normal")
        elif isinstance(s, _Line):
            ax.plot([s.x1, s.x2], [s.y1, s.y2], color=s.stroke, linewidth=0.8, linestyle="--" if s.dash else "-")
    fig.savefig(path, dpi=dpi, facecolor="white")


def write_pngs(plan: "Plan", directory: str | Path, *, recipes: Sequence[Any] | None = None,
               free_plan: "Plan | None" = None) -> list[Path]:
    """Write the report's figures as ``<figure id>.png`` into ``directory`` (created if missing)."""
    try:
        import matplotlib  # noqa: F401  (only to name the missing extra clearly)
    except ImportError as e:
        raise ModuleNotFoundError("PNG figures need matplotlib: pip install matplotlib (in a checkout: "
                                  "pip install -e '.[report]')") from e
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in plan_figures(plan, recipes=recipes, free_plan=free_plan):
        path = out / f"{d.id}.png"
        _paint(d, path)
        paths.append(path)
    logger.info("wrote %d figures to %s", len(paths), out)
    return paths


# ---------------------------------------------------------------------------------- page
_CSS = """
body{font-family:FONT;margin:0;background:#f6f7f9;color:#222;line-height:1.4}
main{max-width:1320px;margin:0 auto;padding:16px 24px 40px}
h1{font-size:1.5em;margin:8px 0 4px}h2{font-size:1.15em;margin:0 0 8px}
.lead{font-size:1.1em;margin:4px 0 12px}.lead b{font-size:1.15em}
section{background:#fff;border:1px solid #e2e4e8;border-radius:6px;padding:12px 16px;margin:12px 0}
nav a{margin-right:12px;color:#3b6fb6;text-decoration:none}
table{border-collapse:collapse;font-size:.9em;margin:6px 0}
th,td{border-bottom:1px solid #eceef1;padding:3px 10px 3px 0;text-align:left;vertical-align:top}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
.grid3{display:flex;flex-wrap:wrap;gap:24px}.grid3>div{flex:1 1 300px}
.fig{overflow-x:auto}.fig svg{max-width:100%;height:auto}.note{color:#666;font-size:.9em}
.warn{color:#a61b1b}.ok{color:#2f7d32}code{font-size:.95em}
.role{display:inline-block;padding:0 6px;border-radius:3px;color:#fff;font-size:.85em;margin-right:3px}
.role.sharded,.role.replicated{color:#222}
""".replace("FONT", _FONT)


def _page(title: str, body: list[str]) -> str:
    role_css = "".join(f".role.{k}{{background:{v[1]}}}" for k, v in ROLES.items())
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{_esc(title)}</title>\n<style>{_CSS}{role_css}</style>\n</head>\n<body>\n<main>\n"
            + "\n".join(body) + "\n</main>\n</body>\n</html>\n")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[int] = ()) -> str:
    """An HTML table; cells are escaped unless they are :class:`_Raw`."""
    num = set(numeric)

    def cell(tag: str, i: int, v: Any) -> str:
        c = ' class="n"' if i in num else ""
        return f"<{tag}{c}>{v.html if isinstance(v, _Raw) else _esc(v)}</{tag}>"

    head = "<tr>" + "".join(cell("th", i, h) for i, h in enumerate(header)) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows)
    return f'<table>{f"<thead>{head}</thead>" if head else ""}<tbody>{body}</tbody></table>'


@dataclass(frozen=True)
class _Raw:
    html: str


def _role_badges(roles: Sequence[str]) -> _Raw:
    return _Raw("".join(f'<span class="role {r}" title="axis {a}: {_esc(ROLES[r][2])}">{a}: {_esc(ROLES[r][0])}</span>'
                        for a, r in enumerate(roles)))


def _figure(d: Drawing) -> str:
    cap = f'<p class="note">{_esc(d.caption)}</p>' if d.caption else ""
    return f'<div class="fig">{_svg(d)}</div>{cap}'


def _mesh_str(mesh: Sequence[int]) -> str:
    return "×".join(map(str, mesh))


def _gap(plan: "Plan") -> tuple[float | None, float | None]:
    lb = plan.solver.get("lower_bound_us")
    if not isinstance(lb, (int, float)) or not math.isfinite(lb):
        return None, None
    return float(lb), (plan.objective_us - lb) / max(abs(plan.objective_us), 1e-12)


def _summary_section(plan: "Plan", param_note: str) -> str:
    from apmodel.roles import emerged

    wl, s, tm = plan.workload, plan.solver, plan.timings
    workload = [("model", wl.get("model", "—")), ("mesh", f"{_mesh_str(plan.mesh_shape)} ({math.prod(plan.mesh_shape)} devices, "
                                                           f"{wl.get('gpus_per_node', '—')} per node)"),
                ("device", wl.get("device", "—")), ("dtype", wl.get("dtype", "—")),
                ("sequence / batch / layers", f"{wl.get('seq', '—')} / {wl.get('batch', '—')} / {wl.get('layers') or 'all'}"),
                ("parameter storage / optimizer", f"{wl.get('param_policy', '—')} / {wl.get('optimizer', '—')}")]
    total = plan.objective_us
    cost = [("objective", f"{_fmt_us(total)} µs"), ("compute", f"{_fmt_us(plan.compute_us)} µs ({_pct(plan.compute_us, total)})"),
            ("communication", f"{_fmt_us(plan.comm_us)} µs ({_pct(plan.comm_us, total)})")]
    lb, gap = _gap(plan)
    solver = [("backend / status", f"{s.get('backend', '—')} / {s.get('status', '—')}"),
              ("lower bound / gap", "—" if lb is None else f"{_fmt_us(lb)} µs / {100 * gap:.3f}%"),
              ("nodes / groups / states / edges", " / ".join(f"{plan.sizes[k]:,}" if k in plan.sizes else "—"
                                                             for k in ("nodes", "groups", "states", "edges"))),
              ("trace / build / solve / total (s)", " / ".join(f"{tm[k]:.2f}" if k in tm else "—"
                                                               for k in ("trace_s", "build_s", "solve_s", "total_s")))]
    roles = emerged(plan)  # storage placements and traffic only when the model is not attached
    axes = [(f"axis {k[4:]} ({plan.mesh_shape[int(k[4:])]})", v) for k, v in roles.items()]
    return ('<section id="summary"><h2>Workload and solver</h2><div class="grid3">'
            f"<div>{_table(('workload', ''), workload)}</div><div>{_table(('cost per step', ''), cost)}</div>"
            f"<div>{_table(('solver', ''), solver)}</div></div>"
            f"<h2>What each mesh axis does</h2>{_table(('axis', 'role'), axes)}"
            + ("" if plan.model is not None else f'<p class="note">{_esc(param_note)}</p>') + "</section>")


def plan_page(plan: "Plan", *, recipes: Sequence[Any] | None = None, free_plan: "Plan | None" = None,
              warnings: Sequence[str] | None = None, source: str | None = None,
              notes: Sequence[str] = ()) -> str:
    """The HTML report of ``plan`` (one self-contained page).

    ``recipes``: the :class:`~apmodel.recipes.RecipeResult` list of ``--compare-recipes`` (None: the
    section says it was not run), ``free_plan`` the plan searched under free storage for that
    comparison; ``warnings`` default to ``plan.warnings``; ``source`` names the plan file;
    ``notes`` are shown at the top.
    """
    blocks, params = _placement_data(plan)
    wl = plan.workload
    model = wl.get("model") or "model"
    title = f"apmodel plan: {model} on mesh {_mesh_str(plan.mesh_shape)}"
    param_note = ("How parameters are used (gathered or read sharded) needs the plan's model, which is not attached: "
                  "the grid shows storage placements only (run `apmodel report` with --trace on a plan saved by "
                  "`apmodel plan --out` to see uses).")
    warnings = list(plan.warnings if warnings is None else warnings)
    mem = plan.memory
    lead = (f"Objective <b>{_esc(_fmt_us(plan.objective_us))} µs</b> per step: compute {_esc(_fmt_us(plan.compute_us))} µs "
            f"({_pct(plan.compute_us, plan.objective_us)}), communication {_esc(_fmt_us(plan.comm_us))} µs "
            f"({_pct(plan.comm_us, plan.objective_us)})")
    if mem.get("peak_bytes") is not None:
        lead += f"; peak memory {_esc(_fmt_bytes(mem['peak_bytes']))} of {_esc(_fmt_bytes(mem.get('hbm_bytes')))}"
    lead += f'; <span class="{"warn" if warnings else "ok"}">{len(warnings)} warning{"s" * (len(warnings) != 1)}</span>.'
    body = [f"<h1>{_esc(title)}</h1>",
            f'<p class="note">{_esc(wl.get("device", "?"))}, {_esc(wl.get("dtype", "?"))}'
            + (f"; plan file {_esc(source)}" if source else "") + "</p>",
            f'<p class="lead">{lead}</p>',
            '<nav><a href="#summary">summary</a><a href="#placements">placements</a><a href="#time">time</a>'
            '<a href="#memory">memory</a><a href="#recipes">recipes</a><a href="#warnings">warnings</a></nav>']
    body += [f'<p class="note warn">{_esc(n)}</p>' for n in notes]
    body.append(_summary_section(plan, param_note))

    grid = _layout_grid(blocks, plan.mesh_shape)
    rows = [(p.name, p.shape, p.stored, p.uses, _role_badges(p.roles)) for p in params]
    body.append('<section id="placements"><h2>Placements: storage and use, per layer and mesh axis</h2>'
                f"{_figure(grid)}"
                '<p class="note">Stored: where the parameter lives between steps. Used: the placement the op that computes '
                "with it reads (mm, embedding, mul), after views such as the transpose <code>t</code>, so a transposed "
                "weight's S(0) is its S(1). Hover a stripe for details.</p>"
                + ("" if plan.model is not None else f'<p class="note warn">{_esc(param_note)}</p>')
                + f"<details><summary>All {len(params)} parameters</summary>"
                f"{_table(('parameter', 'shape', 'stored', 'used by (op: placements)', 'role per axis'), rows)}</details>"
                "</section>")

    collectives = [(_collective_label(k), _fmt_us(v), _pct(v, plan.objective_us))
                   for k, v in sorted(plan.comm_by_collective.items(), key=lambda kv: -kv[1])]
    body.append('<section id="time"><h2>Compute and communication</h2>'
                f"{_figure(_layout_bars(_time_bars(plan)))}"
                f"{_table(('term', 'µs', 'share'), [('compute', _fmt_us(plan.compute_us), _pct(plan.compute_us, plan.objective_us))] + collectives + [('total', _fmt_us(plan.objective_us), '100.0%')], numeric=(1, 2))}"
                f"{_figure(_layout_bars(_layer_bars(plan)))}</section>")

    mem_bars = _memory_bars(plan)
    if mem_bars is None:
        body.append('<section id="memory"><h2>Memory per device</h2><p class="note">not recorded: the plan file '
                    "predates the memory model; re-plan to see it.</p></section>")
    else:
        keys = [("parameters", "params_bytes"), ("gradients", "grads_bytes"), ("optimizer state", "optimizer_bytes"),
                ("activations", "activations_bytes"), ("peak", "peak_bytes"), ("HBM", "hbm_bytes")]
        hbm = mem.get("hbm_bytes")
        body.append('<section id="memory"><h2>Memory per device</h2>'
                    f"{_figure(_layout_bars(mem_bars))}"
                    f"{_table(('what', 'bytes', 'of HBM'), [(k, _fmt_bytes(mem.get(f)), _pct(mem.get(f) or 0.0, hbm) if hbm else '—') for k, f in keys], numeric=(1, 2))}"
                    "</section>")

    if recipes is None:
        body.append('<section id="recipes"><h2>Recipes</h2><p class="note">Not compared: this report was made '
                    + ("from a plan file alone; " if source else "without --compare-recipes; ")
                    + "run <code>apmodel plan ... --compare-recipes --report FILE.html</code> to price DDP, FSDP, HSDP, "
                    "Megatron TP (+SP) and FSDP+TP against the found plan.</p></section>")
    else:
        rrows = _recipe_rows(plan, recipes, free_plan)
        base = plan.objective_us
        trows = [(r["name"], r["policy"], _fmt_us(r["objective"]) if r["objective"] is not None else r["status"],
                  _fmt_us(r["compute"]), _fmt_us(r["comm"]), _fmt_bytes(r["bytes"]),
                  f"{100 * (r['objective'] - base) / base:+.1f}%" if r["objective"] is not None and base else "",
                  r["reason"]) for r in rrows]
        body.append('<section id="recipes"><h2>Found plan versus hand-written recipes</h2>'
                    f"{_figure(_layout_bars(_recipe_bars(rrows)))}"
                    f"{_table(('plan', 'param storage', 'objective µs', 'compute µs', 'comm µs', 'params/device', 'vs found', 'note'), trows, numeric=(2, 3, 4, 5, 6))}"
                    '<p class="note">* outside the default search space (parameters not fully sharded); compared with '
                    "the free-storage plan, which contains every recipe.</p></section>")

    items = "".join(f'<li class="warn">{_esc(w)}</li>' for w in warnings)
    body.append('<section id="warnings"><h2>Warnings</h2>'
                + (f"<ul>{items}</ul>" if warnings else '<p class="ok">none</p>') + "</section>")
    return _page(title, body)


# ---------------------------------------------------------------------------------- diff
def diff_page(a: "Plan", b: "Plan", *, names: tuple[str, str] = ("a", "b"), node_limit: int = 500) -> str:
    """An HTML page of what changed from plan ``a`` to plan ``b``.

    Plans for different meshes or graphs are compared by parameter and node name, with a note at
    the top saying what differs (see :func:`apmodel.plans.diff`)."""
    from apmodel.formatting import strategy_str as _strategy_str
    from apmodel.plans import PlanMismatch, diff

    notes = []
    try:
        rows = diff(a, b)
    except PlanMismatch as e:
        what = str(e).split("; pass allow_mismatch")[0]  # the API hint means nothing on this page
        notes.append(f"{what}. They are compared by parameter and node name: only what both have is comparable.")
        rows = diff(a, b, allow_mismatch=True)
    if not notes and a.fingerprint != b.fingerprint:
        notes.append("The plans were made for graphs with the same structure but different shapes (fingerprints differ).")
    na, nb = names
    title = f"apmodel plan diff: {na} → {nb}"

    def delta(x: float | None, y: float | None) -> tuple[str, str]:
        if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
            return "—", "—"
        return f"{y - x:+,.1f}", (f"{100 * (y - x) / x:+.2f}%" if x else "—")

    summary = [("model", a.workload.get("model", "—"), b.workload.get("model", "—"), "", ""),
               ("mesh", _mesh_str(a.mesh_shape), _mesh_str(b.mesh_shape), "", ""),
               ("solver", f"{a.solver.get('backend', '—')} {a.solver.get('status', '')}",
                f"{b.solver.get('backend', '—')} {b.solver.get('status', '')}", "", "")]
    for label, x, y in (("objective µs", a.objective_us, b.objective_us), ("compute µs", a.compute_us, b.compute_us),
                        ("communication µs", a.comm_us, b.comm_us)):
        summary.append((label, _fmt_us(x), _fmt_us(y), *delta(x, y)))
    for key in sorted(set(a.comm_by_collective) | set(b.comm_by_collective), key=_natural):
        x, y = a.comm_by_collective.get(key, 0.0), b.comm_by_collective.get(key, 0.0)
        summary.append((f"  {_collective_label(key)} µs", _fmt_us(x), _fmt_us(y), *delta(x, y)))
    if a.memory.get("peak_bytes") is not None and b.memory.get("peak_bytes") is not None:
        x, y = a.memory["peak_bytes"], b.memory["peak_bytes"]
        summary.append(("peak memory", _fmt_bytes(x), _fmt_bytes(y), ("+" if y >= x else "−") + _fmt_bytes(abs(y - x)),
                        f"{100 * (y - x) / x:+.2f}%" if x else "—"))
    else:
        summary.append(("peak memory", _fmt_bytes(a.memory.get("peak_bytes")) if a.memory else "not recorded",
                        _fmt_bytes(b.memory.get("peak_bytes")) if b.memory else "not recorded", "—", "—"))

    bars = _Bars("diff-time", "Time per step, by collective (µs)", "us",
                 [(label, [("compute", p.compute_us)] + sorted(p.comm_by_collective.items(), key=_natural_item))
                  for label, p in ((na, a), (nb, b))])
    params = [r for r in rows if r["kind"] == "param"]
    nodes = [r for r in rows if r["kind"] == "node"]
    sa, sb = a.node_strategy, b.node_strategy
    n_params = len(set(a.param_placements) | set(b.param_placements))
    body = [f"<h1>{_esc(title)}</h1>"]
    body += [f'<p class="note warn"><b>Not the same workload:</b> {_esc(n)}</p>' for n in notes]
    dobj = b.objective_us - a.objective_us
    body.append(f'<p class="lead">Objective {_esc(_fmt_us(a.objective_us))} → <b>{_esc(_fmt_us(b.objective_us))} µs</b> '
                f"({dobj:+,.1f} µs{f', {100 * dobj / a.objective_us:+.2f}%' if a.objective_us else ''}); {len(params)} of {n_params} parameters stored "
                f"differently; {len(nodes)} nodes with a different strategy.</p>")
    body.append('<section id="summary"><h2>Totals</h2>'
                f"{_table(('', na, nb, 'b − a', 'change'), summary, numeric=(1, 2, 3, 4))}"
                f"{_figure(_layout_bars(bars))}</section>")
    if a.per_layer and b.per_layer and len(set(a.per_layer) & set(b.per_layer)) > 1:
        lrows = []
        for k in sorted(set(a.per_layer) & set(b.per_layer), key=_natural):
            x = a.per_layer[k].get("compute_us", 0.0) + a.per_layer[k].get("comm_us", 0.0)
            y = b.per_layer[k].get("compute_us", 0.0) + b.per_layer[k].get("comm_us", 0.0)
            lrows.append((k, _fmt_us(x), _fmt_us(y), *delta(x, y)))
        body.append(f'<section id="layers"><h2>Per layer (µs)</h2>{_table(("layer", na, nb, "b − a", "change"), lrows, numeric=(1, 2, 3, 4))}</section>')
    prow = [(r["name"], r["a"] or "— (absent)", r["b"] or "— (absent)") for r in params]
    body.append('<section id="params"><h2>Parameters whose storage changed</h2>'
                + (_table(("parameter", na, nb), prow) if prow else '<p class="ok">none</p>') + "</section>")
    nrow = [(r["name"], _strategy_str(sa[r["name"]]) if r["name"] in sa else "— (absent)",
             _strategy_str(sb[r["name"]]) if r["name"] in sb else "— (absent)") for r in nodes[:node_limit]]
    more = (f'<p class="note">showing {node_limit} of {len(nodes)}</p>' if len(nodes) > node_limit else "")
    body.append('<section id="nodes"><h2>Nodes whose strategy changed (outputs ← inputs)</h2>'
                + (_table(("node", na, nb), nrow) + more if nrow else '<p class="ok">none</p>') + "</section>")
    return _page(title, body)
