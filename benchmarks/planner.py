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

Table 3 (frontier, issue 27): the planning targets at scale, each planned end to end as a user
runs it (``python -m apmodel.cli plan ... --json``, default options, memory model on) in its own
child process, so that the planner's peak resident memory is that child's own: the high-water
mark of its address space since ``exec`` (``VmHWM`` of ``/proc/self/status``, which the child
writes to stderr as it exits; ``ru_maxrss`` from ``os.wait4`` where there is no ``/proc``, which on
Linux keeps the forking parent's high-water mark across ``exec``: after Table 1 and 2 built their
problems in the parent, a frontier child of LLaMA-3 8B read 6.6 GiB that way). Columns: trace, build, solve and total seconds as the CLI reports them, the
target beside them, peak RSS, objective, certified gap, the plan's peak memory per device beside
80 GB, and which targets pass. The table's title names the machine's load average at the start and
end of the run (``os.getloadavg``). Run by default: its seven plans are a few minutes together
(estimated from single runs, not measured as one: 405B about 40 s, DeepSeek-V3 45-70 s, the
unseeded 4-D 8B about 60 s, llama3-8b-cp about 40 s, the rest under 20 s each, plus 10-15 s of
interpreter start per child; more on a loaded machine), short beside Table 1. ``--frontier-only``
runs it alone, ``--frontier NAME,...`` picks workloads (``--frontier ''`` or ``--no-frontier``:
none) and ``--frontier-layers N`` shortens every model for a quick check (the targets then do not
apply)::

    python benchmarks/planner.py --frontier-only --json frontier.json      # the issue-27 table
    python benchmarks/planner.py --frontier-only --frontier qwen3-32b --frontier-layers 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import solvers  # noqa: E402
from apmodel import models  # noqa: E402
from apmodel.core.options import PlanOptions  # noqa: E402
from apmodel.entry.api import (  # noqa: E402
    build_model,
    plan_workload,
    replay_constraints,
    solve_model,
)
from apmodel.frontend.workloads import load_workload, parse_mesh  # noqa: E402
from apmodel.graph.capture import capture  # noqa: E402
from apmodel.problem.placement_model import ConstraintConflict  # noqa: E402

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
        entries = sum(len(g) * g.shape[0] * g.shape[1] for g in problem.groups)  # dense pairs, never spread
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
                   "serial_solve_us": found.solver.get("energy_us"),
                   "status": found.solver.get("status"), "nodes": found.sizes["nodes"],
                   "peak_bytes": found.memory.get("peak_bytes")}
            bound, serial = row["lower_bound_us"], row["serial_solve_us"]  # the bound certifies the serial solve
            row["gap"] = None if bound is None or not math.isfinite(bound) or not serial else (serial - bound) / serial
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


#: Issue 27's "plans fit in 80 GB per device" (an H100 SXM's HBM, as the issue states it, in GB).
FRONTIER_DEVICE_MEMORY_BYTES = 80e9
#: Issue 27: "peak resident memory of the planner <= 4 GiB" (405B and DeepSeek-V3).
FRONTIER_MAX_RSS_GIB = 4.0
#: Issue 27: "(2,2,2,4) <= 30 s at the unseeded optimum (certified gap <= 0.01%)".
FRONTIER_MAX_GAP = 1e-4
#: Linux reports ``ru_maxrss`` in KiB (getrusage(2)).
RU_MAXRSS_BYTES = 1024
#: Wall-clock cap of one frontier plan (a hung child is killed and reported, not waited on forever).
DEFAULT_FRONTIER_TIMEOUT_S = 1800.0
#: Tag of the line a frontier child writes to stderr as it exits: its peak resident bytes.
PEAK_TAG = "apmodel-benchmark-peak-rss-bytes"
#: A frontier child: ``apmodel``'s CLI with these arguments, writing the high-water mark of its
#: own address space (``VmHWM``, reset by ``exec``) to stderr as it exits.
PEAK_REPORTING_CLI = f"""
import atexit, sys

def report_peak():
    try:
        with open("/proc/self/status") as status:
            kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return
    sys.stderr.write("\\n{PEAK_TAG} %d\\n" % (kib * 1024))

atexit.register(report_peak)
from apmodel.cli import main
sys.argv = ["apmodel", *sys.argv[1:]]
main()
"""
#: How often the parent checks whether a frontier child has finished.
FRONTIER_POLL_S = 0.1
#: Characters the frontier table is printed in at least (its sixteen columns, unwrapped).
FRONTIER_TABLE_WIDTH = 200


