"""The AutoParallel paper's storage results (Appendix C, Tables 7 and 8) reproduced with apmodel.

    python benchmarks/storage.py                       # LLaMA-3 70B, mesh 4x8, seq 2048, batch 16, H100
    python benchmarks/storage.py --layers 4 --json storage.json   # quick
    python benchmarks/storage.py --solver trws         # approximate, faster on big meshes

Table 7 (budget sweep): the storage budget ``high`` (``param_budget_ratio``: the mean over parameter
tensors of local / global elements) from 1/world to 1; per point the objective, its communication,
the placements (dp, tp) of the attention and FFN norm weights, weights per GPU (fp32 master
parameters, as the paper counts them), and how many parameters (matrices / norms) are stored
differently from the fully sharded point.

Table 8 (counterfactuals at high = 1): every parameter forced replicated on the tensor-parallel
axis, the FSDP axis, or both; the objective's change against the unconstrained point.

The model is traced once and its candidate strategies enumerated once; each point builds its own
placement model (one linear budget row) and solves it. Planning ignores the memory limit here (the
paper's sweep does too: replicating 70B parameters on both axes needs 282 GB per GPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

# This folder has a costmodels.py; make sure "import costmodels" finds the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from apmodel import models  # noqa: E402
from apmodel.candidates.strategies import enumerate_strategies  # noqa: E402
from apmodel.core import placements as pl  # noqa: E402
from apmodel.core.options import PlanOptions  # noqa: E402
from apmodel.frontend.workloads import parse_mesh  # noqa: E402
from apmodel.graph.capture import capture  # noqa: E402
from apmodel.problem.pricing import build_cost_context  # noqa: E402
from apmodel.solve.search import placement_model, solve_model  # noqa: E402

logger = logging.getLogger("benchmarks.storage")

#: Paper, Appendix C, Table 7 (LLaMA 3 70B, 4x8 H100, bf16 mixed precision; K µs, GB).
PAPER_TABLE7 = {
    "1/32": {"objective_Kus": 3854, "comm_Kus": 1878, "attn_norm": "S0,S0", "ffn_norm": "S0,S0", "wt_GB": 8.819},
    "1/16": {"objective_Kus": 3828, "comm_Kus": 1852, "attn_norm": "R,S0", "ffn_norm": "R,S0", "wt_GB": 8.820},
    "1/8": {"objective_Kus": 3826, "comm_Kus": 1850, "attn_norm": "S0,R", "ffn_norm": "S0,R", "wt_GB": 8.820},
    "1/4": {"objective_Kus": 3816, "comm_Kus": 1840, "attn_norm": "S0,R", "ffn_norm": "R,R", "wt_GB": 8.822},
    "1/2": {"objective_Kus": 3807, "comm_Kus": 1831, "attn_norm": "R,R", "ffn_norm": "R,R", "wt_GB": 8.824},
    "1": {"objective_Kus": 3807, "comm_Kus": 1831, "attn_norm": "R,R", "ffn_norm": "R,R", "wt_GB": 8.824},
}
#: Paper, Appendix C, Table 8 (objective K µs, change vs unconstrained, weights per GPU GB).
PAPER_TABLE8 = {
    "none": {"objective_Kus": 3807, "delta_pct": 0.0, "wt_GB": 8.8},
    "R on tp": {"objective_Kus": 3911, "delta_pct": 2.7, "wt_GB": 70.6},
    "R on fsdp": {"objective_Kus": 4053, "delta_pct": 6.5, "wt_GB": 35.3},
    "R on both": {"objective_Kus": 4856, "delta_pct": 27.6, "wt_GB": 282.2},
}
#: Master parameters are fp32 (mixed precision), as the paper's "Wt/GPU" counts them.
MASTER_BYTES = 4


def _placement(plan: Any, fqn: str) -> str:
    return ",".join(pl.to_str(p).replace("(", "").replace(")", "") for p in plan.param_placements[fqn])


def _weights_per_gpu_bytes(plan: Any, captured: Any, mesh: tuple[int, ...]) -> float:
    """fp32 master parameter bytes one GPU stores under the plan's storage placements."""
    shapes = {n.name: tuple(n.meta["val"].shape) for n in captured.gm.graph.nodes if n.name in captured.param_fqn}
    return sum(math.prod(pl.local_shape(shapes[node], plan.param_placements[fqn], mesh)) * MASTER_BYTES
               for node, fqn in captured.param_fqn.items())


def _forced_replicated(axes: tuple[int, ...]):
    """A constraint: every parameter replicated on ``axes`` (the counterfactuals of Table 8)."""
    def apply(m: Any) -> None:
        for node, fqn in m.captured.param_fqn.items():
            m.restrict(node, lambda s: all(pl.to_str(s.outputs[0][a]) == "R" for a in axes),
                       f"benchmark: {fqn} replicated on axes {axes}")
    return apply


def _is_norm(fqn: str) -> bool:
    return fqn.endswith("norm.weight")


