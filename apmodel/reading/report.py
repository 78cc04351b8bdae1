"""Plan reports a person reads in a minute: one self-contained HTML page (and PNGs) per plan.

    page = report.plan_page(plan, recipes=results)          # str: one HTML file, nothing to fetch
    report.write_pngs(plan, "figures/")                      # the same figures with matplotlib (Agg)
    page = report.diff_page(a, b, names=("a.json", "b.json"))

The page has no script and loads nothing: CSS and the SVG figures are inline, so it can be mailed
or attached to an issue as one file. What it shows is read off the plan by
:mod:`apmodel.reading.report_data`; each figure is laid out once by :mod:`apmodel.reading.report_figures` and
painted twice: as inline SVG for the page and with matplotlib for the PNGs, so both show the same
thing. matplotlib is imported only by :func:`write_pngs`.

How a parameter is *used* (gathered for the op that computes with it, or read sharded) needs the
graph: it is read with :func:`apmodel.reading.roles.read_param` (as the CLI's table is) when the plan has
its model attached (``plan.model``: a plan just solved, or one re-attached with
:func:`apmodel.entry.api.attach`). A plan read from a file alone shows storage placements only, and says so.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from apmodel.core.formatting import fmt_bytes, fmt_us
from apmodel.reading.report_data import (
    ROLES,
    Bars,
    collective_label,
    layer_bars,
    memory_bars,
    natural,
    natural_item,
    pct,
    placement_data,
    recipe_bars,
    recipe_rows,
    time_bars,
    timeline_lanes,
)
from apmodel.reading.report_figures import FONT, Drawing, esc, layout_bars, layout_grid, layout_lanes, paint, svg

if TYPE_CHECKING:
    from apmodel.result.plans import Plan

__all__ = ["ROLES", "Drawing", "plan_figures", "plan_page", "diff_page", "write_pngs"]

logger = logging.getLogger(__name__)


def plan_figures(plan: "Plan", *, recipes: Sequence[Any] | None = None,
                 free_plan: "Plan | None" = None) -> list[Drawing]:
    """The report's figures: placement grid, time breakdown, per layer, one layer's timeline
    (with overlap), memory, recipes (if given)."""
    blocks, _ = placement_data(plan)
    out = [layout_grid(blocks, plan.mesh_shape), layout_bars(time_bars(plan)), layout_bars(layer_bars(plan))]
    out += [layout_lanes(lanes) for lanes in timeline_lanes(plan)]
    mem = memory_bars(plan)
    if mem is not None:
        out.append(layout_bars(mem))
    if recipes is not None:
        out.append(layout_bars(recipe_bars(recipe_rows(plan, recipes, free_plan))))
    return out


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
        paint(d, path)
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
""".replace("FONT", FONT)


def _page(title: str, body: list[str]) -> str:
    role_css = "".join(f".role.{k}{{background:{v[1]}}}" for k, v in ROLES.items())
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{esc(title)}</title>\n<style>{_CSS}{role_css}</style>\n</head>\n<body>\n<main>\n"
            + "\n".join(body) + "\n</main>\n</body>\n</html>\n")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[int] = ()) -> str:
    """An HTML table; cells are escaped unless they are :class:`_Raw`."""
    num = set(numeric)

    def cell(tag: str, i: int, v: Any) -> str:
        c = ' class="n"' if i in num else ""
        return f"<{tag}{c}>{v.html if isinstance(v, _Raw) else esc(v)}</{tag}>"

    head = "<tr>" + "".join(cell("th", i, h) for i, h in enumerate(header)) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows)
    return f'<table>{f"<thead>{head}</thead>" if head else ""}<tbody>{body}</tbody></table>'


@dataclass(frozen=True)
class _Raw:
    html: str


def _role_badges(roles: Sequence[str]) -> _Raw:
    return _Raw("".join(f'<span class="role {r}" title="axis {a}: {esc(ROLES[r][2])}">{a}: {esc(ROLES[r][0])}</span>'
                        for a, r in enumerate(roles)))


def _figure(d: Drawing) -> str:
    cap = f'<p class="note">{esc(d.caption)}</p>' if d.caption else ""
    return f'<div class="fig">{svg(d)}</div>{cap}'


def _mesh_str(mesh: Sequence[int]) -> str:
    return "×".join(map(str, mesh))