@dataclass(frozen=True)
class FrontierWorkload:
    """One planning target of issue 27: an ``apmodel plan`` command line and the limits it is held
    to (``None``: reported for information only)."""

    name: str
    model: str
    mesh: str
    flags: tuple[str, ...] = ()
    target_s: float | None = None
    max_rss_gib: float | None = None
    must_fit: bool = False
    max_gap: float | None = None
    note: str = ""

    def command(self, device: str, gpus_per_node: int, layers: int | None) -> list[str]:
        cmd = [sys.executable, "-c", PEAK_REPORTING_CLI, "plan", "--model", self.model, "--mesh", self.mesh,
               "--device", device, "--gpus-per-node", str(gpus_per_node), *self.flags, "--json"]
        if layers is not None:
            cmd += ["--layers", str(layers)]
        return cmd


#: The workloads of issue 27's "Planning at scale" (item 2), with its limits; Qwen3 for information.
FRONTIER_WORKLOADS: tuple[FrontierWorkload, ...] = (
    FrontierWorkload("llama3-8b", "llama3-8b", "4x8", ("--seq", "2048", "--batch", "8"), target_s=2.5,
                     note="defaults"),
    FrontierWorkload("llama3-8b-unseeded", "llama3-8b", "2x2x2x4", ("--seq", "2048", "--batch", "8", "--no-seeding"),
                     target_s=30.0, max_gap=FRONTIER_MAX_GAP, note="unseeded optimum"),
    FrontierWorkload("llama3-405b", "llama3-405b", "8x8x16", ("--seq", "8192", "--batch", "128", "--ac", "full"),
                     target_s=60.0, max_rss_gib=FRONTIER_MAX_RSS_GIB, must_fit=True),
    FrontierWorkload("deepseek-v3", "deepseek-v3", "8x8x8", ("--seq", "4096", "--batch", "64"),
                     target_s=60.0, max_rss_gib=FRONTIER_MAX_RSS_GIB, must_fit=True),
    FrontierWorkload("qwen3-235b-a22b", "qwen3-235b-a22b", "8x8x8", ("--seq", "4096", "--batch", "64"),
                     note="information"),
    FrontierWorkload("qwen3-32b", "qwen3-32b", "8x8", ("--seq", "4096", "--batch", "32"), note="information"),
    FrontierWorkload("llama3-8b-cp", "llama3-8b-cp", "2x2x2x4", ("--seq", "32768", "--batch", "4", "--ac", "selective"),
                     target_s=30.0),
)
FRONTIER_NAMES = tuple(w.name for w in FRONTIER_WORKLOADS)


@dataclass
class ChildRun:
    """A finished child process: exit code, wall seconds, peak resident bytes, its stdout and stderr."""

    returncode: int
    wall_s: float
    maxrss_bytes: int
    stdout: str
    stderr: str
    timed_out: bool = False


