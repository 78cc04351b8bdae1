"""Benchmark the solver backends on placement-like pairwise problems.

    python benchmarks/solvers.py [--json out.json] [--repeats 3] [--sizes small,large]

Instances imitate the planner's problems: every state of a variable has a *layout* (one of a few
ways a tensor can be split); an edge costs 0 when the two layouts agree and an edge-scaled
transfer cost otherwise (some transfers are forbidden, +inf, like partial-sum targets); unary
costs are compute-like (a per-variable base time divided by a per-state speed-up); the graph is a
random sparse layered DAG (each variable takes inputs from the previous few layers).

Prints a table (median seconds over repeats, energy, bound, gap to the HiGHS optimum).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import solvers  # noqa: E402

SIZES = {  # name: (variables, states, edges)
    "small": (500, 20, 1_000),
    "large": (5_000, 30, 10_000),
}
N_LAYOUTS = 8  # distinct layouts (placement tuples of one tensor)
LAYER_WIDTH = 10  # variables per DAG layer
LOOKBACK = 3  # inputs come from up to this many previous layers
P_FORBIDDEN = 0.1  # fraction of layout transfers that are forbidden (like R -> P)


def placement_like(n_vars: int, n_states: int, n_edges: int, seed: int = 0) -> solvers.PairwiseProblem:
    rng = np.random.default_rng(seed)
    # state s of every variable has layout s % N_LAYOUTS (layout 0 = replicated); states sharing a
    # layout differ in their other choices, so in their compute cost
    layout = np.tile(np.arange(n_states) % N_LAYOUTS, (n_vars, 1))
    # transfer cost between layouts (µs per unit of edge size); 0 on the diagonal
    transfer = rng.uniform(0.5, 2.0, size=(N_LAYOUTS, N_LAYOUTS))
    np.fill_diagonal(transfer, 0.0)
    forbid = (rng.random((N_LAYOUTS, N_LAYOUTS)) < P_FORBIDDEN) & ~np.eye(N_LAYOUTS, dtype=bool)
    forbid[0, :] = False  # from replicated, everything is reachable
    forbid[:, 0] = False
    transfer[forbid] = np.inf
    base = rng.lognormal(mean=3.0, sigma=1.0, size=n_vars)  # µs of compute when replicated
    layout_speedup = np.array([1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0, 8.0])[:N_LAYOUTS]
    unary = base[:, None] / layout_speedup[layout] * rng.uniform(0.8, 1.25, size=(n_vars, n_states))
    # layered DAG
    layer = np.arange(n_vars) // LAYER_WIDTH
    per_var = max(1, round(n_edges / max(1, n_vars - LAYER_WIDTH)))
    pairs = set()
    for v in range(LAYER_WIDTH, n_vars):
        lo = max(0, (layer[v] - LOOKBACK) * LAYER_WIDTH)
        hi = layer[v] * LAYER_WIDTH
        for u in rng.integers(lo, hi, size=per_var):
            pairs.add((int(u), v))
    pairs = sorted(pairs)[:n_edges]
    size = rng.lognormal(mean=2.0, sigma=1.0, size=len(pairs))  # edge scale (tensor size)
    edges = []
    for (u, v), s in zip(pairs, size):
        edges.append((u, v, s * transfer[layout[u][:, None], layout[v][None, :]]))
    return solvers.PairwiseProblem(list(unary), edges)


def run(sizes: list[str], repeats: int, backends: list[str], highs_time_limit: float) -> list[dict]:
    rows = []
    for name in sizes:
        n, s, e = SIZES[name]
        t0 = time.perf_counter()
        prob = placement_like(n, s, e, seed=1)
        build_s = time.perf_counter() - t0
        ref = None
        for backend in backends:
            times, sol = [], None
            reps = repeats if backend != "highs" or name == "small" else 1
            opts = {"time_limit": highs_time_limit} if backend in ("highs", "cvxpy") else {}
            for _ in range(reps):
                sol = solvers.solve(prob, backend, **opts)
                times.append(sol.seconds)
            if backend == "highs":
                ref = sol
            rows.append({"instance": name, "vars": n, "states": s, "edges": prob.n_edges, "build_s": build_s,
                         "backend": backend, "seconds": statistics.median(times), "repeats": reps,
                         "energy": sol.energy, "bound": sol.lower_bound, "status": sol.status})
        for r in rows:
            if r["instance"] == name:
                r["gap_to_highs"] = None if ref is None else (r["energy"] - ref.energy) / abs(ref.energy)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--backends", default="highs,trws")
    ap.add_argument("--highs-time-limit", type=float, default=300.0)
    args = ap.parse_args(argv)
    rows = run(args.sizes.split(","), args.repeats, args.backends.split(","), args.highs_time_limit)
    from rich.console import Console
    from rich.table import Table

    table = Table(title="solvers on placement-like instances (median seconds over repeats)")
    for col in ("instance", "backend", "seconds", "energy", "bound", "gap to HiGHS", "status"):
        table.add_column(col, justify="right" if col not in ("instance", "backend", "status") else "left",
                         no_wrap=True)
    for r in rows:
        table.add_row(f"{r['instance']} {r['vars']}x{r['states']}, {r['edges']} edges", r["backend"],
                      f"{r['seconds']:.3f}", f"{r['energy']:.3f}",
                      "-" if r["bound"] is None else f"{r['bound']:.3f}",
                      "-" if r["gap_to_highs"] is None else f"{100 * r['gap_to_highs']:.4f}%", r["status"])
    Console(width=140).print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