def _gap(plan: "Plan") -> tuple[float | None, float | None]:
    lb = plan.solver.get("lower_bound_us")
    if not isinstance(lb, (int, float)) or not math.isfinite(lb):
        return None, None
    return float(lb), (plan.objective_us - lb) / max(abs(plan.objective_us), 1e-12)


def _summary_section(plan: "Plan", param_note: str) -> str:
    from apmodel.reading.roles import emerged

    wl, s, tm = plan.workload, plan.solver, plan.timings
    workload = [("model", wl.get("model", "—")), ("mesh", f"{_mesh_str(plan.mesh_shape)} ({math.prod(plan.mesh_shape)} devices, "
                                                           f"{wl.get('gpus_per_node', '—')} per node)"),
                ("device", wl.get("device", "—")), ("dtype", wl.get("dtype", "—")),
                ("sequence / batch / layers", f"{wl.get('seq', '—')} / {wl.get('batch', '—')} / {wl.get('layers') or 'all'}"),
                ("parameter storage / optimizer", f"{wl.get('param_policy', '—')} / {wl.get('optimizer', '—')}")]
    total = plan.objective_us
    cost = [("objective", f"{fmt_us(total)} µs"), ("compute", f"{fmt_us(plan.compute_us)} µs ({pct(plan.compute_us, total)})"),
            ("communication", f"{fmt_us(plan.comm_us)} µs ({pct(plan.comm_us, total)})")]
    lb, gap = _gap(plan)
    solver = [("backend / status", f"{s.get('backend', '—')} / {s.get('status', '—')}"),
              ("lower bound / gap", "—" if lb is None or gap is None else f"{fmt_us(lb)} µs / {100 * gap:.3f}%"),
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
            + ("" if plan.model is not None else f'<p class="note">{esc(param_note)}</p>') + "</section>")


def _objective_lead(plan: "Plan") -> str:
    """The headline's objective: the step (a pipeline's, with one stage's microbatch after it)."""
    split = (f"compute {esc(fmt_us(plan.compute_us))} µs ({pct(plan.compute_us, plan.objective_us)}), communication "
             f"{esc(fmt_us(plan.comm_us))} µs ({pct(plan.comm_us, plan.objective_us)})")
    pp = plan.pipeline
    if pp and pp.get("degree", 1) > 1:  # the step is the pipeline's; the rest of the report is one stage's microbatch
        lead = (f"Objective <b>{esc(fmt_us(plan.step_objective_us))} µs</b> per step: a pipeline of degree "
                f"{pp['degree']} ({esc(pp['schedule'])}, {pp['microbatches']} microbatches, bubble "
                f"{esc(fmt_us(pp['bubble_us']))} µs); the stage plan below, per microbatch: "
                f"{esc(fmt_us(plan.objective_us))} µs, {split}")
    else:
        lead = f"Objective <b>{esc(fmt_us(plan.objective_us))} µs</b> per step: {split}"
    return lead