def run_child(cmd: list[str], timeout_s: float, cwd: Path | None = None) -> ChildRun:
    """Run ``cmd`` to completion: its peak resident bytes are the ones it reports on stderr
    (``PEAK_TAG``, see :data:`PEAK_REPORTING_CLI`), else its ``ru_maxrss`` from ``os.wait4`` (that
    child's alone, not earlier children's as ``RUSAGE_CHILDREN`` would mix in, but on Linux at
    least the parent's high-water mark when it forked). Output goes to files, so a large JSON
    cannot block the child on a full pipe."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd or root, env=env)
        deadline = t0 + timeout_s
        timed_out = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid == proc.pid:
                break
            if time.perf_counter() > deadline:
                timed_out = True
                proc.kill()
                _pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(FRONTIER_POLL_S)
        wall_s = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
        reported = [line.split()[1] for line in stderr.splitlines() if line.startswith(PEAK_TAG + " ")]
        maxrss = int(reported[-1]) if reported else usage.ru_maxrss * RU_MAXRSS_BYTES
        return ChildRun(returncode=proc.returncode, wall_s=wall_s, maxrss_bytes=maxrss,
                        stdout=out.read().decode(errors="replace"), stderr=stderr, timed_out=timed_out)


def _plan_json(stdout: str) -> dict[str, Any]:
    """The plan's JSON object on the child's stdout (anything printed before it is skipped)."""
    start = stdout.find("{")
    if start < 0:
        raise ValueError("no JSON object on stdout")
    obj, _end = json.JSONDecoder().raw_decode(stdout[start:])
    return obj


def frontier_row(workload: FrontierWorkload, run: ChildRun, layers: int | None) -> dict[str, Any]:
    """One table/JSON row from a finished ``apmodel plan --json`` child, with its checks."""
    row: dict[str, Any] = {
        "name": workload.name, "model": workload.model, "mesh": workload.mesh, "flags": list(workload.flags),
        "note": workload.note, "layers": layers, "gpus": math.prod(int(a) for a in workload.mesh.split("x")),
        "wall_s": run.wall_s, "returncode": run.returncode, "timed_out": run.timed_out,
        "peak_rss_bytes": run.maxrss_bytes, "peak_rss_gib": run.maxrss_bytes / 2**30,
        "target_s": workload.target_s, "max_rss_gib": workload.max_rss_gib, "max_gap": workload.max_gap,
        "device_memory_bytes": FRONTIER_DEVICE_MEMORY_BYTES if workload.must_fit else None,
    }
    plan: dict[str, Any] | None = None
    if run.returncode == 0 and not run.timed_out:
        try:
            plan = _plan_json(run.stdout)
        except ValueError as e:
            row["error"] = f"unreadable JSON: {e}"
    else:
        tail = run.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        row["error"] = ("timed out after %.0f s" % run.wall_s) if run.timed_out else f"exit {run.returncode}: {tail[0][:200]}"
    memory = (plan or {}).get("memory") or {}
    row.update({
        "nodes": None if plan is None else plan.get("nodes"),
        **{k: None if plan is None else plan.get(k) for k in ("trace_s", "build_s", "solve_s", "total_s")},
        "objective_us": None if plan is None else plan.get("objective_us"),
        "lower_bound_us": None if plan is None else plan.get("serial_lower_bound_us", plan.get("lower_bound_us")),
        "serial_solve_us": None if plan is None else plan.get("serial_solve_us", plan.get("objective_us")),
        "status": "error" if plan is None else plan.get("status"),
        "peak_bytes": memory.get("peak_bytes"), "memory": memory,
        "memory_limit_bytes": None if plan is None else plan.get("memory_limit_bytes"),
        "emerged": None if plan is None else plan.get("emerged"),
        "warnings": [] if plan is None else plan.get("warnings") or [],
    })
    obj, bound = row["serial_solve_us"], row["lower_bound_us"]  # the certificate is of the serial solve
    row["gap"] = (None if obj is None or bound is None or not math.isfinite(bound) or obj == 0
                  else (obj - bound) / obj)
    checks: dict[str, bool] = {}
    if workload.target_s is not None:
        checks["time"] = row["total_s"] is not None and row["total_s"] <= workload.target_s
    if workload.max_rss_gib is not None:
        checks["rss"] = plan is not None and row["peak_rss_gib"] <= workload.max_rss_gib
    if workload.must_fit:
        checks["fit"] = row["peak_bytes"] is not None and row["peak_bytes"] <= FRONTIER_DEVICE_MEMORY_BYTES
    if workload.max_gap is not None:
        checks["gap"] = row["gap"] is not None and row["gap"] <= workload.max_gap
    row["checks"] = checks
    row["passed"] = None if not checks else (plan is not None and all(checks.values()))
    return row


def frontier(args, console: Console) -> list[dict[str, Any]]:
    """Each selected frontier workload planned by the CLI in a child process of its own."""
    rows: list[dict[str, Any]] = []
    by_name = {w.name: w for w in FRONTIER_WORKLOADS}
    for name in args.frontier:
        workload = by_name[name]
        cmd = workload.command(args.device, args.gpus_per_node, args.frontier_layers)
        logger.info("frontier %s: %s", name, " ".join(cmd[1:]))
        load_before = os.getloadavg()
        run = run_child(cmd, args.frontier_timeout)
        row = frontier_row(workload, run, args.frontier_layers)
        row["command"] = " ".join(["python", *cmd[1:]])
        row["load_before"] = list(load_before)
        rows.append(row)
        if "error" in row:
            logger.warning("frontier %s failed: %s\n%s", name, row["error"], run.stderr[-2000:])
        verdict = {None: "information", True: "pass", False: "FAIL"}[row["passed"]]
        if args.frontier_layers is not None:
            verdict += f" ({args.frontier_layers} layers: not the target)"
        console.print(f"  frontier {name} on {workload.mesh}: "
                      + (row["error"] if "error" in row else
                         f"{row['objective_us']:,.1f} µs in {row['total_s']:.1f} s (trace {row['trace_s']:.1f}, "
                         f"build {row['build_s']:.1f}, solve {row['solve_s']:.1f}), peak RSS "
                         f"{row['peak_rss_gib']:.2f} GiB")
                      + f": {verdict}", highlight=False)
    return rows


def _load_str(load: list[float] | tuple[float, ...] | None) -> str:
    return "—" if load is None else "/".join(f"{x:.2f}" for x in load)


def print_frontier(result: dict[str, Any], console: Console) -> None:
    a = result["args"]
    load = result.get("load_average", {})
    layers = a.get("frontier_layers")
    t = Table(title=f"Frontier (issue 27): apmodel plan per workload in its own process, {a['device']}, "
                    f"{a['gpus_per_node']} GPUs per node"
                    + (f", {layers} layers (quick check: the targets do not apply)" if layers else "")
                    + f"; load average (1/5/15 min) {_load_str(load.get('start'))} at start, "
                    f"{_load_str(load.get('end'))} at end, {result.get('cpus')} CPUs", title_justify="left")
    left = ("workload", "mesh", "result")
    # the limits sit right of the values they bound: "≤ s" (total seconds), "≤ GiB" (planner RSS),
    # "≤ GB" (the plan's peak memory per device)
    for col in ("workload", "mesh", "GPUs", "nodes", "trace s", "build s", "solve s", "total s", "≤ s",
                "RSS GiB", "≤ GiB", "objective µs", "gap", "peak GB", "≤ GB", "result"):
        t.add_column(col, justify="left" if col in left else "right", no_wrap=True)
    for r in result["frontier"]:
        checks = r["checks"]
        failed = [k for k, ok in checks.items() if not ok]
        verdict = ("error" if "error" in r else "info" if not checks
                   else "pass" if not failed else "FAIL: " + ", ".join(failed))
        if layers is not None:
            verdict = f"({verdict})"  # a shortened model: the targets do not apply
        t.add_row(r["name"], r["mesh"], f"{r['gpus']:,}", _f(r["nodes"], ","), _f(r["trace_s"]), _f(r["build_s"]),
                  _f(r["solve_s"]), _f(r["total_s"]), _f(r["target_s"], "g"),
                  _f(r["peak_rss_gib"], ".2f"), _f(r["max_rss_gib"], "g"), _f(r["objective_us"]),
                  "—" if r["gap"] is None else f"{100 * r['gap']:.3f}%",
                  _f(None if r["peak_bytes"] is None else r["peak_bytes"] / 1e9, ".1f"),
                  _f(None if r["device_memory_bytes"] is None else r["device_memory_bytes"] / 1e9, "g"), verdict)
    # sixteen columns: never truncated to a narrow terminal's width (the table is pasted as is)
    saved = console.width
    console.width = max(saved, FRONTIER_TABLE_WIDTH)
    try:
        console.print(t)
    finally:
        console.width = saved


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
    if result.get("frontier"):
        print_frontier(result, console)


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
    p.add_argument("--frontier", default=",".join(FRONTIER_NAMES),
                   help=f"comma-separated frontier workloads (issue 27's targets; '' for none): {', '.join(FRONTIER_NAMES)}")
    p.add_argument("--no-frontier", dest="frontier", action="store_const", const="", help="skip the frontier table")
    p.add_argument("--frontier-only", action="store_true",
                   help="only the frontier table (no end-to-end, scalability or replanning tables)")
    p.add_argument("--frontier-layers", type=int, default=None,
                   help="override n_layers of every frontier model (quick check; the targets then do not apply)")
    p.add_argument("--frontier-timeout", type=float, default=DEFAULT_FRONTIER_TIMEOUT_S,
                   help=f"seconds before a frontier plan is killed (default {DEFAULT_FRONTIER_TIMEOUT_S:g})")
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
    args.frontier = [w for w in args.frontier.split(",") if w]
    unknown = [w for w in args.frontier if w not in FRONTIER_NAMES]
    if unknown:
        p.error(f"frontier workloads {unknown} are not among {list(FRONTIER_NAMES)}")
    if args.frontier_only:
        if not args.frontier:
            p.error("--frontier-only with no frontier workloads selected")
        args.e2e_meshes, args.scalability, args.replan = [], False, False
    unknown = [v for v in args.e2e_variants if v not in E2E_VARIANTS]
    if unknown:
        p.error(f"end-to-end variants {unknown} are not among {list(E2E_VARIANTS)}")
    console = Console(width=160) if not Console().is_terminal else Console()
    load_start = os.getloadavg()
    result: dict[str, Any] = {
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "json"},
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    result["args"]["meshes"] = [list(m) for m in args.meshes]
    result["args"]["replan_mesh"] = "x".join(map(str, args.replan_mesh))
    result["args"]["e2e_meshes"] = [list(m) for m in args.e2e_meshes]
    result["end_to_end"] = end_to_end(args, console)
    result["scalability"] = scalability(args, console) if args.scalability else []
    result["replanning"] = replanning(args, console) if args.replan else []
    result["frontier"] = frontier(args, console)
    result["load_average"] = {"start": list(load_start), "end": list(os.getloadavg())}
    print_tables(result, console)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, default=str))
        console.print(f"results written to {args.json}", highlight=False)
    return result


if __name__ == "__main__":
    main()
