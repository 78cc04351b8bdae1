"""What ``apmodel plan`` prints: the JSON object of ``--json`` and the rich tables."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from apmodel.core.formatting import fmt_bytes as _fmt_bytes
from apmodel.core.formatting import fmt_us as _fmt_us

#: Keys the ``plan --json`` object always has (docs/design.md, "Public contracts").
JSON_KEYS = (
    "model", "mesh", "device", "solver", "nodes", "groups", "states", "edges",
    "trace_s", "build_s", "solve_s", "total_s", "objective_us", "lower_bound_us", "status",
    "compute_us", "comm_us", "param_placements",
)


def _finite_or_none(x: Any) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def overlapped(plan) -> bool:
    """Whether the plan's objective is its step priced with overlap (not the serial sum)."""
    return bool(plan.overlap.get("enabled"))


def step_keys(plan) -> dict[str, Any]:
    """``step_us``, ``exposed_comm_us``, ``hidden_comm_us``, the plan's serial objective
    (``serial_objective_us``), and the serial solve's own objective and the solver's bound on it
    (``serial_solve_us``, ``serial_lower_bound_us``: the certificate, of the serial problem)."""
    ov = plan.overlap
    return {"step_us": ov.get("step_us", plan.objective_us),
            "exposed_comm_us": ov.get("exposed_comm_us", plan.comm_us),
            "hidden_comm_us": ov.get("hidden_comm_us", 0.0),
            "serial_objective_us": ov.get("serial_us", plan.objective_us),
            "serial_solve_us": plan.solver.get("energy_us"),
            "serial_lower_bound_us": _finite_or_none(plan.solver.get("lower_bound_us")),
            "overlap": overlapped(plan)}


def plan_json(result, cfg) -> dict[str, Any]:
    """The ``--json`` object (docs/design.md keys first, then extras)."""
    from apmodel.core import placements as pl
    from apmodel.reading.roles import emerged

    plan = result.plan
    lb = plan.solver.get("lower_bound_us")
    data: dict[str, Any] = {
        "model": cfg.model,
        "mesh": list(plan.pipeline["mesh"] if plan.pipeline else plan.mesh_shape),  # a pipeline's: the whole mesh
        "device": result.options.device_name,
        "solver": result.options.solver,
        **{k: plan.sizes[k] for k in ("nodes", "groups", "states", "edges")},
        "trace_s": plan.timings.get("trace_s"),
        "build_s": plan.timings.get("build_s"),
        "solve_s": plan.timings.get("solve_s"),
        "total_s": plan.timings.get("total_s"),
        "objective_us": plan.objective_us,
        # the solver's bound certifies the serial objective; with overlap the objective is the step
        "lower_bound_us": None if overlapped(plan) else _finite_or_none(lb),
        "status": plan.solver.get("status"),
        "timings_s": dict(plan.timings),  # trace_s, build_s, solve_s, total_s of the found plan
        "compute_us": plan.compute_us,
        "comm_us": plan.comm_us,
        "param_placements": {k: pl.tuple_to_str(v) for k, v in plan.param_placements.items()},
        "seq": plan.workload.get("seq", cfg.seq),  # as planned (an hf: model caps it at its position table)
        "batch": cfg.batch,
        "dtype": result.options.dtype,
        "layers": cfg.layers,
        "comm_by_collective": plan.comm_by_collective,
        "param_bytes_per_device": result.param_bytes,
        "emerged": emerged(plan),
        "warnings": list(result.warnings),
        "memory": dict(plan.memory),
        "memory_limit_bytes": result.memory_limit_bytes,
        **step_keys(plan),
    }
    if plan.pipeline:  # the chosen degree, split, price and every degree priced (apmodel.result.pipeline_record)
        data["pipeline"] = dict(plan.pipeline)
        if plan.pipeline["degree"] > 1:
            _pipelined_objective(data)
    if result.recipes is not None:
        data["recipes"] = {r.name: r.objective_us for r in result.recipes}
        data["recipes_detail"] = {
            r.name: {"status": r.status, "reason": r.reason, "param_policy": r.param_policy,
                     "objective_us": r.objective_us, "compute_us": r.compute_us, "comm_us": r.comm_us,
                     "param_bytes_per_device": r.param_bytes,  # in the pricing dtype, as the top level's
                     # what a device stores (fp32 masters under mixed precision): the recipe tables' figure
                     "params_bytes": None if r.plan is None else r.plan.memory.get("params_bytes"),
                     "peak_bytes": None if r.plan is None else r.plan.memory.get("peak_bytes"),
                     "fits_memory": result.fits(r.plan)}
            for r in result.recipes
        }
        data["free_policy_objective_us"] = result.free_plan.objective_us
    return data


