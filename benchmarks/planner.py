"""Planner scalability and replanning benchmark (LLaMA-3 8B by default).

    python benchmarks/planner.py                                   # full: 32 layers, 4 meshes
    python benchmarks/planner.py --layers 2 --meshes 8,4x8 --backends trws,highs --time-limit 60
    python benchmarks/planner.py --json planner.json --no-replan
    python benchmarks/planner.py --no-scalability --no-replan              # end to end only

Table 0 (end to end): ``apmodel.plan`` on the preset as a user runs it, per mesh (``--e2e-meshes``)
and variant (``--e2e-variants``: defaults; bf16/fp32 mixed precision traced as it runs with
selective activation checkpointing; seeding off): trace, build, solve and total seconds, objective
and the solver's certified gap.

Table 1 (scalability): the model is traced once; for each mesh the placement model is built once
(strategies + clustering + pricing) and solved by each backend (``solvers.solve`` on
``pmodel.compile()``) under a time limit. Columns: groups, states, edges, build seconds, solve
seconds, objective (µs per training step), lower bound, status, gap to the best objective found
on that mesh by any backend.

Table 2 (replanning): a plan made at the base sequence length is replayed
(``apmodel.replay_constraints``) at longer sequences and priced, against a fresh plan at each
length; the gain is ``(replayed - fresh) / replayed``. All lengths are traced with the same
``max_seq_len`` so that only the sequence length differs between the graphs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import solvers  # noqa: E402
from apmodel import models  # noqa: E402
from apmodel.api import build_model, replay_constraints, solve_model  # noqa: E402
from apmodel.capture import capture  # noqa: E402
from apmodel.api import plan_workload  # noqa: E402
from apmodel.options import PlanOptions  # noqa: E402
from apmodel.workloads import load_workload, parse_mesh  # noqa: E402
from apmodel.placement_model import ConstraintConflict  # noqa: E402

logger = logging.getLogger("benchmarks.planner")

DEFAULT_MESHES = "8,4x8,4x2x4,2x2x2x4"
DEFAULT_REPLAN_SEQS = "4096,8192,16384,32768"
#: Backends that build the marginal-polytope MILP (one column per pairwise cost entry).
MILP_BACKENDS = ("highs", "cvxpy")
#: Default cap on pairwise entries for those backends (about 2 GB of model at ~40 B per column).
DEFAULT_MAX_MILP_ENTRIES = 50_000_000


@contextlib.contextmanager
def _quiet_stdout():
    """Solver banners (HiGHS prints on fd 1) go to stderr, so that tables stay readable."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def trace(model: str, layers: int | None, seq: int, batch: int, max_seq_len: int):
    overrides: dict[str, Any] = {"max_seq_len": max(max_seq_len, models.config(model).max_seq_len)}
    if layers is not None:
        overrides["n_layers"] = layers
    cfg = models.config(model, **overrides)
    with torch.device("meta"):
        module = models.build(cfg)
    return capture(module, models.sample_inputs(cfg, batch=batch, seq=seq))


