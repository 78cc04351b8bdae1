"""The report's figures: each laid out once, in pixels, as a list of shapes (:class:`Drawing`), and
painted twice: as inline SVG for the page (:func:`svg`) and with matplotlib for the PNGs
(:func:`paint`, matplotlib imported there only), so both show the same thing.

The placement grid folds consecutive layers that read alike into one row ("layers.1–31") and wraps
its columns into bands no wider than the page (:data:`GRID_MAX_WIDTH`), so a model with many
parameters per layer or a mesh with many axes stays legible without scaling the figure down.
"""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Sequence

from apmodel.core.formatting import fmt_bytes, fmt_us
from apmodel.reading.report_data import ROLES, Bars, Block, Lanes, collective_label, pct

#: Fill colours of the bar segments; collectives are shaded lighter on higher mesh axes.
_SEGMENT_COLOURS = MappingProxyType({
    "compute": "#4e5d6c", "communication": "#e15759",
    "all_gather": "#4c72b0", "reduce_scatter": "#76b7b2", "all_reduce": "#e15759",
    "all_to_all": "#b07aa1", "broadcast": "#edc948",
    "parameters": "#2f4b7c", "gradients": "#76b7b2", "optimizer state": "#edc948", "activations": "#8cd17d",
})
_DARK_TEXT_ROLES = frozenset({"sharded", "replicated"})
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', sans-serif"


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _segment_colour(key: str) -> str:
    from apmodel.result.plans import parse_collective_key

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
    """One figure laid out in pixels (y down); :func:`svg` and :func:`paint` draw it."""

    id: str
    title: str
    width: float
    height: float
    shapes: list[Any] = field(default_factory=list)
    caption: str = ""


# ------------------------------------------------------------------------------- layouts
#: Widest the placement grid is laid out (px): the page's content width (``main`` is 1,320 px, less
#: its own and a section's padding and borders, see ``report._CSS``), so the page never scales the
#: figure, and its text, down; wider grids wrap their columns into bands.
GRID_MAX_WIDTH = 1230.0
_LAYER_NUMBER = re.compile(r"^(.*?)(\d+)$")


def _layer_range(labels: Sequence[str]) -> str:
    """One label for consecutive layers: "layers.1–31" (or the first and last label)."""
    if len(labels) == 1:
        return labels[0]
    first, last = _LAYER_NUMBER.match(labels[0]), _LAYER_NUMBER.match(labels[-1])
    if first and last and first.group(1) == last.group(1):
        return f"{first.group(1)}{first.group(2)}–{last.group(2)}"
    return f"{labels[0]} … {labels[-1]}"


def _folded(rows: Sequence[tuple[str, list[Any]]]) -> list[tuple[str, list[Any]]]:
    """Consecutive rows whose cells read alike (the same role and text on every stripe) as one row,
    labelled by their range; its tooltips name the range and how many layers it stands for."""
    def reading(cells: list[Any]) -> tuple:
        return tuple(None if c is None else tuple((s.role, s.text) for s in c.stripes) for c in cells)

    runs: list[list[tuple[str, list[Any]]]] = []
    for label, cells in rows:
        if runs and reading(runs[-1][-1][1]) == reading(cells):
            runs[-1].append((label, cells))
        else:
            runs.append([(label, cells)])
    out = []
    for run in runs:
        first, cells = run[0]
        label = _layer_range([lab for lab, _ in run])
        if len(run) > 1:
            def renamed(tip: str, first: str = first, label: str = label, layers: int = len(run)) -> str:
                return tip.replace(first, label, 1) + f" (the same in each of {layers} layers)"

            cells = [None if c is None else replace(c, stripes=tuple(replace(s, tip=renamed(s.tip)) for s in c.stripes))
                     for c in cells]
        out.append((label, cells))
    return out


