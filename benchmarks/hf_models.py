"""Hugging Face models against FSDP, as in the AutoParallel paper's Appendix A (Table 5).

    python benchmarks/hf_models.py                          # every model, 1x8 H100, batch 16, seq 4096
    python benchmarks/hf_models.py --models gpt2-medium bert-base --json hf.json
    python benchmarks/hf_models.py --layers 2               # quick: every model cut to 2 layers

Each model is built from its transformers config on the meta device (``hf:NAME``, see
:mod:`apmodel.frontend.hf`) and one training step (the model's own causal- or masked-LM loss) is planned
on a (8,) mesh of H100s, global batch 16, sequence 4096 capped at a learned position table's size,
bf16 mixed precision (fp32 gradient reductions), parameters fully sharded in storage (the paper's
``high = 1/world_size``). The found plan's objective is compared with apmodel's ``fsdp`` recipe
(every parameter gathered for use, the batch sharded: FSDP / SimpleFSDP) priced by the same cost
model on the same candidates, and with the paper's change where Table 5 lists the model. Both are
cost-model objectives (µs per step, no overlap), not measured times; no memory limit is applied
(the paper's comparison has none beyond the storage policy).

The paper's numbers come from its own cost model (and CBC); apmodel's compute model is fitted to
measured H200 kernels (H100 derived), its collectives are NCCL's model with constants fitted to
published nccl-tests runs, about 21 µs for a small all-gather on 8 NVSwitch ranks. The paper attributes its large gains on small models to a latency
floor of about 160 µs per all-gather / reduce-scatter (SimpleFSDP's per-parameter collectives are
80-84% latency); ``--floor-us 160`` (on by default, beside the plain model) prices every collective
at ``max(NCCL time, floor)``, the paper's setting, so both columns show how much of the change that
floor makes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

# This folder has a costmodels.py; make sure "import costmodels" finds the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from apmodel.core.options import PlanOptions  # noqa: E402
from apmodel.entry.api import build_model, solve_model  # noqa: E402
from apmodel.frontend import hf  # noqa: E402
from apmodel.frontend.workloads import load_workload, parse_mesh  # noqa: E402
from apmodel.problem.pricing import build_cost_context  # noqa: E402
from apmodel.reading import recipes as R  # noqa: E402
from apmodel.reading.roles import emerged  # noqa: E402

logger = logging.getLogger("benchmarks.hf_models")

#: Paper, Appendix A, Table 5 (1x8 H100, batch 16, bf16 mixed precision): objective change (%) of
#: AutoParallel against SimpleFSDP, the sequence length used, and the group the paper puts the plan in.
PAPER_TABLE5: dict[str, dict[str, Any]] = {
    "distilbert-base": {"delta_pct": -40.8, "seq": 512, "group": "tensor parallelism"},
    "roberta-base": {"delta_pct": -40.4, "seq": 512, "group": "tensor parallelism"},
    "bert-base": {"delta_pct": -40.2, "seq": 512, "group": "tensor parallelism"},
    "gpt2-medium": {"delta_pct": -22.3, "seq": 1024, "group": "tensor parallelism"},
    "gpt2-xl": {"delta_pct": -9.3, "seq": 1024, "group": "mixed"},
    "pythia-160m": {"delta_pct": -1.0, "seq": 4096, "group": "mixed"},
    "pythia-6.9b": {"delta_pct": -0.2, "seq": 4096, "group": "FSDP + embedding/head"},
    "bloom-560m": {"delta_pct": -1.1, "seq": 4096, "group": "FSDP + embedding/head"},
    "bloom-7b1": {"delta_pct": -0.9, "seq": 4096, "group": "FSDP + embedding/head"},
    "stablelm-2-1.6b": {"delta_pct": -0.9, "seq": 4096, "group": "FSDP + embedding/head"},
    "phi-1": {"delta_pct": -0.6, "seq": 4096, "group": "FSDP + embedding/head"},
    "gpt-neo-2.7b": {"delta_pct": -0.5, "seq": 2048, "group": "FSDP + embedding/head"},
    "phi-2": {"delta_pct": -0.2, "seq": 4096, "group": "FSDP + embedding/head"},
    "falcon-7b": {"delta_pct": -0.2, "seq": 4096, "group": "FSDP + embedding/head"},
    "t5-small": {"delta_pct": -3.1, "seq": 4096, "group": "mixed"},
    "gpt-j-6b": {"delta_pct": -3.0, "seq": 2048, "group": "mixed"},
    "t5-base": {"delta_pct": -0.9, "seq": 4096, "group": "mixed"},
}
#: The paper's 17 models in its order (groups as it reports them), then the other models apmodel.frontend.hf knows.
DEFAULT_MODELS = ["bloom-560m", "bloom-7b1", "stablelm-2-1.6b", "phi-1", "gpt-neo-2.7b", "phi-2", "falcon-7b",
                  "pythia-6.9b", "distilbert-base", "roberta-base", "bert-base", "gpt2-medium", "gpt2-xl",
                  "t5-small", "gpt-j-6b", "pythia-160m", "t5-base",
                  "gpt2", "opt-125m", "opt-1.3b", "tinyllama-1.1b", "llama-2-7b"]


class CollectiveFloor:
    """A collective model whose every collective costs at least ``floor_us`` (``max(base, floor)``)."""

    def __init__(self, base: Any, floor_us: float) -> None:
        self.base = base
        self.floor_us = float(floor_us)
        self.mesh_shape = tuple(getattr(base, "mesh_shape", ()))
        self.topo = getattr(base, "topo", None)
        self.redistribution_cache = None  # the redistribution model caches prices on the comm object
        self.redistribution_matrix_cache = None

    def time_us(self, kind: str, nbytes: float, axis: int) -> float:
        return max(self.base.time_us(kind, nbytes, axis), self.floor_us)


def _options(args: argparse.Namespace, floor_us: float | None) -> PlanOptions:
    options = PlanOptions(device=args.device, solver=args.solver, dtype="bf16")
    if floor_us is None:
        return options
    base = build_cost_context(parse_mesh(args.mesh), options).comm
    return options.replace(comm_model=CollectiveFloor(base, floor_us))


def run_model(name: str, args: argparse.Namespace, floor_us: float | None) -> dict[str, Any]:
    """Plan one model and price the FSDP recipe on the same candidates."""
    mesh = parse_mesh(args.mesh)
    options = _options(args, floor_us)
    t0 = time.perf_counter()
    wl = load_workload(f"hf:{name}", mesh, batch=args.batch, seq=args.seq, layers=args.layers)
    params = sum(p.numel() for p in {id(p): p for p in wl.model.parameters()}.values())
    timings: dict[str, float] = {}
    pmodel = build_model(wl.model, mesh, wl.sample_inputs, loss_fn=wl.loss_fn, kwargs=wl.kwargs,
                         options=options, timings=timings)
    found = solve_model(pmodel, options, timings=timings, workload=wl.record)
    found.model = pmodel
    fsdp = R.run(R.get("fsdp"), pmodel.captured, pmodel.strategies, pmodel.cost, options,
                 itemsize=options.dtype_bytes)
    row: dict[str, Any] = {
        "model": name, "floor_us": floor_us, "params": params, "layers": wl.model.config.num_hidden_layers,
        "seq": int(wl.record["seq"]), "batch": args.batch, "nodes": len(pmodel.captured.gm.graph.nodes),
        "found_us": found.objective_us, "found_compute_us": found.compute_us, "found_comm_us": found.comm_us,
        "solver_status": found.solver.get("status"), "fsdp_us": fsdp.objective_us,
        "fsdp_compute_us": fsdp.compute_us, "fsdp_comm_us": fsdp.comm_us, "fsdp_status": fsdp.status,
        "delta_pct": None, "paper_delta_pct": PAPER_TABLE5.get(name, {}).get("delta_pct"),
        "paper_seq": PAPER_TABLE5.get(name, {}).get("seq"), "emerged": emerged(found),
        "unsupported_ops": list(pmodel.captured.unsupported_ops), "seconds": time.perf_counter() - t0,
    }
    if fsdp.objective_us:
        row["delta_pct"] = 100.0 * (found.objective_us - fsdp.objective_us) / fsdp.objective_us
    logger.info("%s (floor %s µs): found %.1f µs, fsdp %s µs (%.1f s)", name, floor_us, found.objective_us,
                fsdp.objective_us, row["seconds"])
    return row


def _fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _short(emerged_axes: dict[str, str]) -> str:
    """The reading of the single mesh axis, without the counts (``FSDP; tensor parallel``)."""
    parts = []
    for desc in emerged_axes.values():
        for item in desc.split("; "):
            parts.append(item.split(" (")[0])
    return ", ".join(parts)


def print_table(result: dict[str, Any], console: Console) -> None:
    floors = result["floors_us"]
    t = Table(title=f"Found plan vs FSDP recipe on mesh {result['mesh']} of {result['device']} "
                    f"(batch {result['batch']}, {result['dtype']} mixed precision; µs per step)",
              title_justify="left")
    for col in ["model", "params", "seq", "found µs", "FSDP µs", "Δ%"]:
        t.add_column(col, justify="left" if col == "model" else "right")
    for f in floors[1:]:
        t.add_column(f"Δ% ({f:g} µs floor)", justify="right")
    t.add_column("paper Δ%", justify="right")
    t.add_column("found plan (floor)" if len(floors) > 1 else "found plan")
    by = {(r["model"], r.get("floor_us")): r for r in result["rows"]}
    for name in result["models"]:
        first = by[(name, floors[0])]
        if "error" in first:
            t.add_row(name, "", "", f"error: {first['error']}")
            continue
        deltas = [_fmt(by[(name, f)].get("delta_pct")) for f in floors[1:]]
        last = by[(name, floors[-1])]
        t.add_row(name, _params(first["params"]), str(first["seq"]), _fmt(first["found_us"]), _fmt(first["fsdp_us"]),
                  _fmt(first["delta_pct"]), *deltas, _fmt(first["paper_delta_pct"]),
                  _short(last.get("emerged", {})))
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help=f"names of apmodel.frontend.hf.PRESETS "
                    f"({', '.join(hf.PRESETS)})")
    ap.add_argument("--mesh", default="8")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096, help="capped at each model's position table")
    ap.add_argument("--layers", type=int, default=None, help="cut every model to this many layers (quick runs)")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--solver", default="highs")
    ap.add_argument("--floor-us", type=float, nargs="*", default=[160.0],
                    help="also price with every collective costing at least this (the paper's ~160 µs); none: off")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here ('-': stdout only)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    unknown = [m for m in args.models if m not in hf.PRESETS]
    if unknown:
        ap.error(f"unknown models {unknown}; known: {', '.join(hf.PRESETS)}")
    floors: list[float | None] = [None, *args.floor_us]
    result: dict[str, Any] = {"mesh": list(parse_mesh(args.mesh)), "device": args.device, "batch": args.batch,
                              "seq": args.seq, "layers": args.layers, "dtype": "bf16", "solver": args.solver,
                              "mixed_precision": True, "floors_us": floors, "models": list(args.models),
                              "paper_table5": PAPER_TABLE5, "rows": []}
    for name in args.models:
        for floor in floors:
            try:
                result["rows"].append(run_model(name, args, floor))
            except Exception as e:  # one model failing must not hide the others' numbers
                logger.exception("%s failed", name)
                result["rows"].append({"model": name, "floor_us": floor,
                                       "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
    if args.json is not None and str(args.json) == "-":
        print(json.dumps(result, indent=1, default=float))
        return 0
    console = Console()
    if not console.is_terminal:
        console.width = 140
    print_table(result, console)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, default=float), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
