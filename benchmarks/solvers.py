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

The "redist" sizes price edges like redistributions instead (:func:`redistribution_like`: strategies
producing placements on a 2-D mesh, alpha-beta collectives per axis; few dominated states).
``--planner llama3-8b@8,llama3-8b@4x8`` adds the planner's own problems (built by apmodel, torch needed).

Prints a table (median seconds over interleaved repeats, the first run's seconds, energy, bound,
certified gap, gap to the HiGHS optimum) and the machine's load average. TRW-S's compiled kernels
are loaded before the timings, as apmodel's planner loads them in the background while it traces
(the seconds that took are in the title); ``--cold`` leaves them to TRW-S's first solve.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import solvers  # noqa: E402

SIZES = {  # name: (variables, states, edges); "planner" is built by planner_like (edges = compute nodes),
    # "redist-*" by redistribution_like, the others by placement_like
    "small": (500, 20, 1_000),
    "large": (5_000, 30, 10_000),
    "planner": (331, 36, 120),
    "redist-small": (500, 20, 1_000),
    "redist-large": (5_000, 30, 10_000),
}
N_LAYOUTS = 8  # distinct layouts (placement tuples of one tensor)
LAYER_WIDTH = 10  # variables per DAG layer
LOOKBACK = 3  # inputs come from up to this many previous layers
P_FORBIDDEN = 0.1  # fraction of layout transfers that are forbidden (like R -> P)


def _layered_pairs(rng: np.random.Generator, n_vars: int, n_edges: int, lookback: int) -> list[tuple[int, int]]:
    """Up to ``n_edges`` edges of a layered DAG (``LAYER_WIDTH`` variables a layer): every variable
    after the first layer takes inputs from the ``lookback`` layers before its own."""
    layer = np.arange(n_vars) // LAYER_WIDTH
    per_var = max(1, round(n_edges / max(1, n_vars - LAYER_WIDTH)))
    pairs = set()
    for v in range(LAYER_WIDTH, n_vars):
        lo = max(0, (layer[v] - lookback) * LAYER_WIDTH)
        for u in rng.integers(lo, layer[v] * LAYER_WIDTH, size=per_var):
            pairs.add((int(u), v))
    return sorted(pairs)[:n_edges]


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
    pairs = _layered_pairs(rng, n_vars, n_edges, LOOKBACK)
    size = rng.lognormal(mean=2.0, sigma=1.0, size=len(pairs))  # edge scale (tensor size)
    edges = []
    for (u, v), s in zip(pairs, size, strict=False):
        edges.append((u, v, s * transfer[layout[u][:, None], layout[v][None, :]]))
    return solvers.PairwiseProblem(list(unary), edges)


# redistribution-shaped instances: a tensor's state is one placement per mesh axis (R, P or S(d)), the
# edge cost the alpha-beta time of the per-axis collectives that turn one into the other
REDIST_MESH = (4, 8)  # axis 0 across nodes, axis 1 inside one (the planner's (4, 8) main job)
REDIST_GBPS = (50.0, 450.0)  # per-axis bus bandwidth, GB/s: 400 Gb/s NIC, NVLink 4 (H100 SXM)
REDIST_ALPHA_US = (10.0, 3.0)  # per-step latency of a collective on each axis, µs
REDIST_COMPUTE_US = 500.0  # median compute time of an op on one device
REDIST_BYTES = 4e6  # median tensor size (a 2048 x 1024 bf16 activation)
REDIST_RANK = 3  # tensor rank: per axis R, P, S(0..2), so 25 placement tuples
REDIST_LAYOUTS = 8  # output placements an op can produce among them
REDIST_SAME = 0.9  # probability that a strategy wants an input in its own output placement
REDIST_LOOKBACK = 1  # inputs from the previous layer only (chains with branches, like a network's graph)


def _axis_cost(a: str, b: str, n: int, nbytes: float, axis: int) -> float:
    """µs to turn per-axis placement ``a`` into ``b`` on an axis of ``n`` devices for a local tensor of
    ``nbytes`` (before this axis splits it): all-gather, reduce-scatter, all-reduce, all-to-all, free slice."""
    if a == b or (a == "R" and b.startswith("S")):
        return 0.0
    if b == "P":
        return np.inf  # nothing turns into a pending sum
    alpha, beta = REDIST_ALPHA_US[axis], 1e-3 / REDIST_GBPS[axis]  # µs per byte
    frac = (n - 1) / n
    if a == "P":  # all-reduce to R, reduce-scatter to S
        return 2 * (n - 1) * alpha + 2 * frac * nbytes * beta if b == "R" else (n - 1) * alpha + frac * nbytes * beta
    if b == "R":  # all-gather
        return (n - 1) * alpha + frac * nbytes * beta
    return (n - 1) * alpha + frac * nbytes * beta / n  # S(i) -> S(j): all-to-all