def scalability(args, console: Console) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    max_seq = max([args.seq, *args.replan_seqs]) if args.replan else args.seq
    t0 = time.perf_counter()
    with _quiet_stdout():
        captured = trace(args.model, args.layers, args.seq, args.batch, max_seq)
    trace_s = time.perf_counter() - t0
    console.print(f"traced {args.model} ({args.layers or 'all'} layers, seq {args.seq}, batch {args.batch}): "
                  f"{len(captured.gm.graph.nodes):,} nodes in {trace_s:.1f} s", highlight=False)
    for mesh in args.meshes:
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        with _quiet_stdout():
            pmodel = build_model(captured, mesh, timings=timings, device=args.device, gpus_per_node=args.gpus_per_node)
            problem = pmodel.compile()
        build_s = time.perf_counter() - t0
        sizes = pmodel.summary()
        mesh_rows = []
        entries = sum(int(m.size) for _u, _v, m in problem.edges)
        for backend in args.backends:
            row: dict[str, Any] = {"mesh": list(mesh), "backend": backend, **sizes, "trace_s": trace_s,
                                   "build_s": build_s, "pairwise_entries": entries}
            if backend in MILP_BACKENDS and entries > args.max_milp_entries:
                # the marginal-polytope MILP has one column per pairwise entry: beyond a few tens
                # of millions it does not fit in memory (the 2x2x2x4 8B model was OOM-killed)
                row.update(status=f"skipped ({entries:,} pairwise entries > --max-milp-entries)", solve_s=None,
                           objective_us=None, lower_bound_us=None)
                mesh_rows.append(row)
                console.print(f"  mesh {'x'.join(map(str, mesh))} {backend}: {row['status']}", highlight=False)
                continue
            try:
                with _quiet_stdout():
                    sol = solvers.solve(problem, backend=backend, time_limit=args.time_limit)
            except Exception as e:  # a backend that fails or cannot finish is reported, not fatal
                row.update(status=f"error: {type(e).__name__}: {str(e)[:120]}", solve_s=None, objective_us=None,
                           lower_bound_us=None)
                logger.warning("mesh %s backend %s: %s", mesh, backend, e)
            else:
                row.update(status=sol.status, solve_s=sol.seconds,
                           objective_us=sol.energy if math.isfinite(sol.energy) else None,
                           lower_bound_us=sol.lower_bound if sol.lower_bound is not None and math.isfinite(sol.lower_bound) else None)
            mesh_rows.append(row)
            console.print(f"  mesh {'x'.join(map(str, mesh))} {backend}: {row['status']} "
                          f"{row['objective_us'] if row['objective_us'] is None else round(row['objective_us'], 1)} µs "
                          f"in {row['solve_s'] if row['solve_s'] is None else round(row['solve_s'], 1)} s", highlight=False)
        found = [r["objective_us"] for r in mesh_rows if r["objective_us"] is not None]
        best = min(found) if found else None
        for r in mesh_rows:
            r["gap_to_best"] = None if best is None or r["objective_us"] is None else (r["objective_us"] - best) / best
        rows.extend(mesh_rows)
    return rows


#: End-to-end variants: name -> planning options beyond the defaults.
E2E_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "mixed+selective": {"mixed_precision": ("bf16", "fp32"), "ac": "selective"},
    "unseeded": {"seeding": False},
}


def end_to_end(args, console: Console) -> list[dict[str, Any]]:
    """``apmodel.plan`` as a user runs it (``plan_workload`` on the preset: trace, build, solve,
    memory fit), per mesh and variant; ``total_s`` is what the CLI reports."""
    rows: list[dict[str, Any]] = []
    for mesh in args.e2e_meshes:
        for variant in args.e2e_variants:
            options = PlanOptions(device=args.device, gpus_per_node=args.gpus_per_node, time_limit=args.time_limit,
                                  **E2E_VARIANTS[variant])
            t0 = time.perf_counter()
            with _quiet_stdout():
                result = plan_workload(load_workload(args.model, mesh, batch=args.batch, seq=args.seq, layers=args.layers),
                                       options)
            found = result.plan
            row = {"mesh": list(mesh), "variant": variant, "wall_s": time.perf_counter() - t0,
                   **{k: found.timings.get(k) for k in ("trace_s", "build_s", "solve_s", "total_s")},
                   "objective_us": found.objective_us, "lower_bound_us": found.solver.get("lower_bound_us"),
                   "status": found.solver.get("status"), "nodes": found.sizes["nodes"],
                   "peak_bytes": found.memory.get("peak_bytes")}
            bound = row["lower_bound_us"]
            row["gap"] = None if bound is None or not math.isfinite(bound) else (row["objective_us"] - bound) / row["objective_us"]
            rows.append(row)
            console.print(f"  end to end {'x'.join(map(str, mesh))} {variant}: {row['objective_us']:,.1f} µs in "
                          f"{row['total_s']:.1f} s (trace {row['trace_s']:.1f}, build {row['build_s']:.1f}, "
                          f"solve {row['solve_s']:.1f})", highlight=False)
    return rows