def plan_page(plan: "Plan", *, recipes: Sequence[Any] | None = None, free_plan: "Plan | None" = None,
              warnings: Sequence[str] | None = None, source: str | None = None,
              notes: Sequence[str] = ()) -> str:
    """The HTML report of ``plan`` (one self-contained page).

    ``recipes``: the :class:`~apmodel.reading.recipes.RecipeResult` list of ``--compare-recipes`` (None: the
    section says it was not run), ``free_plan`` the plan searched under free storage for that
    comparison; ``warnings`` default to ``plan.warnings``; ``source`` names the plan file;
    ``notes`` are shown at the top.
    """
    blocks, params = placement_data(plan)
    wl = plan.workload
    model = wl.get("model") or "model"
    title = f"apmodel plan: {model} on mesh {_mesh_str(plan.mesh_shape)}"
    param_note = ("How parameters are used (gathered or read sharded) needs the plan's model, which is not attached: "
                  "the grid shows storage placements only (run `apmodel report` with --trace on a plan saved by "
                  "`apmodel plan --out` to see uses).")
    warnings = list(plan.warnings if warnings is None else warnings)
    mem = plan.memory
    lead = _objective_lead(plan)
    hidden = plan.overlap.get("hidden_comm_us", 0.0) if plan.overlap.get("enabled") else 0.0
    if plan.overlap.get("enabled"):
        lead += (f", of which {esc(fmt_us(hidden))} µs hidden behind computation (serial sum "
                 f"{esc(fmt_us(plan.overlap['serial_us']))} µs)")
    if mem.get("peak_bytes") is not None:
        lead += f"; peak memory {esc(fmt_bytes(mem['peak_bytes']))} of {esc(fmt_bytes(mem.get('hbm_bytes')))}"
    lead += f'; <span class="{"warn" if warnings else "ok"}">{len(warnings)} warning{"s" * (len(warnings) != 1)}</span>.'
    body = [f"<h1>{esc(title)}</h1>",
            f'<p class="note">{esc(wl.get("device", "?"))}, {esc(wl.get("dtype", "?"))}'
            + (f"; plan file {esc(source)}" if source else "") + "</p>",
            f'<p class="lead">{lead}</p>',
            '<nav><a href="#summary">summary</a><a href="#placements">placements</a><a href="#time">time</a>'
            '<a href="#memory">memory</a><a href="#recipes">recipes</a><a href="#warnings">warnings</a></nav>']
    body += [f'<p class="note warn">{esc(n)}</p>' for n in notes]
    body.append(_summary_section(plan, param_note))

    grid = layout_grid(blocks, plan.mesh_shape)
    rows = [(p.name, p.shape, p.stored, p.uses, _role_badges(p.roles)) for p in params]
    body.append('<section id="placements"><h2>Placements: storage and use, per layer and mesh axis</h2>'
                f"{_figure(grid)}"
                '<p class="note">Stored: where the parameter lives between steps. Used: the placement the op that computes '
                "with it reads (mm, embedding, mul), after views such as the transpose <code>t</code>, so a transposed "
                "weight's S(0) is its S(1). Hover a stripe for details.</p>"
                + ("" if plan.model is not None else f'<p class="note warn">{esc(param_note)}</p>')
                + f"<details><summary>All {len(params)} parameters</summary>"
                f"{_table(('parameter', 'shape', 'stored', 'used by (op: placements)', 'role per axis'), rows)}</details>"
                "</section>")

    collectives = [(collective_label(k), fmt_us(v), pct(v, plan.objective_us))
                   for k, v in sorted(plan.comm_by_collective.items(), key=lambda kv: -kv[1])]
    body.append('<section id="time"><h2>Compute and communication</h2>'
                f"{_figure(layout_bars(time_bars(plan)))}"
                f"{_table(('term', 'µs', 'share'), [('compute', fmt_us(plan.compute_us), pct(plan.compute_us, plan.objective_us))] + collectives + ([('hidden behind computation', '-' + fmt_us(hidden), '-' + pct(hidden, plan.objective_us))] if hidden else []) + [('total', fmt_us(plan.objective_us), '100.0%')], numeric=(1, 2))}"
                f"{_figure(layout_bars(layer_bars(plan)))}"
                + "".join(_figure(layout_lanes(lanes)) for lanes in timeline_lanes(plan))
                + "</section>")

    mem_bars = memory_bars(plan)
    if mem_bars is None:
        body.append('<section id="memory"><h2>Memory per device</h2><p class="note">not recorded: the plan file '
                    "predates the memory model; re-plan to see it.</p></section>")
    else:
        keys = [("parameters", "params_bytes"), ("gradients", "grads_bytes"), ("optimizer state", "optimizer_bytes"),
                ("activations", "activations_bytes"), ("peak", "peak_bytes"), ("HBM", "hbm_bytes")]
        hbm = mem.get("hbm_bytes")
        body.append('<section id="memory"><h2>Memory per device</h2>'
                    f"{_figure(layout_bars(mem_bars))}"
                    f"{_table(('what', 'bytes', 'of HBM'), [(k, fmt_bytes(mem.get(f)), pct(mem.get(f) or 0.0, hbm) if hbm else '—') for k, f in keys], numeric=(1, 2))}"
                    "</section>")

    if recipes is None:
        body.append('<section id="recipes"><h2>Recipes</h2><p class="note">Not compared: this report was made '
                    + ("from a plan file alone; " if source else "without --compare-recipes; ")
                    + "run <code>apmodel plan ... --compare-recipes --report FILE.html</code> to price DDP, FSDP, HSDP, "
                    "Megatron TP (+SP) and FSDP+TP against the found plan.</p></section>")
    else:
        rrows = recipe_rows(plan, recipes, free_plan)
        base = plan.objective_us
        trows = [(r["name"], r["policy"], fmt_us(r["objective"]) if r["objective"] is not None else r["status"],
                  fmt_us(r["compute"]), fmt_us(r["comm"]), fmt_bytes(r["bytes"]),
                  f"{100 * (r['objective'] - base) / base:+.1f}%" if r["objective"] is not None and base else "",
                  r["reason"]) for r in rrows]
        body.append('<section id="recipes"><h2>Found plan versus hand-written recipes</h2>'
                    f"{_figure(layout_bars(recipe_bars(rrows)))}"
                    f"{_table(('plan', 'param storage', 'objective µs', 'compute µs', 'comm µs', 'params/device', 'vs found', 'note'), trows, numeric=(2, 3, 4, 5, 6))}"
                    '<p class="note">* outside the default search space (parameters not fully sharded); compared with '
                    "the free-storage plan, which contains every recipe.</p></section>")

    items = "".join(f'<li class="warn">{esc(w)}</li>' for w in warnings)
    body.append('<section id="warnings"><h2>Warnings</h2>'
                + (f"<ul>{items}</ul>" if warnings else '<p class="ok">none</p>') + "</section>")
    return _page(title, body)