def _redistribution_table() -> tuple[list[tuple[str, str]], np.ndarray, np.ndarray]:
    """Placement tuples of a rank-``REDIST_RANK`` tensor on ``REDIST_MESH`` and, for every pair, the
    latency (µs) and per-byte (µs per byte of the whole tensor) parts of redistributing one into the other."""
    per_axis = ["R", "P"] + [f"S{d}" for d in range(REDIST_RANK)]
    tuples = [(a, b) for a in per_axis for b in per_axis]
    n_t = len(tuples)
    lat, per_byte = np.zeros((n_t, n_t)), np.zeros((n_t, n_t))
    for i, ta in enumerate(tuples):
        for j, tb in enumerate(tuples):
            for ax in range(2):
                other = REDIST_MESH[1 - ax] if ta[1 - ax].startswith("S") else 1  # the other axis's split
                c0 = _axis_cost(ta[ax], tb[ax], REDIST_MESH[ax], 0.0, ax)
                c1 = _axis_cost(ta[ax], tb[ax], REDIST_MESH[ax], 1.0, ax)
                lat[i, j] += c0
                per_byte[i, j] += (c1 - c0) / other if np.isfinite(c1) else np.inf
    return tuples, lat, per_byte


def redistribution_like(n_vars: int, n_states: int, n_edges: int, seed: int = 0) -> solvers.PairwiseProblem:
    """Placement problem priced like the planner's: strategies, placements on a 2-D mesh, collectives.

    A variable is an op with ``n_states`` strategies.  Each strategy produces its output in one of
    ``REDIST_LAYOUTS`` placement tuples the op can produce, and wants each input in a placement (its
    output's with probability ``REDIST_SAME``, as a matmul sharded on rows wants its input so, else any
    tuple); unary = compute time divided by the devices splitting the output (P counts: a split
    contraction) times a per-strategy factor; the edges a layered DAG (inputs from the previous layer),
    costing the alpha-beta time of the per-axis collectives (``_axis_cost``, summed over the axes)
    from the producer's output placement to the placement the consumer wants, for a tensor of
    lognormal size.  Rows repeat where strategies share an output placement (as in the planner).
    """
    rng = np.random.default_rng(seed)
    tuples, lat, per_byte = _redistribution_table()
    n_t = len(tuples)
    split = np.array([np.prod([REDIST_MESH[i] for i in range(2) if t[i] != "R"]) for t in tuples], dtype=float)
    out = []
    for _ in range(n_vars):
        layouts = rng.choice(n_t, size=REDIST_LAYOUTS, replace=False)
        out.append(layouts[rng.integers(0, REDIST_LAYOUTS, size=n_states)])
    base = rng.lognormal(mean=np.log(REDIST_COMPUTE_US), sigma=1.0, size=n_vars)  # µs of compute on one device
    unary = [base[v] / split[out[v]] * rng.uniform(0.8, 1.25, size=n_states) for v in range(n_vars)]
    pairs = _layered_pairs(rng, n_vars, n_edges, REDIST_LOOKBACK)
    sizes = rng.lognormal(mean=np.log(REDIST_BYTES), sigma=1.0, size=len(pairs))  # bytes of the whole tensor
    edges = []
    for (u, v), nb in zip(pairs, sizes, strict=False):
        want = np.where(rng.random(n_states) < REDIST_SAME, out[v], rng.integers(0, n_t, size=n_states))
        edges.append((u, v, lat[out[u][:, None], want[None, :]] + nb * per_byte[out[u][:, None], want[None, :]]))
    return solvers.PairwiseProblem(unary, edges)


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
    for _ in range(n_compute):
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


SLOW_REPEAT_S = 10.0  # a backend whose first run took longer is not repeated (its one time is its median)


def planner_problem(model: str, mesh: tuple[int, ...]) -> solvers.PairwiseProblem:
    """The planner's own problem for a preset on a mesh (seq 2048, batch 8, H100 cost model, 8 GPUs a
    node, default options: what ``apmodel plan`` solves); imports torch and apmodel."""
    import torch

    from apmodel import models
    from apmodel.entry.api import build_model
    from apmodel.graph.capture import capture

    cfg = models.config(model, max_seq_len=max(2048, models.config(model).max_seq_len))
    with torch.device("meta"):
        module = models.build(cfg)
    captured = capture(module, models.sample_inputs(cfg, batch=8, seq=2048))
    return build_model(captured, mesh, device="h100", gpus_per_node=8).compile()


def _instance(name: str, path: Path | None) -> solvers.PairwiseProblem:
    if path is not None:
        return load_npz(path)
    if "@" in name:  # model@mesh: the planner's own problem
        model, mesh = name.split("@")
        return planner_problem(model, tuple(int(x) for x in mesh.split("x")))
    if name == "planner":
        return planner_like(*SIZES[name], seed=1)
    if name.startswith("redist"):
        return redistribution_like(*SIZES[name], seed=1)
    return placement_like(*SIZES[name], seed=1)