def replanning(args, console: Console) -> list[dict[str, Any]]:
    mesh = args.replan_mesh
    max_seq = max([args.seq, *args.replan_seqs])
    with _quiet_stdout():
        base = trace(args.model, args.layers, args.seq, args.batch, max_seq)
        plan = solve_model(build_model(base, mesh, device=args.device, gpus_per_node=args.gpus_per_node),
                           solver=args.replan_backend, time_limit=args.time_limit)
    rows = [{"seq": args.seq, "replayed_us": plan.objective_us, "fresh_us": plan.objective_us, "gain": 0.0}]
    console.print(f"replanning on mesh {'x'.join(map(str, mesh))}: base plan at seq {args.seq}: "
                  f"{plan.objective_us:,.1f} µs", highlight=False)
    for seq in args.replan_seqs:
        with _quiet_stdout():
            captured = trace(args.model, args.layers, seq, args.batch, max_seq)
        row: dict[str, Any] = {"seq": seq}
        try:
            with _quiet_stdout():
                replayed = solve_model(build_model(captured, mesh, constraints=[replay_constraints(plan)],
                                                   device=args.device, gpus_per_node=args.gpus_per_node),
                                       solver=args.replan_backend)
            row["replayed_us"] = replayed.objective_us
        except (ConstraintConflict, solvers.Infeasible, ValueError) as e:
            row["replayed_us"] = None
            row["replay_error"] = str(e)[:200]
        with _quiet_stdout():
            fresh = solve_model(build_model(captured, mesh, device=args.device, gpus_per_node=args.gpus_per_node),
                                solver=args.replan_backend, time_limit=args.time_limit)
        row["fresh_us"] = fresh.objective_us
        rep = row["replayed_us"]
        row["gain"] = None if rep is None else (rep - fresh.objective_us) / rep
        rows.append(row)
        console.print(f"  seq {seq}: replayed {rep if rep is None else round(rep, 1)} µs, fresh {fresh.objective_us:,.1f} µs",
                      highlight=False)
    return rows


def _f(x: float | None, fmt: str = ",.1f") -> str:
    return "—" if x is None else format(x, fmt)