#: Top-level ``--json`` figures of one stage plan's microbatch: under ``pipeline.stage_plan`` for a
#: pipelined plan, whose top-level objective is the step.
STAGE_PLAN_KEYS = ("objective_us", "lower_bound_us", "compute_us", "comm_us", "comm_by_collective", "step_us",
                   "exposed_comm_us", "hidden_comm_us", "serial_objective_us", "serial_solve_us",
                   "serial_lower_bound_us")


def _pipelined_objective(data: dict[str, Any]) -> None:
    """A pipelined plan's ``--json``: ``objective_us`` and ``step_us`` the pipeline's step, the
    stage plan's per-microbatch figures moved under ``pipeline.stage_plan`` (None at the top: a
    step on the schedule's timeline is no sum of them)."""
    pp = data["pipeline"]
    pp["stage_plan"] = {k: data[k] for k in STAGE_PLAN_KEYS}
    for k in STAGE_PLAN_KEYS:
        data[k] = None
    data["comm_by_collective"] = {}
    data["objective_us"] = data["step_us"] = pp["objective_us"]


def print_plan(result, cfg, console: Console) -> None:
    """Readable summary: solver stats, objective breakdown, one layer's parameters, emerged roles."""
    from apmodel.core import placements as pl
    from apmodel.reading.roles import emerged, read_param
    from apmodel.result.plans import parse_collective_key

    plan = result.plan
    mesh = tuple(plan.mesh_shape)
    seq = plan.workload.get("seq", cfg.seq)  # as planned (an hf: model caps it at its position table)
    console.print(f"[bold]apmodel plan[/]: {escape(str(cfg.model))} (seq {seq}, batch {cfg.batch}"
                  f"{f', {cfg.layers} layers' if cfg.layers else ''}) on mesh {'x'.join(map(str, mesh))} "
                  f"of {result.options.device_name}, priced in {result.options.dtype}", highlight=False)
    pp = plan.pipeline
    if pp and pp["degree"] > 1:
        console.print(f"pipeline of degree {pp['degree']} on axis {pp['axis']} of mesh {'x'.join(map(str, pp['mesh']))}: "
                      f"the tables below are one stage plan, one microbatch of {cfg.batch // pp['microbatches']} "
                      f"on the stage mesh (the last table prices the pipeline)", highlight=False)

    t = Table(title="Problem and solver", show_header=False, title_justify="left")
    t.add_column("what")
    t.add_column("value", justify="right")
    s = plan.sizes
    t.add_row("nodes / groups / states / edges", f"{s['nodes']:,} / {s['groups']:,} / {s['states']:,} / {s['edges']:,}")
    tm = plan.timings
    t.add_row("trace / build / solve / total (s)",
              f"{tm.get('trace_s', 0):.2f} / {tm.get('build_s', 0):.2f} / {tm.get('solve_s', 0):.2f} / {tm.get('total_s', 0):.2f}")
    lb = plan.solver.get("lower_bound_us")
    t.add_row("backend / status", f"{plan.solver.get('backend')} / {plan.solver.get('status')}")
    if pp and pp["degree"] > 1:
        t.add_row("step (µs)", f"{_fmt_us(plan.step_objective_us)} (the pipeline's)")
    t.add_row("objective (µs)", _fmt_us(plan.objective_us) + (" (step, with overlap)" if overlapped(plan) else "")
              + (" per microbatch of the stage" if pp and pp["degree"] > 1 else ""))
    if overlapped(plan):
        t.add_row("serial objective (µs)", _fmt_us(plan.overlap["serial_us"]))
    if lb is not None and math.isfinite(lb):
        # with overlap the bound certifies the serial solve's own solution, not the kept plan's step
        certified = plan.solver.get("energy_us", plan.objective_us) if overlapped(plan) else plan.objective_us
        gap = (certified - lb) / max(abs(certified), 1e-12)
        t.add_row("lower bound (µs) / gap" + (" of the serial solve" if overlapped(plan) else ""),
                  f"{_fmt_us(lb)} / {100 * gap:.2f}%")
    t.add_row(f"parameter bytes per device ({result.options.dtype})", _fmt_bytes(result.param_bytes))
    mem = plan.memory
    if mem.get("peak_bytes") is not None:
        t.add_row("memory per device: peak / HBM", f"{_fmt_bytes(mem['peak_bytes'])} / {_fmt_bytes(mem['hbm_bytes'])}")
        t.add_row("  params / grads / optimizer / activations",
                  " / ".join(_fmt_bytes(mem[k]) for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")))
    console.print(t)

    t = Table(title="Objective breakdown (µs per training step)", title_justify="left")
    t.add_column("term")
    t.add_column("µs", justify="right")
    t.add_column("share", justify="right")
    total = max(plan.objective_us, 1e-12)
    t.add_row("compute", _fmt_us(plan.compute_us), f"{100 * plan.compute_us / total:.1f}%")
    t.add_row("communication", _fmt_us(plan.comm_us), f"{100 * plan.comm_us / total:.1f}%")
    for key, us in sorted(plan.comm_by_collective.items(), key=lambda kv: -kv[1]):
        kind, axis = key.split("@")  # "all_gather@axis0"; a region's own: "all_to_all (moe)@axis0+1"
        ranks = math.prod(mesh[a] for a in parse_collective_key(key)[2])
        t.add_row(f"  {kind} on {axis.replace('axis', 'axis ')} ({ranks} ranks)", _fmt_us(us), f"{100 * us / total:.1f}%")
    if overlapped(plan):
        ov = plan.overlap
        t.add_row("communication hidden behind compute", "-" + _fmt_us(ov["hidden_comm_us"]),
                  f"-{100 * ov['hidden_comm_us'] / total:.1f}%")
        t.add_row("step (compute + exposed communication)", _fmt_us(ov["step_us"]), "100.0%", style="bold")
    else:
        t.add_row("total", _fmt_us(plan.objective_us), "100.0%", style="bold")
    console.print(t)

    pm = plan.model
    layer0 = sorted(f for f in plan.param_placements if ".0." in f or not any(ch.isdigit() for ch in f))
    t = Table(title="Parameter placements (layer 0 and the non-layer parameters)", title_justify="left")
    for col in ("parameter", "shape", "stored", "used as", "bytes/device"):
        t.add_column(col, justify="right" if col == "bytes/device" else "left")
    itemsize = result.options.dtype_bytes
    tied = {alias: node for node, aliases in pm.captured.tied_params.items() for alias in aliases}
    for fqn in layer0:
        node = pm.fqn_to_node.get(fqn) or tied[fqn]  # a tied alias is read through its parameter's node
        val = pm.node_by_name[node].meta["val"]
        stored = plan.param_placements[fqn]
        local = pl.local_shape(tuple(val.shape), stored, mesh)
        # what the computing ops read, after views: the report's grid shows the same reading
        t.add_row(fqn, "x".join(map(str, val.shape)), pl.tuple_to_str(stored), read_param(plan, fqn).used_as,
                  _fmt_bytes(math.prod(local) * itemsize))
    console.print(t)

    t = Table(title="What emerged, per mesh axis", title_justify="left")
    t.add_column("axis")
    t.add_column("size", justify="right")
    t.add_column("role")
    for axis, desc in emerged(plan).items():
        t.add_row(axis.replace("axis", ""), str(mesh[int(axis[4:])]), desc)
    console.print(t)

    if plan.pipeline:
        _print_pipeline(plan.pipeline, result.memory_limit_bytes, console)
    if result.recipes is not None:
        _print_recipes(result, cfg, console)
    for w in result.warnings:  # plan warnings and recipe checks; literal text, never markup
        console.print(Text.assemble(("WARNING:", "bold red"), " ", w))


def _print_recipes(result, cfg, console: Console) -> None:
    from apmodel.reading import recipes as R

    plan = result.plan
    base = plan.objective_us
    t = Table(title="Found plan versus hand-written recipes (same cost model, same solver)", title_justify="left")
    for col in ("plan", "param storage", "objective µs", "compute µs", "comm µs", "params/device stored",
                "peak memory", "vs found"):
        t.add_column(col, justify="left" if col in ("plan", "param storage") else "right")

    def peak(p) -> Text:
        """Peak memory per device, red and marked when it does not fit the limit."""
        fits = result.fits(p)
        text = _fmt_bytes(None if p is None else p.memory.get("peak_bytes"))
        return Text(text + (" (over)" if fits is False else ""), style="red" if fits is False else "")

    def stored(p) -> str:
        """Parameter bytes a device holds (the memory model's: fp32 masters under mixed precision),
        the same figure the report shows for every row."""
        return _fmt_bytes(None if p is None else p.memory.get("params_bytes"))

    def pct(x: float) -> str:
        return f"{100 * (x - base) / base:+.1f}%"

    t.add_row("[bold]apmodel (found)[/]", result.options.param_policy, _fmt_us(base), _fmt_us(plan.compute_us),
              _fmt_us(plan.comm_us), stored(plan), peak(plan), "0.0%")
    ff = result.free_plan
    if ff is not plan:
        t.add_row("apmodel (free storage)", "free", _fmt_us(ff.objective_us), _fmt_us(ff.compute_us),
                  _fmt_us(ff.comm_us), stored(ff), peak(ff), pct(ff.objective_us))
    notes = []
    for r in result.recipes:
        policy = r.param_policy + ("" if R.within_default_space(R.get(r.name)) else " *")
        if r.objective_us is None:
            t.add_row(r.title, policy, Text(r.status, style="yellow"), "", "", "", "", "")
            notes.append(f"{r.name}: {r.status} — {r.reason.splitlines()[0][:300]}")
            continue
        t.add_row(r.title, policy, _fmt_us(r.objective_us), _fmt_us(r.compute_us), _fmt_us(r.comm_us),
                  stored(r.plan), peak(r.plan), pct(r.objective_us))
    console.print(t)
    console.print("* outside the default search space (parameters not fully sharded: more bytes per device); "
                  "compared with the free-storage plan, which contains every recipe.", style="dim", highlight=False)
    if result.memory_limit_bytes is not None:
        console.print(f"peak memory per device against the limit of {_fmt_bytes(result.memory_limit_bytes)} "
                      "(--memory-limit-bytes; default HBM less 10%); (over): does not fit.", style="dim", highlight=False)
    for n in notes:
        console.print(f"  {n}", style="dim", highlight=False, markup=False)


def _print_pipeline(pp: dict[str, Any], limit: float | None, console: Console) -> None:
    """Every pipeline degree priced, as the recipe table compares recipes (the chosen one in bold)."""
    title = (f"Pipeline degrees on mesh axis {pp['axis']} ({pp['schedule']}, {pp['microbatches']} microbatches; "
             f"µs per training step, bytes on the fullest device)")
    t = Table(title=title, title_justify="left")
    for col in ("degree", "stage mesh", "stages (layers)", "step µs", "bubble", "p2p µs", "weights", "peak memory",
                "vs chosen"):
        t.add_column(col, justify="left" if col in ("degree", "stage mesh", "stages (layers)", "weights") else "right")
    best = pp["objective_us"]
    for a in pp["alternatives"]:
        stages = ", ".join(f"{s[0]}-{s[1]}" for s in a["stages"]) if a["stages"] else "no pipelining"
        if len(stages) > 48:
            stages = stages[:45] + "..."
        bubble = f"{100 * a['bubble_us'] / a['objective_us']:.1f}%" if a["objective_us"] else ""
        peak = Text(_fmt_bytes(a["peak_bytes"]) + (" (over)" if a["fits"] is False else ""),
                    style="red" if a["fits"] is False else "")
        chosen = a["degree"] == pp["degree"]
        t.add_row(f"[bold]{a['degree']}[/]" if chosen else str(a["degree"]), "x".join(map(str, a["stage_mesh"])),
                  stages, _fmt_us(a["objective_us"]), bubble, _fmt_us(a["p2p_us"]), _weights(a.get("weight_sync", [])), peak,
                  f"{100 * (a['objective_us'] - best) / best:+.1f}%" if best else "")
    console.print(t)
    note = ("the tables above are the chosen degree's stage plan (one microbatch on the stage mesh); weights per "
            "stage: g gathered once per step and kept, r gathered per microbatch, gradients reduced once per step, "
            "m both per microbatch")
    if limit is not None:
        note += f"; peak memory against the limit of {_fmt_bytes(limit)} ((over): does not fit)"
    console.print(note, style="dim", highlight=False)


def _weights(syncs: list[str]) -> str:
    """Each stage's weight sync, one letter each (``gather_once`` g, ``reduce_once`` r, ``microbatch`` m)."""
    letters = "".join({"gather_once": "g", "reduce_once": "r", "microbatch": "m"}.get(x, "?") for x in syncs)
    return letters if len(letters) <= 8 else letters[:7] + "…"