def run(sizes: list[str], repeats: int, backends: list[str], highs_time_limit: float,
        npz: list[Path] = (), reduce: bool = True) -> list[dict]:
    """One row per instance and backend: median seconds over ``repeats`` runs, the backends taking
    turns run by run (interleaved, so a change of the machine's load hits every backend alike);
    ``first_s`` is the first run's seconds (it includes one-time costs such as numba's loading)."""
    rows = []
    cases = [(name, None) for name in sizes] + [(path.stem, path) for path in npz]
    for name, path in cases:
        t0 = time.perf_counter()
        prob = _instance(name, path)
        n, s = prob.n_vars, int(prob.n_states.max())
        build_s = time.perf_counter() - t0
        times: dict[str, list[float]] = {spec: [] for spec in backends}
        sols: dict[str, solvers.Solution] = {}
        for rep in range(repeats):
            for spec in backends:
                if rep and times[spec][0] > SLOW_REPEAT_S:
                    continue
                backend, extra = parse_backend(spec)
                opts = {"time_limit": highs_time_limit} if backend in ("highs", "cvxpy") else {}
                opts["reduce"] = reduce
                opts.update(extra)
                sols[spec] = solvers.solve(prob, backend, **opts)
                times[spec].append(sols[spec].seconds)
        ref = sols.get("highs")
        for spec in backends:
            sol = sols[spec]
            rows.append({"instance": name, "vars": n, "states": s, "edges": prob.n_edges, "build_s": build_s,
                         "backend": spec, "seconds": statistics.median(times[spec]), "first_s": times[spec][0],
                         "repeats": len(times[spec]), "energy": sol.energy, "bound": sol.lower_bound,
                         "certified_gap": sol.gap, "status": sol.status,
                         "gap_to_highs": None if ref is None else (sol.energy - ref.energy) / abs(ref.energy)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="small,large,planner,redist-small,redist-large",
                    help="synthetic sizes ('' for none)")
    ap.add_argument("--planner", default="",
                    help="the planner's own problems, model@mesh comma-separated, e.g. llama3-8b@8,llama3-8b@4x8")
    ap.add_argument("--npz", type=Path, nargs="*", default=[], help="saved planner problems (.npz) to add")
    ap.add_argument("--backends", default="highs,trws,trws:kernel=numpy",
                    help="comma-separated; options after a colon, ';'-separated: trws:polish=false;max_iter=50")
    ap.add_argument("--no-reduce", action="store_true", help="skip the exact reductions (solvers.reduce)")
    ap.add_argument("--highs-time-limit", type=float, default=300.0)
    ap.add_argument("--cold", action="store_true",
                    help="leave TRW-S's compiled kernels unloaded (its first solve in the process loads numba); by "
                         "default they are loaded first, as the planner loads them while it traces")
    args = ap.parse_args(argv)
    sizes = [x for x in args.sizes.split(",") if x]
    unknown = [x for x in sizes if x not in SIZES]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {sorted(SIZES)}")
    planner = [x for x in args.planner.split(",") if x]
    bad = [x for x in planner if x.count("@") != 1]
    if bad:
        ap.error(f"--planner: {bad} is not model@mesh (e.g. llama3-8b@4x8)")
    sizes += planner
    warm_up_s = None
    if not args.cold:  # as apmodel's planner runs TRW-S: kernels loaded in the background while it traces
        t0 = time.perf_counter()
        thread = solvers.warm_up_in_background()
        if thread is not None:
            thread.join()
            warm_up_s = time.perf_counter() - t0
    rows = run(sizes, args.repeats, args.backends.split(","), args.highs_time_limit, args.npz, not args.no_reduce)
    for r in rows:
        r["kernels_loaded_first_s"] = warm_up_s
    from rich.console import Console
    from rich.table import Table

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    loaded = ("TRW-S kernels cold" if warm_up_s is None else
              f"TRW-S kernels loaded first, as the planner does while tracing ({warm_up_s:.2f} s)")
    table = Table(title=f"solvers on placement-like instances (median seconds over interleaved repeats; {loaded}; "
                        f"load average {load:.1f} at the end, {os.cpu_count()} CPUs)")
    for col in ("instance", "backend", "seconds", "first s", "energy", "bound", "certified gap", "gap to HiGHS",
                "status"):
        table.add_column(col, justify="right" if col not in ("instance", "backend", "status") else "left",
                         no_wrap=True)
    for r in rows:
        table.add_row(f"{r['instance']} {r['vars']}x{r['states']}, {r['edges']} edges", r["backend"],
                      f"{r['seconds']:.3f}", f"{r['first_s']:.3f}", f"{r['energy']:.3f}",
                      "-" if r["bound"] is None else f"{r['bound']:.3f}",
                      "-" if r["certified_gap"] is None else f"{100 * r['certified_gap']:.4f}%",
                      "-" if r["gap_to_highs"] is None else f"{100 * r['gap_to_highs']:.4f}%", r["status"])
    Console(width=170).print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