def run(args: argparse.Namespace) -> dict[str, Any]:
    mesh = parse_mesh(args.mesh)
    world = math.prod(mesh)
    overrides = {"n_layers": args.layers} if args.layers else {}
    cfg = models.config(args.model, **overrides)
    with torch.device("meta"):
        model = models.build(cfg)
    t0 = time.perf_counter()
    captured = capture(model, models.sample_inputs(cfg, batch=args.batch, seq=args.seq))
    logger.info("traced %s in %.1f s", args.model, time.perf_counter() - t0)
    base = PlanOptions(device=args.device, solver=args.solver, time_limit=args.time_limit, memory_limit_bytes=math.inf)
    cost = build_cost_context(mesh, base)
    strategies = enumerate_strategies(captured.gm, mesh)
    fqns = list(captured.param_fqn.values())
    attn_norm = next(f for f in fqns if f.endswith("attention_norm.weight"))
    ffn_norm = next(f for f in fqns if f.endswith("ffn_norm.weight"))

    def solve(options: PlanOptions, constraints: list) -> tuple[Any, float]:
        t = time.perf_counter()
        plan = solve_model(placement_model(captured, strategies, cost, options, constraints=constraints), options)
        return plan, time.perf_counter() - t

    sweep = []
    highs = [Fraction(1, world) * 2**i for i in range(int(math.log2(world)) + 1)]
    reference = None
    for high in highs:
        plan, seconds = solve(base.replace(param_budget_ratio=float(high)), [])
        reference = reference or plan
        changed = [f for f in fqns if plan.param_placements[f] != reference.param_placements[f]]
        sweep.append({
            "high": str(high), "objective_us": plan.objective_us, "comm_us": plan.comm_us,
            "compute_us": plan.compute_us, "attn_norm": _placement(plan, attn_norm), "ffn_norm": _placement(plan, ffn_norm),
            "weights_per_gpu_GB": _weights_per_gpu_bytes(plan, captured, mesh) / 1e9,
            "changed_matrices": sum(not _is_norm(f) for f in changed), "changed_norms": sum(_is_norm(f) for f in changed),
            "status": plan.solver.get("status"), "solve_s": seconds,
        })
        logger.info("high %s: %.1f µs (%s)", high, plan.objective_us, plan.solver.get("status"))
    free = base.replace(param_budget_ratio=1.0)
    counterfactuals = []
    unconstrained = None
    for label, axes in (("none", ()), ("R on tp", (1,)), ("R on fsdp", (0,)), ("R on both", (0, 1))):
        plan, seconds = solve(free, [_forced_replicated(axes)] if axes else [])
        unconstrained = unconstrained or plan.objective_us
        counterfactuals.append({
            "constraint": label, "objective_us": plan.objective_us,
            "delta_pct": 100 * (plan.objective_us - unconstrained) / unconstrained,
            "weights_per_gpu_GB": _weights_per_gpu_bytes(plan, captured, mesh) / 1e9,
            "status": plan.solver.get("status"), "solve_s": seconds,
        })
    return {"model": args.model, "layers": cfg.n_layers, "mesh": list(mesh), "seq": args.seq, "batch": args.batch,
            "device": args.device, "solver": args.solver, "sweep": sweep, "counterfactuals": counterfactuals,
            "paper_table7": PAPER_TABLE7, "paper_table8": PAPER_TABLE8}


def print_tables(result: dict[str, Any], console: Console) -> None:
    t = Table(title=f"Table 7: storage budget sweep, {result['model']} ({result['layers']} layers) on "
                    f"{'x'.join(map(str, result['mesh']))}, seq {result['seq']}, batch {result['batch']}, "
                    f"{result['device']} (paper's values in brackets)", title_justify="left")
    for col in ("high", "objective K µs", "comm K µs", "attn norm", "ffn norm", "Wt/GPU GB", "changed matrices / norms",
                "status"):
        t.add_column(col, justify="left" if col in ("high", "attn norm", "ffn norm", "status") else "right")
    for row in result["sweep"]:
        paper = result["paper_table7"].get(row["high"], {})
        t.add_row(row["high"], f"{row['objective_us'] / 1e3:,.0f} [{paper.get('objective_Kus', '—')}]",
                  f"{row['comm_us'] / 1e3:,.0f} [{paper.get('comm_Kus', '—')}]",
                  f"{row['attn_norm']} [{paper.get('attn_norm', '—')}]", f"{row['ffn_norm']} [{paper.get('ffn_norm', '—')}]",
                  f"{row['weights_per_gpu_GB']:.3f} [{paper.get('wt_GB', '—')}]",
                  f"{row['changed_matrices']} / {row['changed_norms']}", row["status"])
    console.print(t)
    t = Table(title="Table 8: every parameter forced replicated (high = 1)", title_justify="left")
    for col in ("constraint", "objective K µs", "Δ %", "Wt/GPU GB", "paper: K µs / Δ % / GB"):
        t.add_column(col, justify="left" if col == "constraint" else "right")
    for row in result["counterfactuals"]:
        paper = result["paper_table8"][row["constraint"]]
        t.add_row(row["constraint"], f"{row['objective_us'] / 1e3:,.0f}", f"{row['delta_pct']:+.1f}",
                  f"{row['weights_per_gpu_GB']:.1f}",
                  f"{paper['objective_Kus']:,} / {paper['delta_pct']:+.1f} / {paper['wt_GB']}")
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count (quick runs)")
    ap.add_argument("--mesh", default="4x8")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--device", default="h100")
    ap.add_argument("--solver", default="highs")
    ap.add_argument("--time-limit", type=float, default=600.0)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here ('-' for stdout only)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    result = run(args)
    if args.json is not None and str(args.json) == "-":
        print(json.dumps(result, indent=1))
        return 0
    console = Console()
    if not console.is_terminal:
        console.width = 170
    print_tables(result, console)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