# ---------------------------------------------------------------------------------- diff
def diff_page(a: "Plan", b: "Plan", *, names: tuple[str, str] = ("a", "b"), node_limit: int = 500) -> str:
    """An HTML page of what changed from plan ``a`` to plan ``b``.

    Plans for different meshes or graphs are compared by parameter and node name, with a note at
    the top saying what differs (see :func:`apmodel.result.plans.diff`)."""
    from apmodel.core.formatting import strategy_str as _strategy_str
    from apmodel.result.plans import PlanMismatch, diff

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
        summary.append((label, fmt_us(x), fmt_us(y), *delta(x, y)))
    for key in sorted(set(a.comm_by_collective) | set(b.comm_by_collective), key=natural):
        x, y = a.comm_by_collective.get(key, 0.0), b.comm_by_collective.get(key, 0.0)
        summary.append((f"  {collective_label(key)} µs", fmt_us(x), fmt_us(y), *delta(x, y)))
    peak_a, peak_b = a.memory.get("peak_bytes"), b.memory.get("peak_bytes")
    if peak_a is not None and peak_b is not None:
        summary.append(("peak memory", fmt_bytes(peak_a), fmt_bytes(peak_b),
                        ("+" if peak_b >= peak_a else "−") + fmt_bytes(abs(peak_b - peak_a)),
                        f"{100 * (peak_b - peak_a) / peak_a:+.2f}%" if peak_a else "—"))
    else:
        summary.append(("peak memory", fmt_bytes(a.memory.get("peak_bytes")) if a.memory else "not recorded",
                        fmt_bytes(b.memory.get("peak_bytes")) if b.memory else "not recorded", "—", "—"))

    bars = Bars("diff-time", "Time per step, by collective (µs)", "us",
                 [(label, [("compute", p.compute_us)] + sorted(p.comm_by_collective.items(), key=natural_item))
                  for label, p in ((na, a), (nb, b))])
    params = [r for r in rows if r["kind"] == "param"]
    nodes = [r for r in rows if r["kind"] == "node"]
    sa, sb = a.node_strategy, b.node_strategy
    n_params = len(set(a.param_placements) | set(b.param_placements))
    body = [f"<h1>{esc(title)}</h1>"]
    body += [f'<p class="note warn"><b>Not the same workload:</b> {esc(n)}</p>' for n in notes]
    dobj = b.objective_us - a.objective_us
    body.append(f'<p class="lead">Objective {esc(fmt_us(a.objective_us))} → <b>{esc(fmt_us(b.objective_us))} µs</b> '
                f"({dobj:+,.1f} µs{f', {100 * dobj / a.objective_us:+.2f}%' if a.objective_us else ''}); {len(params)} of {n_params} parameters stored "
                f"differently; {len(nodes)} nodes with a different strategy.</p>")
    body.append('<section id="summary"><h2>Totals</h2>'
                f"{_table(('', na, nb, 'b − a', 'change'), summary, numeric=(1, 2, 3, 4))}"
                f"{_figure(layout_bars(bars))}</section>")
    if a.per_layer and b.per_layer and len(set(a.per_layer) & set(b.per_layer)) > 1:
        lrows = []
        for k in sorted(set(a.per_layer) & set(b.per_layer), key=natural):
            x = a.per_layer[k].get("compute_us", 0.0) + a.per_layer[k].get("comm_us", 0.0)
            y = b.per_layer[k].get("compute_us", 0.0) + b.per_layer[k].get("comm_us", 0.0)
            lrows.append((k, fmt_us(x), fmt_us(y), *delta(x, y)))
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