def print_tables(result: dict[str, Any], console: Console) -> None:
    a = result["args"]
    t = Table(title=f"Planner scalability: {a['model']} ({a['layers'] or 'all'} layers), seq {a['seq']}, batch {a['batch']}, "
                    f"{a['device']}, time limit {a['time_limit']} s", title_justify="left")
    for col in ("mesh", "backend", "groups", "states", "edges", "build s", "solve s", "objective µs", "bound µs", "status", "gap to best"):
        t.add_column(col, justify="left" if col in ("mesh", "backend", "status") else "right")
    for r in result["scalability"]:
        t.add_row("x".join(map(str, r["mesh"])), r["backend"], f"{r['groups']:,}", f"{r['states']:,}", f"{r['edges']:,}",
                  _f(r["build_s"]), _f(r["solve_s"]), _f(r["objective_us"]), _f(r["lower_bound_us"]), r["status"],
                  "—" if r["gap_to_best"] is None else f"{100 * r['gap_to_best']:.2f}%")
    if result["scalability"]:
        console.print(t)
    if result.get("end_to_end"):
        t = Table(title="End to end (apmodel.plan as the CLI runs it; total_s as reported)", title_justify="left")
        for col in ("mesh", "variant", "nodes", "trace s", "build s", "solve s", "total s", "objective µs", "gap", "status", "peak GB"):
            t.add_column(col, justify="left" if col in ("mesh", "variant", "status") else "right")
        for r in result["end_to_end"]:
            t.add_row("x".join(map(str, r["mesh"])), r["variant"], f"{r['nodes']:,}", _f(r["trace_s"]), _f(r["build_s"]),
                      _f(r["solve_s"]), _f(r["total_s"]), _f(r["objective_us"]),
                      "—" if r["gap"] is None else f"{100 * r['gap']:.2f}%", str(r["status"]),
                      _f(None if r["peak_bytes"] is None else r["peak_bytes"] / 1e9, ".2f"))
        console.print(t)
    if result.get("replanning"):
        t = Table(title=f"Replanning: the seq-{a['seq']} plan replayed at longer sequences vs a fresh plan "
                        f"(mesh {a['replan_mesh']}, {a['replan_backend']})", title_justify="left")
        for col in ("seq", "replayed µs", "fresh µs", "gain"):
            t.add_column(col, justify="right")
        for r in result["replanning"]:
            t.add_row(str(r["seq"]), _f(r["replayed_us"]), _f(r["fresh_us"]),
                      "—" if r["gain"] is None else f"{100 * r['gain']:.1f}%")
        console.print(t)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=None, help="override n_layers (default: the preset's, 32 for 8B)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="h100")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--meshes", default=DEFAULT_MESHES, help=f"comma-separated meshes (default {DEFAULT_MESHES})")
    p.add_argument("--backends", default="trws,highs", help="comma-separated backends (e.g. trws,highs,cvxpy,pgmpy)")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds per solve")
    p.add_argument("--max-milp-entries", type=int, default=DEFAULT_MAX_MILP_ENTRIES,
                   help="skip MILP backends (highs, cvxpy) on problems with more pairwise cost entries")
    p.add_argument("--replan-seqs", default=DEFAULT_REPLAN_SEQS)
    p.add_argument("--replan-mesh", default="4x8")
    p.add_argument("--replan-backend", default="trws")
    p.add_argument("--no-replan", dest="replan", action="store_false")
    p.add_argument("--no-scalability", dest="scalability", action="store_false")
    p.add_argument("--e2e-meshes", default="8,4x8", help="meshes of the end-to-end table ('' for none)")
    p.add_argument("--e2e-variants", default="default,mixed+selective",
                   help=f"comma-separated variants of the end-to-end table: {', '.join(E2E_VARIANTS)}")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    args.meshes = [parse_mesh(m) for m in args.meshes.split(",") if m]
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = [b for b in args.backends if b not in solvers.available()]
    if unknown:
        p.error(f"backends {unknown} are not available: {solvers.available()}")
    args.replan_seqs = [int(s) for s in args.replan_seqs.split(",") if s]
    args.replan_mesh = parse_mesh(args.replan_mesh)
    args.e2e_meshes = [parse_mesh(m) for m in args.e2e_meshes.split(",") if m]
    args.e2e_variants = [v for v in args.e2e_variants.split(",") if v]
    unknown = [v for v in args.e2e_variants if v not in E2E_VARIANTS]
    if unknown:
        p.error(f"end-to-end variants {unknown} are not among {list(E2E_VARIANTS)}")
    console = Console(width=160) if not Console().is_terminal else Console()
    result: dict[str, Any] = {
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "json"},
        "torch": torch.__version__,
    }
    result["args"]["meshes"] = [list(m) for m in args.meshes]
    result["args"]["replan_mesh"] = "x".join(map(str, args.replan_mesh))
    result["args"]["e2e_meshes"] = [list(m) for m in args.e2e_meshes]
    result["end_to_end"] = end_to_end(args, console)
    result["scalability"] = scalability(args, console) if args.scalability else []
    result["replanning"] = replanning(args, console) if args.replan else []
    print_tables(result, console)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, default=str))
        console.print(f"results written to {args.json}", highlight=False)
    return result


if __name__ == "__main__":
    main()