def layout_grid(blocks: list[Block], mesh_shape: Sequence[int]) -> Drawing:
    """The placement grid: rows are layers (consecutive layers that read alike folded into one row),
    columns parameters, one coloured stripe per mesh axis; columns wrap into bands at
    :data:`GRID_MAX_WIDTH`."""
    D = len(mesh_shape)
    stripe_w, row_h, pad = 52.0, 17.0, 8.0
    cell_w = stripe_w * D + 6
    shown = [(b, _folded(b.rows)) for b in blocks]
    labels = [label for _, rows in shown for label, _ in rows]
    label_w = max([_text_width(x, 11) for x in labels] + [40]) + 14
    header_h = max([_text_width(c, 11) * 0.65 for b in blocks for c in b.columns] + [30]) + 16
    overhang = header_h * 0.8  # the last column's slanted name reaches past its cell
    fits = max(1, int((GRID_MAX_WIDTH - label_w - overhang - pad) // cell_w))

    def band_size(n: int) -> int:  # bands of even width: 11 columns as 6 + 5, not 9 + 2
        return max(1, -(-n // -(-n // fits))) if n else 1

    ncols = max([band_size(len(b.columns)) for b in blocks] + [1])
    width = label_w + ncols * cell_w + overhang + pad
    d = Drawing("placement-grid", "Parameter placements per layer and mesh axis", width, 0)
    y = _title(d, pad)
    d.shapes.append(_Text(pad, y + 12, "Each cell: one stripe per mesh axis, left to right: " + ", ".join(
        f"axis {a} ({n} devices)" for a, n in enumerate(mesh_shape)) + "; text: stored→used", 11, fill="#555555"))
    y += 22
    for b, rows in shown:
        per_band = band_size(len(b.columns))
        for start in range(0, max(len(b.columns), 1), per_band):
            title = b.title if start == 0 else f"{b.title} (continued)"
            d.shapes.append(_Text(pad, y + 13, title, 12, bold=True))
            y += header_h
            band = range(start, min(start + per_band, len(b.columns)))
            for j, col in enumerate(b.columns[k] for k in band):
                cx = label_w + j * cell_w + cell_w / 2
                d.shapes.append(_Text(cx, y - 4, col, 11, rotate=35.0))
            for label, cells in rows:
                d.shapes.append(_Text(label_w - 8, y + row_h - 4.5, label, 11, anchor="end"))
                for j, cell in enumerate(cells[k] for k in band):
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


def layout_bars(b: Bars, width: float = 900.0) -> Drawing:
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
    fmt = fmt_bytes if b.unit == "bytes" else (lambda v: f"{fmt_us(v)} µs")
    bottom = top + len(rows) * (row_h + gap) - gap
    for name, v in markers:  # drawn first: the bars' total labels stay readable over them
        x = label_w + plot_w * v / vmax
        d.shapes.append(_Line(x, top - 4, x, bottom, "#222222", dash=True))
        d.shapes.append(_Text(x, top - 7, f"{name} {fmt(v)}", 10, anchor="end" if x > width * 0.7 else "middle"))
    for (label, segs), total in zip(rows, totals, strict=True):
        d.shapes.append(_Text(label_w - 8, y + row_h - 5.5, label, 11, anchor="end"))
        x = label_w
        for key, v in segs:
            if v <= 0:
                continue
            w = plot_w * v / vmax
            d.shapes.append(_Rect(x, y, w, row_h, _segment_colour(key),
                                  f"{label}: {collective_label(key)} {fmt(v)} ({pct(v, total)})"))
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
    y = _legend(d, [(collective_label(k), _segment_colour(k)) for k in keys], label_w, bottom + 26, width - pad)
    d.height = y + pad
    return d



def layout_lanes(b: Lanes, width: float = 900.0) -> Drawing:
    """A timeline: one row per lane, each span a box from its start to its end."""
    pad, row_h, gap = 8.0, 20.0, 6.0
    label_w = max([_text_width(name, 11) for name, _ in b.lanes] + [40]) + 14
    plot_w = width - label_w - pad - 40
    vmax = max([e for _, spans in b.lanes for _, e, _, _ in spans] + [1e-9])
    step = _nice_step(vmax)
    vmax = math.ceil(vmax / step - 1e-9) * step
    d = Drawing(b.id, b.title, width, 0, caption=b.caption)
    y = top = _title(d, pad) + 4
    for name, spans in b.lanes:
        d.shapes.append(_Text(label_w - 8, y + row_h - 5.5, name, 11, anchor="end"))
        for start, end, key, tip in spans:
            d.shapes.append(_Rect(label_w + plot_w * start / vmax, y, max(plot_w * (end - start) / vmax, 0.5), row_h,
                                  _segment_colour(key), tip, stroke="#ffffff"))
        y += row_h + gap
    bottom = top + len(b.lanes) * (row_h + gap) - gap
    d.shapes.append(_Line(label_w, bottom, label_w + plot_w, bottom, "#999999"))
    for i in range(int(round(vmax / step)) + 1):
        x = label_w + plot_w * i * step / vmax
        d.shapes.append(_Line(x, bottom, x, bottom + 4, "#999999"))
        d.shapes.append(_Text(x, bottom + 16, _tick_label(i * step, "us"), 10, anchor="middle", fill="#555555"))
    keys = list(dict.fromkeys(k for _, spans in b.lanes for _, _, k, _ in spans if k != "compute"))
    y = _legend(d, [("compute", _segment_colour("compute"))] + [(collective_label(k), _segment_colour(k)) for k in keys], label_w,
                bottom + 26, width - pad)
    d.height = y + pad
    return d


# ------------------------------------------------------------------------------ painters
def svg(d: Drawing) -> str:
    parts = [f'<svg id="{esc(d.id)}" role="img" aria-label="{esc(d.title)}" width="{d.width:.0f}" '
             f'height="{d.height:.0f}" viewBox="0 0 {d.width:.1f} {d.height:.1f}" font-family="{esc(FONT)}">',
             f"<title>{esc(d.title)}</title>"]
    for s in d.shapes:
        if isinstance(s, _Rect):
            stroke = f' stroke="{s.stroke}"' if s.stroke else ""
            rect = f'<rect x="{s.x:.1f}" y="{s.y:.1f}" width="{max(s.w, 0):.1f}" height="{s.h:.1f}" fill="{s.fill}"{stroke}'
            parts.append(f"{rect}><title>{esc(s.tip)}</title></rect>" if s.tip else f"{rect}/>")
        elif isinstance(s, _Text):
            anchor = {"start": "start", "middle": "middle", "end": "end"}[s.anchor]
            extra = f' transform="rotate({-s.rotate:g} {s.x:.1f} {s.y:.1f})"' if s.rotate else ""
            weight = ' font-weight="bold"' if s.bold else ""
            parts.append(f'<text x="{s.x:.1f}" y="{s.y:.1f}" font-size="{s.size:g}" text-anchor="{anchor}" '
                         f'fill="{s.fill}"{weight}{extra}>{esc(s.text)}</text>')
        elif isinstance(s, _Line):
            dash = ' stroke-dasharray="4 3"' if s.dash else ""
            parts.append(f'<line x1="{s.x1:.1f}" y1="{s.y1:.1f}" x2="{s.x2:.1f}" y2="{s.y2:.1f}" stroke="{s.stroke}"{dash}/>')
    parts.append("</svg>")
    return "".join(parts)


def paint(d: Drawing, path: Path, dpi: int = 150) -> None:
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
