"""The AutoParallel paper's candidate plans for LLaMA-3 8B (Table 6) solved with apmodel.

    python benchmarks/paper_plans.py                          # the paper's setup: mesh 4x8, seq 8192
    python benchmarks/paper_plans.py --seq 512 --layers 2     # quick
    python benchmarks/paper_plans.py --json plans.json        # also a JSON list, one object a plan

``benchmarks/data/paper_table6_plans.json`` (its ``source``: the paper's Table 6) writes each plan
as the forward output placement of each projection on the 3-D activation ``[batch, seq, feature]``,
one entry per mesh axis (``S0`` batch, ``S1`` sequence, ``S2`` feature, ``P`` partial, ``R``).
``p00`` is solved unconstrained; every other plan with the outputs it lists fixed
(``apmodel.fix_output``, on every layer), or with ``--differing`` only those that differ from
``p00``'s (how the paper made them). Linear layers are kept 3-D at capture
(``apmodel/graph/linear3d.py``), so every placement of the table is a placement of the graph and no
two plans collapse to one constraint set (asserted). Per plan the table shows the objective (the
step with overlap), compute, communication by collective (summed over mesh axes), peak memory per
device, and whether every fixed output held in the solved plan.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

# This folder has a costmodels.py; make sure "import costmodels" finds the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from apmodel.core import placements as pl  # noqa: E402
from apmodel.core.options import PlanOptions  # noqa: E402
from apmodel.entry.api import plan_workload  # noqa: E402
from apmodel.frontend.workloads import load_workload, parse_mesh  # noqa: E402
from apmodel.problem.constraints import fix_output, module_output_nodes  # noqa: E402

logger = logging.getLogger("paper_plans")
DATA = _HERE / "data" / "paper_table6_plans.json"
#: The table's projection names -> the LLaMA preset's module paths (every layer).
PROJECTIONS = {
    "Wqkv": ("layers.*.attention.wq", "layers.*.attention.wk", "layers.*.attention.wv"),
    "Wo": ("layers.*.attention.wo",),
    "W1/3": ("layers.*.feed_forward.w1", "layers.*.feed_forward.w3"),
    "W2": ("layers.*.feed_forward.w2",),
}
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def constraint_sets(plans: list[dict[str, Any]], mesh_axes: int, differing: bool) -> dict[str, dict[str, tuple]]:
    """Per plan: module glob -> the placement strings its output is fixed to (none for ``p00``)."""
    base = plans[0]["outputs"]
    out: dict[str, dict[str, tuple]] = {}
    for entry in plans:
        fixes: dict[str, tuple] = {}
        if entry["plan"] != plans[0]["plan"]:
            for proj, placement in entry["outputs"].items():
                if differing and placement == base[proj]:
                    continue
                want = pl.parse_notation(placement, mesh_axes)
                fixes.update({glob: want for glob in PROJECTIONS[proj]})
        out[entry["plan"]] = fixes
    sets = [frozenset(f.items()) for f in out.values()]
    assert len(set(sets)) == len(sets), "two plans of the table collapse to the same constraint set"
    return out


def _held(plan: Any, fixes: dict[str, tuple]) -> bool:
    """Whether the output of every fixed module is placed as fixed in the solved plan."""
    for glob, want in fixes.items():
        for node in module_output_nodes(plan.model, glob).values():
            if tuple(pl.to_str(p) for p in plan.node_strategy[node].outputs[0]) != want:
                return False
    return True


def _notation(placements: tuple) -> str:
    """``(Shard(0), Partial())`` -> ``"S0,P"`` (the table's notation)."""
    return ",".join(pl.to_str(p).replace("(", "").replace(")", "") for p in placements)


def solved_outputs(plan: Any) -> dict[str, str]:
    """The table's projections as the solved plan places them (the first layer's, first module's)."""
    out = {}
    for proj, globs in PROJECTIONS.items():
        nodes = module_output_nodes(plan.model, globs[0])
        out[proj] = _notation(plan.node_strategy[next(iter(nodes.values()))].outputs[0])
    return out


def _by_collective(plan: Any) -> dict[str, float]:
    sums = dict.fromkeys(COLLECTIVES, 0.0)
    for key, us in plan.comm_by_collective.items():
        kind = key.split("@", 1)[0].split(" (", 1)[0]
        sums[kind] = sums.get(kind, 0.0) + float(us)
    return sums


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    table = json.loads(DATA.read_text())
    mesh = parse_mesh(args.mesh)
    fixes_of = constraint_sets(table["plans"], len(mesh), args.differing)
    options = PlanOptions(device=args.device, gpus_per_node=args.gpus_per_node, mixed_precision=("bf16", "fp32"),
                          ac=args.ac)
    rows = []
    for name, fixes in fixes_of.items():
        start = time.perf_counter()
        workload = load_workload(args.model, mesh, batch=args.batch, seq=args.seq, layers=args.layers)
        constraints = [fix_output(glob, "".join(want), name=f"{name}: {glob} {''.join(want)}")
                       for glob, want in fixes.items()]
        plan = plan_workload(workload, options, constraints=constraints).plan
        rows.append({
            "plan": name, "objective_us": plan.objective_us, "compute_us": plan.compute_us, "comm_us": plan.comm_us,
            "comm_by_collective_us": _by_collective(plan), "peak_bytes": plan.memory.get("peak_bytes"),
            "fixes_held": _held(plan, fixes), "fixed": {g: "".join(w) for g, w in fixes.items()},
            "outputs": solved_outputs(plan),
            "status": plan.solver.get("status"), "seconds": time.perf_counter() - start,
        })
        logger.info("%s: %.1f µs in %.1f s", name, plan.objective_us, rows[-1]["seconds"])
    return rows


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    t = Table(title=f"Paper Table 6 plans: {args.model}, mesh {args.mesh}, seq {args.seq}, batch {args.batch}, "
                    f"{args.device} (µs per step)")
    for col in ("plan", "objective", "compute", "comm", *COLLECTIVES, "peak GiB", "fixes held"):  # µs but peak
        t.add_column(col, justify="left" if col == "plan" else "right")
    for r in rows:
        peak = r["peak_bytes"]
        t.add_row(r["plan"], f"{r['objective_us']:,.1f}", f"{r['compute_us']:,.1f}", f"{r['comm_us']:,.1f}",
                  *(f"{r['comm_by_collective_us'].get(k, 0.0):,.1f}" for k in COLLECTIVES),
                  "-" if peak is None else f"{peak / 2**30:.2f}", "yes" if r["fixes_held"] else "NO")
    console = Console(width=170)
    console.print(t)
    console.print("p00 as solved: " + ", ".join(f"{k} {v}" for k, v in rows[0]["outputs"].items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--mesh", default="4x8")
    p.add_argument("--device", default="h100")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=None, help="override the preset's layers (quick runs)")
    p.add_argument("--ac", default="selective", help="activation checkpointing: none, selective, full")
    p.add_argument("--differing", action="store_true", help="fix only the outputs that differ from p00's")
    p.add_argument("--json", default=None, help="write a JSON list of the plans here ('-' for stdout only)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    rows = run(args)
    out = [{"plan": r["plan"], "objective_us": r["objective_us"], "compute_us": r["compute_us"],
            "comm_us": r["comm_us"], "fixes_held": r["fixes_held"]} for r in rows]
    if args.json == "-":
        print(json.dumps(out, indent=1))
        return 0
    print_table(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(r["fixes_held"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
