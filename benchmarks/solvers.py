"""Benchmark the solver backends on placement-like pairwise problems.

    python benchmarks/solvers.py [--json out.json] [--repeats 3] [--sizes small,large,planner]
    python benchmarks/solvers.py --npz saved/*.npz      # planner problems saved as .npz (see load_npz)
    python benchmarks/solvers.py --backends trws:polish=false,trws,highs   # backend options after a colon

Instances imitate the planner's problems: every state of a variable has a *layout* (one of a few
ways a tensor can be split); an edge costs 0 when the two layouts agree and an edge-scaled
transfer cost otherwise (some transfers are forbidden, +inf, like partial-sum targets); unary
costs are compute-like (a per-variable base time divided by a per-state speed-up); the graph is a
random sparse layered DAG (each variable takes inputs from the previous few layers).

The "planner" size imitates the structure of the planner's real problems instead: chains of
*follower* variables (views / transposes: degree 2, free on a permutation of the producer's
states, a transfer cost otherwise) between compute variables, fixed single-state boundary
variables and forbidden states, which the exact reductions of ``solvers.reduce`` remove.  Real
instances can be read with ``--npz`` (keys ``u0..u{n-1}`` unary vectors, ``e0..e{m-1}`` edge
matrices, ``edge_uv`` (m, 2) endpoints, ``n_vars``).

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

SIZES = {  # name: (variables, states, edges); "planner" is built by planner_like (edges = compute nodes)
    "small": (500, 20, 1_000),
    "large": (5_000, 30, 10_000),
    "planner": (331, 36, 120),
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


FOLLOWERS = (0, 3)  # views / transposes between two compute nodes (inclusive range)
P_FIXED = 0.04  # fraction of single-state (fixed) boundary variables


def planner_like(n_vars: int, n_states: int, n_compute: int, seed: int = 0) -> solvers.PairwiseProblem:
    """Planner-structured instance (see the module docstring); about ``n_vars`` variables."""
    rng = np.random.default_rng(seed)
    transfer = rng.uniform(0.5, 2.0, size=(N_LAYOUTS, N_LAYOUTS))
    np.fill_diagonal(transfer, 0.0)
    speedup = np.array([1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0, 8.0])[:N_LAYOUTS]
    unary, layouts, edges = [], [], []

    def add(k: int, base: float) -> int:
        lay = rng.integers(0, N_LAYOUTS, size=k)
        lay[0] = 0
        u = base / speedup[lay] * rng.uniform(0.8, 1.25, size=k)
        u[rng.random(k) < 0.05] = np.inf
        u[0] = base  # replicated is always allowed
        unary.append(u)
        layouts.append(lay)
        return len(unary) - 1

    compute = []
    per_chain = max(1, (n_vars - n_compute) // max(1, n_compute))
    for c in range(n_compute):
        k = 1 if rng.random() < P_FIXED else int(rng.integers(max(2, n_states // 4), n_states + 1))
        v = add(k, float(rng.lognormal(3.0, 1.0)))
        srcs = [int(s) for s in rng.choice(compute[-4:], size=min(len(compute[-4:]), 2), replace=False)] if compute else []
        for s in srcs:
            prev = s
            for _ in range(int(rng.integers(FOLLOWERS[0], min(FOLLOWERS[1], per_chain) + 1))):
                f = add(len(unary[prev]), 0.0)  # follower: same states as its producer, no compute
                layouts[f] = layouts[prev].copy()
                unary[f] = np.zeros(len(unary[prev]))
                size = float(rng.lognormal(2.0, 1.0))
                m = size * transfer[layouts[prev][:, None], layouts[f][None, :]]
                m[np.arange(len(unary[f])), np.arange(len(unary[f]))] = 0.0
                edges.append((prev, f, m))
                prev = f
            size = float(rng.lognormal(2.0, 1.0))
            edges.append((prev, v, size * transfer[layouts[prev][:, None], layouts[v][None, :]]))
        compute.append(v)
    return solvers.PairwiseProblem(unary, edges)


def load_npz(path: Path) -> solvers.PairwiseProblem:
    """A problem saved as .npz (keys in the module docstring)."""
    z = np.load(path)
    for key in ("n_vars", "edge_uv"):
        if key not in z:
            raise ValueError(f"{path}: missing field {key!r}")
    n = int(z["n_vars"])
    uv = np.asarray(z["edge_uv"], dtype=np.int64).reshape(-1, 2)
    return solvers.PairwiseProblem([z[f"u{i}"] for i in range(n)],
                                   [(int(uv[k, 0]), int(uv[k, 1]), z[f"e{k}"]) for k in range(len(uv))])


def parse_backend(spec: str) -> tuple[str, dict]:
    """``"trws:polish=false,max_iter=50"`` -> ``("trws", {"polish": False, "max_iter": 50})`` (values as JSON
    where they parse, else strings)."""
    name, _, rest = spec.partition(":")
    opts = {}
    for item in filter(None, rest.split(";")):
        key, _, value = item.partition("=")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    return name, opts


def run(sizes: list[str], repeats: int, backends: list[str], highs_time_limit: float,
        npz: list[Path] = (), reduce: bool = True) -> list[dict]:
    rows = []
    cases = [(name, None) for name in sizes] + [(path.stem, path) for path in npz]
    for name, path in cases:
        t0 = time.perf_counter()
        if path is not None:
            prob = load_npz(path)
        elif name == "planner":
            prob = planner_like(*SIZES[name], seed=1)
        else:
            prob = placement_like(*SIZES[name], seed=1)
        n, s = prob.n_vars, int(prob.n_states.max())
        build_s = time.perf_counter() - t0
        ref = None
        for spec in backends:
            backend, extra = parse_backend(spec)
            times, sol = [], None
            reps = repeats if backend != "highs" or name == "small" else 1
            opts = {"time_limit": highs_time_limit} if backend in ("highs", "cvxpy") else {}
            opts["reduce"] = reduce
            opts.update(extra)
            for _ in range(reps):
                sol = solvers.solve(prob, backend, **opts)
                times.append(sol.seconds)
            if spec == "highs":
                ref = sol
            rows.append({"instance": name, "vars": n, "states": s, "edges": prob.n_edges, "build_s": build_s,
                         "backend": spec, "seconds": statistics.median(times), "repeats": reps,
                         "energy": sol.energy, "bound": sol.lower_bound, "status": sol.status})
        for r in rows:
            if r["instance"] == name:
                r["gap_to_highs"] = None if ref is None else (r["energy"] - ref.energy) / abs(ref.energy)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="small,large,planner", help="synthetic sizes ('' for none)")
    ap.add_argument("--npz", type=Path, nargs="*", default=[], help="saved planner problems (.npz) to add")
    ap.add_argument("--backends", default="highs,trws",
                    help="comma-separated; options after a colon, ';'-separated: trws:polish=false;max_iter=50")
    ap.add_argument("--no-reduce", action="store_true", help="skip the exact reductions (solvers.reduce)")
    ap.add_argument("--highs-time-limit", type=float, default=300.0)
    args = ap.parse_args(argv)
    sizes = [x for x in args.sizes.split(",") if x]
    unknown = [x for x in sizes if x not in SIZES]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {sorted(SIZES)}")
    rows = run(sizes, args.repeats, args.backends.split(","), args.highs_time_limit, args.npz, not args.no_reduce)
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
